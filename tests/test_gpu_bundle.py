"""`make gpu-bundle` (benchmarks/gpu/bundle.py): the folder of wheels that travels to a GPU machine. The builder runs
for real (pip download, SGLang stripped, vSkipper's wheel built, manifest, budget) from a local wheel folder holding
one small wheel per requirement of bundle.txt; and a bundle built here is checked against bundle.txt when present."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from benchmarks.gpu.bundle import (
    DEFAULT_OUT,
    LIST,
    MANIFEST,
    BundleError,
    build,
    read_device_packages,
    read_requirements,
    verify,
)

STRIPPED_MEMBERS = ("sglang/srt/rust_extensions/_server_abi.so", "sglang/multimodal_gen/runtime.py",
                    "sglang/test/test_utils.py", "sglang/benchmark/bench.py")
KEPT_MEMBERS = ("sglang/__init__.py", "sglang/srt/rust_extensions/radix.so")


def _wheel(folder: Path, name: str, version: str, members: tuple[str, ...] = ()) -> Path:
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    files = {m: f"# {m}\n" for m in members} | {
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{m},,\n" for m in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for member, text in files.items():
            z.writestr(member, text * 200)
        z.writestr(f"{dist}.dist-info/RECORD", record)
    return path


@pytest.fixture(scope="module")
def wheel_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("index")
    for req in read_requirements():
        _wheel(folder, req.name, req.version, STRIPPED_MEMBERS + KEPT_MEMBERS if req.key == "sglang" else ())
    return folder


@pytest.fixture(scope="module")
def built(wheel_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle") / ".gpu-bundle"
    return out, build(out, find_links=wheel_folder)


def test_bundle_list_gives_each_requirement_a_pinned_version_and_a_reason_and_none_the_device_has():
    reqs = read_requirements()
    assert {"sglang", "transformers", "tokenizers", "xgrammar", "apache-tvm-ffi", "pydantic-core"} <= \
        {r.key for r in reqs}
    assert all(r.version and r.why for r in reqs)
    device = read_device_packages()
    assert "torch" in device and "triton" in device
    overlap = {r.key for r in reqs} & device
    # Carried although the device has them: SGLang's pinned pair and a newer typing-extensions for pydantic.
    assert overlap == {"transformers", "tokenizers", "typing-extensions"}


def test_manifest_lists_every_requirement_once_with_size_sha256_and_why(built):
    out, manifest = built
    assert json.loads((out / MANIFEST).read_text()) == manifest
    by_requirement = {e["requirement"]: e for e in manifest["files"]}
    assert set(by_requirement) == {f"{r.name}=={r.version}" for r in read_requirements()} | {"vskipper (this tree)"}
    for req in read_requirements():
        entry = by_requirement[f"{req.name}=={req.version}"]
        assert entry["why"].startswith(req.why)
        assert (out / entry["file"]).stat().st_size == entry["size"]
        assert len(entry["sha256"]) == 64
    assert manifest["total_bytes"] == sum(e["size"] for e in manifest["files"])
    assert manifest["budget_bytes"] == 48 * 2 ** 20
    assert verify(out) == manifest


def test_sglang_is_stripped_of_what_the_text_server_never_imports(built):
    out, manifest = built
    entry = next(e for e in manifest["files"] if e["requirement"].startswith("sglang=="))
    with zipfile.ZipFile(out / entry["file"]) as z:
        names = set(z.namelist())
        record = z.read("sglang-0.5.21.dist-info/RECORD").decode()
    assert set(KEPT_MEMBERS) <= names and not set(STRIPPED_MEMBERS) & names
    assert all(m not in record for m in STRIPPED_MEMBERS) and all(m in record for m in KEPT_MEMBERS)
    assert f"[{len(STRIPPED_MEMBERS)} members left out" in entry["why"]


def test_the_project_wheel_carries_the_sglang_plugin_entry_point(built):
    out, manifest = built
    entry = next(e for e in manifest["files"] if e["requirement"] == "vskipper (this tree)")
    with zipfile.ZipFile(out / entry["file"]) as z:
        points = next(z.read(n).decode() for n in z.namelist() if n.endswith("entry_points.txt"))
        names = z.namelist()
    assert "[sglang.srt.plugins]" in points and "vskipper.sglang.hooks:register" in points
    assert "vskipper/sglang/shims_gpu/sgl_kernel/__init__.py" in names


def test_a_bundle_over_its_budget_fails_the_build(wheel_folder, tmp_path):
    with pytest.raises(BundleError, match="exceed the budget of 0.01 MiB"):
        build(tmp_path / "b", budget_mib=0.01, find_links=wheel_folder, with_project=False)


def test_verify_names_a_file_that_changed_after_the_build(wheel_folder, tmp_path):
    out = tmp_path / "b"
    manifest = build(out, find_links=wheel_folder, with_project=False)
    victim = manifest["files"][3]["file"]
    with open(out / victim, "ab") as f:
        f.write(b"x")
    with pytest.raises(BundleError, match=f"{victim}: size or sha256 differs"):
        verify(out)


def test_the_bundle_built_here_matches_bundle_txt():
    if not (DEFAULT_OUT / MANIFEST).is_file():
        pytest.skip(f"no bundle built ({DEFAULT_OUT}): `make gpu-bundle` builds it")
    manifest = verify(DEFAULT_OUT)
    assert manifest["total_bytes"] <= 48 * 2 ** 20
    assert LIST.is_file()
