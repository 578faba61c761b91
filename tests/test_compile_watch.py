"""The attestation's count of Triton's compilations (`vskipper.sglang.compile_watch`), with Triton's own compiler:
no GPU is needed to compile a kernel for one (`vskipper.mixed.compile_check`), and Triton calls its compilation
listener there as it does when a server's launch compiles. The watch runs in a process of its own: it chains
Triton's process-wide listener, and this one runs the kernels in the interpreter (conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json
import triton.knobs as knobs
from vskipper.mixed import compile_check
from vskipper.sglang import compile_watch

before = []  # a listener installed before the watch (as SGLang's may be) is still called
knobs.compilation.listener = lambda **kw: before.append((kw["src"].name, kw["cache_hit"]))
assert compile_watch.install() and compile_watch.install()  # once per process
launch = compile_check.cohort_maps_launch(4096, True)
for _ in range(2):  # built, then loaded from Triton's cache
    assert "error" not in compile_check.compile_launch(launch, 90)
print(json.dumps({"doc": compile_watch.attestation(), "before": before}))
"""


def test_a_kernel_compiled_is_counted_with_its_seconds_and_a_load_from_the_cache_apart(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compiled here, not found in a cache
    res = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    doc = out["doc"]
    assert doc["watched"] and doc["compiles_total"] == 1 and doc["cache_loads_total"] == 1
    assert doc["compiles_by_kernel"] == {"cohort_maps_kernel": 1} and doc["compile_seconds_total"] > 0
    assert doc["cache_loads_by_kernel"] == {"cohort_maps_kernel": 1}
    assert [r["kernel"] for r in doc["recent"]] == ["cohort_maps_kernel"]
    assert out["before"] == [["cohort_maps_kernel", False], ["cohort_maps_kernel", True]]


def test_the_runtime_attests_the_watch(tmp_path):
    """Every runtime's attestation carries the count (under the interpreter nothing compiles: zero)."""
    from vskipper.arms import get_arm
    from vskipper.sglang.runtime import Runtime
    from vskipper.sglang.spec import ServeSpec

    runtime = Runtime(ServeSpec(get_arm("dense"), 0, 0), "llama", (), "LlamaForCausalLM")
    doc = runtime.attestation()["triton_compiles"]
    assert doc["watched"] is True and doc["compiles_total"] >= 0
    assert set(doc) == {"watched", "compiles_total", "compile_seconds_total", "cache_loads_total",
                        "compiles_by_kernel", "cache_loads_by_kernel", "recent"}
