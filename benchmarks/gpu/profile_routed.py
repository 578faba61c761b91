"""Where a served arm's time goes: SGLang's own torch profiler over a burst's prefill steps and decode steps.

    python benchmarks/gpu/profile_routed.py OUTDIR [--arm NAME ...] [--prompt 2048] [--batch 1] [--steps 3]
                                           [--new-tokens 64] [--with-stack] [--part-clock] [--dry-run]

For each arm in turn (dense, the always-route arm, the always-route s = 0 control): starts its server with the
device run's model and flags (benchmarks/gpu/run.py), sends a warm-up burst, asks `/start_profile` to trace
`--steps` prefill steps and, once every request of the burst is admitted, `--steps` decode steps (SGLang's
profile by stage, without Python stacks unless `--with-stack`), sends the burst of `--batch` prompts, and sums
each trace: GPU kernels and CPU ops by total time per step of the trace (a prompt's prefill is one step), the host
waits (device-to-host copies, synchronisations) that stall the scheduler, and each step's host span beside its
device span and the device's busy time in it (a span well beyond its busy time waited on the host: a host-bound
step). Prints the tables and writes OUTDIR/profile-<arm>.json; the traces stay on the machine.

`--part-clock` measures without the profiler's cost: each server runs with its part clock on
(`vskipper.sglang.part_times`), and the burst's passes are read from it: the host's ms a pass per layer kind and
part (on a GPU the launches, the host's own cost) beside the device's span of a pass (CUDA events), per phase
(OUTDIR/clock-<arm>.json). A pass whose device span is about as long as its host time (the device waited on the
launches) is host-bound; the clock's own wrapped calls add a little to the host's time.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gzip
import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_cpu import run_clock  # noqa: E402
from benchmarks.gpu import run  # noqa: E402
from vskipper.sglang.launch import http  # noqa: E402
from vskipper.sglang.spec import ENV_PART_CLOCK  # noqa: E402

HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "Memcpy DtoH",
              "aten::item", "aten::_local_scalar_dense")


def busy_us(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """How long within [start, end] at least one of the (start, end) intervals runs: their union, clipped."""
    busy, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            busy += b - a
            reach = b
    return busy


def summarise(trace: dict, top: int) -> dict:
    """A trace's GPU kernels, CPU ops and host waits by total time, the forward steps it holds (SGLang's
    `step[...]` annotations: a stage's trace may hold fewer than the steps asked for, one prefill pass for one
    prompt), and each step's clocks: the host's span of the step (`cpu_us`), the device's (`gpu_span_us`, its
    GPU-side annotation) and the time within that a kernel ran (`gpu_busy_us`). A device span much longer than its
    busy time waited on the host's launches: the step is host-bound (the trace's own overhead inflates the host's
    time, the more so with Python stacks recorded)."""
    kernels, ops, waits = collections.Counter(), collections.Counter(), collections.Counter()
    counts = collections.Counter()
    host_steps, device_steps, intervals = [], [], []
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X":
            continue
        name, dur, cat = event.get("name", ""), float(event.get("dur", 0.0)), event.get("cat", "")
        if cat == "kernel":
            kernels[name[:90]] += dur
            intervals.append((float(event.get("ts", 0.0)), float(event.get("ts", 0.0)) + dur))
        elif cat in ("cpu_op", "user_annotation"):
            ops[name[:90]] += dur
        if name.startswith("step[") and cat in ("user_annotation", "gpu_user_annotation"):
            (host_steps if cat == "user_annotation" else device_steps).append(event)
        if any(w in name for w in HOST_WAITS):
            waits[name[:90]] += dur
            counts[name[:90]] += 1
    host_steps.sort(key=lambda e: float(e.get("ts", 0.0)))
    spans: list[list[float]] = []  # each step's device side: its GPU annotations (nested ones overlap) as one span
    for e in sorted(device_steps, key=lambda e: float(e.get("ts", 0.0))):
        start = float(e.get("ts", 0.0))
        end = start + float(e.get("dur", 0.0))
        if spans and start < spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    clocks = []
    for i, host in enumerate(host_steps):
        clock = {"step": host["name"], "cpu_us": float(host.get("dur", 0.0))}
        if len(spans) == len(host_steps):  # the i-th step's device side (none paired where the counts differ)
            start, end = spans[i]
            clock.update(gpu_span_us=end - start, gpu_busy_us=busy_us(intervals, start, end))
        clocks.append(clock)
    return {"steps": len(host_steps), "step_clocks": clocks, "gpu_kernel_us_total": sum(kernels.values()),
            "gpu_kernels_us": kernels.most_common(top), "cpu_ops_us": ops.most_common(top),
            "host_waits_us": [(k, v, counts[k]) for k, v in waits.most_common(top)]}


def _trace_stage(path: Path) -> str:
    return "decode" if "DECODE" in path.name else "prefill" if "EXTEND" in path.name else "all"


def warm_server(plan, args, stack: ExitStack, model: Path, arms: dict[str, Path], vocab: int, arm: str):
    """The arm's server, started with the device run's model and flags and warmed by a burst of the measured
    burst's shape (compiles and captures what it will run): (server, the measured burst's prompts)."""
    server = run.server_for(plan, stack, model, args.out / f"server-{arm}", arm, arms, plan.solo_mem_fraction)
    run.ready(plan, [server])
    warm = [run.prompt(args.prompt, 10_000 + i, vocab) for i in range(args.batch)]
    asyncio.run(run.burst(server, warm, 2))
    return server, [run.prompt(args.prompt, 2 + i, vocab) for i in range(args.batch)]


def clock_arm(plan, args, model: Path, arms: dict[str, Path], vocab: int, arm: str) -> dict:
    """`--part-clock`: the arm's server with its part clock on (`VSKIPPER_PART_CLOCK`, set by `main`) and no
    profiler: after the warm-up burst, the burst's passes per phase as the clock read before and after it counts
    them (`bench_cpu.run_clock`): the host's ms a pass per layer kind (its launches, on a GPU) beside the device's
    span of a pass (the state writer waits for the device's end of every pass timed before it writes the
    attestation, so each reading holds the burst's last pass too)."""
    with ExitStack() as stack:
        server, prompts = warm_server(plan, args, stack, model, arms, vocab, arm)
        before = server.get_json("/vskipper/attestation").get("part_clock")
        if before is None:
            raise RuntimeError(f"{arm}: the server attests no part clock (was {ENV_PART_CLOCK} passed to it?)")
        records = asyncio.run(run.burst(server, prompts, args.new_tokens))
        after = server.get_json("/vskipper/attestation")["part_clock"]
    phases = {phase: run_clock(before, after, phase) for phase in ("prefill", "decode")}
    result = {"arm": arm, "prompt_tokens": args.prompt, "batch": args.batch, "new_tokens": args.new_tokens,
              "ttft_s": [r.ttft_s for r in records], "phases": phases}
    (args.out / f"clock-{arm}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def report_clock(result: dict) -> None:
    """Each phase's host ms a pass by layer kind, its parts by host time, and the device's span of a pass."""
    print(f"== {result['arm']}: batch {result['batch']} x {result['prompt_tokens']} tokens, "
          f"{result['new_tokens']} new tokens each, part clock")
    for phase, c in result["phases"].items():
        device = (f"device span {c['device']:.2f} ms a pass ({c['device_passes']} passes)" if c["device"] is not None
                  else "no device span (a CPU's clock)")
        kinds = ("(the forward whole: pass spans alone)" if c["routed"] is None else
                 f"(routed layers {c['routed']:.2f}, dense layers {c['dense']:.2f}, outside {c['outside']:.2f})")
        print(f"-- {phase}: {c['passes']} passes, {c['tokens']} tokens; host {c['model']:.2f} ms a pass {kinds}; "
              f"{device}")
        parts = sorted(((where, part, s) for where, ps in c["seconds"].items() for part, s in ps.items()),
                       key=lambda row: -row[2])
        for where, part, s in parts[:12]:
            print(f"{s / max(1, c['passes']) * 1e3:9.3f}  {where} {part}")


def profile_arm(plan, args, model: Path, arms: dict[str, Path], vocab: int, arm: str) -> dict:
    traces = args.out / f"trace-{arm}"
    traces.mkdir(exist_ok=True)
    with ExitStack() as stack:
        server, prompts = warm_server(plan, args, stack, model, arms, vocab, arm)
        activities = ["CPU"] if args.dry_run else ["CPU", "GPU"]
        status, text = http(server.url + "/start_profile", {"output_dir": str(traces), "num_steps": args.steps,
                                                            "activities": activities, "profile_by_stage": True,
                                                            "with_stack": args.with_stack, "record_shapes": False},
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
        for c in summary.get("step_clocks", []):
            device = (f"device span {c['gpu_span_us'] / 1e3:.2f} ms, busy {c['gpu_busy_us'] / 1e3:.2f} ms "
                      f"({c['gpu_busy_us'] / c['gpu_span_us']:.0%})" if c.get("gpu_span_us") else "no device side")
            print(f"   {c['step']}: host {c['cpu_us'] / 1e3:.2f} ms, {device}")
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
    p.add_argument("--with-stack", action="store_true",
                   help="record Python stacks (SGLang's default; they slow the host several-fold, so each step's "
                        "host and device spans mostly measure the trace)")
    p.add_argument("--part-clock", action="store_true",
                   help="instead of the profiler, the servers' part clocks: host ms a pass by layer kind and part "
                        "(on a GPU, the launches) beside the device's span of a pass")
    p.add_argument("--dry-run", action="store_true", help="CPU platform, tiny model")
    args = p.parse_args(argv)
    if args.part_clock:
        os.environ[ENV_PART_CLOCK] = "1"  # the servers started below inherit it
    plan = run.Plan.dry() if args.dry_run else run.Plan.gpu()
    args.out.mkdir(parents=True, exist_ok=True)
    model = run.write_model(plan, args.out)
    arms = run.write_arms(args.out)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    for arm in args.arm or [run.ALWAYS]:
        if args.part_clock:
            report_clock(clock_arm(plan, args, model, arms, vocab, arm))
        else:
            report(profile_arm(plan, args, model, arms, vocab, arm))
    return 0


if __name__ == "__main__":
    sys.exit(main())
