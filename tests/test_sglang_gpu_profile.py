"""The GPU profile of `vskipper serve` without a GPU: the CUDA stand-ins' kernels against a float64 reference on
CPU tensors, their import surface (SGLang's CUDA server path imports with CUDA faked, the CPU stub's does not), and
the profile each platform gets (the platform faked: a device node, a real `sgl_kernel` on the path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from vskipper.arms import get_arm
from vskipper.sglang import cli as serve_cli
from vskipper.sglang.spec import (
    CPU_FLAGS,
    GPU_STAND_IN_ENV,
    GPU_STAND_IN_FLAGS,
    SHIMS_DIR,
    SHIMS_GPU_DIR,
    ServeSpec,
    serve_environment,
    serve_profile,
)

ROOT = SHIMS_GPU_DIR.parents[2]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}  # relative, about 2 ulp


@pytest.fixture
def stand_in(monkeypatch):
    """`sgl_kernel` and `flashinfer` imported from the GPU stand-in folder, as the server imports them."""
    def ours() -> list[str]:
        return [m for m in sys.modules if m.split(".")[0] in ("sgl_kernel", "flashinfer")]

    for name in ours():
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(SHIMS_GPU_DIR))
    import sgl_kernel

    yield sgl_kernel
    for name in ours():
        del sys.modules[name]


def _rmsnorm64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def _close(actual: torch.Tensor, expected64: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    err = ((actual.double() - expected64).abs() / expected64.abs().clamp_min(1.0)).max().item()
    assert err <= TOLERANCE[dtype], err


# -- the stand-in kernels, numerically ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rmsnorm_stand_in_equals_a_float64_reference_with_and_without_out(stand_in, dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 256, generator=g) * 3).to(dtype)
    weight = torch.randn(256, generator=g).to(dtype)
    expected = _rmsnorm64(x, weight, 1e-5)
    _close(stand_in.rmsnorm(x, weight, 1e-5), expected, dtype)
    out = torch.empty_like(x)
    assert stand_in.rmsnorm(x, weight, 1e-5, out=out, enable_pdl=False) is out
    _close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_add_rmsnorm_stand_in_updates_both_tensors_in_place_normalising_the_fp32_sum(stand_in, dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(6, 128, generator=g) * 4).to(dtype)
    residual = (torch.randn(6, 128, generator=g) * 4).to(dtype)
    weight = torch.randn(128, generator=g).to(dtype)
    total64 = x.double() + residual.double()
    x_ptr, r_ptr = x.data_ptr(), residual.data_ptr()
    assert stand_in.fused_add_rmsnorm(x, residual, weight, 1e-6) is None
    assert (x.data_ptr(), residual.data_ptr()) == (x_ptr, r_ptr)
    _close(residual, total64, dtype)
    _close(x, _rmsnorm64(total64, weight, 1e-6), dtype)


def test_fused_add_rmsnorm_normalises_the_unrounded_sum_like_the_cuda_kernel(stand_in):
    """In bf16 the rounded residual and the fp32 sum differ; the norm is of the fp32 sum (the kernel's)."""
    x = torch.tensor([[1.0, 2.0 ** -9, 3.0, -1.0]], dtype=torch.bfloat16)
    residual = torch.tensor([[256.0, 1.0, -2.0, 5.0]], dtype=torch.bfloat16)
    weight = torch.ones(4, dtype=torch.bfloat16)
    exact = _rmsnorm64(x.double() + residual.double(), weight, 0.0).to(torch.bfloat16)
    stand_in.fused_add_rmsnorm(x, residual, weight, 0.0)
    assert torch.equal(x, exact)


def test_silu_and_mul_stand_in_equals_a_float64_reference(stand_in):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2 * 48, generator=g).to(torch.bfloat16)
    expected = torch.nn.functional.silu(x[:, :48].double()) * x[:, 48:].double()
    _close(stand_in.silu_and_mul(x), expected, torch.bfloat16)
    out = torch.empty(4, 48, dtype=torch.bfloat16)
    assert stand_in.silu_and_mul(x, out) is out
    _close(out, expected, torch.bfloat16)


def test_weak_ref_tensor_stand_in_views_the_memory_without_keeping_it_alive(stand_in):
    """SGLang's breakable and piecewise prefill CUDA graphs hand their outputs on as weak references (the graph's
    memory pool owns the memory): the stand-in's view has the tensor's dtype, shape, strides and offset over the
    same memory, and takes no use of its storage, where an ordinary view takes one."""
    base = torch.arange(24, dtype=torch.bfloat16).view(4, 6)
    uses = lambda: torch._C._storage_Use_Count(base.untyped_storage()._cdata)  # noqa: E731
    before = uses()
    view = base[1:, 2:5]
    weak = stand_in.weak_ref_tensor(view)
    assert uses() == before + 1  # the ordinary view's, not the weak one's
    assert (weak.dtype, weak.shape, weak.stride(), weak.storage_offset()) == (
        view.dtype, view.shape, view.stride(), view.storage_offset())
    assert weak.data_ptr() == view.data_ptr() and torch.equal(weak, view)
    base[2, 3] = -7  # one memory: a write through the owner shows in the weak view
    assert weak[1, 1].item() == -7
    assert stand_in.weak_ref_tensor(torch.empty(0)).shape == (0,)
    assert stand_in.weak_ref_tensor(None) is None and stand_in.weak_ref_tensor(3) == 3  # not a tensor: as it is


def test_stand_in_has_plain_launches_no_scalar_type_no_ops_and_import_only_names_that_raise(stand_in):
    from sgl_kernel import kvcacheio, quantization, top_k_renorm_prob, utils

    assert utils.is_arch_support_pdl() is False
    assert stand_in.STAND_IN == "cuda"
    with pytest.raises(ModuleNotFoundError):
        import sgl_kernel.scalar_type  # noqa: F401
    assert not hasattr(stand_in, "scalar_type")
    assert not hasattr(torch.ops.sgl_kernel, "rmsnorm")
    for fn in (top_k_renorm_prob, kvcacheio.transfer_kv_per_layer, quantization.ggml_dequantize):
        with pytest.raises(NotImplementedError, match=f"{fn.__name__} is a CUDA kernel the GPU stand-in"):
            fn(torch.zeros(1))
    import flashinfer.comm.mapping  # noqa: F401
    import flashinfer.comm.mnnvl  # noqa: F401
    from flashinfer.sampling import top_k_top_p_sampling_from_probs

    with pytest.raises(NotImplementedError, match="flashinfer.sampling.top_k_top_p_sampling_from_probs"):
        top_k_top_p_sampling_from_probs()
    for kept_unavailable in ("mm_fp4", "fp4_quantize", "nvfp4_block_scale_interleave"):
        assert not hasattr(flashinfer, kept_unavailable)  # SGLang's try/except imports keep them off


# -- the import surface, with CUDA faked ---------------------------------------------------------------------------

def _probe(shims, *args: str, server: bool = True) -> dict:
    """The probe's result, with the server's environment (`server`: the stand-ins' settings) or none of it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    env.update(PYTHONPATH=os.pathsep.join([str(shims), str(ROOT)]))
    if server:
        env.update(GPU_STAND_IN_ENV, SGLANG_FORCE_FUSED_OP_BACKEND="torch",
                   SGLANG_EXTERNAL_MODEL_PACKAGE="vskipper.sglang.models")
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "faked_cuda_probe.py"), *args], capture_output=True,
                       text=True, timeout=240, env=env, cwd=ROOT)
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cuda_path():
    """SGLang's CUDA server path and vSkipper's server imported with CUDA faked and the GPU stand-ins."""
    pytest.importorskip("sglang")
    return _probe(SHIMS_GPU_DIR, "--distributions")


@pytest.mark.server
def test_sglang_cuda_server_path_imports_with_the_stand_ins_and_its_cuda_rmsnorm_equals_native(cuda_path):
    assert cuda_path["failed"] == {}
    assert cuda_path["sgl_kernel"].startswith(str(SHIMS_GPU_DIR))
    assert cuda_path["torch_ops_sgl_kernel"] == []
    assert cuda_path["rmsnorm_max_err"] < 1e-6 and cuda_path["fused_max_err"] < 1e-6
    assert cuda_path["fused_residual_max_err"] < 1e-6


@pytest.mark.server
def test_without_jit_sglangs_forced_torch_backend_runs_its_norms_and_silu_in_torch_not_the_stand_in(cuda_path):
    """The stand-in profile without `--gpu-jit` forces SGLang's fused ops onto their torch paths
    (`SGLANG_FORCE_FUSED_OP_BACKEND=torch`): RMSNorm, its residual add, SiLU-and-mul and the rotary embedding run
    `forward_native`, a chain of torch kernels, on every arm (the paths `--stand-in-ops triton` hooks); the
    stand-in's `rmsnorm` / `fused_add_rmsnorm` / `silu_and_mul` serve only a call that dispatches to SGLang's CUDA
    path."""
    assert cuda_path["dispatched"] == {"RMSNorm": ["forward_native"], "RMSNorm+residual": ["forward_native"],
                                       "SiluAndMul": ["forward_native"], "RotaryEmbedding": ["forward_native"]}


@pytest.mark.server
def test_every_distribution_the_cuda_server_path_imports_is_on_the_device_or_in_the_bundle(cuda_path):
    from benchmarks.gpu.bundle import normalize, read_device_packages, read_requirements

    travels = {r.key for r in read_requirements()} | read_device_packages() | {"vskipper"}
    lacking = sorted(d for d in cuda_path["distributions"] if normalize(d) not in travels)
    assert lacking == []
    assert "sglang" in {normalize(d) for d in cuda_path["distributions"]}


@pytest.mark.server
def test_tune_tiles_imports_sglangs_extend_kernel_on_a_gpu_without_stand_ins_or_kernel_wheels(tmp_path):
    """`vskipper tune-tiles` times SGLang's Triton extend kernel (`vskipper.sglang.backend_read`) in a process
    without the server's stand-ins: with CUDA faked, that import path loads no `sgl_kernel` or `flashinfer`, and every
    distribution it loads travels to the device."""
    from benchmarks.gpu.bundle import normalize, read_device_packages, read_requirements

    pytest.importorskip("sglang")
    tuner = _probe(tmp_path, "--tuner", server=False)  # an empty folder where the stand-ins would be
    assert tuner["failed"] == {} and tuner["kernel_wheels"] == []
    travels = {r.key for r in read_requirements()} | read_device_packages() | {"vskipper"}
    assert sorted(d for d in tuner["distributions"] if normalize(d) not in travels) == []


@pytest.mark.server
def test_the_cpu_stub_cannot_serve_the_cuda_path():
    pytest.importorskip("sglang")
    failed = _probe(SHIMS_DIR)["failed"]
    assert "sglang.srt.models.llama" in failed and "flashinfer" in failed["sglang.srt.models.llama"]


# -- which profile serves ------------------------------------------------------------------------------------------

def test_cpu_profile_is_the_cpu_recipe_unchanged(tmp_path):
    profile = serve_profile("cpu", real_sgl_kernel=False)
    assert profile.flags == CPU_FLAGS and profile.decode_graphs == "disabled"
    env = serve_environment(ServeSpec(get_arm("dense"), 0, 0, tmp_path / "s.json"), base={"PYTHONPATH": "/x"},
                            profile=profile)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SHIMS_DIR), "/x"]
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and "SGLANG_IS_FLASHINFER_AVAILABLE" not in env


def test_gpu_without_kernels_puts_the_cuda_stand_in_first_and_never_the_cpu_stub(tmp_path):
    profile = serve_profile("gpu", real_sgl_kernel=False)
    assert profile.name == "gpu-stand-in" and profile.flags == GPU_STAND_IN_FLAGS
    assert profile.decode_graphs == "full"
    base = {"PYTHONPATH": os.pathsep.join([str(SHIMS_DIR), "/x"])}  # an inherited CPU stub is dropped
    env = serve_environment(ServeSpec(get_arm("dense"), 0, 0), base=base, profile=profile)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SHIMS_GPU_DIR), "/x"]
    assert "SGLANG_USE_CPU_ENGINE" not in env
    for key, value in GPU_STAND_IN_ENV.items():
        assert env[key] == value
    assert env["SGLANG_FORCE_FUSED_OP_BACKEND"] == "torch"
    jit = serve_profile("gpu", real_sgl_kernel=False, jit=True)
    assert "SGLANG_FORCE_FUSED_OP_BACKEND" not in dict(jit.environment) and "nvcc" in jit.attestation()["jit"]


def test_gpu_with_real_kernels_adds_nothing():
    profile = serve_profile("gpu", real_sgl_kernel=True)
    assert (profile.name, profile.path, profile.environment, profile.flags, profile.decode_graphs) == \
        ("gpu-kernels", (), (), (), "sglang-default")
    env = serve_environment(ServeSpec(get_arm("dense"), 0, 0), base={"PYTHONPATH": str(SHIMS_DIR)},
                            profile=profile)
    assert env["PYTHONPATH"] == ""


def test_auto_is_gpu_exactly_where_an_nvidia_device_node_exists(tmp_path):
    node = tmp_path / "nvidiactl"
    assert serve_cli.resolve_platform("auto", str(node)) == "cpu"
    node.touch()
    assert serve_cli.resolve_platform("auto", str(node)) == "gpu"
    assert serve_cli.resolve_platform("cpu", str(node)) == "cpu"


def _dry_run(model, arm: str, pythonpath: str, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), pythonpath]))
    return subprocess.run([sys.executable, "-m", "vskipper.cli", "serve", "--model", str(model), "--arm", arm,
                           "--platform", "gpu", "--dry-run", *extra], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)


def test_serve_picks_the_profile_by_whether_a_real_sgl_kernel_is_importable(tiny_flexidepth, tmp_path):
    fake = tmp_path / "site" / "sgl_kernel"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('never imported by vskipper serve')\n")
    real = _dry_run(tiny_flexidepth, "dense", str(tmp_path / "site"))
    assert real.returncode == 0, real.stderr
    shown = json.loads(real.stdout)
    assert shown["profile"]["name"] == "gpu-kernels"
    assert str(SHIMS_DIR) not in shown["environment"]["PYTHONPATH"]
    assert str(SHIMS_GPU_DIR) not in shown["environment"]["PYTHONPATH"]
    assert "--attention-backend" not in shown["command"]
    stand_in = json.loads(_dry_run(tiny_flexidepth, "always-route", str(tmp_path)).stdout)
    assert stand_in["profile"]["name"] == "gpu-stand-in"
    assert stand_in["environment"]["PYTHONPATH"].split(os.pathsep)[0] == str(SHIMS_GPU_DIR)
    assert json.loads(stand_in["environment"]["VSKIPPER_PROFILE"]) == stand_in["profile"]
    cmd = stand_in["command"]  # SGLang keeps a flag's last value: decode graphs (with a routed variant) stay on
    assert cmd[max(i for i, a in enumerate(cmd) if a == "--cuda-graph-backend-decode") + 1] == "full"
    prefill = json.loads(_dry_run(tiny_flexidepth, "always-route", str(tmp_path), "--",
                                  "--cuda-graph-backend-prefill", "full").stdout)["command"]
    assert prefill[max(i for i, a in enumerate(prefill) if a == "--cuda-graph-backend-prefill") + 1] == "disabled"
