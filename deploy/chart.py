"""The chart's generated files: values.schema.json (from values.yaml and its constraints), the CRD in crds/
(from the operator's schema), and the RBAC rules (from manifests/operator.yaml, the one RBAC source): the
cluster-wide reads, and the rules for a watched namespace (a ClusterRole bound cluster-wide, or a Role per
namespace in operator.watchNamespaces)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

CHART = Path("helm/vskipper")
CRD_FILE = CHART / "crds" / "skipperdeployments.vskipper.io.yaml"
SCHEMA_FILE = CHART / "values.schema.json"
RBAC_FILES = {"cluster": CHART / "files" / "operator-rbac-cluster-rules.yaml",
              "namespaced": CHART / "files" / "operator-rbac-namespaced-rules.yaml"}
# The plain manifest's ClusterRoles: cluster-wide reads, and what the operator does in a watched namespace.
RBAC_ROLES = {"cluster": "vskipper-operator-cluster", "namespaced": "vskipper-operator"}
OPERATOR_MANIFEST = Path("manifests/operator.yaml")

_DNS1123 = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DURATION = r"^([0-9]+(ms|s|m|h))+$"
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}

# Maps whose keys the user chooses (labels, annotations, Kubernetes fragments): any keys, checked by Kubernetes.
FREE_FORM = {
    "operator.resources", "operator.podAnnotations", "operator.podLabels", "operator.nodeSelector",
    "operator.affinity", "serviceAccount.annotations", "metrics.serviceMonitor.labels",
    "metrics.podMonitor.labels", "prometheusRule.labels", "dashboard.labels", "dashboard.annotations",
}
# Constraints beyond the type of the default value, by dotted path.
CONSTRAINTS: dict[str, dict[str, Any]] = {
    "nameOverride": {"maxLength": 63},
    "fullnameOverride": {"maxLength": 63},
    "operator.image.repository": {"minLength": 1},
    "operator.image.pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
    "operator.imagePullSecrets": {"items": {"type": "object", "required": ["name"],
                                            "properties": {"name": {"type": "string", "minLength": 1}}}},
    "operator.watchNamespaces": {"items": {"type": "string", "pattern": _DNS1123, "maxLength": 63},
                                 "uniqueItems": True},
    "operator.resyncSeconds": {"minimum": 1},
    "operator.apiBackoffs": {"pattern": r"^[0-9]+(\.[0-9]+)?(,[0-9]+(\.[0-9]+)?)*$"},
    "operator.healthPort": _PORT,
    "operator.metricsPort": _PORT,
    "operator.tolerations": {"items": {"type": "object"}},
    "metrics.serviceMonitor.interval": {"pattern": _DURATION},
    "metrics.podMonitor.interval": {"pattern": _DURATION},
    "dashboard.labels": {"additionalProperties": {"type": "string"}},
    "dashboard.namespace": {"anyOf": [{"maxLength": 0}, {"pattern": _DNS1123}]},
}


def _doc_comments(values_text: str) -> dict[str, str]:
    """`# -- text` comments (with `#` continuation lines) above a key, by the key's dotted path."""
    docs: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in values_text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            pending = [stripped[4:].strip()]
            continue
        if stripped.startswith("#"):
            if pending:
                pending.append(stripped[1:].strip())
            continue
        m = re.match(r"^( *)([A-Za-z_][A-Za-z0-9_]*):", line)
        if not m:
            pending = []
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [m.group(2)])
        if pending:
            docs[path] = " ".join(pending)
        pending = []
        stack.append((indent, m.group(2)))
    return docs


def _infer(value: Any, path: str, docs: dict[str, str]) -> dict:
    node: dict[str, Any]
    if isinstance(value, bool):
        node = {"type": "boolean"}
    elif isinstance(value, int):
        node = {"type": "integer"}
    elif isinstance(value, float):
        node = {"type": "number"}
    elif isinstance(value, str):
        node = {"type": "string"}
    elif isinstance(value, list):
        node = {"type": "array"}
    elif isinstance(value, dict):
        node = {"type": "object"}
        if path not in FREE_FORM:
            node["properties"] = {k: _infer(v, f"{path}.{k}" if path else k, docs) for k, v in value.items()}
            node["additionalProperties"] = False
    else:
        raise ValueError(f"{path}: cannot infer a schema for {value!r}")
    if path in docs:
        node["description"] = docs[path]
    node.update(CONSTRAINTS.get(path, {}))
    return node


def values_schema(values_text: str) -> dict:
    import yaml

    values = yaml.safe_load(values_text)
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "title": "vskipper chart values",
              **_infer(values, "", _doc_comments(values_text))}
    unknown = [p for p in (*CONSTRAINTS, *FREE_FORM) if not _has_path(values, p)]
    if unknown:
        raise ValueError(f"constraints name paths that values.yaml lacks: {', '.join(unknown)}")
    return schema


def _has_path(values: dict, path: str) -> bool:
    node: Any = values
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def rbac_rules(manifest_text: str) -> dict[str, list[dict]]:
    """The rules of the plain operator manifest's two ClusterRoles, by part (cluster, namespaced)."""
    import yaml

    roles = {d["metadata"]["name"]: d for d in yaml.safe_load_all(manifest_text) if d and d.get("kind") == "ClusterRole"}
    if set(roles) != set(RBAC_ROLES.values()):
        raise ValueError(f"{OPERATOR_MANIFEST}: expected the ClusterRoles {', '.join(RBAC_ROLES.values())}, "
                         f"found {', '.join(roles) or 'none'}")
    return {part: roles[name]["rules"] for part, name in RBAC_ROLES.items()}


def generated_files(root: Path) -> dict[Path, str]:
    import yaml

    from vskipper_operator.crd import render_crd_yaml

    schema = values_schema((root / CHART / "values.yaml").read_text())
    rules = rbac_rules((root / OPERATOR_MANIFEST).read_text())
    header = f"# Generated from {OPERATOR_MANIFEST} by `make chart`; do not edit.\n"
    return {
        SCHEMA_FILE: json.dumps(schema, indent=2) + "\n",
        CRD_FILE: render_crd_yaml(),
        **{path: f"{header}# ClusterRole {RBAC_ROLES[part]}\n"
           + yaml.safe_dump(rules[part], sort_keys=False, default_flow_style=None, width=110)
           for part, path in RBAC_FILES.items()},
    }
