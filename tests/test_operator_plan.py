"""The operator's pure planning: per-GPU-class Deployments and thresholds from a spec and the cluster's nodes."""

from __future__ import annotations

import json
import time

import monitoring_schemas
import pytest
from operator_fixtures import A100, H100, UNKNOWN, mig_mixed_node, mixed_pool, node, resource

from vskipper.constants import attestation
from vskipper.modelspec import PRESETS
from vskipper.roofline import derive_thresholds, lookup_device
from vskipper_operator.crd import SpecError
from vskipper_operator.plan import (
    PLAN_HASH_ANNOTATION,
    contains,
    diff,
    new_conflicts,
    object_key,
    plan,
    status_patch,
)

LLAMA_B = PRESETS["llama-3-8b"].kv_bytes_per_token_layer


def by_kind(result, kind):
    return [o for o in result.objects if o["kind"] == kind]


def deployment_for(result, product):
    return next(o for o in by_kind(result, "Deployment")
                if o["metadata"]["annotations"]["vskipper.io/gpu-product"] == product)


def arg(deployment, flag):
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index(flag) + 1]


def test_mixed_pool_gets_one_deployment_per_known_class_with_its_own_roofline_thresholds():
    result = plan(resource(), mixed_pool())
    assert [d["metadata"]["name"] for d in by_kind(result, "Deployment")] == [
        "llama-nvidia-a100-sxm4-80gb", "llama-nvidia-h100-80gb-hbm3"]
    for product in (A100, H100):
        want = derive_thresholds(lookup_device(product).bandwidth_gbps, 0.5, 16, LLAMA_B)
        dep = deployment_for(result, product)
        assert int(arg(dep, "--exit-tokens")) == want.exit_tokens
        assert int(arg(dep, "--enter-tokens")) == want.enter_tokens
        assert arg(dep, "--arm") == "hybrid"
    # The paper's served bands: A100 160k/200k, H100 270k/340k.
    assert arg(deployment_for(result, A100), "--exit-tokens") == "160000"
    assert arg(deployment_for(result, H100), "--enter-tokens") == "340000"


def test_deployment_is_pinned_to_its_class_including_time_sliced_nodes():
    result = plan(resource(), mixed_pool())
    terms = deployment_for(result, A100)["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In",
                                            "values": [A100, A100 + "-SHARED"]}]}]
    row = next(r for r in result.status()["gpuClasses"] if r["product"] == A100)
    assert row["nodes"] == 2


def test_unknown_gpu_gets_no_deployment_and_status_says_why():
    result = plan(resource(), mixed_pool())
    rows = {r["product"]: r for r in result.status()["gpuClasses"]}
    assert rows[UNKNOWN]["served"] is False
    assert rows[UNKNOWN]["reason"].startswith("UnknownGPU: not in the device catalogue")
    assert "spec.bandwidthOverrides" in rows[UNKNOWN]["reason"]
    assert "deployment" not in rows[UNKNOWN]
    degraded = next(c for c in result.status()["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "UnknownGPU"
    assert [(c.product, t, r) for c, t, r, _ in result.events() if t == "Warning"] == [(UNKNOWN, "Warning", "UnknownGPU")]


def test_events_are_posted_once_per_change_and_the_status_patch_holds_only_changes():
    """A first apply posts each written class's thresholds and the unknown GPU; a resync over the status it wrote
    posts nothing and patches nothing; a rewritten Deployment posts its class again."""
    result = plan(resource(), mixed_pool())
    written = [d["metadata"]["name"] for d in by_kind(result, "Deployment")]
    first = result.new_events({}, written)
    assert sorted(r for _, r, _ in first) == ["ThresholdsDerived", "ThresholdsDerived", "UnknownGPU"]
    status = result.status()
    assert status_patch({}, status) == status
    assert result.new_events(status, []) == []
    assert status_patch(status, status) == {}
    again = result.new_events(status, written[:1])
    assert [(t, r) for t, r, _ in again] == [("Normal", "ThresholdsDerived")] and A100 in again[0][2]
    assert status_patch(status, {**status, "replicas": 7}) == {"replicas": 7}


def test_name_conflicts_are_warned_until_the_status_reports_them():
    held = "Deployment llm/llama-nvidia-h100-80gb-hbm3 is held by another owner"
    assert new_conflicts({}, [held]) == [held]
    degraded = {"conditions": [{"type": "Degraded", "status": "True", "message": f"names taken: {held}"}]}
    assert new_conflicts(degraded, [held]) == []
    assert new_conflicts(degraded, ["Service llm/llama is held by another owner"]) == [
        "Service llm/llama is held by another owner"]


MIG_1G = f"{A100}-MIG-1g.10gb"
MIG_3G = f"{A100}-MIG-3g.40gb"


def affinity_of(dep):
    terms = dep["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return [(e["key"], e["values"]) for t in terms for e in t["matchExpressions"]]


def test_mig_slices_stay_unknown():
    result = plan(resource(), [node("mig-0", MIG_1G, **{"nvidia.com/mig.strategy": "single"})])
    assert not by_kind(result, "Deployment")
    assert "MIG" in result.classes[0].reason


def test_under_the_mixed_strategy_each_slice_type_is_a_class_and_a_partitioned_card_is_none():
    """GFD's `mixed` labels keep the whole card's name in nvidia.com/gpu.product; the planner reads the slice
    types from their own labels and counts the card only where the device plugin still has it whole."""
    partitioned = mig_mixed_node("mig-0", A100, {"1g.10gb": 3, "3g.40gb": 1})
    result = plan(resource(), [partitioned])
    assert [(c.product, c.resource, c.nodes) for c in result.classes] == [
        (MIG_1G, "nvidia.com/mig-1g.10gb", 1), (MIG_3G, "nvidia.com/mig-3g.40gb", 1)]
    assert all(c.reason.startswith("UnknownGPU: a MIG slice") for c in result.classes)
    assert not by_kind(result, "Deployment")  # never a whole-A100 Deployment no node could take
    served = plan(resource(bandwidthOverrides=[{"product": MIG_3G, "gbps": 800}]), [partitioned])
    dep = deployment_for(served, MIG_3G)
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/mig-3g.40gb": "1"}
    assert affinity_of(dep) == [("nvidia.com/mig-3g.40gb.product", [MIG_3G])]
    row = _row(served, MIG_3G)
    assert row["resource"] == "nvidia.com/mig-3g.40gb" and row["labels"] == [MIG_3G]
    # A card left whole beside the partitioned one is served from the catalogue, pinned as any whole card.
    beside = plan(resource(), [mig_mixed_node("mig-1", A100, {"1g.10gb": 7}, whole=1), node("a100-0", A100)])
    assert [(c.product, c.resource, c.nodes, c.served) for c in beside.classes] == [
        (A100, "nvidia.com/gpu", 2, True), (MIG_1G, "nvidia.com/mig-1g.10gb", 1, False)]
    assert affinity_of(deployment_for(beside, A100)) == [("nvidia.com/gpu.product", [A100])]
    # A slice type whose count is 0 offers nothing.
    empty = mig_mixed_node("mig-2", A100, {"1g.10gb": 7})
    empty["metadata"]["labels"]["nvidia.com/mig-1g.10gb.count"] = "0"
    assert plan(resource(), [empty]).classes == []


def test_a_slice_offered_under_both_strategies_or_to_tensor_parallel_pods_is_not_served_and_says_why():
    single = node("mig-s", MIG_1G, **{"nvidia.com/mig.strategy": "single"})
    mixed = mig_mixed_node("mig-m", A100, {"1g.10gb": 7})
    override = [{"product": MIG_1G, "gbps": 280}]
    both = plan(resource(bandwidthOverrides=override), [single, mixed])
    (c,) = both.classes
    assert not c.served and c.reason.startswith("MigStrategyMismatch:") and c.nodes == 2
    assert "nvidia.com/gpu and as nvidia.com/mig-1g.10gb" in c.reason
    degraded = next(x for x in both.status()["conditions"] if x["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "MigStrategyMismatch"
    assert [(t, r) for t, r, _ in both.new_events({}, [])] == [("Warning", "MigStrategyMismatch")]
    assert both.new_events(both.status(), []) == []  # shown in the status: not posted again
    # The nodeSelector picks one set, which is then served.
    picked = plan(resource(bandwidthOverrides=override, placement={"nodeSelector": {"nvidia.com/mig.strategy": "mixed"}}),
                  [single, mixed])
    assert [(c.product, c.served, c.resource) for c in picked.classes] == [(MIG_1G, True, "nvidia.com/mig-1g.10gb")]
    tp = plan(resource(bandwidthOverrides=override, resources={"gpus": 2}), [mixed])
    assert tp.classes[0].reason.startswith("MigSliceTensorParallel:") and not by_kind(tp, "Deployment")
    assert "gpus is 2" in tp.classes[0].reason


def test_bandwidth_override_serves_an_unknown_gpu_and_beats_measured_and_catalogue():
    spec_overrides = [{"product": UNKNOWN, "gbps": 6000}, {"product": A100, "gbps": 2039}]
    result = plan(resource(bandwidthOverrides=spec_overrides), mixed_pool(), measured={A100: 1700.0, H100: 3000.0})
    rows = {r["product"]: r for r in result.status()["gpuClasses"]}
    assert rows[UNKNOWN]["served"] and rows[UNKNOWN]["bandwidthSource"] == "override"
    assert (rows[A100]["bandwidthGBps"], rows[A100]["bandwidthSource"]) == (2039.0, "override")
    assert (rows[H100]["bandwidthGBps"], rows[H100]["bandwidthSource"]) == (3000.0, "measured")
    want = derive_thresholds(3000.0, 0.5, 16, LLAMA_B)
    assert rows[H100]["exitTokens"] == want.exit_tokens
    assert "ridgeRows" not in rows[UNKNOWN] and rows[H100]["ridgeRows"] == pytest.approx(990e12 / 3000e9, abs=0.1)


def test_threshold_override_and_tau_are_applied_to_every_class():
    fixed = plan(resource(switch={"thresholds": {"exitTokens": 50_000, "enterTokens": 60_000}}), mixed_pool())
    for dep in by_kind(fixed, "Deployment"):
        assert (arg(dep, "--exit-tokens"), arg(dep, "--enter-tokens")) == ("50000", "60000")
    assert {r.get("thresholdSource") for r in fixed.status()["gpuClasses"] if r["served"]} == {"override"}
    # Doubling tau doubles V*.
    slow = plan(resource(switch={"tauMsPerRoutedLayer": 2 * 2.67 / 16}), mixed_pool())
    base = plan(resource(), mixed_pool())
    assert slow.classes[0].thresholds.v_star_tokens == pytest.approx(2 * base.classes[0].thresholds.v_star_tokens)


def test_a_prefill_floor_measured_on_the_device_is_served_by_every_class_and_only_where_given():
    floored = plan(resource(switch={"prefillFloorTokens": 2048}), mixed_pool())
    for dep in by_kind(floored, "Deployment"):
        assert arg(dep, "--prefill-floor-tokens") == "2048" and arg(dep, "--arm") == "hybrid"
    (config,) = [o for o in by_kind(floored, "ConfigMap") if o["metadata"]["name"].endswith("-switch")]
    assert json.loads(config["data"]["constants.json"])["prefill_min_prompt_tokens"] == 2048
    assert all("--prefill-floor-tokens" not in d["spec"]["template"]["spec"]["containers"][0]["args"]
               for d in by_kind(plan(resource(), mixed_pool()), "Deployment"))


def test_total_replicas_split_with_remainder_to_the_fastest_class_and_scale_changes_only_replicas():
    three = plan(resource(replicas=3), mixed_pool())
    assert {c.product: c.replicas for c in three.served} == {A100: 1, H100: 2}
    four = plan(resource(replicas=4), mixed_pool())
    changes = diff(four.objects, three.objects)
    assert not changes.create and not changes.delete
    assert [o["metadata"]["name"] for o in changes.update] == ["llama-nvidia-a100-sxm4-80gb"]
    assert changes.update[0]["spec"]["replicas"] == 2
    assert four.status()["replicas"] == 4


def test_replicas_per_class_replace_the_split():
    result = plan(resource(replicasPerClass={H100: 3}), mixed_pool())
    assert {c.product: c.replicas for c in result.served} == {A100: 0, H100: 3}


def test_placement_restricts_classes_by_product_or_catalogue_name_and_node_selector():
    result = plan(resource(placement={"gpuProducts": ["H100-SXM"]}), mixed_pool())
    assert [c.product for c in result.served] == [H100]
    assert next(c for c in result.classes if c.product == A100).reason.startswith("NotAllowed")
    pool = [node("a", A100, pool="serving"), node("b", H100, pool="batch")]
    selected = plan(resource(placement={"nodeSelector": {"pool": "serving"}}), pool)
    assert [c.product for c in selected.classes] == [A100]
    dep = by_kind(selected, "Deployment")[0]
    assert dep["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "serving"}


def test_config_map_carries_the_attested_constants_and_the_arm():
    result = plan(resource(), mixed_pool())
    data = by_kind(result, "ConfigMap")[0]["data"]
    assert json.loads(data["constants.json"]) == attestation()
    arm = json.loads(data["arm.json"])
    assert (arm["skipper"], arm["params"], arm["prefill"], arm["decode"]) == ("flexidepth", {"skip_ratio": 0.5},
                                                                               "hybrid", "hybrid")
    assert json.loads(data["thresholds.json"])[H100]["exit_tokens"] == 270_000


def test_service_monitor_and_probe_jobs_are_optional():
    plain = plan(resource(), mixed_pool())
    assert {o["kind"] for o in plain.objects} == {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget"}
    full = plan(resource(metrics={"serviceMonitor": True}, bandwidthProbe={"enabled": True}), mixed_pool(),
                measured={H100: 3100.0})
    monitor = by_kind(full, "ServiceMonitor")[0]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    # A probe per class still lacking a measurement, the unknown GPU included (a measurement would serve it).
    probed = sorted(j["metadata"]["annotations"]["vskipper.io/gpu-product"] for j in by_kind(full, "Job"))
    assert probed == [A100, UNKNOWN]
    # an overridden class's measurement would serve nothing (the override wins): no GPU spent probing it
    overridden = plan(resource(bandwidthProbe={"enabled": True}, bandwidthOverrides=[{"product": A100, "gbps": 1500}]),
                      mixed_pool(), measured={H100: 3100.0})
    assert sorted(j["metadata"]["annotations"]["vskipper.io/gpu-product"]
                  for j in by_kind(overridden, "Job")) == [UNKNOWN]


def test_server_pods_carry_their_gpu_class_and_the_monitor_copies_it_onto_their_series():
    from vskipper.metrics_names import GPU_CLASS, GPU_CLASS_POD_LABEL

    result = plan(resource(metrics={"serviceMonitor": True}), mixed_pool())
    classes = {}
    for dep in by_kind(result, "Deployment"):
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        classes[dep["metadata"]["annotations"]["vskipper.io/gpu-product"]] = pod_labels[GPU_CLASS_POD_LABEL]
    assert classes == {A100: "nvidia-a100-sxm4-80gb", H100: "nvidia-h100-80gb-hbm3"}
    monitor = by_kind(result, "ServiceMonitor")[0]["spec"]
    assert monitor["podTargetLabels"] == [GPU_CLASS_POD_LABEL]
    # the monitor selects the Service, whose selector takes every class's pods
    service = by_kind(result, "Service")[0]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    for dep in by_kind(result, "Deployment"):
        assert service["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    # prometheus-operator names the series label after the pod label, invalid characters replaced by `_`
    assert GPU_CLASS == "vskipper_io_gpu_class"


needs_monitoring_schemas = pytest.mark.skipif(monitoring_schemas.MISSING is not None,
                                              reason=monitoring_schemas.MISSING or "")


@needs_monitoring_schemas
def test_planned_service_monitor_passes_the_prometheus_operator_schema():
    monitors = [o for spec in ({"metrics": {"serviceMonitor": True}},
                               {"metrics": {"serviceMonitor": True, "interval": "15s"}, "replicas": 5})
                for o in monitoring_schemas.monitoring_objects(plan(resource(**spec), mixed_pool()).objects)]
    assert [m["kind"] for m in monitors] == ["ServiceMonitor", "ServiceMonitor"]
    assert monitoring_schemas.validate(monitors) == [[], []]


@needs_monitoring_schemas
def test_monitor_schema_check_names_a_field_of_the_wrong_type():
    monitor = by_kind(plan(resource(metrics={"serviceMonitor": True}), mixed_pool()), "ServiceMonitor")[0]
    bad = json.loads(json.dumps(monitor))
    bad["spec"]["endpoints"][0]["interval"] = 30
    bad["spec"]["podTargetLabels"] = "vskipper.io/gpu-class"
    assert monitoring_schemas.validate([bad]) == [["spec.endpoints[0].interval: must be string",
                                                   "spec.podTargetLabels: must be array"]]


def test_owner_reference_is_set_when_the_resource_has_a_uid():
    result = plan(resource(uid="1234"), mixed_pool())
    for obj in result.objects:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("SkipperDeployment", "1234", True)


def test_plan_of_the_applied_state_is_empty():
    result = plan(resource(uid="u1"), mixed_pool())
    applied = json.loads(json.dumps(result.objects))
    for obj in applied:  # what the API server adds on apply
        obj["metadata"].update(uid="x", resourceVersion="7", creationTimestamp="2026-01-01T00:00:00Z")
        obj["status"] = {"observedGeneration": 1}
        if obj["kind"] == "Deployment":
            obj["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "1"
            obj["spec"]["revisionHistoryLimit"] = 10
    assert diff(plan(resource(uid="u1"), mixed_pool()).objects, applied).empty


def test_spec_update_changes_only_what_it_should():
    before = plan(resource(), mixed_pool())
    after = plan(resource(skipper={"name": "flexidepth", "params": {"skip_ratio": 0.25}}), mixed_pool())
    changes = diff(after.objects, before.objects)
    assert {o["kind"] for o in changes.update} == {"ConfigMap", "Deployment"}  # Service unchanged
    assert arg(deployment_for(after, H100), "--exit-tokens") == "550000"


def test_a_setting_removed_from_the_spec_is_applied_though_the_applied_objects_still_hold_it():
    """An applied object keeps every field it was given until an apply that leaves it out: a pod annotation or a
    nodeSelector key taken out of the spec leaves the live Deployments holding the old fields, and only each
    object's digest of its plan (`vskipper.io/plan-hash`) tells them apart."""
    pool = [n for n in mixed_pool()]
    for n in pool:
        n["metadata"]["labels"]["pool"] = "serving"
    wide = resource(placement={"nodeSelector": {"pool": "serving"}}, pod={"annotations": {"team": "llm"}})
    before = json.loads(json.dumps(plan(wide, pool).objects))
    after = plan(resource(), pool).objects
    deployments = [o for o in after if o["kind"] == "Deployment"]
    assert deployments and all(contains({**o, "metadata": {**o["metadata"], "annotations": {
        k: v for k, v in o["metadata"]["annotations"].items() if k != PLAN_HASH_ANNOTATION}}}, {
        **d, "metadata": {**d["metadata"], "annotations": {k: v for k, v in d["metadata"]["annotations"].items()
                                                         if k != PLAN_HASH_ANNOTATION}}})
        for o, d in zip(sorted((o for o in before if o["kind"] == "Deployment"), key=object_key),
                        sorted(deployments, key=object_key), strict=True))  # the old objects hold the new fields
    changes = diff(after, before)
    assert sorted(o["metadata"]["name"] for o in changes.update if o["kind"] == "Deployment") == sorted(
        o["metadata"]["name"] for o in deployments)
    assert diff(after, json.loads(json.dumps(after))).empty


def test_gpu_class_leaving_the_pool_deletes_its_deployment():
    before = plan(resource(), mixed_pool())
    after = plan(resource(), [n for n in mixed_pool() if not n["metadata"]["name"].startswith("h100")])
    changes = diff(after.objects, before.objects)
    assert sorted((o["kind"], o["metadata"]["name"]) for o in changes.delete) == [
        ("Deployment", "llama-nvidia-h100-80gb-hbm3"), ("PodDisruptionBudget", "llama-nvidia-h100-80gb-hbm3")]


def test_contains_ignores_server_fields_but_not_changed_values():
    assert contains({"a": 1, "b": {"c": "x", "d": 2}}, {"b": {"c": "x"}})
    assert not contains({"a": [1, 2]}, {"a": [1]})
    assert not contains({"a": {"c": "y"}}, {"a": {"c": "x"}})
    # quantities as the API server stores them: an emptyDir's size limit given in bytes comes back as 40G
    assert contains({"emptyDir": {"sizeLimit": "40G"}}, {"emptyDir": {"sizeLimit": 40_000_000_000}})
    assert not contains({"emptyDir": {"sizeLimit": "40G"}}, {"emptyDir": {"sizeLimit": "41G"}})


@pytest.mark.parametrize(("change", "message"), [
    ({"skipper": {"name": "flexidepth", "skipRatio": 0}}, "spec.skipper.skipRatio: must be in (0, 1]"),
    ({"skipper": {"name": "flexidepth", "params": {"skip_ratio": 0.0}}}, "spec.skipper.skipRatio: must be in (0, 1]"),
    ({"skipper": {"name": "nope"}}, "spec.skipper.name: must be one of flexidepth"),
    ({"skipper": {"name": "random_skip", "params": {"r": 2, "d": 0.5}}}, "spec.skipper.params.r: must be in [0.0, 1.0]"),
    ({"skipper": {"name": "random_skip", "params": {"d": 0.5}}}, "spec.skipper.params.r: required"),
    ({"replicas": -1}, "spec.replicas: must be in [0, 1000]"),
    ({"serving": {}}, "spec.serving.image: required"),
    ({"serving": {"image": "x", "attentionBackend": "magic"}}, "spec.serving.attentionBackend: must be one of"),
    ({"serving": {"image": "x", "extraArgs": ["--port=1"]}}, "spec.serving.extraArgs: must not set flags"),
    ({"serving": {"image": "x", "memFractionStatic": 1.0}}, "spec.serving.memFractionStatic: must be in (0, 1)"),
    ({"model": {"path": "/m"}}, "spec.model: name a preset, or give kvHeads, headDim and routedLayers"),
    ({"model": {"path": "/m", "preset": "gpt-5"}}, "spec.model.preset: must be one of"),
    ({"switch": {"prefill": "routed", "decode": "hybrid"}}, "spec.switch: prefill and decode"),
    ({"switch": {"thresholds": {"exitTokens": 9, "enterTokens": 8}}}, "spec.switch.thresholds: enterTokens must be"),
    ({"switch": {"prefill": "dense", "prefillFloorTokens": 2048}},
     "spec.switch.prefillFloorTokens: applies to a hybrid prefill only (spec.switch.prefill)"),
    ({"switch": {"prefillFloorTokens": 0}}, "spec.switch.prefillFloorTokens: must be in [1, "),
    ({"bandwidthOverrides": [{"product": A100, "gbps": 0}]}, "spec.bandwidthOverrides[0].gbps: must be in (0"),
    ({"bandwidthOverrides": [{"product": A100, "gbps": 1}, {"product": A100, "gbps": 2}]},
     "spec.bandwidthOverrides[1]: duplicate entry for product"),
    ({"resources": {"gpus": 0}}, "spec.resources.gpus: must be in [1, 8]"),
    ({"metrics": {"interval": "soon"}}, "spec.metrics.interval: must match"),
    ({"colour": "blue"}, "spec.colour: unknown field"),
])
def test_invalid_specs_are_rejected_naming_the_field(change, message):
    with pytest.raises(SpecError) as err:
        plan(resource(**change), mixed_pool())
    assert str(err.value).startswith(message), str(err.value)


def test_dense_dense_switch_serves_the_dense_arm():
    result = plan(resource(switch={"prefill": "dense", "decode": "dense"}), mixed_pool())
    assert arg(by_kind(result, "Deployment")[0], "--arm") == "dense"


def test_a_static_depth_arm_derives_its_thresholds_from_the_layers_its_ratio_projects():
    """0.3 of Llama's 16 routed layers projects 4 of them: s = 0.25, not 0.3."""
    ratio = {"skipper": {"name": "static_depth", "params": {"ratio": 0.3}}}
    result = plan(resource(**ratio), mixed_pool())
    want = derive_thresholds(lookup_device(A100).bandwidth_gbps, 0.25, 16, LLAMA_B)
    assert (result.classes[0].enter_tokens, result.classes[0].exit_tokens) == (want.enter_tokens, want.exit_tokens)
    assert want.exit_tokens != derive_thresholds(lookup_device(A100).bandwidth_gbps, 0.3, 16, LLAMA_B).exit_tokens


def test_explicit_model_geometry_without_a_preset():
    model = {"path": "/m", "kvHeads": 8, "headDim": 128, "routedLayers": 16}
    assert plan(resource(model=model), mixed_pool()).classes[0].exit_tokens == 160_000


def test_planning_a_thousand_nodes_for_a_hundred_resources_is_fast():
    products = [A100, H100, "NVIDIA-L40S", "NVIDIA-H200", UNKNOWN]
    nodes = [node(f"n{i}", products[i % len(products)] + ("-SHARED" if i % 7 == 0 else ""), zone=f"z{i % 3}")
             for i in range(1000)]
    start = time.thread_time()  # this thread's CPU: what other work on a loaded host takes does not count
    results = [plan(resource(name=f"r{i}", replicas=i % 10), nodes) for i in range(100)]
    elapsed = time.thread_time() - start
    assert all(len(r.served) == 4 for r in results)
    assert elapsed < 5.0, f"planning took {elapsed:.2f} s of CPU"  # a guard; typically well under a second


def _row(result, product):
    return next(r for r in result.status()["gpuClasses"] if r["product"] == product)


def test_scale_from_zero_plans_named_classes_with_no_node_pinned_to_their_product_labels():
    """A pool that an autoscaler scales from zero has no node until a pod asks for one: with scaleFromZero the
    classes named in gpuProducts are planned anyway (by label value or catalogue name), their pods pending."""
    nodes = [node("a100-0", A100)]
    placement = {"gpuProducts": [A100, "H200"], "scaleFromZero": True}
    result = plan(resource(placement=placement, replicas=2), nodes)
    h200 = deployment_for(result, "NVIDIA-H200")
    terms = h200["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In",
                                            "values": ["NVIDIA-H200"]}]}]
    row = _row(result, "NVIDIA-H200")
    assert row["served"] and row["nodes"] == 0 and row["nodeState"] == "AwaitingScaleUp"
    assert (row["exitTokens"], row["replicas"]) == (390_000, 1)  # H200's thresholds; a replica to scale up for
    assert _row(result, A100)["nodeState"] == "Present"
    assert not any(o["kind"] == "Job" for o in plan(resource(placement=placement, bandwidthProbe={"enabled": True}),
                                                    nodes).objects if "h200" in o["metadata"]["name"])
    # Without scaleFromZero only the classes present are planned.
    plain = plan(resource(placement={"gpuProducts": [A100, "H200"]}), nodes)
    assert [c.product for c in plain.classes] == [A100]


def test_a_class_whose_nodes_vanish_is_kept_for_the_grace_period_then_removed():
    """What was served is read back from the applied Deployments (`served_rows`), as a reconcile does; the first
    re-plan without nodes dates the loss on the class's Deployment, and the class goes once the grace is over."""
    from vskipper_operator.plan import NODES_LOST_ANNOTATION, served_rows

    spec = {"placement": {"nodeLossGraceSeconds": 600}}
    before = plan(resource(**spec), mixed_pool(), now="2026-01-01T00:00:00Z")
    without_h100 = [n for n in mixed_pool() if not n["metadata"]["name"].startswith("h100")]
    lost = plan(resource(**spec), without_h100, previous=served_rows(before.objects), now="2026-01-01T00:01:00Z")
    changes = diff(lost.objects, before.objects)
    assert [(o["kind"], o["metadata"]["annotations"][NODES_LOST_ANNOTATION]) for o in changes.update] == [
        ("Deployment", "2026-01-01T00:01:00Z")]  # the same H100 Deployment, dated; nothing deleted
    assert not changes.delete and deployment_for(lost, H100)["spec"] == deployment_for(before, H100)["spec"]
    row = _row(lost, H100)
    assert row["nodeState"] == "NodesLost" and row["nodesLostAt"] == "2026-01-01T00:01:00Z" and row["nodes"] == 0
    # The loss is dated from when it was first seen, not from each re-plan.
    later = plan(resource(**spec), without_h100, previous=served_rows(lost.objects), now="2026-01-01T00:10:00Z")
    assert _row(later, H100)["nodesLostAt"] == "2026-01-01T00:01:00Z" and diff(later.objects, lost.objects).empty
    gone = plan(resource(**spec), without_h100, previous=served_rows(later.objects), now="2026-01-01T00:11:00Z")
    assert H100 not in [c.product for c in gone.classes]
    assert sorted(o["kind"] for o in diff(gone.objects, later.objects).delete) == ["Deployment", "PodDisruptionBudget"]
    # A node coming back ends the loss.
    back = plan(resource(**spec), mixed_pool(), previous=served_rows(later.objects), now="2026-01-01T00:10:30Z")
    assert _row(back, H100)["nodeState"] == "Present" and "nodesLostAt" not in _row(back, H100)
    assert NODES_LOST_ANNOTATION not in deployment_for(back, H100)["metadata"]["annotations"]
    # A MIG slice's class is kept as it was pinned: its own product label and resource.
    mig_spec = {**spec, "bandwidthOverrides": [{"product": MIG_1G, "gbps": 280}]}
    sliced = plan(resource(**mig_spec), [mig_mixed_node("mig-0", A100, {"1g.10gb": 7})], now="2026-01-01T00:00:00Z")
    for previous in (served_rows(sliced.objects), sliced.status()["gpuClasses"]):
        kept = plan(resource(**mig_spec), [], previous=previous, now="2026-01-01T00:01:00Z")
        assert deployment_for(kept, MIG_1G)["spec"] == deployment_for(sliced, MIG_1G)["spec"]
        assert _row(kept, MIG_1G)["nodeState"] == "NodesLost"
    # Status rows serve as well (what the planner's CLI user may pass).
    assert _row(plan(resource(**spec), without_h100, previous=before.status()["gpuClasses"], now="2026-01-01T00:01:00Z"),
                H100)["nodeState"] == "NodesLost"


def test_model_condition_follows_the_download_init_containers():
    from vskipper_operator.plan import model_condition, resolve

    hf = resolve(resource(model={"path": "hf://meta-llama/Meta-Llama-3-8B", "preset": "llama-3-8b"}))

    def pod(name, state, last=None):
        status = {"name": "fetch-model", "state": state, **({"lastState": last} if last else {})}
        return {"metadata": {"name": name}, "status": {"initContainerStatuses": [status]}}

    assert model_condition(resolve(resource()), [pod("p", {"running": {}})]) is None  # a local path
    assert model_condition(hf, [])["status"] == "Unknown"
    downloading = model_condition(hf, [pod("p0", {"running": {}}), pod("p1", {"waiting": {}})])
    assert (downloading["status"], downloading["reason"]) == ("False", "Downloading") and "p0" in downloading["message"]
    failed = model_condition(hf, [pod("p0", {"waiting": {"reason": "CrashLoopBackOff"}},
                                      {"terminated": {"exitCode": 1, "message": "hf://x/y: access denied (HTTP 401)"}})])
    assert failed["reason"] == "DownloadFailed" and failed["message"].endswith("p0: hf://x/y: access denied (HTTP 401)")
    done = model_condition(hf, [pod("p0", {"terminated": {"exitCode": 0}})])
    assert (done["status"], done["reason"]) == ("True", "Downloaded")
    status = plan(resource(model={"path": "hf://meta-llama/Meta-Llama-3-8B", "preset": "llama-3-8b"}),
                  mixed_pool()).status(pods=[pod("p0", {"waiting": {}}, {"terminated": {"exitCode": 1}})])
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ModelDownloadFailed")
