"""The GPU bundle: the folder of wheels that travels to a GPU machine (no package index there) beside the tree.

    python benchmarks/gpu/bundle.py build [--out .gpu-bundle] [--budget-mib 48] [--find-links DIR]
    python benchmarks/gpu/bundle.py verify [--out .gpu-bundle]

`build` downloads the cp312 manylinux wheels `bundle.txt` lists (pip, no dependencies: the list is complete), strips
SGLang's wheel of what the text server never imports, adds this project's own wheel (its SGLang plugin entry point),
and writes `manifest.json` (file, size, sha256, why). It fails when the folder exceeds the size budget: the bundle
and the tree travel together under 64 MiB. `verify` checks a folder against its manifest and against `bundle.txt`
(run on the device before installing). Standard library only: it runs on the device's bare python3 too.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LIST = HERE / "bundle.txt"
DEVICE_PACKAGES = HERE / "device-packages.txt"
DEFAULT_OUT = ROOT / ".gpu-bundle"
BUDGET_MIB = 48
MANIFEST = "manifest.json"
# The device's interpreter: CPython 3.12 on x86-64 glibc (manylinux tags are matched exactly by pip).
PIP_TARGET = ("--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
              "--abi", "none", *(a for n in (39, 35, 34, 31, 28, 27, 24, 17)
                                  for a in ("--platform", f"manylinux_2_{n}_x86_64")),
              "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64")
# What SGLang's text server never imports (its Rust HTTP/gRPC servers, multimodal generation, tests, benchmarks).
SGLANG_STRIP = ("sglang/srt/rust_extensions/_server*.so", "sglang/srt/rust_extensions/_grpc*.so",
                "sglang/srt/rust_extensions/_multimodal*.so", "sglang/multimodal_gen/*", "sglang/test/*",
                "sglang/benchmark/*")
PROJECT_WHY = "vSkipper's own package: its SGLang plugin entry point (the tree on PYTHONPATH supplies the code)"


class BundleError(RuntimeError):
    """A bundle that cannot be built or does not match its manifest (the message names the file)."""


@dataclass(frozen=True)
class Requirement:
    name: str
    version: str
    why: str

    @property
    def key(self) -> str:
        return normalize(self.name)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_requirements(path: Path = LIST) -> list[Requirement]:
    """`NAME==VERSION` lines, each under the latest `# why:` line."""
    reqs, why = [], None
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if line.startswith("# why:"):
            why = line[len("# why:"):].strip()
            continue
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        if not sep or not version or why is None:
            raise BundleError(f"{path.name}:{n}: expected NAME==VERSION under a '# why:' line, got {line!r}")
        reqs.append(Requirement(name.strip(), version.strip(), why))
    keys = [r.key for r in reqs]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise BundleError(f"{path.name}: listed twice: {', '.join(dupes)}")
    return reqs


def device_pins(path: Path = DEVICE_PACKAGES) -> dict[str, str | None]:
    """The device image's distributions, each with the version the list pins (`name==version`) or None."""
    pins = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[normalize(name.strip())] = version.strip() or None
    return pins


def read_device_packages(path: Path = DEVICE_PACKAGES) -> set[str]:
    return set(device_pins(path))


def wheel_name(filename: str) -> str:
    return normalize(filename.split("-")[0])


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# What a check of the served layer (`check_served.py`) ran of this tree: the runtime's sources and tables, the check
# and the benchmark rig it builds its layers with. With the packages it ran on, its stamp (`check_stamp`).
CHECKED_CODE = ("vskipper/**/*.py", "vskipper/**/*.json", "benchmarks/gpu/check_served.py",
                "benchmarks/mixed_depth_bench.py")
CHECKED_PACKAGES = ("torch", "triton", "sglang", "sgl-kernel", "flashinfer-python", "transformers")


def code_digest(root: Path = ROOT, patterns: tuple[str, ...] = CHECKED_CODE) -> str:
    """sha256 over the files `patterns` match under `root`, each its path and its bytes, in path order."""
    h = hashlib.sha256()
    for path in sorted({p for pattern in patterns for p in root.glob(pattern) if p.is_file()}):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(sha256(path).encode())
    return h.hexdigest()


def check_stamp(tile_table: Path | None, stand_in_ops: str) -> dict[str, str | None]:
    """What a check of the served layer depends on besides the device: this tree's checked code, the packages it
    runs on (None: not installed), SGLang's environment variables the process was given, the tile table it served
    (None: the one shipped for the device, in the code) and the stand-in ops. A later run on the same device reuses
    a check whose stamp is its own (`run.py`'s `check_served`); the check takes its stamp as it starts, before
    SGLang's platform profile sets variables of its own."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {"code": code_digest(), **{name: installed(name) for name in CHECKED_PACKAGES},
            "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SGLANG_")},
            "tile_table": sha256(tile_table) if tile_table is not None else None, "stand_in_ops": stand_in_ops}


def strip_wheel(src: Path, dst: Path, patterns: tuple[str, ...] = SGLANG_STRIP) -> int:
    """Copy a wheel leaving out members matching `patterns` (and their RECORD lines); the count left out."""
    dropped = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        names = zin.namelist()
        gone = {n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)}
        for name in names:
            if name in gone:
                dropped += 1
                continue
            data = zin.read(name)
            if name.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if line.split(b",", 1)[0].decode() not in gone)
            zout.writestr(zin.getinfo(name), data)
    return dropped


def download(reqs: list[Requirement], dest: Path, find_links: Path | None) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", *PIP_TARGET,
           "-d", str(dest), *(f"{r.name}=={r.version}" for r in reqs)]
    if find_links is not None:
        cmd += ["--no-index", "--find-links", str(find_links)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise BundleError(f"pip download failed:\n{result.stderr[-3000:]}")


def project_wheel(dest: Path) -> Path:
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                             "-w", str(dest), str(ROOT)], capture_output=True, text=True)
    if result.returncode != 0:
        raise BundleError(f"building the vskipper wheel failed:\n{result.stderr[-3000:]}")
    return next(dest.glob("vskipper-*.whl"))


def build(out: Path, budget_mib: float = BUDGET_MIB, find_links: Path | None = None,
          with_project: bool = True) -> dict:
    reqs = read_requirements()
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-") as tmp:
        downloads = Path(tmp) / "downloads"
        download(reqs, downloads, find_links)
        by_name = {wheel_name(p.name): p for p in downloads.glob("*.whl")}
        missing = [r.name for r in reqs if r.key not in by_name]
        if missing:
            raise BundleError(f"pip downloaded no wheel for {', '.join(missing)}")
        if out.exists():
            shutil.rmtree(out)
        wheels = out / "wheels"
        wheels.mkdir(parents=True)
        entries = []
        for req in reqs:
            src = by_name[req.key]
            dst = wheels / src.name
            why = req.why
            if req.key == "sglang":
                why += f" [{strip_wheel(src, dst)} members left out, {src.stat().st_size} bytes before]"
            else:
                shutil.copy2(src, dst)
            entries.append({"file": f"wheels/{dst.name}", "requirement": f"{req.name}=={req.version}", "why": why})
        if with_project:
            own = project_wheel(Path(tmp) / "project")
            shutil.copy2(own, wheels / own.name)
            entries.append({"file": f"wheels/{own.name}", "requirement": "vskipper (this tree)", "why": PROJECT_WHY})
    for entry in entries:
        path = out / entry["file"]
        entry.update(size=path.stat().st_size, sha256=sha256(path))
    total = sum(e["size"] for e in entries)
    budget = int(budget_mib * 2 ** 20)
    manifest = {"python": "cp312", "platform": "manylinux x86_64", "total_bytes": total, "budget_bytes": budget,
                "files": entries}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if total > budget:
        raise BundleError(f"{out}: {total / 2 ** 20:.1f} MiB of wheels exceed the budget of {budget_mib:g} MiB "
                          "(the bundle and the tree travel together under 64 MiB)")
    return manifest


def verify(out: Path) -> dict:
    """The manifest of a built bundle, after checking every file's size and sha256 and that its requirements are
    exactly bundle.txt's."""
    path = out / MANIFEST
    if not path.is_file():
        raise BundleError(f"{path}: no manifest (run `make gpu-bundle`)")
    manifest = json.loads(path.read_text())
    for entry in manifest["files"]:
        file = out / entry["file"]
        if not file.is_file():
            raise BundleError(f"{entry['file']}: listed in the manifest, missing from {out}")
        if file.stat().st_size != entry["size"] or sha256(file) != entry["sha256"]:
            raise BundleError(f"{entry['file']}: size or sha256 differs from the manifest")
    listed = {f"{r.name}=={r.version}" for r in read_requirements()}
    bundled = {e["requirement"] for e in manifest["files"] if "==" in e["requirement"]}
    if listed != bundled:
        raise BundleError(f"manifest and bundle.txt differ: only listed {sorted(listed - bundled)}, "
                          f"only bundled {sorted(bundled - listed)}")
    if manifest["total_bytes"] > manifest["budget_bytes"]:
        raise BundleError(f"{out}: {manifest['total_bytes']} bytes exceed the budget {manifest['budget_bytes']}")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["build", "verify"])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--budget-mib", type=float, default=BUDGET_MIB)
    parser.add_argument("--find-links", type=Path, help="take wheels from this folder instead of the index")
    args = parser.parse_args(argv)
    try:
        manifest = build(args.out, args.budget_mib, args.find_links) if args.command == "build" else verify(args.out)
    except BundleError as exc:
        print(f"gpu-bundle: error: {exc}", file=sys.stderr)
        return 1
    print(f"gpu-bundle: {args.out}: {len(manifest['files'])} wheels, {manifest['total_bytes'] / 2 ** 20:.2f} MiB "
          f"of {manifest['budget_bytes'] / 2 ** 20:g} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
