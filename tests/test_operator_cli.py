"""`vskipper-operator`: plan previews from files, the CRD, and a torch-free import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vskipper_operator.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "manifests" / "examples"
NODES = EXAMPLES / "nodes-mixed-pool.json"


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_each_example_plans_cleanly_on_the_mixed_pool(example, capsys):
    assert main(["plan", "--spec", str(example), "--nodes", str(NODES), "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    deployments = [o for o in out["objects"] if o["kind"] == "Deployment"]
    assert deployments, "no Deployment planned"
    served = [r for r in out["status"]["gpuClasses"] if r["served"]]
    assert {r["deployment"] for r in served} == {d["metadata"]["name"] for d in deployments}
    assert all(r["exitTokens"] <= r["enterTokens"] for r in served)
    unknown = next(r for r in out["status"]["gpuClasses"] if r["product"] == "NVIDIA-GB300")
    assert not unknown["served"]


def test_flexidepth_example_shows_each_class_thresholds_in_the_yaml_preview(capsys):
    spec = EXAMPLES / "flexidepth-llama3-8b.yaml"
    assert main(["plan", "--spec", str(spec), "--nodes", str(NODES)]) == 0
    out = capsys.readouterr().out
    header = [line for line in out.splitlines() if line.startswith("#")]
    assert any("NVIDIA-A100-SXM4-80GB: 3 node(s), 1935 GB/s (catalogue), exit 160,000 / enter 200,000" in h
               for h in header)
    assert any("NVIDIA-H100-80GB-HBM3: 2 node(s), 3350 GB/s (catalogue), exit 270,000 / enter 340,000" in h
               for h in header)
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "Deployment", "Deployment", "PodDisruptionBudget",
                                         "PodDisruptionBudget", "ServiceMonitor"]
    assert "&id" not in out  # plain YAML, no anchors


def test_invalid_spec_exits_2_naming_the_field(tmp_path, capsys):
    doc = yaml.safe_load((EXAMPLES / "random-skip-arm.yaml").read_text())
    doc["spec"]["skipper"]["params"]["r"] = 1.5
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    assert main(["plan", "--spec", str(bad), "--nodes", str(NODES)]) == 2
    assert "error: spec.skipper.params.r: must be in [0.0, 1.0], got 1.5" in capsys.readouterr().err


def test_missing_file_is_reported_not_raised(capsys):
    assert main(["plan", "--spec", "/nonexistent.yaml", "--nodes", str(NODES)]) == 2
    assert "spec: cannot read /nonexistent.yaml" in capsys.readouterr().err


def test_measured_bandwidth_file_is_preferred_over_the_catalogue(tmp_path, capsys):
    measured = tmp_path / "measured.yaml"
    measured.write_text("NVIDIA-H100-80GB-HBM3: 3000\n")
    spec = EXAMPLES / "flexidepth-llama3-8b.yaml"
    assert main(["plan", "--spec", str(spec), "--nodes", str(NODES), "--measured", str(measured), "-o", "json"]) == 0
    rows = {r["product"]: r for r in json.loads(capsys.readouterr().out)["status"]["gpuClasses"]}
    assert (rows["NVIDIA-H100-80GB-HBM3"]["bandwidthSource"], rows["NVIDIA-H100-80GB-HBM3"]["exitTokens"]) == (
        "measured", 240_000)


def test_console_script_prints_the_committed_crd_without_importing_torch():
    code = ("import sys; from vskipper_operator.cli import main; import vskipper_operator.plan; "
            "rc = main(['crd']); assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True).stdout
    assert out == (ROOT / "manifests" / "crd.yaml").read_text()


def test_operator_manifest_runs_one_replica_with_recreate_and_rbac_for_every_api_it_calls():
    from vskipper_operator.kube import RESOURCES

    all_docs = [d for d in yaml.safe_load_all((ROOT / "manifests" / "operator.yaml").read_text()) if d]
    docs = {d["kind"]: d for d in all_docs}
    dep = docs["Deployment"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}  # no leader election
    granted = {(group, res, verb) for role in all_docs if role["kind"] == "ClusterRole" for rule in role["rules"]
               for group in rule["apiGroups"] for res in rule["resources"] for verb in rule["verbs"]}
    for (api_version, _kind), (_prefix, plural) in RESOURCES.items():
        group = api_version.rpartition("/")[0]
        assert (group, plural, "list") in granted, plural
        if plural != "pods":
            assert {(group, plural, v) for v in ("create", "patch")} <= granted, plural
        if plural not in ("pods", "configmaps", "services"):  # a resource's ConfigMap and Service keep their names
            assert (group, plural, "delete") in granted, plural
    assert {("", "nodes", "watch"), ("vskipper.io", "skipperdeployments", "watch"),
            ("vskipper.io", "skipperdeployments/status", "patch"), ("", "events", "create")} <= granted
