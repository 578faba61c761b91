"""Where a served arm's time goes: SGLang's own torch profiler over one prefill and its first decode steps.

    python benchmarks/gpu/profile_routed.py OUTDIR [--arm dense|random-r1-d0.5-always] [--prompt 2048] [--dry-run]

Starts the arm's server with the device run's model and flags (benchmarks/gpu/run.py), sends one warm-up request,
asks `/start_profile` for the next steps, sends one prompt, and sums the trace it writes: GPU kernels and CPU ops by
total time, and the host waits (device-to-host copies, synchronisations) that stall the scheduler. Prints the tables
and writes OUTDIR/profile-<arm>.json; the trace itself stays on the machine.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import gzip
import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu import run  # noqa: E402
from vskipper.sglang.launch import http  # noqa: E402

HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "Memcpy DtoH",
              "aten::item", "aten::_local_scalar_dense")


def summarise(trace: dict, top: int) -> dict:
    kernels, ops, waits = collections.Counter(), collections.Counter(), collections.Counter()
    counts = collections.Counter()
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X":
            continue
        name, dur, cat = event.get("name", ""), float(event.get("dur", 0.0)), event.get("cat", "")
        if cat == "kernel":
            kernels[name[:90]] += dur
        elif cat in ("cpu_op", "user_annotation"):
            ops[name[:90]] += dur
        if any(w in name for w in HOST_WAITS):
            waits[name[:90]] += dur
            counts[name[:90]] += 1
    return {"gpu_kernel_us_total": sum(kernels.values()),
            "gpu_kernels_us": kernels.most_common(top), "cpu_ops_us": ops.most_common(top),
            "host_waits_us": [(k, v, counts[k]) for k, v in waits.most_common(top)]}


def wait_for(traces: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not list(traces.rglob("*.json*")):
        if time.monotonic() > deadline:
            return False
        time.sleep(1)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--arm", default=run.ALWAYS, choices=["dense", run.ALWAYS])
    p.add_argument("--prompt", type=int, default=2048, help="prompt tokens of the profiled request")
    p.add_argument("--new-tokens", type=int, default=6, help="decode steps profiled after its prefill")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--dry-run", action="store_true", help="CPU platform, tiny model")
    args = p.parse_args(argv)
    plan = run.Plan.dry() if args.dry_run else run.Plan.gpu()
    args.out.mkdir(parents=True, exist_ok=True)
    model = run.write_model(plan, args.out)
    arms = run.write_arms(args.out)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    traces = args.out / f"trace-{args.arm}"
    traces.mkdir(exist_ok=True)
    with ExitStack() as stack:
        server = run.server_for(plan, stack, model, args.out / f"server-{args.arm}", args.arm, arms,
                                plan.sweep_mem_fraction)
        run.ready(plan, [server])
        asyncio.run(run.burst(server, [run.prompt(args.prompt, 1, vocab)], args.new_tokens))  # warm-up
        steps = args.new_tokens  # one prefill, then new_tokens - 1 decode steps
        activities = ["CPU"] if args.dry_run else ["CPU", "GPU"]
        status, text = http(server.url + "/start_profile", {"output_dir": str(traces), "num_steps": steps,
                                                            "activities": activities}, timeout=60)
        if status != 200:
            raise RuntimeError(f"/start_profile: HTTP {status} {text[:300]}")
        record = asyncio.run(run.burst(server, [run.prompt(args.prompt, 2, vocab)], args.new_tokens))[0]
        if not wait_for(traces, 20):  # the step count missed (an extra or a merged step): stop it by hand
            http(server.url + "/stop_profile", {}, timeout=60)
            wait_for(traces, 150)
        time.sleep(3)  # the file is written in one go once found; let a gzip writer finish
    files = sorted(traces.rglob("*.json*"))
    if not files:
        raise RuntimeError(f"no trace under {traces} after the profiled steps")
    opener = gzip.open if files[0].suffix == ".gz" else open
    with opener(files[0], "rt") as f:
        result = summarise(json.load(f), args.top)
    result.update(arm=args.arm, prompt_tokens=args.prompt, profiled_steps=steps, trace=str(files[0]),
                  ttft_s=record.ttft_s)
    (args.out / f"profile-{args.arm}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.arm}: {steps} steps profiled (prompt {args.prompt}), TTFT {record.ttft_s * 1e3:.1f} ms, "
          f"GPU kernels {result['gpu_kernel_us_total'] / 1e3:.1f} ms in all")
    for title, rows in (("GPU kernels", result["gpu_kernels_us"]), ("CPU ops", result["cpu_ops_us"])):
        print(f"-- {title} (ms)")
        for name, us in rows:
            print(f"{us / 1e3:9.2f}  {name}")
    print("-- host waits (ms, count)")
    for name, us, n in result["host_waits_us"]:
        print(f"{us / 1e3:9.2f} {n:6d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
