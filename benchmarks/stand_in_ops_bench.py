#!/usr/bin/env python3
"""The host's cost of one RMSNorm (plain, with its residual add) and one SiLU-and-mul call: SGLang's torch path
(`forward_native`, what the CUDA stand-in profile runs without JIT) against the path `vskipper serve --stand-in-ops
triton` hooks in its place (`vskipper.sglang.stand_in_ops`: the call's checks, the outputs' allocation, one Triton
launch), in one process on CPU.

The rows are few and narrow (16 x 64 by default, bfloat16 as served), so the torch path's compute is negligible and its time is its
dispatches; the Triton launch is recorded and not run (`vskipper.mixed.launches.interpreted_launches`), so the
hooked path's time is its Python up to the launch, without Triton's own launcher (a compiled kernel's argument
binding and driver call, which only a GPU can time). Each figure beside the launches a call makes on a GPU (torch
operators that compute or copy, a kernel each; Triton launches). The two paths alternate call by call, each
repetition's figure the median of its calls, and the repetitions' median [min, max] is printed with the ratio.

    python benchmarks/stand_in_ops_bench.py                # about half a minute
    python benchmarks/stand_in_ops_bench.py --rows 16 --width 64 --repetitions 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined: the kernels here are never run
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from vskipper.mixed.launches import LaunchCount, interpreted_launches  # noqa: E402
from vskipper.sglang.standalone import init_sglang  # noqa: E402


def calls(rows: int, width: int, dtype: torch.dtype) -> dict:
    """Per op: (SGLang's torch path, the hooked path) as zero-argument calls on the same operands."""
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm

    from vskipper.sglang import stand_in_ops

    norm, silu = RMSNorm(width).to(dtype), SiluAndMul()
    x, r, z = (torch.randn(rows, n, dtype=dtype) for n in (width, width, 2 * width))
    native_norm, native_silu = RMSNorm.forward_native, SiluAndMul.forward_native
    return {
        "rmsnorm": (lambda: native_norm(norm, x), lambda: stand_in_ops.around_rmsnorm(native_norm, norm, x)),
        "add+rmsnorm": (lambda: native_norm(norm, x, r),
                        lambda: stand_in_ops.around_rmsnorm(native_norm, norm, x, r)),
        "silu_and_mul": (lambda: native_silu(silu, z), lambda: stand_in_ops.around_silu_and_mul(native_silu, silu, z)),
    }


def launches(fn) -> tuple[int, int]:
    count = LaunchCount()
    with interpreted_launches(count.triton, run=False), count:
        fn()
    return sum(count.ops.values()), sum(count.triton.values())


def measure(pair, repetitions: int, n: int) -> tuple[list[float], list[float]]:
    times: tuple[list[float], list[float]] = ([], [])
    for fn in pair:  # warm-up
        fn()
    for _ in range(repetitions):
        per: tuple[list[float], list[float]] = ([], [])
        for i in range(n):
            for k in ((0, 1) if i % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                pair[k]()
                per[k].append(time.perf_counter() - t0)
        for k in (0, 1):
            times[k].append(statistics.median(per[k]) * 1e6)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the operands' (bfloat16, as served: the torch path's casts to fp32 and back are kernels)")
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000, help="calls of each path per repetition")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    init_sglang("cpu")
    torch.manual_seed(0)
    report: dict = {"rows": args.rows, "width": args.width, "dtype": args.dtype, "repetitions": args.repetitions,
                    "ops": {}}
    print(f"{args.rows} rows x {args.width}, {args.dtype}; one torch thread; microseconds a call, median [min, max] over "
          f"{args.repetitions} repetitions of {args.calls} calls; launches a call on a GPU (torch kernels + Triton)")
    print(f"  {'op':<14}{'SGLang torch path':>28}{'launches':>10}{'hooked Triton path':>28}{'launches':>10}"
          f"{'hooked / torch':>16}")
    with interpreted_launches(Counter(), run=False):
        for op, pair in calls(args.rows, args.width, getattr(torch, args.dtype)).items():
            native, hooked = measure(pair, args.repetitions, args.calls)
            counts = [launches(fn) for fn in pair]
            ratio = [h / t for h, t in zip(hooked, native, strict=True)]
            cells = [f"{statistics.median(ts):7.1f} [{min(ts):6.1f}, {max(ts):6.1f}]" for ts in (native, hooked)]
            print(f"  {op:<14}{cells[0]:>28}{sum(counts[0]):>10}{cells[1]:>28}{sum(counts[1]):>10}"
                  f"{statistics.median(ratio):>15.3f}x")
            report["ops"][op] = {"torch_us": native, "hooked_us": hooked, "torch_launches": counts[0],
                                 "hooked_launches": counts[1], "hooked_over_torch": statistics.median(ratio)}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
