"""Memory-bandwidth probe: a device-to-device copy benchmark, run by the operator's probe Job per GPU class.

    python -m vskipper_operator.probe [--device cuda|cpu] [--mib 1024] [--iters 20]

It times `dst.copy_(src)` over a buffer much larger than the caches (each copy reads and writes the buffer,
2 x bytes of traffic) and reports the achieved bandwidth as one JSON line on stdout and in the container's
termination message (/dev/termination-log), where the operator reads it from the finished pod's status.
A copy streams memory the way decode attention reads the KV cache, so the achieved figure (typically 80-90%
of the data-sheet peak on HBM) is what the roofline rule's V* = tau * BW / (s * L_r * b) should use.

torch is imported only when the probe runs (the runtime image has it; the operator image does not).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

TERMINATION_LOG = "/dev/termination-log"


def measure(device: str = "cuda", mib: int = 1024, iters: int = 20, warmup: int = 3) -> dict[str, Any]:
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("probe: --device cuda but no CUDA device is visible")
    if mib <= 0 or iters <= 0:
        raise SystemExit("probe: --mib and --iters must be positive")
    n_bytes = mib * 2**20
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(warmup):
        dst.copy_(src)
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        name = torch.cuda.get_device_name()
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
        name = "cpu"
    if not torch.equal(dst[:4096], src[:4096]):
        raise SystemExit("probe: copy produced wrong data")
    return {"bandwidth_gbps": round(2 * n_bytes * iters / seconds / 1e9, 1), "device": device, "device_name": name,
            "bytes": n_bytes, "iters": iters, "seconds": round(seconds, 6), "method": "copy",
            "torch": torch.__version__}


def parse_result(message: str | None) -> float | None:
    """The bandwidth (GB/s) in a probe's output, or None when the message is not a probe result."""
    try:
        value = float(json.loads(message or "")["bandwidth_gbps"])
    except (ValueError, KeyError, TypeError):
        return None
    return value if value > 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vskipper_operator.probe", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu", "auto"), default="cuda")
    parser.add_argument("--mib", type=int, default=1024, help="buffer size, MiB (default 1024)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--termination-log", default=TERMINATION_LOG,
                        help="file for the result (default: the container's termination message)")
    args = parser.parse_args(argv)
    result = json.dumps(measure(args.device, args.mib, args.iters, args.warmup), sort_keys=True)
    print(result)
    target = args.termination_log
    if target and (target != TERMINATION_LOG or os.path.exists(os.path.dirname(target))):
        try:
            with open(target, "w") as fh:
                fh.write(result)
        except OSError as exc:
            print(f"probe: cannot write {target}: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
