"""`vskipper-loadgen demo`: a small matched-work A/B run against two local stand-in servers.

The servers are `loadgen.double_server.DoubleServer` instances (toy engines, no model): an "upstream" one and
an "always-route" one whose decode steps cost less per row and which attests the always-route arm. The demo
records the baseline's natural output lengths at each rate, replays them in both arms over paired,
order-alternating repetitions, gates every pair, and writes the per-cell JSON, the Markdown table and the plots.
It takes about a minute (three repetitions).
"""

from __future__ import annotations

import asyncio
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


async def run_demo(out: str | Path, repetitions: int = 3, progress: bool = False) -> dict:
    arm = get_arm("always-route")
    upstream = DoubleConfig(decode_base_s=0.006, decode_per_row_s=0.0025, natural_max=32)
    served = DoubleConfig(decode_base_s=0.006, decode_per_row_s=0.0019, natural_max=32, arm=arm.as_dict(),
                          routed_phases=arm.routed_phases)
    suite = demo_suite()
    results = []
    with DoubleServerProcess(upstream) as a, DoubleServerProcess(served) as b:
        base = ArmTarget("upstream", Endpoint(a.url, attestation_path=None))
        target = ArmTarget(arm.name, Endpoint(b.url), arm)
        for label, rate in DEMO_RATES.items():
            results.append(await run_ab(base, target, suite, rate, repetitions=repetitions, seed=7,
                                        label=label, max_new_tokens=128, progress=progress))
    paths = write_report(results, out, title="demo: stand-in servers, matched work")
    return {"results": results, "paths": paths, "table": markdown_table(results)}


def main(out: str | Path, repetitions: int = 3) -> int:
    res = asyncio.run(run_demo(out, repetitions))
    print(res["table"])
    for key in ("table", "latency_vs_load", "change_map"):
        print(f"wrote {res['paths'][key]}")
    return 0
