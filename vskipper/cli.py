"""`vskipper` command line. Torch-free commands (thresholds, devices, arms) import no torch."""

from __future__ import annotations

import argparse
import json
import sys

from vskipper import constants
from vskipper.modelspec import ModelConfigError, load_model_facts
from vskipper.roofline import DEVICES, UnknownDeviceError, derive_thresholds, lookup_device
from vskipper.serveargs import add_serve_arguments
from vskipper.skippers.registry import SkipperConfigError


def _thresholds(args: argparse.Namespace) -> int:
    facts = load_model_facts(args.model)
    routed = args.routed_layers if args.routed_layers is not None else facts.num_routed_layers
    if args.device:
        device = lookup_device(args.device)
        bandwidth, tflops, source = device.bandwidth_gbps, device.dense_tflops, f"catalogue:{device.name}"
    else:
        bandwidth, tflops, source = args.bandwidth_gbps, args.tflops, "flag"
    t = derive_thresholds(bandwidth, args.skip_ratio, routed, facts.kv_bytes_per_token_layer, tflops)
    result = {**t.as_dict(), "model": facts.name, "bandwidth_source": source}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    ridge = "n/a (pass --tflops)" if t.ridge_rows is None else f"{t.ridge_rows:.1f} rows"
    print(f"model {facts.name}: L_r = {routed} routed layers, b = {t.kv_bytes_per_token_layer} bytes/token/layer")
    print(f"bandwidth {bandwidth:g} GB/s ({source}), s = {args.skip_ratio:g}, tau = {t.tau_ms:.4g} ms")
    print(f"V* = {t.v_star_tokens / 1e3:.1f}k resident tokens")
    print(f"served thresholds: exit {t.exit_tokens // 1000}k / enter {t.enter_tokens // 1000}k tokens")
    print(f"ridge point M* = {ridge}")
    return 0


def _devices(args: argparse.Namespace) -> int:
    rows = [{"name": d.name, "bandwidth_gbps": d.bandwidth_gbps, "dense_tflops": d.dense_tflops,
             "shared_mem_per_block": d.shared_mem_per_block, "ridge_rows": round(d.ridge_rows, 1),
             "gfd_products": list(d.gfd_products)} for d in DEVICES]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'device':16} {'BW GB/s':>8} {'TFLOP/s':>8} {'smem/blk':>9} {'M* rows':>8}  GFD product labels")
    for r in rows:
        print(f"{r['name']:16} {r['bandwidth_gbps']:8.0f} {r['dense_tflops']:8.0f} {r['shared_mem_per_block']:9d} "
              f"{r['ridge_rows']:8.1f}  {', '.join(r['gfd_products'])}")
    return 0


def _arms(args: argparse.Namespace) -> int:
    from vskipper.arms import ARMS, Arm, get_arm

    if args.file:
        with open(args.file) as f:
            arm = Arm.from_dict(json.load(f))
        print(json.dumps(arm.as_dict(), indent=2))
        return 0
    if args.name:
        print(json.dumps(get_arm(args.name).as_dict(), indent=2))
        return 0
    if args.json:
        print(json.dumps({n: a.as_dict() for n, a in ARMS.items()}, indent=2))
        return 0
    for name, arm in ARMS.items():
        s = arm.switch_settings()
        print(f"{name:24} skipper={arm.skipper or '-':16} prefill={s.prefill.value:7} decode={s.decode.value:7} "
              f"promotion={'on' if s.promotion else 'off'}  s={arm.declared_skip_ratio()}")
    return 0


def _constants(args: argparse.Namespace) -> int:
    print(json.dumps(constants.attestation(), indent=2))
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    from vskipper.checkpoint import TinySize, make_tiny_model

    size = TinySize(layers=args.layers, hidden=args.hidden, intermediate=args.intermediate)
    out = make_tiny_model(args.arch, args.out, size=size, seed=args.seed, dtype=args.dtype)
    files = "config.json, generation_config.json, model.safetensors"
    if args.tokenizer:
        from vskipper.checkpoint import write_tiny_tokenizer

        write_tiny_tokenizer(out, vocab_size=size.vocab)
        files += ", tokenizer.json, tokenizer_config.json"
    print(f"wrote {args.arch} checkpoint to {out} ({files})")
    return 0


def _tune_tiles(args: argparse.Namespace) -> int:
    from vskipper.mixed.tune_cli import run_tune_tiles

    if args.attention_backend == "none":
        return run_tune_tiles(args)
    from vskipper.sglang.backend_read import BACKEND_READS  # imports SGLang's kernel only when it times it

    return run_tune_tiles(args, BACKEND_READS[args.attention_backend])


def _serve(args: argparse.Namespace) -> int:
    from vskipper.sglang.cli import run_serve

    return run_serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vskipper", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("thresholds", help="decode switching thresholds from the roofline rule")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--device", help="catalogue name or nvidia.com/gpu.product label (see `vskipper devices`)")
    where.add_argument("--bandwidth-gbps", type=float, help="memory bandwidth in GB/s")
    p.add_argument("--tflops", type=float, help="dense 16-bit TFLOP/s, for the ridge point with --bandwidth-gbps")
    p.add_argument("--skip-ratio", type=float, required=True, help="fraction s of routed decisions projecting")
    p.add_argument("--model", required=True, help="llama-3-8b | qwen3-4b | qwen3-8b | PATH/config.json | DIR")
    p.add_argument("--routed-layers", type=int, help="override the model's routed layer count L_r")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_thresholds)

    p = sub.add_parser("devices", help="the device catalogue the rule and the operator use")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_devices)

    p = sub.add_parser("arms", help="list the named serving arms, show one, or validate an arm file")
    p.add_argument("name", nargs="?")
    p.add_argument("--file", help="validate an arm given as a JSON file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_arms)

    p = sub.add_parser("constants", help="the switch constants (the attested single source of truth)")
    p.set_defaults(func=_constants)

    p = sub.add_parser("make-tiny-model", help="write a tiny random skipper checkpoint in the real layout")
    p.add_argument("--arch", required=True, choices=["flexidepth-llama", "qwen3-skipper"])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tokenizer", action="store_true",
                   help="also train and save a tiny BPE tokenizer with a chat template (to serve the checkpoint)")
    p.set_defaults(func=_make_tiny)

    p = sub.add_parser("tune-tiles", help="time cohort GEMM tiles against torch, a routed layer's two cohort FFNs "
                       "grouped against apart, and the packed prefill read's launches on this GPU; write a tile "
                       "table")
    p.add_argument("--model", default="llama-3-8b", help="preset or config.json giving the GEMM widths and heads")
    p.add_argument("--device", help="catalogue name for the table (default: detected from the GPU)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--out", required=True, help="where to write the JSON table")
    p.add_argument("--max-candidates", type=int, help="sample at most this many tiles per shape")
    p.add_argument("--budget-s", type=float, help="spread this many seconds over the shapes: a shape whose share "
                   "is spent stops trying tiles (the current table's first), so the tuner ends within it")
    p.add_argument("--interpret", action="store_true",
                   help="tiny smoke run on the Triton interpreter (CPU); the table is not a measurement")
    p.add_argument("--attention-backend", default="triton", choices=["triton", "none"],
                   help="SGLang attention backend whose prefill read of every row is timed beside the packed read "
                   "(a routed prefill reads through it where the packed read is no faster; default triton, as the "
                   "stand-in profile serves; none: SDPA's read alone)")
    p.set_defaults(func=_tune_tiles)

    p = sub.add_parser("serve", help="serve a skipper checkpoint with SGLang; options it does not know go to SGLang",
                       description="Validate the arm, then launch SGLang 0.5.21 with vSkipper. Options this command "
                       "does not define (and everything after `--`) are passed to SGLang's launcher unchanged.")
    add_serve_arguments(p)
    p.set_defaults(func=_serve)

    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `serve` forwards what it does not define to SGLang: everything after a bare `--`, and unknown options.
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command != "serve" and (unknown or passthrough):
        parser.error(f"unrecognized arguments: {' '.join(unknown + passthrough)}")
    args.sglang_args = unknown + passthrough
    try:
        return args.func(args)
    except (ValueError, UnknownDeviceError, ModelConfigError, SkipperConfigError, FileNotFoundError) as exc:
        print(f"vskipper {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
