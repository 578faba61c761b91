"""Schema checks for prometheus-operator objects (monitoring.coreos.com/v1 ServiceMonitor, PodMonitor,
PrometheusRule), which the Kubernetes schemas of `kubernetes-validate` do not cover.

The validators are those of the npm package `@kubernetes-models/prometheus-operator` (pinned in the Makefile,
installed by `make tools` into .tools/ beside helm): JSON-schema validators generated from prometheus-operator's
CRDs (types, required fields, enums, duration and label patterns; v0.90.1 for the 5.0.x releases), run by node.
They do not reject unknown fields. `validate(objects)` returns, per object, the errors naming the offending field.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / ".tools"
PACKAGE = "@kubernetes-models/prometheus-operator"
NODE = shutil.which("node")
KINDS = ("ServiceMonitor", "PodMonitor", "PrometheusRule")
MISSING = None if NODE and (TOOLS / "node_modules" / PACKAGE / "package.json").is_file() else \
    f"node or {PACKAGE} missing: run `make tools`"

# Read a JSON list of objects on stdin; print, per object, its validation errors (instance path, message).
_SCRIPT = """
let text = "";
for await (const chunk of process.stdin) text += chunk;
const out = [];
for (const doc of JSON.parse(text)) {
  const [group, version] = String(doc.apiVersion).split("/");
  if (group !== "monitoring.coreos.com") { out.push([["/apiVersion", "not a monitoring.coreos.com object"]]); continue; }
  const module = await import(`PACKAGE/${group}/${version}/${doc.kind}`);
  try {
    new module[doc.kind](doc).validate();
    out.push([]);
  } catch (err) {
    out.push((err.errors ?? [{instancePath: "", message: err.message}]).map(e => [e.instancePath, e.message]));
  }
}
console.log(JSON.stringify(out));
""".replace("PACKAGE", PACKAGE)


def _field(instance_path: str) -> str:
    """`/spec/endpoints/0/interval` -> `spec.endpoints[0].interval`."""
    out = ""
    for part in instance_path.strip("/").split("/"):
        out += f"[{part}]" if re.fullmatch(r"[0-9]+", part) else (f".{part}" if out else part)
    return out


def validate(objects: list[dict]) -> list[list[str]]:
    """Per object, `field: message` for each schema violation (empty when the object is valid)."""
    if MISSING:
        raise RuntimeError(MISSING)
    proc = subprocess.run([NODE, "--input-type=module", "-e", _SCRIPT], input=json.dumps(objects),
                          capture_output=True, text=True, timeout=120, cwd=TOOLS,
                          env={**os.environ, "NODE_NO_WARNINGS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"node failed:\n{proc.stderr[-3000:]}")
    results = json.loads(proc.stdout)
    return [sorted({f"{_field(path) or '(object)'}: {message}" for path, message in errors}) for errors in results]


def monitoring_objects(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d and d.get("apiVersion", "").startswith("monitoring.coreos.com/")]
