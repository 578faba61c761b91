"""vSkipper load generator: open-loop Poisson load, matched-work A/B with paired statistics, Q* sweeps,
cell gates, quality helpers, reports and a queueing simulator.

Torch-free: it runs in its own image next to the servers it measures.
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
