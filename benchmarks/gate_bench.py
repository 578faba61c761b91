#!/usr/bin/env python3
"""The host's cost of one routed layer's route under a trained gate: the gate's own `route` (its router module and
decision, what the torch execution runs) against the fused gate the triton execution runs in its place
(`vskipper.mixed.router`: the router's two GEMMs and two Triton launches), in one process on CPU.

The rows are few and narrow (16 x 64, a router of 4, bfloat16 as served), so the GEMMs' compute is negligible and
each path's time is its dispatches; the Triton launches are recorded and not run
(`vskipper.mixed.launches.interpreted_launches`), so the fused path's time is its Python up to each launch, without
Triton's own launcher (a compiled kernel's argument binding and driver call, which only a GPU can time). Each
figure beside the launches a call makes on a GPU (torch operators that compute or copy, a kernel each; Triton
launches); a pass launches it at every routed layer (16 on Llama-3-8B). The two paths alternate call by call, each
repetition's figure the median of its calls, and the repetitions' median [min, max] is printed with the ratio.

    python benchmarks/gate_bench.py                # about half a minute
    python benchmarks/gate_bench.py --rows 16 --hidden 64 --repetitions 7
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined: the kernels here are never run
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.stand_in_ops_bench import compare  # noqa: E402
from vskipper.mixed.router import gate_route  # noqa: E402
from vskipper.modelspec import router_sizes  # noqa: E402
from vskipper.skippers.modules import SkipRouter  # noqa: E402
from vskipper.skippers.trained_gate import FlexiDepthGate, HardGate  # noqa: E402


def calls(rows: int, hidden: int, dtype: torch.dtype) -> dict:
    """Per gate: (its own route, the fused gate) as zero-argument calls on the same router and rows."""
    reduced, _ = router_sizes({"hidden_size": hidden, "intermediate_size": hidden})  # the release's factor, 16
    router = SkipRouter(hidden, reduced).to(dtype)
    u = torch.randn(rows, hidden, dtype=dtype)
    valid = torch.ones(rows, 1, dtype=torch.bool)
    return {gate.name: (lambda gate=gate: gate.route(0, u, valid, router),
                        lambda gate=gate: gate_route(gate, u, valid, router))
            for gate in (FlexiDepthGate(), HardGate())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000, help="calls of each path per repetition")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"{args.rows} rows x {args.hidden}, {args.dtype}; one torch thread; microseconds a routed layer's route, "
          f"median [min, max] over {args.repetitions} repetitions of {args.calls} calls; launches a call on a GPU "
          "(torch kernels + Triton)")
    compared = compare(calls(args.rows, args.hidden, getattr(torch, args.dtype)), args.repetitions, args.calls,
                       ("gate", "its own route", "fused gate", "fused / own"))
    report = {"rows": args.rows, "hidden": args.hidden, "dtype": args.dtype, "repetitions": args.repetitions,
              "gates": {gate: {"own_us": c["us"][0], "fused_us": c["us"][1], "own_launches": c["launches"][0],
                               "fused_launches": c["launches"][1], "fused_over_own": c["ratio"]}
                        for gate, c in compared.items()}}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
