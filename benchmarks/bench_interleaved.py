"""`make bench-interleaved`: decode and prefill, s = 0.5 over s = 0, measured in one server pass against pass.

bench-cpu compares servers run one after another, and on a shared host their speed drifts between the runs a
ratio pairs (its dense layers, the same work in every arm, moved by up to 11% from run to run). Here one server
serves both: the s = 0.5 arm (always-route RandomSkip r = 1, d = 0.5) with `VSKIPPER_INTERLEAVE_CONTROL=1`, so its
decode passes alternate between the skipper's routes and every row RUN through the routed layers (the s = 0
control's work; `vskipper.sglang.runtime`). The pass clock (`vskipper.sglang.part_times.PassClock`) times each
decode pass to the start of the next where the next decodes the same rows: the same batch a token later, so the
two kinds of pass do the same work a fraction of a second apart, and a step is what throughput counts (the
forward, the scheduler's handling of its output and the planning of the next batch).

bench-cpu's checkpoint and decode load (32-token prompts, 256 output tokens, 16 concurrent, SGLang's
`sglang.bench_serving`, `--enable-metrics`) are driven `--repetitions` times. Per run it prints both kinds of
step in ms and their ratio, control over routed: the throughput ratio of s = 0.5 over s = 0 at equal batch. Beside
it, from the same server's part clock (its control passes are a phase of their own, `decode_control`):

  limit      what the skipped parts (Q, the read, o_proj, the MLP) of the routed layers took in the control
             passes, less what they took in the routed passes, less the adapter, against the control passes'
             model time (`bench_cpu.served_limit`; the scheduler's time left out: an upper bound)
  model      the model time's ratio, control over routed passes
  dense      the dense layers' ratio (layers before the first routed one, the same work in both kinds of pass):
             1.00 when nothing but the routing differs between them; each run's step ratio over it is printed
             beside (`over dense`), and a run whose step ratio is above the limit is named with it

Prefill the same way: the server's prefill passes alternate too (each phase on its own), and after each decode
run bench-cpu's prefill prompts, twice as many, go one at a time (`prefill_load`), so that every pass prefills one
whole prompt (a run whose prompts took more passes, chunked, is refused; so is one whose passes prefilled fewer
tokens than that, a repeated prompt served from SGLang's radix cache, which the server runs without: the part
clock counts each phase's tokens). A prefill pass lasts seconds and its
step is mostly the forward, so the prefill figure is the model time's ratio, control over routed pass, beside the
FLOP limit (the goal's, `bench_cpu.flop_limit`) and the limit the part clock measures; the dense layers' ratio
and each run's ratio over it as for decode. A run above the FLOP limit is named, and so, apart, is one above the
part clock's limit alone; for both phases each kind of pass's parts are printed (`parts_line`), which tell what
else moved between the kinds of pass. bench_serving's warm-up request is one more prompt of the same length,
and its pass counts with its kind.

Where it differs from two servers: the control pass computes the skipper's r = 1 routes and then runs every row
as a dense-mode row (the s = 0 arm hashes with r = 0: the same host work, other values); the steps are decode
steps of a full batch only (the load's ramp and tail, where the batch changes every pass, are left out).

    python benchmarks/bench_interleaved.py               # the full size (about 16 minutes on two cores)
    python benchmarks/bench_interleaved.py --size quick  # a tiny model: checks the pipeline, figures mean nothing

The last line: `interleaved decode <x>x [<lo>, <hi>] of limit <y>x (<z>% of its gain); prefill <x>x [<lo>, <hi>],
over dense <x>x [<lo>, <hi>] of FLOP limit <y>x (<z>%, <z>% of its gain)`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cpu import (  # noqa: E402
    ARCH,
    ARMS,
    SIZES,
    SKIP,
    BenchServing,
    Load,
    Size,
    check_served,
    default_threads,
    flop_limit,
    gain_share,
    routed_parts,
    run_clock,
    runs_clock,
    served_counts,
    served_limit,
    spread,
    threads_env,
    write_model,
)

from vskipper.checkpoint import tiny_config  # noqa: E402
from vskipper.sglang.part_times import CONTROL_PHASES  # noqa: E402

# Each kind of pass, by its phase in the clocks, per phase.
KINDS = {phase: {"control": CONTROL_PHASES[phase], "routed": phase} for phase in ("decode", "prefill")}


def prefill_load(size: Size) -> Load:
    """bench-cpu's prefill prompts, twice as many, one at a time: each prompt one pass of the same tokens, and the
    passes alternate between the two kinds."""
    return replace(size.prefill, prompts=2 * size.prefill.prompts, concurrency=1)


def interleaved_run(before: dict, after: dict) -> dict:
    """One run's steps (the pass clock) and model time (the part clock, `run_clock`) per kind of pass, from the
    server's attestation read before and after the run; the step ratio, control over routed."""
    out: dict = {}
    for kind, phase in KINDS["decode"].items():
        passes = after["pass_clock"]["passes_total"].get(phase, 0) - before["pass_clock"]["passes_total"].get(phase, 0)
        seconds = (after["pass_clock"]["seconds_total"].get(phase, 0.0)
                   - before["pass_clock"]["seconds_total"].get(phase, 0.0))
        if not passes:
            raise RuntimeError(f"no {kind} decode step was timed in this run: is the server interleaving "
                               f"(VSKIPPER_INTERLEAVE_CONTROL=1, a routed arm)?")
        out[kind] = {"steps": passes, "step_ms": seconds / passes * 1e3,
                     "clock": run_clock(before["part_clock"], after["part_clock"], phase)}
    out["ratio"] = out["control"]["step_ms"] / out["routed"]["step_ms"]
    out["model_ratio"] = out["control"]["clock"]["model"] / out["routed"]["clock"]["model"]
    out["dense_ratio"] = out["control"]["clock"]["dense"] / out["routed"]["clock"]["dense"]
    return out


def prefill_run(before: dict, after: dict, load: Load) -> dict:
    """One prefill run's model time a pass per kind of pass (the part clock, `run_clock`) from the server's
    attestation read before and after the run, and their ratio, control over routed. Every pass must prefill one
    whole prompt (the load's prompts and bench_serving's warm-up), or the two kinds would not prefill the same
    tokens: a prompt cut into chunks takes more passes, and a repeated prompt that SGLang's radix cache still
    holds prefills a token or two (the server runs `--disable-radix-cache`)."""
    out: dict = {}
    for kind, phase in KINDS["prefill"].items():
        out[kind] = {"clock": run_clock(before["part_clock"], after["part_clock"], phase)}
        if not out[kind]["clock"]["passes"]:
            raise RuntimeError(f"no {kind} prefill pass ran in this run: is the server interleaving "
                               f"(VSKIPPER_INTERLEAVE_CONTROL=1, a routed arm)?")
    passes = out["control"]["clock"]["passes"] + out["routed"]["clock"]["passes"]
    if passes != load.prompts + 1:
        raise RuntimeError(f"the prefill load's {load.prompts} prompts and its warm-up ran as {passes} passes, not "
                           f"one pass each (chunked prefill below {load.input_len} tokens?): the two kinds of pass "
                           f"would not prefill the same tokens")
    for kind in KINDS["prefill"]:
        clock = out[kind]["clock"]
        if clock["tokens"] != clock["passes"] * load.input_len:
            raise RuntimeError(f"the {kind} prefill passes ran {clock['tokens']} tokens in {clock['passes']} "
                               f"passes, not {load.input_len} each: a prompt was served in part from SGLang's "
                               f"radix cache (serve with --disable-radix-cache), its prompts are not "
                               f"{load.input_len} tokens long, or the server's part clock counts no tokens; the "
                               f"two kinds of pass would not prefill the same tokens")
    out["model_ratio"] = out["control"]["clock"]["model"] / out["routed"]["clock"]["model"]
    out["dense_ratio"] = out["control"]["clock"]["dense"] / out["routed"]["clock"]["dense"]
    return out


def interleaved_limit(runs: list[dict], phase: str = "decode") -> dict:
    """`served_limit` of the control passes against the routed ones, over all runs, each kind a pass of its own
    (both are divided by their own passes: the same batch in both, so a pass compares with a pass)."""
    clocks = {kind: runs_clock([run[kind]["clock"] for run in runs], phase) for kind in KINDS[phase]}
    n_control, n_routed = (clocks[k]["passes_total"][phase] for k in KINDS[phase])
    routed = clocks["routed"]
    scaled = {"passes_total": {phase: n_control},
              "seconds_total": {phase: {where: {part: t * n_control / n_routed for part, t in parts.items()}
                                        for where, parts in routed["seconds_total"][phase].items()}}}
    return served_limit(clocks["control"], scaled, phase)


def run_interleaved(ckpt: Path, out: Path, size: Size, threads: int) -> tuple[list[dict], list[dict]]:
    """Each repetition's decode run, then its prefill run (`prefill_load`), against one interleaving server."""
    from vskipper.sglang.launch import launched
    from vskipper.sglang.spec import ENV_INTERLEAVE_CONTROL, ENV_PART_CLOCK

    arm_file = out / "arm-interleaved.json"
    arm_file.write_text(json.dumps({"name": "bench-interleaved", **ARMS[f"s={SKIP}"]}))
    # Without the radix cache: bench_serving's random prompts repeat now and then, and a repeated prompt would
    # prefill one token in whichever kind of pass it fell to.
    extra = ["--enable-metrics", "--sleep-on-idle", "--disable-radix-cache", "--max-total-tokens",
             str(size.max_total_tokens)]
    env = {**threads_env(threads), ENV_PART_CLOCK: "1", ENV_INTERLEAVE_CONTROL: "1"}
    client = BenchServing()
    runs, prefill_runs = [], []
    prefill = prefill_load(size)
    try:
        with launched(ckpt, out / "server-interleaved", dtype="bfloat16", extra=extra, graceful=False, env=env,
                      arm_file=arm_file) as launch:
            server = launch.wait_ready(timeout=900)
            for rep in range(size.repetitions):
                counts, before = served_counts(server), server.get_json("/vskipper/attestation")
                client.run(server.url, ckpt, size.decode, out / f"interleaved-decode-{rep}.jsonl", seed=rep)
                check_served(server, "interleaved", "decode", size.decode, counts)
                run = interleaved_run(before, server.get_json("/vskipper/attestation"))
                runs.append(run)
                print(f"  rep {rep} steps control {run['control']['steps']} x {run['control']['step_ms']:.1f} ms, "
                      f"routed {run['routed']['steps']} x {run['routed']['step_ms']:.1f} ms: {run['ratio']:.3f}x "
                      f"(model {run['model_ratio']:.3f}x, dense layers {run['dense_ratio']:.3f})", flush=True)
                counts, before = served_counts(server), server.get_json("/vskipper/attestation")
                client.run(server.url, ckpt, prefill, out / f"interleaved-prefill-{rep}.jsonl", seed=rep)
                check_served(server, "interleaved", "prefill", prefill, counts)
                run = prefill_run(before, server.get_json("/vskipper/attestation"), prefill)
                prefill_runs.append(run)
                print(f"  rep {rep} prefill passes control {run['control']['clock']['passes']} x "
                      f"{run['control']['clock']['model']:.0f} ms, routed {run['routed']['clock']['passes']} x "
                      f"{run['routed']['clock']['model']:.0f} ms: model {run['model_ratio']:.3f}x (dense layers "
                      f"{run['dense_ratio']:.3f})", flush=True)
    finally:
        client.close()
    return runs, prefill_runs


def above_limit(runs: list[dict], limit: float, key: str = "ratio", ceiling: float = float("inf")) -> list[str]:
    """Each run whose ratio `key`, or that ratio over its dense layers' (`over_dense`, computed first), is above
    the limit, with its dense layers' ratio: the same work in both kinds of pass, whose distance from 1.00 is what
    the two kinds of pass differed by besides the routing (and the division by it assumes the whole pass drifted
    alike). With a `ceiling`, only the runs above the limit but not above the ceiling (a higher limit named
    apart)."""
    def name(i: int, run: dict) -> str:
        corrected = run["ratio_over_dense"]
        over = f", over dense {corrected:.3f}x" if corrected > limit else ""
        return f"run {i} {run[key]:.3f}x{over} (dense layers {run['dense_ratio']:.3f})"

    return [name(i, run) for i, run in enumerate(runs)
            if limit < max(run[key], run["ratio_over_dense"]) <= ceiling]


def over_dense(runs: list[dict], key: str) -> tuple[float, float, float]:
    """Each run's ratio `key` over its dense layers' ratio (kept as the run's `ratio_over_dense`), spread."""
    for run in runs:
        run["ratio_over_dense"] = run[key] / run["dense_ratio"]
    return spread([run["ratio_over_dense"] for run in runs])


ABOVE = ("the arms run the same kernels, so such a run measures the two kinds of pass apart by more than the "
         "routing (see its dense layers)")


def parts_line(limit: dict) -> str:
    """The routed layers' parts, ms a pass, control -> routed pass (`served_limit`'s), and both kinds' layers: where
    the two kinds of pass differ, the routing's own parts (Q, the read, o_proj, the MLP, the adapter) and any other
    part that moved between them."""
    layers = ", ".join(f"{kind} {ms['s=0']:.1f} -> {ms[f's={SKIP}']:.1f}" for kind, ms in limit["layers_ms"].items())
    return f"  parts, control -> routed pass (ms a pass): layers {layers}; the routed layers' {routed_parts(limit)}"


def report_prefill(runs: list[dict], flop: float) -> dict:
    """The prefill block of the report: the model time's ratio (a prefill pass is seconds long, the scheduler's
    share of its step a few ms), beside the FLOP limit (the goal's) and the limit the part clock measures."""
    limit = interleaved_limit(runs, "prefill")
    model, dense = (spread([run[key] for run in runs]) for key in ("model_ratio", "dense_ratio"))
    corrected = over_dense(runs, "model_ratio")
    print(f"prefill, s={SKIP} over s=0 in one server (control over routed pass, model time, {len(runs)} runs):")
    print(f"  model ratio     {model[0]:.3f}x [{model[1]:.3f}, {model[2]:.3f}]  ({gain_share(model[0], flop)} of the "
          f"FLOP limit's gain)")
    print(f"  dense layers    {dense[0]:.3f} [{dense[1]:.3f}, {dense[2]:.3f}]  (the same work in both kinds of pass)")
    print(f"  over dense      {corrected[0]:.3f}x [{corrected[1]:.3f}, {corrected[2]:.3f}]  "
          f"({gain_share(corrected[0], flop)} of the FLOP limit's gain)")
    print(f"  FLOP limit      {flop:.3f}x; the part clock's {limit['limit']:.3f}x (the skipped parts "
          f"{limit['skippable_share']:.1%} of the control's model time)")
    print(parts_line(limit))
    above = above_limit(runs, flop, "model_ratio")
    if above:
        print(f"  above the FLOP limit: {'; '.join(above)}: {ABOVE}")
    # The part clock's limit counts only the parts a Project-Only row skips; a run above it is a question whose
    # answer is in the parts that moved between the kinds of pass (printed above).
    above_time = above_limit(runs, limit["limit"], "model_ratio", ceiling=flop)
    if above_time:
        print(f"  above the part clock's limit ({limit['limit']:.3f}x): {'; '.join(above_time)}: a question; the "
              "parts above show what else moved between the two kinds of pass")
    return {"runs": runs, "model_ratio": model, "dense_ratio": dense, "ratio_over_dense": corrected,
            "flop_limit": flop, "limit": limit, "above_limit": above, "above_time_limit": above_time,
            "line": f"prefill {model[0]:.3f}x [{model[1]:.3f}, {model[2]:.3f}], over dense {corrected[0]:.3f}x "
                    f"[{corrected[1]:.3f}, {corrected[2]:.3f}] of FLOP limit {flop:.3f}x "
                    f"({gain_share(model[0], flop)}, {gain_share(corrected[0], flop)} of its gain)"}


def report(runs: list[dict]) -> dict:
    limit = interleaved_limit(runs)
    ratio, model, dense = (spread([run[key] for run in runs]) for key in ("ratio", "model_ratio", "dense_ratio"))
    corrected = over_dense(runs, "ratio")
    print(f"decode, s={SKIP} over s=0 in one server (control over routed step, {len(runs)} runs):")
    print(f"  step ratio      {ratio[0]:.3f}x [{ratio[1]:.3f}, {ratio[2]:.3f}]  "
          f"({gain_share(ratio[0], limit['limit'])} of the limit's gain)")
    print(f"  model ratio     {model[0]:.3f}x [{model[1]:.3f}, {model[2]:.3f}]")
    print(f"  dense layers    {dense[0]:.3f} [{dense[1]:.3f}, {dense[2]:.3f}]  (the same work in both kinds of pass)")
    print(f"  over dense      {corrected[0]:.3f}x [{corrected[1]:.3f}, {corrected[2]:.3f}]  (each run's step ratio over "
          f"its dense layers' ratio; {gain_share(corrected[0], limit['limit'])} of the limit's gain)")
    print(f"  limit           {limit['limit']:.3f}x  (the skipped parts {limit['skippable_share']:.1%} of the "
          f"control's model time; saving {limit['saving_ms']:.1f} ms a pass, adapter {limit['projector_ms']:.1f} ms)")
    print(parts_line(limit))
    above = above_limit(runs, limit["limit"])
    if above:
        print(f"  above the limit: {'; '.join(above)}: {ABOVE}")
    line = (f"interleaved decode {ratio[0]:.3f}x [{ratio[1]:.3f}, {ratio[2]:.3f}] of limit {limit['limit']:.3f}x "
            f"({gain_share(ratio[0], limit['limit'])} of its gain)")
    return {"runs": runs, "ratio": ratio, "model_ratio": model, "dense_ratio": dense, "ratio_over_dense": corrected,
            "above_limit": above, "limit": limit, "line": line}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=SIZES, default="full", help="bench-cpu's sizes (its model and decode load)")
    p.add_argument("--out", default="out/bench-interleaved", help="checkpoint, server log, client records, JSON")
    p.add_argument("--repetitions", type=int, help="decode runs (default: the size's repetitions)")
    p.add_argument("--server-threads", type=int, default=default_threads(),
                   help="the server's torch threads (default: the cores but one, %(default)s here)")
    args = p.parse_args(argv)
    if args.server_threads < 1:
        raise SystemExit("--server-threads must be at least 1")
    size = SIZES[args.size]
    if args.repetitions is not None:
        if args.repetitions < 1:
            raise SystemExit("--repetitions must be at least 1")
        size = replace(size, repetitions=args.repetitions)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = write_model(out, size)
    config = tiny_config(ARCH, size.model, "bfloat16")
    print(f"model: {config['num_hidden_layers']} layers, d={config['hidden_size']}, routed "
          f"{config['routing_layers'][0]}-{config['routing_layers'][-1]}, bf16 ({ckpt}); decode load "
          f"{size.decode}; {args.server_threads} torch thread(s)", flush=True)
    runs, prefill_runs = run_interleaved(ckpt, out, size, args.server_threads)
    summary = report(runs)
    summary["prefill"] = report_prefill(prefill_runs, flop_limit(config, prefill_load(size), SKIP))
    summary["line"] += f"; {summary['prefill']['line']}"
    summary["server_threads"] = args.server_threads
    (out / "bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(summary["line"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
