"""vSkipper: dynamic layer skipping that pays off in LLM serving.

The top-level package imports nothing heavy: `vskipper.constants`, `vskipper.roofline`, `vskipper.switch`,
`vskipper.arms` and `vskipper.skippers` (the registry) are pure Python, so the operator uses them without torch.
"""

__version__ = "0.1.0"
