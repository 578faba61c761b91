"""The autoscaling example (manifests/examples/autoscaling/): an autoscaling/v2 HorizontalPodAutoscaler scaling a
SkipperDeployment through the CRD's scale subresource on SGLang's queue depth, served by a prometheus-adapter rule.

The HPA is a valid Kubernetes 1.29 object; it targets an example resource whose scale subresource leads to every
server pod the planner makes; the adapter's rule matches the SGLang gauge `vskipper.metrics_names` names (checked
against SGLang's collector in tests/test_deploy_generated.py) under both spellings and serves it under the name the
HPA reads. tests/test_prometheus_live.py evaluates the rule's query, as the adapter instantiates it, against a real
`vskipper serve`.
"""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import yaml
from operator_fixtures import mixed_pool

from vskipper import metrics_names as mn
from vskipper_operator.crd import API_VERSION, KIND, crd_manifest
from vskipper_operator.plan import plan

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "manifests" / "examples"
AUTOSCALING = EXAMPLES / "autoscaling"
KUBE_VERSION = "1.29.0"


def hpa() -> dict:
    return yaml.safe_load((AUTOSCALING / "hpa-queue-depth.yaml").read_text())


def adapter_rule() -> dict:
    (rule,) = yaml.safe_load((AUTOSCALING / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"]
    return rule


def adapter_query(rule: dict, series: str, namespace: str, pods: list[str]) -> str:
    """The rule's metricsQuery as prometheus-adapter renders it for a pods metric of one namespace."""
    matchers = f'namespace="{namespace}",pod=~"{"|".join(pods)}"'
    return (rule["metricsQuery"].replace("<<.Series>>", series).replace("<<.LabelMatchers>>", matchers)
            .replace("<<.GroupBy>>", "pod"))


def _target() -> dict:
    ref, meta = hpa()["spec"]["scaleTargetRef"], hpa()["metadata"]
    for path in EXAMPLES.glob("*.yaml"):
        doc = yaml.safe_load(path.read_text())
        if (doc["apiVersion"], doc["kind"], doc["metadata"]["name"], doc["metadata"]["namespace"]) == \
                (ref["apiVersion"], ref["kind"], ref["name"], meta["namespace"]):
            return doc
    raise AssertionError(f"no example {ref['kind']} {meta['namespace']}/{ref['name']}")


def test_hpa_example_validates_against_the_kubernetes_1_29_schemas():
    kubernetes_validate.validate(hpa(), KUBE_VERSION, strict=True)
    assert hpa()["apiVersion"] == "autoscaling/v2"


def test_hpa_scales_an_example_resource_through_the_scale_subresource_onto_every_server_pod():
    ref = hpa()["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"]) == (API_VERSION, KIND)
    (version,) = crd_manifest()["spec"]["versions"]
    scale = version["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.replicas" and scale["labelSelectorPath"] == ".status.selector"
    target = _target()
    assert "replicasPerClass" not in target["spec"]  # it would replace the split of spec.replicas the HPA sets
    target["metadata"]["uid"] = "uid-example"
    result = plan(target, mixed_pool())
    selector = dict(kv.split("=", 1) for kv in result.status()["selector"].split(","))
    deployments = [o for o in result.objects if o["kind"] == "Deployment"]
    assert len(deployments) == 2  # both GPU classes of the pool
    for dep in deployments:
        assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert sum(d["spec"]["replicas"] for d in deployments) == target["spec"]["replicas"]
    assert hpa()["spec"]["minReplicas"] <= target["spec"]["replicas"] <= hpa()["spec"]["maxReplicas"]


def test_adapter_rule_serves_sglangs_queue_gauge_under_the_name_the_hpa_reads():
    rule, (metric,) = adapter_rule(), hpa()["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert mn.SGLANG_QUEUE in mn.SGLANG_GAUGES
    # Both spellings of SGLang's name (prometheus_client writes `_` for `:` in OpenMetrics), and nothing else.
    spellings = (mn.SGLANG_QUEUE, mn.SGLANG_QUEUE.replace(":", "_", 1))
    series_pattern = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"]).group(1)
    for pattern in (series_pattern, rule["name"]["matches"]):
        assert all(re.fullmatch(pattern.strip("^$"), s) for s in spellings), pattern
        assert not re.fullmatch(pattern.strip("^$"), "sglang:num_running_reqs")
    # The HPA asks for pods by namespace and name: the series' own labels (the ServiceMonitor keeps them).
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert 'namespace!=""' in rule["seriesQuery"] and 'pod!=""' in rule["seriesQuery"]
    query = adapter_query(rule, mn.SGLANG_QUEUE, "llm", ["a-0", "b-0"])
    assert query == 'sum by (pod) (sglang:num_queue_reqs{namespace="llm",pod=~"a-0|b-0"})'
