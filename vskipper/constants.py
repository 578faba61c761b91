"""The one place where vSkipper's switching constants live.

Every number that decides when routed execution is used is defined here and nowhere else: the roofline rule
(`vskipper.roofline`), the mode switch (`vskipper.switch`), the operator and the runtime's attestation all read
them from this module. `attestation()` returns them as a plain dict, so a client can compare the constants a
server actually ran with against the ones it expected.

Pure Python: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class SwitchConstants:
    # Routed decode's fixed per-step cost, measured as the intercept difference of the dense and routed per-step
    # latency lines over 16 routed layers of Llama-3-8B on an A100 (paper, Appendix D). It is reused on every
    # device and model as a per-routed-layer coefficient: tau(L_r) = tau_ms_per_16_layers * L_r / 16.
    tau_ms_per_16_layers: float = 2.67
    tau_reference_routed_layers: int = 16

    # Served hysteresis band derived from the crossover V*: routing is left at V <= exit and entered at
    # V >= enter, with exit = V* and enter = enter_factor * V*, both rounded to the nearest rounding step (enter at
    # least one step above exit: `vskipper.roofline.rounded_thresholds`).
    enter_factor: float = 1.25
    threshold_rounding_tokens: int = 10_000

    # Prefill rule: an admission round is routed when its prompt tokens (counted before prefix-cache hits)
    # reach the floor and the estimated Project-Only share exceeds the minimum; the share estimate is
    # refreshed by a probe every `prefill_probe_period_batches` admitted batches.
    prefill_min_prompt_tokens: int = 1536
    prefill_min_project_share: float = 0.35
    prefill_probe_period_batches: int = 64

    # FlexiDepth's trained gate selects RUN for a row when its router weight exceeds this value.
    router_run_threshold: float = 0.5


CONSTANTS = SwitchConstants()


def attestation() -> dict:
    """The constants as a JSON-ready dict (part of the runtime's attestation)."""
    return asdict(CONSTANTS)
