"""`vskipper-loadgen demo`: a small matched-work A/B run against two local stand-in servers.

The servers are `loadgen.double_server.DoubleServer` instances (toy engines, no model): an "upstream" one and
an "always-route" one whose decode steps cost less per row and which attests the always-route arm. The demo
records the baseline's natural output lengths at each rate, replays them in both arms over paired,
order-alternating repetitions, gates every pair, and writes the per-cell JSON, the Markdown table and the plots.
It takes about a minute (three repetitions).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

from loadgen.client import Endpoint
from loadgen.double_server import DoubleConfig, DoubleServerProcess
from loadgen.experiment import ArmTarget, run_ab
from loadgen.report import markdown_table, write_report
from loadgen.suite import Suite, SuiteRequest
from vskipper.arms import get_arm

# Fixed rates from light to heavy load of the upstream stand-in (its output rate still creeps up past 30 req/s,
# so no Q* ladder is run here; a real deployment takes its cells from `vskipper-loadgen ladder`).
DEMO_RATES = {"15req-s": 15.0, "19req-s": 19.0, "25req-s": 25.0}


def demo_suite(n: int = 40) -> Suite:
    return Suite("demo", tuple(SuiteRequest(f"demo:test:{i}", tuple(range(5 + 3 * i, 45 + 3 * i)))
                               for i in range(n)))


async def run_rates(baseline: ArmTarget, target: ArmTarget, suite: Suite, rates: Mapping[str, float],
                    out: str | Path, *, repetitions: int, title: str, seed: int = 7, max_new_tokens: int = 128,
                    progress: bool = False) -> dict:
    """One matched-work A/B cell per labelled rate between two served arms, then the report (per-cell JSON, the
    Markdown table, the plots). The stand-in demo and `make demo` (two real servers) both run this."""
    results = []
    for label, rate in rates.items():
        results.append(await run_ab(baseline, target, suite, rate, repetitions=repetitions, seed=seed,
                                    label=label, max_new_tokens=max_new_tokens, progress=progress))
    paths = write_report(results, out, title=title)
    return {"results": results, "paths": paths, "table": markdown_table(results)}


async def run_demo(out: str | Path, repetitions: int = 3, progress: bool = False) -> dict:
    arm = get_arm("always-route")
    upstream = DoubleConfig(decode_base_s=0.006, decode_per_row_s=0.0025, natural_max=32)
    served = DoubleConfig(decode_base_s=0.006, decode_per_row_s=0.0019, natural_max=32, arm=arm.as_dict(),
                          routed_phases=arm.routed_phases)
    with DoubleServerProcess(upstream) as a, DoubleServerProcess(served) as b:
        base = ArmTarget("upstream", Endpoint(a.url, attestation_path=None))
        target = ArmTarget(arm.name, Endpoint(b.url), arm)
        return await run_rates(base, target, demo_suite(), DEMO_RATES, out, repetitions=repetitions,
                               title="demo: stand-in servers, matched work", progress=progress)


def print_report(res: dict) -> None:
    """The Markdown table and where the report went."""
    print(res["table"])
    for key in ("table", "latency_vs_load", "change_map"):
        print(f"wrote {res['paths'][key]}")


def main(out: str | Path, repetitions: int = 3) -> int:
    print_report(asyncio.run(run_demo(out, repetitions)))
    return 0
