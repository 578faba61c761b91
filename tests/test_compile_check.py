"""`python -m vskipper.mixed.compile_check`: every Triton kernel compiled ahead of time to a cubin for a Hopper and
an Ampere part with 99 KiB of shared memory, at the launch configurations a server uses there, with Triton's own
compiler and ptxas (no GPU: what runs on the device itself, registers and speed, is measured there)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import triton
from triton.runtime.interpreter import InterpretedFunction

from tests.sglang_world import ROOT
from vskipper.mixed import kernels

pytestmark = pytest.mark.server  # a heavy process: about 30 s of compiling


def test_every_kernel_compiles_for_hopper_and_a_99_kib_ampere_part_within_its_shared_memory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compiled here, not found in a cache
    out = tmp_path / "compiled.json"
    res = subprocess.run([sys.executable, "-m", "vskipper.mixed.compile_check", "--device", "H100-SXM",
                          "--device", "RTX-A6000", "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    reports = json.loads(out.read_text())
    # this process runs them in the interpreter (conftest.py), the check's as JIT functions; `_` marks a helper
    # the kernels inline
    jitted = {name for name, obj in inspect.getmembers(kernels)
              if isinstance(obj, (triton.runtime.JITFunction, InterpretedFunction)) and not name.startswith("_")}
    for report, limit in zip(reports, (227 * 1024, 99 * 1024), strict=True):
        assert report["failed"] == []
        assert {r["kernel"] for r in report["launches"]} == jitted  # every kernel of the module, none missed
        assert all(r["shared"] <= limit for r in report["launches"])
        # ptxas's own report of each launch (a spill is reported, not refused: the tuner times what it costs)
        assert all(0 < r["registers"] <= 255 and r["spill_bytes"] >= 0 for r in report["launches"])
    # the measured H100 table's tiles are among the launches (the 99 KiB part takes the default table)
    assert len(reports[0]["launches"]) > len(reports[1]["launches"])


def test_the_check_refuses_the_interpreter_naming_it():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "vskipper.mixed.compile_check"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "TRITON_INTERPRET=1" in res.stderr
