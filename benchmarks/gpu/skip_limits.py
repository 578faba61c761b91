#!/usr/bin/env python3
"""The skip's limit on a device run's load, for several skips: how far the headline's goals lie from what a skip
could give at all.

A device run's headline measures one skip, RandomSkip r = 1, d = 0.5 (8 of Llama-3-8B's 32 layers skipped on
average, as FlexiDepth skips), on its GSM8K-shaped cells. Whatever serving does, a routed pass saves at most what
the skip's physical limit allows: a decode step reads every weight (the adapter's too) and the KV of the rows that
run, a prefill pass does the work of its RUN rows and its Project-Only rows' K/V and projector
(`headline.limit_lines`). This script runs the queueing model (`loadgen.simulate`) with always-route's passes at
that limit against the sweep's dense on the run's cells (their suites drawn again from their seeds, digests
checked; their rates and seeded arrivals) for each d asked (`headline.skip_limit`), and prints each load's mean
E2E, TTFT and TPOT change beside the paper's (FlexiDepth against upstream SGLang, A100 and H100). Where the sweep
served always-route at a d asked, it says where that arm falls short of its limit (`headline.limit_parts`): the
model with its routed lines as measured, with its decode line at the limit and its prefill as measured, the other
way round, and both at the limit.

A prediction from the sweep's dense lines and the model, not a measurement: the model serves one pass at a time
with no chunked prefill, its lines come from the sweep's fixed batches, and its dense may queue otherwise than the
served cells did (the summary's model table says how far). A goal beyond a skip's limit needs another skip or
load; a measured change beyond it is a question.

    python benchmarks/gpu/skip_limits.py benchmarks/results/H200/lease-4 --sweep benchmarks/results/H200/host-lean-sweep
    python benchmarks/gpu/skip_limits.py RUN --d 0.5,0.75,1 --json limits.json

RUN holds the ladder stage's `ladder.json` (Q*'s cells and suites) and, where the headline stage ran, its
`headline.json` (the KV pool the arms served with; otherwise `--kv-pool`, or none: the pool bounds nothing). The
sweep folder (RUN by default) holds `sweep.json` with dense's lines, `model/config.json` and `env.json` (its GPU,
whose catalogued bandwidth charges the adapter's read; `--bandwidth-gbps` otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu import headline  # noqa: E402
from loadgen.qstar import CELL_FACTORS  # noqa: E402

DEFAULT_D = (0.5, 0.75, 1.0)


def sweep_bandwidth(sweep_dir: Path) -> float | None:
    """The bandwidth (GB/s) of the GPU the sweep ran on (its env.json, the roofline's catalogue), or None."""
    from vskipper.roofline import find_device

    env = sweep_dir / "env.json"
    gpu = json.loads(env.read_text()).get("gpu") if env.is_file() else None
    device = find_device(gpu) if gpu else None
    return device.bandwidth_gbps if device else None


def limits(run: Path, sweep_dir: Path, ds: list[float], kv_pool: int | None = None,
           bandwidth_gbps: float | None = None) -> dict:
    """The skip's limit per d on RUN's cells, and where the sweep's always-route arms fall short of theirs:
    {"kv_pool_tokens", "max_running", "bandwidth_gbps", "limits": [skip_limit, ...], "parts": [limit_parts, ...]}."""
    ladder = json.loads((run / "ladder.json").read_text())
    sweep = json.loads((sweep_dir / "sweep.json").read_text())
    config = json.loads((sweep_dir / "model" / "config.json").read_text())
    dense = (sweep.get("arms") or {}).get("dense")
    if not dense:
        raise ValueError(f"{sweep_dir / 'sweep.json'}: the sweep served no dense arm: no lines to scale")
    if kv_pool is None and (run / "headline.json").is_file():
        kv_pool = headline.kv_pool_of(json.loads((run / "headline.json").read_text()))
    cells = [headline.Cell.from_dict(c) for c in ladder["cells"]]
    suites = headline.drawn_suites(ladder, config["vocab_size"])
    running = headline.max_running((ladder.get("plan") or {}).get("sglang_flags") or [])
    bandwidth_gbps = bandwidth_gbps or sweep_bandwidth(sweep_dir)
    arms = sweep["arms"]
    routed = {d: arms[headline.always_route(d).name] for d in ds if headline.always_route(d).name in arms}
    source = headline.prefill_source([dense, *routed.values()])  # the limits' and their parts' alike
    found = [headline.skip_limit(dense, config, cells, suites, kv_pool, running, d, bandwidth_gbps, source)
             for d in ds]
    if any(f is None for f in found):
        raise ValueError(f"{sweep_dir / 'sweep.json'}: dense has no decode line or fewer than two prefill lengths")
    parts = [headline.limit_parts(dense, arm, config, cells, suites, kv_pool, running, d, bandwidth_gbps, source)
             for d, arm in routed.items()]
    return {"run": str(run), "sweep": str(sweep_dir), "kv_pool_tokens": kv_pool, "max_running": running,
            "bandwidth_gbps": bandwidth_gbps, "limits": found, "parts": [p for p in parts if p]}


def report(doc: dict) -> list[str]:
    bandwidth = (f"the adapter's read at {doc['bandwidth_gbps']:g} GB/s" if doc.get("bandwidth_gbps")
                 else "the adapter's read not charged: no known device bandwidth")
    lines = [f"the skip's limit on {doc['run']}'s cells (dense's lines from {doc['sweep']}; KV pool "
             f"{doc['kv_pool_tokens'] or 'unbounded'} tokens, at most {doc['max_running'] or 'any'} running; "
             f"{bandwidth}): the queueing model's % change of the mean against dense, always-route with every routed "
             "pass at the skip's physical limit", "",
             "| skip | layers skipped | load | E2E | TTFT | TPOT | paper A100 E2E | paper H100 E2E |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for limit in doc["limits"]:
        for load, p in limit["loads"].items():
            paper = [headline._paper(headline.PAPER[dev]["loads"][load]["e2e_mean"]) for dev in ("A100", "H100")]
            lines.append(f"| {limit['arm']} (s = {limit['skip']:g}) | {limit['layers_skipped']:g} of "
                         f"{limit['layers']} | {CELL_FACTORS[load]} Q* | "
                         + " | ".join(headline._pct(p.get(m)) for m in headline.MODEL_METRICS)
                         + f" | {' | '.join(paper)} |")
    for found in doc.get("parts") or []:
        lines += ["", *headline.limit_parts_lines(found)[:-1]]
    knee = {limit["skip"]: limit["loads"].get(headline.KNEE, {}).get("e2e_mean") for limit in doc["limits"]}
    reach = [s for s, e in knee.items() if e is not None and e < headline.PAPER_KNEE_E2E]
    lines += ["", f"knee: the paper's {headline.PAPER_KNEE_E2E:+.1f}% lies within the limit of "
              + (", ".join(f"s = {s:g}" for s in reach) if reach else "none of these skips")
              + "; " + ", ".join(f"s = {s:g} {headline._pct(e)}" for s, e in knee.items())]
    return lines


def parse_ds(text: str) -> list[float]:
    try:
        ds = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--d: comma-separated numbers in (0, 1], got {text!r}") from None
    if not ds or any(not 0 < d <= 1 for d in ds):
        raise argparse.ArgumentTypeError(f"--d: each d must lie in (0, 1], got {text!r}")
    return ds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a device run's folder with the ladder stage's ladder.json")
    p.add_argument("--sweep", type=Path, help="the folder with sweep.json and model/config.json (default: RUN)")
    p.add_argument("--d", type=parse_ds, default=list(DEFAULT_D),
                   help="RandomSkip's d values, comma-separated (default: 0.5,0.75,1)")
    p.add_argument("--kv-pool", type=int, help="the KV pool in tokens (default: the headline's arms')")
    p.add_argument("--bandwidth-gbps", type=float, help="the device's memory bandwidth, GB/s (default: the "
                   "roofline's catalogue entry for the sweep's GPU, env.json)")
    p.add_argument("--json", type=Path, help="write the limits here")
    args = p.parse_args(argv)
    if args.bandwidth_gbps is not None and args.bandwidth_gbps <= 0:
        p.error(f"--bandwidth-gbps must be positive, got {args.bandwidth_gbps:g}")
    for path in (args.run / "ladder.json", (args.sweep or args.run) / "sweep.json"):
        if not path.is_file():
            p.error(f"{path}: not found (the ladder and sweep stages' results)")
    doc = limits(args.run, args.sweep or args.run, args.d, args.kv_pool, args.bandwidth_gbps)
    print("\n".join(report(doc)))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
