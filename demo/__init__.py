"""The live demo: `make demo`, `python -m demo` (demo/live.py).

It stands above every other part of the repository: the offline tour (`vskipper.tour`), real SGLang servers
started through `vskipper serve` (`vskipper.sglang.launch`) and a matched-work A/B with `loadgen`. Nothing
imports it, and it is not part of the installed packages.
"""
