"""Where a served arm's time goes: SGLang's own torch profiler over a burst's prefill steps and decode steps.

    python benchmarks/gpu/profile_routed.py OUTDIR [--arm NAME ...] [--prompt 2048] [--batch 1] [--steps 3]
                                           [--new-tokens 64] [--dry-run]

For each arm in turn (dense, the always-route arm, the always-route s = 0 control): starts its server with the
device run's model and flags (benchmarks/gpu/run.py), sends a warm-up burst, asks `/start_profile` to trace
`--steps` prefill steps and, once every request of the burst is admitted, `--steps` decode steps (SGLang's
profile by stage), sends the burst of `--batch` prompts, and sums each trace: GPU kernels and CPU ops by total
time per step, and the host waits (device-to-host copies, synchronisations) that stall the scheduler. Prints the
tables and writes OUTDIR/profile-<arm>.json; the traces stay on the machine.
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
    """A trace's GPU kernels, CPU ops and host waits by total time, and the forward steps it holds (SGLang's
    `step[...]` annotations: a stage's trace may hold fewer than the steps asked for, one prefill pass for one
    prompt)."""
    kernels, ops, waits = collections.Counter(), collections.Counter(), collections.Counter()
    counts = collections.Counter()
    steps = 0
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X":
            continue
        name, dur, cat = event.get("name", ""), float(event.get("dur", 0.0)), event.get("cat", "")
        if cat == "kernel":
            kernels[name[:90]] += dur
        elif cat in ("cpu_op", "user_annotation"):
            ops[name[:90]] += dur
            steps += cat == "user_annotation" and name.startswith("step[")
        if any(w in name for w in HOST_WAITS):
            waits[name[:90]] += dur
            counts[name[:90]] += 1
    return {"steps": steps, "gpu_kernel_us_total": sum(kernels.values()),
            "gpu_kernels_us": kernels.most_common(top), "cpu_ops_us": ops.most_common(top),
            "host_waits_us": [(k, v, counts[k]) for k, v in waits.most_common(top)]}


def _trace_stage(path: Path) -> str:
    return "decode" if "DECODE" in path.name else "prefill" if "EXTEND" in path.name else "all"


def profile_arm(plan, args, model: Path, arms: dict[str, Path], vocab: int, arm: str) -> dict:
    traces = args.out / f"trace-{arm}"
    traces.mkdir(exist_ok=True)
    prompts = [run.prompt(args.prompt, 2 + i, vocab) for i in range(args.batch)]
    with ExitStack() as stack:
        server = run.server_for(plan, stack, model, args.out / f"server-{arm}", arm, arms, plan.solo_mem_fraction)
        run.ready(plan, [server])
        warm = [run.prompt(args.prompt, 10_000 + i, vocab) for i in range(args.batch)]
        asyncio.run(run.burst(server, warm, 2))  # compiles and captures what the burst will run
        activities = ["CPU"] if args.dry_run else ["CPU", "GPU"]
        status, text = http(server.url + "/start_profile", {"output_dir": str(traces), "num_steps": args.steps,
                                                            "activities": activities, "profile_by_stage": True},
                            timeout=60)
        if status != 200:
            raise RuntimeError(f"/start_profile: HTTP {status} {text[:300]}")
        records = asyncio.run(run.burst(server, prompts, args.new_tokens))
        deadline = time.monotonic() + 60
        while len(list(traces.rglob("*.json*"))) < 2 and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(3)  # a file is written in one go once found; let a gzip writer finish
    files = sorted(traces.rglob("*.json*"))
    if not files:
        raise RuntimeError(f"no trace under {traces} after the profiled steps")
    stages = {}
    for path in files:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            stages[_trace_stage(path)] = summarise(json.load(f), args.top)
    result = {"arm": arm, "prompt_tokens": args.prompt, "batch": args.batch, "profiled_steps": args.steps,
              "traces": [str(f) for f in files], "ttft_s": [r.ttft_s for r in records], "stages": stages}
    (args.out / f"profile-{arm}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def report(result: dict) -> None:
    """Each stage's figures per step of its own trace (the steps it holds, not the steps asked for)."""
    print(f"== {result['arm']}: batch {result['batch']} x {result['prompt_tokens']} tokens, "
          f"{result['profiled_steps']} steps asked per stage")
    for stage, summary in result["stages"].items():
        steps = summary.get("steps") or result["profiled_steps"]
        print(f"-- {stage}: {steps} steps traced; GPU kernels {summary['gpu_kernel_us_total'] / 1e3 / steps:.2f} ms "
              "per step")
        for title, rows in (("GPU kernels", summary["gpu_kernels_us"]), ("CPU ops", summary["cpu_ops_us"])):
            print(f"   {title} (ms per step)")
            for name, us in rows:
                print(f"{us / 1e3 / steps:9.3f}  {name}")
        print("   host waits (ms per step, count)")
        for name, us, n in summary["host_waits_us"]:
            print(f"{us / 1e3 / steps:9.3f} {n:6d}  {name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--arm", action="append", choices=["dense", run.ALWAYS, run.CONTROL],
                   help="repeat for several arms, profiled one after the other (default: the always-route arm)")
    p.add_argument("--prompt", type=int, default=2048, help="prompt tokens of each request")
    p.add_argument("--batch", type=int, default=1, help="requests in the profiled burst")
    p.add_argument("--steps", type=int, default=3, help="prefill steps, then decode steps, traced")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens each request generates")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--dry-run", action="store_true", help="CPU platform, tiny model")
    args = p.parse_args(argv)
    plan = run.Plan.dry() if args.dry_run else run.Plan.gpu()
    args.out.mkdir(parents=True, exist_ok=True)
    model = run.write_model(plan, args.out)
    arms = run.write_arms(args.out)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    for arm in args.arm or [run.ALWAYS]:
        report(profile_arm(plan, args, model, arms, vocab, arm))
    return 0


if __name__ == "__main__":
    sys.exit(main())
