"""Paired statistics of the A/B protocol.

Each repetition runs both arms on the same suite and arrival schedule; the arms alternate order across
repetitions (`arm_order`). Per repetition a metric's % change against the baseline is taken; the cell reports
the mean of those changes with a two-sided t-based interval. A change is *resolved* only when its interval
excludes zero, and a single repetition (no interval) is never resolved.

Beside it, for the rates (`geometric_comparison`): the geometric mean of the per-repetition ratios, its interval
the t interval of the mean log-ratio taken back to a % change. The mean of % changes weighs a doubling (+100%)
twice as much as a halving (-50%), so where the ratios spread widely (an overload window's completions) one
repetition's ratio carries it; the log-ratio weighs both alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as _st

PERCENTILES = (50, 90, 99)


def pct_change(value: float, baseline: float) -> float:
    """Percentage change of `value` against `baseline` (negative: lower than the baseline)."""
    if baseline == 0:
        raise ValueError("pct_change: baseline is 0, the % change is undefined")
    return (value - baseline) / baseline * 100.0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's default)."""
    if len(values) == 0:
        raise ValueError("percentile of an empty sample")
    return float(np.percentile(np.asarray(values, dtype=float), q))


def describe(values: Sequence[float]) -> dict[str, float | int | None]:
    """Mean and p50/p90/p99 over a sample (None fields when it is empty)."""
    out: dict[str, float | int | None] = {"n": len(values)}
    if not values:
        out.update({"mean": None, **{f"p{p}": None for p in PERCENTILES}})
        return out
    arr = np.asarray(values, dtype=float)
    out["mean"] = float(arr.mean())
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p))
    return out


@dataclass(frozen=True)
class Interval:
    """Mean of a sample with a two-sided t interval; half_width is NaN when n < 2."""

    mean: float
    half_width: float
    n: int
    confidence: float = 0.95

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    @property
    def resolved(self) -> bool:
        if self.n < 2 or math.isnan(self.half_width):
            return False
        return self.low > 0 or self.high < 0

    def as_dict(self) -> dict:
        hw = None if math.isnan(self.half_width) else self.half_width
        return {"mean": self.mean, "half_width": hw, "low": None if hw is None else self.low,
                "high": None if hw is None else self.high, "n": self.n, "confidence": self.confidence,
                "resolved": self.resolved}

    def format(self, digits: int = 1) -> str:
        if math.isnan(self.half_width):
            return f"{self.mean:+.{digits}f}"
        return f"{self.mean:+.{digits}f} ± {self.half_width:.{digits}f}"


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean with the two-sided t interval: t_{(1+c)/2, n-1} * s / sqrt(n), s the sample standard deviation."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    arr = np.asarray(values, dtype=float)
    n = int(arr.size)
    if n == 0:
        raise ValueError("mean_interval of an empty sample")
    if not np.all(np.isfinite(arr)):
        raise ValueError("mean_interval: the sample has a non-finite value")
    mean = float(arr.mean())
    if n < 2:
        return Interval(mean, math.nan, n, confidence)
    sem = float(arr.std(ddof=1)) / math.sqrt(n)
    half = float(_st.t.ppf((1 + confidence) / 2, n - 1)) * sem
    return Interval(mean, half, n, confidence)


def arm_order(repetition: int, baseline: str, treated: str) -> tuple[str, str]:
    """Which arm runs first in a repetition: the baseline on even repetitions, the treated arm on odd ones."""
    if repetition < 0:
        raise ValueError(f"repetition must be >= 0, got {repetition}")
    return (baseline, treated) if repetition % 2 == 0 else (treated, baseline)


def paired_changes(baseline: Sequence[Mapping[str, float]], treated: Sequence[Mapping[str, float]],
                   metrics: Sequence[str]) -> dict[str, list[float]]:
    """Per-repetition % change of each metric; repetition i of `treated` is paired with repetition i of
    `baseline`."""
    if len(baseline) != len(treated):
        raise ValueError(f"paired_changes: {len(baseline)} baseline repetitions vs {len(treated)} arm repetitions")
    out: dict[str, list[float]] = {m: [] for m in metrics}
    for i, (b, a) in enumerate(zip(baseline, treated, strict=True)):
        for m in metrics:
            if b.get(m) is None or a.get(m) is None:
                raise ValueError(f"paired_changes: repetition {i} lacks metric {m!r}")
            out[m].append(pct_change(float(a[m]), float(b[m])))
    return out


def paired_comparison(baseline: Sequence[Mapping[str, float]], treated: Sequence[Mapping[str, float]],
                      metrics: Sequence[str], confidence: float = 0.95) -> dict[str, Interval]:
    """Mean % change per metric over paired repetitions, with its t interval."""
    changes = paired_changes(baseline, treated, metrics)
    return {m: mean_interval(v, confidence) for m, v in changes.items()}


@dataclass(frozen=True)
class RatioInterval:
    """The geometric mean of paired ratios as a % change, with the t interval of the mean log-ratio taken back to
    % (exp(mean -/+ half) - 1: not symmetric about the change); low and high are None when n < 2."""

    mean: float
    low: float | None
    high: float | None
    n: int
    confidence: float = 0.95

    @property
    def resolved(self) -> bool:
        if self.low is None or self.high is None:
            return False
        return self.low > 0 or self.high < 0

    def as_dict(self) -> dict:
        return {"statistic": "geometric", "mean": self.mean, "half_width": None, "low": self.low, "high": self.high,
                "n": self.n, "confidence": self.confidence, "resolved": self.resolved}

    def format(self, digits: int = 1) -> str:
        if self.low is None:
            return f"{self.mean:+.{digits}f}"
        return f"{self.mean:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"


def ratio_interval(ratios: Sequence[float], confidence: float = 0.95) -> RatioInterval:
    """The geometric mean change of positive ratios (treated over baseline) with its interval (`RatioInterval`)."""
    arr = np.asarray(ratios, dtype=float)
    if arr.size == 0:
        raise ValueError("ratio_interval of an empty sample")
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError(f"ratio_interval: every ratio must be finite and positive, got {arr.tolist()}")
    logs = mean_interval(np.log(arr).tolist(), confidence)

    def change(log: float) -> float:
        return math.expm1(log) * 100.0

    if math.isnan(logs.half_width):
        return RatioInterval(change(logs.mean), None, None, logs.n, confidence)
    return RatioInterval(change(logs.mean), change(logs.low), change(logs.high), logs.n, confidence)


def geometric_comparison(baseline: Sequence[Mapping[str, float]], treated: Sequence[Mapping[str, float]],
                         metrics: Sequence[str], confidence: float = 0.95) -> dict[str, RatioInterval]:
    """The geometric mean change per metric over paired repetitions (`ratio_interval`); every repetition's value
    of a metric must be positive in both arms."""
    if len(baseline) != len(treated):
        raise ValueError(f"geometric_comparison: {len(baseline)} baseline repetitions vs {len(treated)} arm "
                         "repetitions")
    out = {}
    for m in metrics:
        ratios = []
        for i, (b, a) in enumerate(zip(baseline, treated, strict=True)):
            if not (b.get(m) or 0) > 0 or not (a.get(m) or 0) > 0:
                raise ValueError(f"geometric_comparison: repetition {i}'s {m!r} is not positive in both arms "
                                 f"(baseline {b.get(m)!r}, arm {a.get(m)!r})")
            ratios.append(float(a[m]) / float(b[m]))
        out[m] = ratio_interval(ratios, confidence)
    return out
