"""The alert and recording rules (helm/vskipper/files/prometheus-rules.yaml) under Debian's promtool: syntax and
the unit tests of deploy/prometheus/rules.test.yaml (each alert fires on its pathology and stays quiet on a
healthy neighbour; the recording rules give the expected shares)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "helm" / "vskipper" / "files" / "prometheus-rules.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "rules.test.yaml"
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing: run `make tools`")


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_promtool_accepts_the_rules():
    proc = promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 11 rules found" in proc.stdout


def test_rule_unit_tests_pass():
    proc = promtool("test", "rules", str(RULE_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_rule_unit_tests_fail_when_an_alert_is_silenced(tmp_path):
    """The unit tests can fail: with the flapping threshold raised beyond the test's 20 transitions, they do."""
    rules = tmp_path / "helm" / "vskipper" / "files"
    rules.mkdir(parents=True)
    text = RULES.read_text()
    assert "\n      > 10\n" in text
    (rules / "prometheus-rules.yaml").write_text(text.replace("\n      > 10\n", "\n      > 100\n"))
    tests = tmp_path / "deploy" / "prometheus"
    tests.mkdir(parents=True)
    (tests / "rules.test.yaml").write_text(RULE_TESTS.read_text())
    proc = subprocess.run([PROMTOOL, "test", "rules", str(tests / "rules.test.yaml")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert "VskipperSwitchFlapping" in proc.stdout + proc.stderr


def test_every_alert_links_a_runbook_section_that_exists():
    import re

    import yaml

    runbook = (ROOT / "deploy" / "runbook.md").read_text()
    anchors = {re.sub(r"[^a-z0-9-]", "", h.lower().replace(" ", "-")) for h in re.findall(r"^## (.+)$", runbook, re.M)}
    groups = {g["name"]: g["rules"] for g in yaml.safe_load(RULES.read_text())["groups"]}
    assert [r["alert"] for r in groups["vskipper.operator"]] == [
        "VskipperOperatorDown", "VskipperOperatorReconcileErrors", "VskipperDeploymentNotReady",
        "VskipperGpuClassNotServed"]
    alerts = [r for g in ("vskipper.alerts", "vskipper.operator") for r in groups[g]]
    assert len(alerts) == 8
    for rule in alerts:
        url = rule["annotations"]["runbook_url"]
        assert url.startswith("https://github.com/vskipper/vskipper/blob/main/deploy/runbook.md#"), url
        assert url.rpartition("#")[2] in anchors, url
    assert len(anchors) == len(alerts)  # no section of an alert that no longer exists
