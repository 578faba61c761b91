"""`vskipper-operator`: see what the operator would apply (`plan`), print the CRD (`crd`), run the operator."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vskipper_operator.crd import SpecError, render_crd_yaml
from vskipper_operator.settings import SettingsError


def _load(path: str, what: str):
    import yaml

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        return yaml.safe_load(text)
    except OSError as exc:
        raise SpecError(f"{what}: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{what}: {path} is not valid YAML/JSON ({exc})") from None


def _summary(result) -> list[str]:
    lines = [f"SkipperDeployment {result.namespace}/{result.name}: arm {result.resolved.arm.name}, "
             f"s = {result.resolved.skip_ratio:g}, L_r = {result.resolved.routed_layers}, "
             f"b = {result.resolved.kv_bytes} bytes/token/layer"]
    for c in result.classes:
        if c.served:
            lines.append(f"  {c.product}: {c.nodes} node(s), {c.bandwidth_gbps:g} GB/s ({c.bandwidth_source}), "
                         f"exit {c.exit_tokens:,} / enter {c.enter_tokens:,} tokens ({c.threshold_source}), "
                         f"{c.deployment} x{c.replicas}")
        else:
            lines.append(f"  {c.product}: {c.nodes} node(s), not served: {c.reason}")
    if not result.classes:
        lines.append("  no node carries an nvidia.com/gpu.product label that matches the placement")
    return lines


def _no_aliases():
    import yaml

    class NoAliases(yaml.SafeDumper):
        def ignore_aliases(self, data):  # plain YAML, readable and kubectl-friendly
            return True

    return NoAliases


def _plan(args: argparse.Namespace) -> int:
    import yaml

    from vskipper_operator.plan import nodes_from_document, plan

    resource = _load(args.spec, "spec")
    nodes = nodes_from_document(_load(args.nodes, "nodes"))
    measured = _load(args.measured, "measured") if args.measured else None
    result = plan(resource, nodes, measured)
    _NoAliases = _no_aliases()
    status = result.status()
    if args.output == "json":
        print(json.dumps({"status": status, "objects": result.objects}, indent=2))
    else:
        print("\n".join("# " + line for line in _summary(result)))
        print(yaml.dump_all(result.objects, Dumper=_NoAliases, sort_keys=False, width=110), end="")
    return 0


def _crd(args: argparse.Namespace) -> int:
    print(render_crd_yaml(), end="")
    return 0


def _sglang_flags(args: argparse.Namespace) -> int:
    from vskipper_operator.flags import sglang_table

    table = sglang_table()
    options = ",\n".join("  " + json.dumps(o) for o in table.pop("options"))
    print(json.dumps(table)[:-1] + ', "options": [\n' + options + "\n]}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from vskipper_operator.handlers import run_operator

    run_operator(namespaces=args.namespace, liveness=args.liveness, metrics_port=args.metrics_port)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vskipper-operator", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the objects the operator would apply for a SkipperDeployment")
    p.add_argument("--spec", required=True, help="a SkipperDeployment manifest (YAML or JSON; - for stdin)")
    p.add_argument("--nodes", required=True, help="a `kubectl get nodes -o json` document")
    p.add_argument("--measured", help="YAML/JSON map of GPU product -> measured bandwidth in GB/s")
    p.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml")
    p.set_defaults(func=_plan)
    p = sub.add_parser("crd", help="print the SkipperDeployment CustomResourceDefinition")
    p.set_defaults(func=_crd)
    p = sub.add_parser("sglang-flags", help="print SGLang's server flag table (vskipper_operator/sglang_flags.json; "
                       "needs SGLang installed)")
    p.set_defaults(func=_sglang_flags)
    p = sub.add_parser("run", help="run the operator (kopf) against the current cluster")
    p.add_argument("--namespace", action="append", default=[], help="watch this namespace (repeatable; "
                   "default: cluster-wide)")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL")
    p.add_argument("--metrics-port", type=int, help="Prometheus metrics port (0: off; default: "
                   "$VSKIPPER_OPERATOR_METRICS_PORT, else 9090)")
    p.set_defaults(func=_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (SpecError, SettingsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
