"""Prometheus recording rules and alerts over the runtime's metrics (named in `vskipper.metrics_names`) and the
operator's (`vskipper_operator_*`). Rendered to helm/vskipper/files/prometheus-rules.yaml, which the chart's
PrometheusRule embeds and promtool checks and unit-tests (deploy/prometheus/rules.test.yaml).

Per-server expressions aggregate by (job, instance): every scraped series carries them, one target per server
pod. Per-deployment expressions aggregate by (namespace, service) and the GPU class: the labels the operator's
ServiceMonitor attaches (it names a SkipperDeployment's Service after the resource and copies each pod's GPU-class
label, `vskipper.metrics_names.GPU_CLASS`). Each class runs with its own thresholds, so its routed shares differ.
"""

from __future__ import annotations

from vskipper.metrics_names import (
    GPU_CLASS,
    OPERATOR_ERRORS,
    OPERATOR_GPU_CLASSES,
    OPERATOR_RECONCILES,
    OPERATOR_RESOURCE_READY,
    PASSES,
    RESIDENT_TOKENS,
    ROUTED_PREFILL_PASSES,
    ROWS,
    SWITCH_DECISIONS,
    THRESHOLD_TOKENS,
)

TARGET = "job, instance"
DEPLOYMENT = f"namespace, service, {GPU_CLASS}"

# Recording rules: name -> expression.
DECODE_ROWS_ROUTED_SHARE = "vskipper:decode_rows_skipped:ratio_rate5m"
PASSES_ROUTED_SHARE = "vskipper:passes_routed:ratio_rate5m"
ROWS_SKIPPED_SHARE = "vskipper:rows_skipped:ratio_rate5m"

FLAP_WINDOW = "10m"
FLAP_TRANSITIONS = 10  # route_on + route_off decisions per window: more than one a minute defeats the hysteresis
NEVER_ENGAGES_WINDOW = "15m"
NOT_EXECUTED_WINDOW = "10m"
REFUSED_WINDOW = "10m"


def share(numerator: str, denominator: str, by: str) -> str:
    """sum(numerator) / sum(denominator) by the labels `by`; 0 (not absent) where the denominator has groups that
    the numerator lacks, e.g. a phase whose rows never skip."""
    num, den = f"sum by ({by}) ({numerator})", f"sum by ({by}) ({denominator})"
    return f"({num}\n or 0 * {den})\n/ {den}"


def recording_rules() -> list[dict]:
    rows, passes = ROWS.name, PASSES.name
    return [
        {"record": DECODE_ROWS_ROUTED_SHARE,
         "expr": share(f'rate({rows}{{phase="decode", action="project_only"}}[5m])',
                       f'rate({rows}{{phase="decode"}}[5m])', DEPLOYMENT)},
        {"record": ROWS_SKIPPED_SHARE,
         "expr": share(f'rate({rows}{{action="project_only"}}[5m])', f"rate({rows}[5m])", f"{DEPLOYMENT}, phase")},
        {"record": PASSES_ROUTED_SHARE,
         "expr": share(f'rate({passes}{{mode="routed"}}[5m])', f"rate({passes}[5m])", f"{DEPLOYMENT}, phase")},
    ]


RUNBOOK = "https://github.com/vskipper/vskipper/blob/main/deploy/runbook.md"


def alert(name: str, expr: str, severity: str, summary: str, description: str, for_: str = "5m") -> dict:
    """An alerting rule: pending for `for_`, labelled with its severity, linking its section of deploy/runbook.md
    (a section titled with the alert's name)."""
    return {"alert": name, "expr": expr, "for": for_, "labels": {"severity": severity},
            "annotations": {"summary": summary, "description": description,
                            "runbook_url": f"{RUNBOOK}#{name.lower()}"}}


def alerts() -> list[dict]:
    w = NEVER_ENGAGES_WINDOW
    never_engages = (
        f"min_over_time({RESIDENT_TOKENS.name}[{w}])\n"
        f"> on ({TARGET}) max by ({TARGET}) (max_over_time({THRESHOLD_TOKENS.name}{{bound=\"enter\"}}[{w}]))\n"
        f"unless on ({TARGET})\n"
        f"sum by ({TARGET}) (increase({PASSES.name}{{phase=\"decode\", mode=\"routed\"}}[{w}])) > 0")
    flapping = (f"sum by ({TARGET}) (increase({SWITCH_DECISIONS.name}{{decision=~\"route_on|route_off\"}}"
                f"[{FLAP_WINDOW}])) > {FLAP_TRANSITIONS}")
    w = NOT_EXECUTED_WINDOW
    not_executed = (
        f"sum by ({TARGET}, phase) (increase({PASSES.name}{{mode=\"routed\"}}[{w}])) > 0\n"
        f"unless on ({TARGET}, phase)\n"
        f"sum by ({TARGET}, phase) (increase({ROWS.name}{{action=\"project_only\"}}[{w}])) > 0")
    refused = (f"sum by ({TARGET}) (increase({ROUTED_PREFILL_PASSES.name}{{layers=\"eager_refused\"}}"
               f"[{REFUSED_WINDOW}])) > 0")
    return [
        alert("VskipperRoutingNeverEngages", never_engages, "warning",
              "Routing never engages although V stays above the enter threshold",
              "{{ $labels.instance }}: resident tokens stayed above the enter threshold for "
              f"{NEVER_ENGAGES_WINDOW} and no decode pass ran routed. The switch is not acting on its thresholds "
              "(or the runtime exports thresholds it does not use)."),
        alert("VskipperSwitchFlapping", flapping, "warning", "The decode mode switch flaps",
              "{{ $labels.instance }}: {{ $value }} route_on/route_off decisions in "
              f"{FLAP_WINDOW}. The exit/enter band is too narrow for this load; check the thresholds the operator "
              "derived for this GPU class."),
        alert("VskipperMechanismNotExecuted", not_executed, "critical",
              "Routed passes ran but no row skipped: the declared mechanism is not executed",
              "{{ $labels.instance }}: {{ $labels.phase }} passes ran in routed mode for "
              f"{NOT_EXECUTED_WINDOW} but no row took project_only. The attested arm declares skipping that the "
              "server does not perform."),
        alert("VskipperPrefillGraphsRefused", refused, "warning",
              "Routed prefill passes run eagerly: their count's graphs were refused",
              "{{ $labels.instance }}: {{ $value }} routed prefill passes in "
              f"{REFUSED_WINDOW} ran their routed layers eagerly because their token count's graphs were refused "
              "(the capture failed, or its checks at start strayed). The attestation's prefill_graphs.failed "
              "names the count and why."),
    ]


# The operator's metrics target: the chart's ServiceMonitor (job = the metrics Service, `<release>-vskipper-
# operator-metrics`) or PodMonitor (job = `<namespace>/<monitor>`), or a static job of that name.
OPERATOR_JOB = 'job=~".*vskipper-operator.*"'
NOT_READY_FOR = "30m"  # a model download and load take minutes; the startup probe allows 30 by default
NOT_SERVED_FOR = "15m"


def operator_alerts() -> list[dict]:
    """The operator and the resources it serves: the operator's target down or gone, its reconciles failing, a
    SkipperDeployment not Ready, GPU classes present but not served."""
    return [
        alert("VskipperOperatorDown", f"up{{{OPERATOR_JOB}}} == 0\nor absent(up{{{OPERATOR_JOB}}})", "critical",
              "The vSkipper operator is down or not scraped",
              "No vSkipper operator target has answered for 5m: SkipperDeployments are not reconciled (new GPU "
              "classes, scaling, drift and model-download status wait)."),
        alert("VskipperOperatorReconcileErrors",
              f'sum by (job) (increase({OPERATOR_RECONCILES}{{result="error"}}[10m])) > 0', "warning",
              "The vSkipper operator keeps failing to reconcile",
              "{{ $value }} failed reconciliations in 10m (see " + OPERATOR_ERRORS + " by kind and the operator's "
              "Events).", for_="15m"),
        alert("VskipperDeploymentNotReady", f"{OPERATOR_RESOURCE_READY} == 0", "warning",
              "A SkipperDeployment is not Ready",
              "{{ $labels.namespace }}/{{ $labels.name }} has not been Ready for "
              f"{NOT_READY_FOR}: see its Ready and ModelAvailable conditions (kubectl describe skd).",
              for_=NOT_READY_FOR),
        alert("VskipperGpuClassNotServed", f'{OPERATOR_GPU_CLASSES}{{served="false"}} > 0', "warning",
              "GPU classes in the pool are not served",
              "{{ $labels.namespace }}/{{ $labels.name }}: {{ $value }} GPU class(es) present are not served "
              "(unknown bandwidth, or not in spec.placement.gpuProducts): status.gpuClasses gives each reason.",
              for_=NOT_SERVED_FOR),
    ]


def rule_groups() -> dict:
    return {"groups": [
        {"name": "vskipper.recording", "rules": recording_rules()},
        {"name": "vskipper.alerts", "rules": alerts()},
        {"name": "vskipper.operator", "rules": operator_alerts()},
    ]}


def all_expressions() -> list[str]:
    return [r["expr"] for g in rule_groups()["groups"] for r in g["rules"]]


def render_rules_yaml() -> str:
    import yaml

    class _Literal(yaml.SafeDumper):
        pass

    def _str(dumper, data):
        style = "|" if "\n" in data else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    _Literal.add_representer(str, _str)
    header = "# Generated from deploy/rules.py by `make chart`; do not edit.\n"
    return header + yaml.dump(rule_groups(), Dumper=_Literal, sort_keys=False, width=110)
