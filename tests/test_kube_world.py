"""The API server the operator tests run against (tests/kube_world.py) keeps resourceVersion and generation as a
kube-apiserver does, and refuses stale writes as it does: the operator's handling (Kopf's consistency wait, its
finalizer patch) rests on both.
"""

from __future__ import annotations

import urllib.error

import pytest

SKD = "/apis/vskipper.io/v1alpha1/namespaces/llm/skipperdeployments"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


def skd(spec=None):
    return {"apiVersion": "vskipper.io/v1alpha1", "kind": "SkipperDeployment",
            "metadata": {"name": "llama", "namespace": "llm"}, "spec": spec or {"replicas": 2}}


def meta(obj):
    return obj["metadata"]["resourceVersion"], obj["metadata"]["generation"]


def refused(cluster, method, path, body, content_type=MERGE) -> int:
    with pytest.raises(urllib.error.HTTPError) as err:
        cluster.http(method, path, body, content_type)
    return err.value.code


def test_every_write_has_a_new_version_and_only_a_desired_state_change_a_new_generation(cluster):
    created = cluster.http("POST", SKD, skd())
    version, generation = meta(created)
    assert generation == 1
    seen = {version}

    def write(path, body, content_type=MERGE, method="PATCH"):
        obj = cluster.http(method, path, body, content_type)
        assert obj["metadata"]["resourceVersion"] not in seen, "a write kept an earlier version"
        seen.add(obj["metadata"]["resourceVersion"])
        assert cluster.http("GET", f"{SKD}/llama")["metadata"] == obj["metadata"]
        return obj["metadata"]["generation"]

    assert write(f"{SKD}/llama", {"spec": {"replicas": 5}}) == 2
    assert write(f"{SKD}/llama/scale", {"spec": {"replicas": 6}}) == 3  # `kubectl scale`
    assert write(f"{SKD}/llama/status", {"status": {"observedGeneration": 3}}) == 3
    assert write(f"{SKD}/llama", {"metadata": {"labels": {"team": "a"}}}) == 3
    # The generation is the server's: a client's is overwritten.
    assert write(f"{SKD}/llama", {"metadata": {"generation": 9}, "spec": {"replicas": 7}}) == 4
    assert write(f"{SKD}/llama", [{"op": "replace", "path": "/spec/replicas", "value": 8}], JSON_PATCH) == 5
    # A write that changes nothing stores nothing: version and generation stand.
    before = cluster.http("GET", f"{SKD}/llama")["metadata"]
    for body in ({"spec": {"replicas": 8}}, {"metadata": {"generation": 1, "resourceVersion": None}}):
        assert cluster.http("PATCH", f"{SKD}/llama", body, MERGE)["metadata"] == before
    # A delete that a finalizer holds marks the object: a write with one more generation.
    write(f"{SKD}/llama", {"metadata": {"finalizers": ["x"]}})
    assert write(f"{SKD}/llama", None, method="DELETE") == 6
    assert cluster.http("GET", f"{SKD}/llama")["metadata"]["deletionTimestamp"]
    # Other kinds share the one counter.
    node = cluster.http("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n"}})
    assert node["metadata"]["resourceVersion"] not in seen


def test_a_write_against_an_older_version_is_refused_and_changes_nothing(cluster):
    version, _ = meta(cluster.http("POST", SKD, skd()))
    current = cluster.http("PATCH", f"{SKD}/llama", {"metadata": {"resourceVersion": version},
                                                     "spec": {"replicas": 3}}, MERGE)
    assert current["spec"]["replicas"] == 3
    # The version it was read at is gone: optimistic concurrency refuses both patch kinds.
    assert refused(cluster, "PATCH", f"{SKD}/llama", {"metadata": {"resourceVersion": version},
                                                     "spec": {"replicas": 4}}) == 409
    assert refused(cluster, "PATCH", f"{SKD}/llama",
                   [{"op": "test", "path": "/metadata/resourceVersion", "value": version},
                    {"op": "add", "path": "/metadata/finalizers", "value": ["x"]}], JSON_PATCH) == 422
    assert cluster.http("GET", f"{SKD}/llama") == current
    # At the current version both apply.
    latest = current["metadata"]["resourceVersion"]
    patched = cluster.http("PATCH", f"{SKD}/llama",
                           [{"op": "test", "path": "/metadata/resourceVersion", "value": latest},
                            {"op": "add", "path": "/metadata/finalizers", "value": ["x"]}], JSON_PATCH)
    assert patched["metadata"]["finalizers"] == ["x"] and patched["metadata"]["resourceVersion"] != latest
