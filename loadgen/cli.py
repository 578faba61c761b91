"""`vskipper-loadgen`: build suites, sweep Q*, run matched-work A/B cells, simulate, demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from loadgen.attestation import DEFAULT_ATTESTATION_PATH


def _rates(text: str, integers: bool = False) -> list:
    try:
        if "-" in text and "," not in text:
            lo, hi = (int(x) for x in text.split("-"))
            values = list(range(lo, hi + 1))
        else:
            values = [int(x) if integers else float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates: expected 'a-b' or a comma list, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("rates: empty")
    return values


def _write_json(path: str | None, data: dict) -> None:
    text = json.dumps(data, indent=1)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
        print(f"wrote {path}")
    else:
        print(text)


def cmd_build_suite(args) -> int:
    from loadgen.suite import build_suite

    suite = build_suite(args.prompts, args.tokenizer, name=args.name, id_prefix=args.id_prefix,
                        text_field=args.text_field, id_field=args.id_field, scored=not args.unscored,
                        add_special_tokens=not args.no_special_tokens, max_new_tokens=args.max_new_tokens)
    suite.save(args.out)
    print(f"wrote {args.out}: {len(suite)} requests, digest {suite.digest}")
    return 0


def cmd_pad_suite(args) -> int:
    from loadgen.suite import load_suite, pad_suite

    suite = pad_suite(load_suite(args.suite), load_suite(args.extra), args.size)
    suite.save(args.out)
    print(f"wrote {args.out}: {len(suite)} requests, digest {suite.digest}")
    return 0


def _endpoint(url: str, args, attested: bool):
    from loadgen.client import Endpoint

    return Endpoint(url, api=args.api, model=args.model,
                    attestation_path=args.attestation_path if attested else None)


def cmd_ladder(args) -> int:
    from loadgen.experiment import ArmTarget, run_ladder
    from loadgen.suite import load_suite

    target = ArmTarget(args.name, _endpoint(args.url, args, False))
    res = asyncio.run(run_ladder(target, load_suite(args.suite), args.rates, seed=args.seed,
                                 context_len=args.context_len, max_new_tokens=args.max_new_tokens,
                                 progress=args.progress))
    q = res.q_star
    print(f"Q* = {q.q_star} req/s ({q.tok_s_at_q_star:.1f} output tok/s; plateau reached: {q.plateau_reached}); "
          f"cells: {q.cells()}")
    _write_json(args.out, res.as_dict())
    return 0


def cmd_ab(args) -> int:
    from loadgen.experiment import ArmTarget, run_ab
    from loadgen.qstar import cell_rates
    from loadgen.report import markdown_table, write_report
    from loadgen.suite import load_suite
    from vskipper.arms import Arm, get_arm

    arm = Arm.from_dict(json.loads(Path(args.arm_json).read_text())) if args.arm_json else get_arm(args.arm)
    if args.q_star is not None:
        cells = {f"{f}x": r for f, r in zip((0.75, 0.95, 1.25), cell_rates(args.q_star).values(), strict=True)}
    elif args.rates:
        cells = {f"{r:g}req-s": r for r in args.rates}
    else:
        raise SystemExit("ab: give --q-star or --rates")
    suite = load_suite(args.suite)
    execution = json.loads(Path(args.execution).read_text()) if args.execution else None
    if execution is not None and not isinstance(execution, dict):
        raise ValueError(f"--execution {args.execution}: must hold a JSON object of executed fields")
    base = ArmTarget(args.baseline_name, _endpoint(args.baseline_url, args, args.baseline_attested),
                     execution=execution if args.baseline_attested else None)
    target = ArmTarget(arm.name, _endpoint(args.arm_url, args, True), arm, execution)

    async def go():
        return [await run_ab(base, target, suite, rate, repetitions=args.repetitions, seed=args.seed, label=label,
                             context_len=args.context_len, max_new_tokens=args.max_new_tokens,
                             empty_exceptions=args.empty_exception, expect_engaged=not args.below_engagement,
                             progress=args.progress)
                for label, rate in cells.items()]

    results = asyncio.run(go())
    write_report(results, args.out, title=f"{suite.name}: {arm.name} vs {args.baseline_name}")
    print(markdown_table(results))
    print(f"wrote {args.out}")
    return 0 if all(r.accepted for r in results) else 3


def cmd_simulate(args) -> int:
    from loadgen.simulate import SimConfig, StepLine, predict
    from loadgen.suite import load_suite
    from vskipper.arms import get_arm

    if args.suite:
        suite = load_suite(args.suite)
        prompts = [r.prompt_tokens for r in suite.requests]
        ids = suite.ids
    else:
        prompts = [args.prompt_tokens] * args.requests
        ids = [str(i) for i in range(args.requests)]
    if args.lengths:
        data = json.loads(Path(args.lengths).read_text())
        lengths = data.get("lengths", data)
        missing = [i for i in ids if i not in lengths]
        if missing:
            raise SystemExit(f"simulate: --lengths has no length for request {missing[0]!r}")
        outputs = [max(1, int(lengths[i])) for i in ids]
    else:
        outputs = [args.output_tokens] * len(prompts)
    enter, exit_ = args.enter_tokens, args.exit_tokens
    if args.device:
        from vskipper.modelspec import load_model_facts
        from vskipper.roofline import derive_thresholds, lookup_device

        dev, facts = lookup_device(args.device), load_model_facts(args.model)
        th = derive_thresholds(dev.bandwidth_gbps, args.skip_ratio, facts.num_routed_layers,
                               facts.kv_bytes_per_token_layer)
        enter, exit_ = th.enter_tokens, th.exit_tokens
    if enter is None or exit_ is None:
        raise SystemExit("simulate: give --enter-tokens and --exit-tokens, or --device and --model")
    cfg = SimConfig(StepLine.parse(args.decode_dense, "--decode-dense"),
                    StepLine.parse(args.decode_routed, "--decode-routed"),
                    StepLine.parse(args.prefill_dense, "--prefill-dense"),
                    StepLine.parse(args.prefill_routed, "--prefill-routed"),
                    enter_tokens=enter, exit_tokens=exit_, max_running=args.max_running,
                    kv_capacity_tokens=args.kv_capacity_tokens, max_prefill_tokens=args.max_prefill_tokens,
                    project_share=args.project_share, prefill_floor_tokens=args.prefill_floor_tokens)
    preds = predict(prompts, outputs, args.rates, cfg, get_arm(args.arm).switch_settings(), seed=args.seed)
    print(f"{'rate':>8} " + " ".join(f"{m:>11}" for m in preds[0].change_pct))
    for p in preds:
        print(f"{p.rate:>8g} " + " ".join(f"{v:>+10.1f}%" for v in p.change_pct.values()))
    if args.out:
        _write_json(args.out, {"arm": args.arm, "enter_tokens": enter, "exit_tokens": exit_,
                               "predictions": [p.as_dict() for p in preds]})
    return 0


def cmd_demo(args) -> int:
    from loadgen.demo import main as demo_main

    return demo_main(args.out, args.repetitions)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vskipper-loadgen", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("build-suite", help="tokenize a local JSONL of prompts into a frozen suite")
    s.add_argument("--prompts", required=True)
    s.add_argument("--tokenizer", required=True, help="a local directory with tokenizer.json")
    s.add_argument("--out", required=True)
    s.add_argument("--name")
    s.add_argument("--id-prefix", default="prompt")
    s.add_argument("--id-field", default="id")
    s.add_argument("--text-field", default="prompt")
    s.add_argument("--unscored", action="store_true", help="mark the requests as load only")
    s.add_argument("--no-special-tokens", action="store_true")
    s.add_argument("--max-new-tokens", type=int)
    s.set_defaults(fn=cmd_build_suite)

    s = sub.add_parser("pad-suite", help="append unscored requests from another suite up to a size")
    s.add_argument("--suite", required=True)
    s.add_argument("--extra", required=True)
    s.add_argument("--size", type=int, required=True)
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_pad_suite)

    def server_args(s):
        s.add_argument("--api", choices=("generate", "completions"), default="generate")
        s.add_argument("--model", default="default", help="model name for /v1/completions")
        s.add_argument("--attestation-path", default=DEFAULT_ATTESTATION_PATH)
        s.add_argument("--context-len", type=int, help="natural lane: generate up to the remaining context")
        s.add_argument("--max-new-tokens", type=int, help="natural lane: a cap per request")
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--progress", action="store_true")

    s = sub.add_parser("ladder", help="baseline natural lane at contiguous integer rates -> Q*")
    s.add_argument("--url", required=True)
    s.add_argument("--name", default="upstream")
    s.add_argument("--suite", required=True)
    s.add_argument("--rates", required=True, type=lambda t: _rates(t, integers=True), help="e.g. 8-18")
    s.add_argument("--out")
    server_args(s)
    s.set_defaults(fn=cmd_ladder)

    s = sub.add_parser("ab", help="matched-work A/B cells with paired repetitions, gates and a report")
    s.add_argument("--suite", required=True)
    s.add_argument("--baseline-url", required=True)
    s.add_argument("--baseline-name", default="upstream")
    s.add_argument("--baseline-attested", action="store_true",
                   help="the baseline serves the attestation too (off for upstream SGLang)")
    s.add_argument("--arm-url", required=True)
    s.add_argument("--arm", default="hybrid", help="a named arm (vskipper arms)")
    s.add_argument("--arm-json", help="an arm as a JSON file (overrides --arm)")
    s.add_argument("--q-star", type=float, help="run the cells at 0.75, 0.95 and 1.25 x Q*")
    s.add_argument("--rates", type=_rates, help="or explicit rates, comma-separated")
    s.add_argument("--repetitions", type=int, default=6)
    s.add_argument("--empty-exception", action="append", default=[], help="request id allowed to be empty")
    s.add_argument("--below-engagement", action="store_true",
                   help="hybrid arm: accept cells where the switch never routes")
    s.add_argument("--execution", help="the configuration both arms must attest they executed: a JSON file "
                                       "holding an object of `executed` fields (attested arms only)")
    s.add_argument("--out", required=True)
    server_args(s)
    s.set_defaults(fn=cmd_ab)

    s = sub.add_parser("simulate", help="discrete-event prediction of the arm's latency change across load")
    s.add_argument("--suite", help="take prompt lengths from a suite")
    s.add_argument("--requests", type=int, default=400)
    s.add_argument("--prompt-tokens", type=int, default=800)
    s.add_argument("--lengths", help="JSON {request id: output tokens} (e.g. an A/B result's lengths)")
    s.add_argument("--output-tokens", type=int, default=120)
    s.add_argument("--rates", type=_rates, required=True)
    s.add_argument("--arm", default="hybrid")
    s.add_argument("--decode-dense", required=True, help="intercept,per_row,per_resident_token (seconds)")
    s.add_argument("--decode-routed", required=True)
    s.add_argument("--prefill-dense", required=True)
    s.add_argument("--prefill-routed", required=True)
    s.add_argument("--enter-tokens", type=int)
    s.add_argument("--exit-tokens", type=int)
    s.add_argument("--device", help="derive thresholds from the roofline for this device")
    s.add_argument("--model", default="llama-3-8b")
    s.add_argument("--skip-ratio", type=float, default=0.5)
    s.add_argument("--max-running", type=int, default=256)
    s.add_argument("--kv-capacity-tokens", type=int, default=400_000)
    s.add_argument("--max-prefill-tokens", type=int, default=16384)
    s.add_argument("--project-share", type=float, default=0.5)
    s.add_argument("--prefill-floor-tokens", type=int,
                   help="the prefill floor the arm serves (`vskipper serve --prefill-floor-tokens`; default: "
                        "vskipper.constants')")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out")
    s.set_defaults(fn=cmd_simulate)

    s = sub.add_parser("demo", help="a small A/B run against two local stand-in servers, with report and plots")
    s.add_argument("--out", default="out/loadgen-demo")
    s.add_argument("--repetitions", type=int, default=3)
    s.set_defaults(fn=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, OSError) as exc:
        print(f"vskipper-loadgen {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
