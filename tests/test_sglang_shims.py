"""The two CPU shims the pinned SGLang needs: the torchvision patch (one idempotent command) and the sgl_kernel
stand-in (on the server's PYTHONPATH only)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vskipper.sglang.shims import patch_torchvision as tv

SAMPLE = (
    "import torch\nimport torchvision.extension  # noqa: F401\n\n"
    "@register_meta(\"roi_align\")\ndef meta_roi_align(): ...\n\n"
    "@torch.library.register_fake(\"torchvision::nms\")\ndef meta_nms(): ...\n\n"
    "@torch.library.register_fake(\"torchvision::qnms\")\ndef meta_qnms(): ...\n"
)


def test_torchvision_patch_guards_every_unconditional_fake_registration():
    out = tv.patched_source(SAMPLE)
    assert tv.UNGUARDED not in out
    assert out.count(tv.GUARDED) == 2
    assert out.count("def _register_fake_if_ops") == 1
    compile(out, "_meta_registrations.py", "exec")


def test_torchvision_patch_is_idempotent():
    once = tv.patched_source(SAMPLE)
    assert tv.patched_source(once) == once


def test_torchvision_patch_refuses_an_unknown_file_layout():
    with pytest.raises(ValueError, match="anchor"):
        tv.patched_source("@torch.library.register_fake(\"torchvision::nms\")\n")


@pytest.mark.server
def test_installed_torchvision_is_patched_and_imports_beside_the_cpu_torch():
    pytest.importorskip("sglang")
    check = subprocess.run([sys.executable, "-m", "vskipper.sglang.shims.patch_torchvision", "--check"],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    r = subprocess.run([sys.executable, "-c", "import torch, torchvision; print(torch.version.cuda)"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "None"  # still the CPU torch


def test_sgl_kernel_stand_in_imports_any_name_and_raises_when_called():
    from vskipper.sglang.spec import SHIMS_DIR

    code = ("from sgl_kernel import copy_all_layer_kv_cache_cpu as f\n"
            "import sgl_kernel; assert sgl_kernel.STUB\n"
            "try:\n    f(1)\nexcept NotImplementedError as e:\n    print('raised', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": str(SHIMS_DIR), "PATH": ""})
    assert r.returncode == 0, r.stderr
    assert "raised sgl_kernel.copy_all_layer_kv_cache_cpu is a CUDA kernel" in r.stdout


def test_sgl_kernel_stand_in_is_not_importable_outside_the_server_path():
    r = subprocess.run([sys.executable, "-c", "import sgl_kernel"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
