"""Seeded Poisson arrivals over a declared window.

A cell of n requests at offered rate lambda declares duration D = n / lambda. The arrival times are a Poisson
process on [0, D) conditioned on n arrivals: n sorted uniform times, drawn from `numpy.random.default_rng(seed)`.
The same (n, rate, seed) gives the same schedule for every arm.
"""

from __future__ import annotations

import numpy as np


def declared_duration(n_requests: int, rate: float) -> float:
    if n_requests < 1:
        raise ValueError(f"n_requests must be >= 1, got {n_requests}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate!r}")
    return n_requests / rate


def poisson_arrivals(n_requests: int, rate: float, seed: int) -> list[float]:
    duration = declared_duration(n_requests, rate)
    rng = np.random.default_rng(seed)
    return sorted(float(t) for t in rng.uniform(0.0, duration, n_requests))
