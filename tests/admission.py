"""What a kube-apiserver's admission would say about a SkipperDeployment, read from the generated CRD.

`admit(resource)` takes the `openAPIV3Schema` out of `manifests/crd.yaml` (the file a cluster is given, not the
Python it is generated from) and checks a resource the way the API server does on create and update, with real
implementations where one exists here:

- defaults filled in from the schema's `default`s before anything is checked (the API server defaults on decode);
- the structural part with `jsonschema`'s Draft 4 validator (Kubernetes' OpenAPI v3 uses Draft 4's boolean
  exclusiveMinimum/Maximum): types, enums, ranges, lengths, patterns, required fields, maxItems/maxProperties;
- what Draft 4 does not know, written out here: `x-kubernetes-int-or-string` (an integer or a string), map-list
  keys unique (`x-kubernetes-list-type: map`), and unknown fields refused (the API server prunes them; kubectl
  >= 1.27 asks for strict field validation, which refuses them);
- every `x-kubernetes-validations` CEL rule with `cel-python`, on each node it is attached to (array items and
  map values included), `self` bound to that node, the error placed at the node plus the rule's `fieldPath`.

What a real kube-apiserver does that this cannot: CEL cost estimation and budgets, CEL's int64 overflow errors
(cel-python has Python integers: the schema's maxima keep values in range instead), Kubernetes' CEL libraries
(quantity, url, ...; the rules here use none), RE2 (the patterns are written in the common subset of RE2 and
Python's `re`), format checks, validation ratcheting on update, admission webhooks and ValidatingAdmissionPolicies.
CEL rules run only when the structural check passed (the API server also evaluates them then, on typed values).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[1]
CRD_FILE = ROOT / "manifests" / "crd.yaml"


@functools.lru_cache(maxsize=1)
def schema() -> dict:
    crd = yaml.safe_load(CRD_FILE.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@functools.cache
def _program(expr: str):
    env = celpy.Environment()
    return env.program(env.compile(expr))


def _default(node: dict, value: Any) -> Any:
    if isinstance(value, dict) and node.get("type") == "object":
        for key, child in node.get("properties", {}).items():
            if key not in value and "default" in child:
                value[key] = copy.deepcopy(child["default"])
            elif key not in value and child.get("type") == "object" and any(
                    "default" in c for c in child.get("properties", {}).values()):
                value[key] = {}
            if key in value:
                _default(child, value[key])
        if isinstance(node.get("additionalProperties"), dict):
            for item in value.values():
                _default(node["additionalProperties"], item)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for item in value:
            _default(node["items"], item)
    return value


def _nodes(node: dict, value: Any, path: str):
    """(schema node, value, path) for every value in the document that the schema describes."""
    yield node, value, path
    if isinstance(value, dict):
        for key, child in node.get("properties", {}).items():
            if key in value:
                yield from _nodes(child, value[key], f"{path}.{key}")
        if isinstance(node.get("additionalProperties"), dict):
            for key, item in value.items():
                yield from _nodes(node["additionalProperties"], item, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            yield from _nodes(node["items"], item, f"{path}[{i}]")


def _extensions(node: dict, value: Any, path: str) -> list[str]:
    if node.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            return [f"{path}: must be an integer or a string"]
        return []
    errors = []
    if isinstance(value, dict) and node.get("type") == "object" and "properties" in node and not (
            node.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in node):
        errors += [f"{path}.{key}: unknown field" for key in sorted(set(value) - set(node["properties"]))]
    keys = node.get("x-kubernetes-list-map-keys")
    if isinstance(value, list) and node.get("x-kubernetes-list-type") == "map" and keys:
        seen = set()
        for i, item in enumerate(value):
            key = tuple(item.get(k) for k in keys) if isinstance(item, dict) else None
            if key in seen:
                errors.append(f"{path}[{i}]: Duplicate value: {key}")
            seen.add(key)
    return errors


def admit(resource: dict) -> list[str]:
    """The errors the API server would answer a create of `resource` with (HTTP 422), each starting with the
    field's path (`spec.serving.image: ...`); empty when it would be admitted."""
    root = schema()
    doc = _default(root, copy.deepcopy(resource))
    errors = [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
              for e in jsonschema.Draft4Validator(root).iter_errors(doc)]
    # Paths as the API server writes them: array indexes in brackets.
    errors = [_bracket(e) for e in errors]
    for node, value, path in _nodes(root, doc, ""):
        errors += _extensions(node, value, path.lstrip("."))
    if errors:
        return errors
    for node, value, path in _nodes(root, doc, ""):
        for rule in node.get("x-kubernetes-validations", []):
            result = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
            if isinstance(result, celpy.CELEvalError):
                errors.append(f"{(path + rule.get('fieldPath', '')).lstrip('.')}: rule failed to evaluate: {result}")
            elif not bool(result):
                errors.append(f"{(path + rule.get('fieldPath', '')).lstrip('.')}: {rule['message']}")
    return errors


def _bracket(error: str) -> str:
    path, sep, message = error.partition(": ")
    parts = path.split(".")
    out = parts[0]
    for part in parts[1:]:
        out += f"[{part}]" if part.isdigit() else f".{part}"
    return out + sep + message
