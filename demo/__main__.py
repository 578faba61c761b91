"""`python -m demo`: what `make demo` runs."""

from __future__ import annotations

import argparse
import sys

from demo.live import BENCH_SIZES, Sizing, run_demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m demo", description="The main job on an embedded default (tiny model, no GPU): an offline "
        "tour of a tiny FlexiDepth checkpoint (routes, thresholds, the mode switch), then two real SGLang servers "
        "on CPU (dense and hybrid): OpenAI-compatible requests, a small matched-work A/B with loadgen, the "
        "attestation and /metrics; then what routing saves on a CPU on an 8-layer d = 1024 model, next to its "
        "limits.")
    parser.add_argument("--out", default="out/demo")
    parser.add_argument("--offline", action="store_true", help="the offline tour only (no server; seconds)")
    parser.add_argument("--requests", type=int, help="requests per A/B cell (the demo prints the sizing it runs)")
    parser.add_argument("--repetitions", type=int, help="paired matched-work repetitions of the A/B")
    parser.add_argument("--rate", type=float, help="offered load of the A/B in requests per second")
    parser.add_argument("--bench", choices=BENCH_SIZES, default="demo",
                        help="step 6, what routing saves on CPU: bench_cpu's demo size (about two minutes), its "
                             "quick size (pipeline check, figures mean nothing), or off")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    given = {k: getattr(args, k) for k in ("requests", "repetitions", "rate") if getattr(args, k) is not None}
    try:
        return run_demo(args.out, offline=args.offline, sizing=Sizing(**given), bench=args.bench)
    except ValueError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
