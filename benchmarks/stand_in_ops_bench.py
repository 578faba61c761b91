#!/usr/bin/env python3
"""The host's cost of one RMSNorm (plain, with its residual add), one SiLU-and-mul and one RoPE call: SGLang's torch
path (`forward_native`, what the CUDA stand-in profile runs without JIT) against the path `vskipper serve
--stand-in-ops triton` hooks in its place (`vskipper.sglang.stand_in_ops`: the call's checks, the outputs'
allocation, one Triton launch), in one process on CPU.

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
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    from vskipper.sglang import stand_in_ops

    norm, silu = RMSNorm(width).to(dtype), SiluAndMul()
    x, r, z = (torch.randn(rows, n, dtype=dtype) for n in (width, width, 2 * width))
    native_norm, native_silu, native_rope = RMSNorm.forward_native, SiluAndMul.forward_native, \
        RotaryEmbedding.forward_native
    # RoPE over rows of `width`: heads of 16 (4 a KV head), the query's and key's views of one fused projection;
    # its cos/sin cache in fp32, as SGLang keeps it on CUDA (on CPU it would cast it to the operands' dtype, and
    # the torch path would then skip the two casts a call it makes on a GPU)
    head, heads = 16, width // 16
    rope = RotaryEmbedding(head, head, 4096, 500000, True, torch.float32)
    qkv = torch.randn(rows, (heads + 2 * max(1, heads // 4)) * head, dtype=dtype)
    q, k = qkv[:, :heads * head], qkv[:, heads * head:(heads + max(1, heads // 4)) * head]
    positions = torch.randint(0, 4096, (rows,))
    return {
        "rmsnorm": (lambda: native_norm(norm, x), lambda: stand_in_ops.around_rmsnorm(native_norm, norm, x)),
        "add+rmsnorm": (lambda: native_norm(norm, x, r),
                        lambda: stand_in_ops.around_rmsnorm(native_norm, norm, x, r)),
        "silu_and_mul": (lambda: native_silu(silu, z), lambda: stand_in_ops.around_silu_and_mul(native_silu, silu, z)),
        "rope": (lambda: native_rope(rope, positions, q, k),
                 lambda: stand_in_ops.around_rope(native_rope, rope, positions, q, k)),
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


def compare(pairs: dict, repetitions: int, n: int, heads: tuple[str, str, str, str]) -> dict:
    """Each of `pairs`' two zero-argument calls timed alternately (`measure`) and counted (`launches`), printed as a
    table under `heads` (the names' column, the first path, the second, their ratio), and returned by name: each
    path's microseconds a repetition, its launches (torch operators, Triton launches) and the second's median
    ratio to the first."""
    print(f"  {heads[0]:<17}{heads[1]:>28}{'launches':>10}{heads[2]:>28}{'launches':>10}{heads[3]:>16}")
    out = {}
    with interpreted_launches(Counter(), run=False):
        for name, pair in pairs.items():
            first, second = measure(pair, repetitions, n)
            counts = [launches(fn) for fn in pair]
            ratio = statistics.median(b / a for a, b in zip(first, second, strict=True))
            cells = [f"{statistics.median(ts):7.1f} [{min(ts):6.1f}, {max(ts):6.1f}]" for ts in (first, second)]
            print(f"  {name:<17}{cells[0]:>28}{sum(counts[0]):>10}{cells[1]:>28}{sum(counts[1]):>10}{ratio:>15.3f}x")
            out[name] = {"us": (first, second), "launches": counts, "ratio": ratio}
    return out


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
    print(f"{args.rows} rows x {args.width}, {args.dtype}; one torch thread; microseconds a call, median [min, max] over "
          f"{args.repetitions} repetitions of {args.calls} calls; launches a call on a GPU (torch kernels + Triton)")
    compared = compare(calls(args.rows, args.width, getattr(torch, args.dtype)), args.repetitions, args.calls,
                       ("op", "SGLang torch path", "hooked Triton path", "hooked / torch"))
    report = {"rows": args.rows, "width": args.width, "dtype": args.dtype, "repetitions": args.repetitions,
              "ops": {op: {"torch_us": c["us"][0], "hooked_us": c["us"][1], "torch_launches": c["launches"][0],
                           "hooked_launches": c["launches"][1], "hooked_over_torch": c["ratio"]}
                      for op, c in compared.items()}}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
