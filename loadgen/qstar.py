"""Q*: the last offered rate at which the baseline's output token rate still grows.

The sweep runs contiguous integer rates r_0 < r_1 < ... (step 1) and measures the baseline's output tokens/s
t_i under natural generation. With M_i = max(t_0 .. t_{i-1}) the running maximum before rate i, rate i counts
as growth when t_i >= (1 + g) M_i and t_{i+1} >= (1 + g) M_i (g = 1%): the rate and the next one both exceed
the running maximum. Q* is the last rate that counts as growth (r_0 when none does). The top rate has no next
rate, so it can never count; when it still exceeds the running maximum the sweep did not reach the plateau and
the result says so (`plateau_reached` False): extend the ladder.

Cells are then run at 0.75 (below the knee), 0.95 (the knee) and 1.25 (overload) x Q*.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

CELL_FACTORS: dict[str, float] = {"below": 0.75, "knee": 0.95, "overload": 1.25}
MIN_GROWTH = 0.01


@dataclass(frozen=True)
class QStar:
    q_star: int
    rates: tuple[int, ...]
    tok_s: tuple[float, ...]
    growth: tuple[bool, ...]  # per rate: counted as growth
    plateau_reached: bool
    min_growth: float = MIN_GROWTH

    @property
    def tok_s_at_q_star(self) -> float:
        return self.tok_s[self.rates.index(self.q_star)]

    @property
    def growth_above_pct(self) -> float:
        """Output rate at the top of the ladder against Q*'s, in %."""
        return (self.tok_s[-1] / self.tok_s_at_q_star - 1.0) * 100.0

    def cells(self, factors: Mapping[str, float] = CELL_FACTORS) -> dict[str, float]:
        return cell_rates(self.q_star, factors)

    def as_dict(self) -> dict:
        return {"q_star": self.q_star, "rates": list(self.rates), "tok_s": list(self.tok_s),
                "growth": list(self.growth), "plateau_reached": self.plateau_reached,
                "min_growth": self.min_growth, "tok_s_at_q_star": self.tok_s_at_q_star,
                "growth_above_pct": self.growth_above_pct, "cells": self.cells()}


def find_q_star(ladder: Mapping[int, float] | Sequence[tuple[int, float]],
                min_growth: float = MIN_GROWTH) -> QStar:
    """Apply the Q* rule to a sweep {rate: output tokens/s}; rates must be contiguous integers."""
    points = sorted(ladder.items() if isinstance(ladder, Mapping) else ladder)
    if len(points) < 2:
        raise ValueError(f"ladder: need at least 2 rates, got {len(points)}")
    rates = [r for r, _ in points]
    for r in rates:
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise ValueError(f"ladder: rates must be positive integers, got {r!r}")
    for a, b in zip(rates[:-1], rates[1:], strict=True):
        if b != a + 1:
            raise ValueError(f"ladder: rates must be contiguous integers, found {a} then {b}")
    tok = [float(t) for _, t in points]
    if any(t < 0 for t in tok):
        raise ValueError("ladder: output token rates must be >= 0")
    factor = 1.0 + min_growth
    growth = [False] * len(tok)
    for i in range(1, len(tok) - 1):
        running_max = max(tok[:i])
        growth[i] = tok[i] >= factor * running_max and tok[i + 1] >= factor * running_max
    last = max((i for i, g in enumerate(growth) if g), default=0)
    plateau = tok[-1] < factor * max(tok[:-1])
    return QStar(rates[last], tuple(rates), tuple(tok), tuple(growth), plateau, min_growth)


def cell_rates(q_star: float, factors: Mapping[str, float] = CELL_FACTORS) -> dict[str, float]:
    if q_star <= 0:
        raise ValueError(f"q_star must be > 0, got {q_star!r}")
    return {name: round(f * q_star, 6) for name, f in factors.items()}
