"""Run as a script: import SGLang 0.5.21's CUDA server path with CUDA faked at import time (this machine has no
GPU), the stand-ins on PYTHONPATH as the GPU profile puts them, then run SGLang's own CUDA RMSNorm
(`RMSNorm.forward_cuda`, which calls `sgl_kernel.rmsnorm` / `fused_add_rmsnorm`) on CPU tensors against its
native torch path. With `--distributions`, also imports vSkipper's server and model modules and lists the installed
distributions every loaded module belongs to. With `--tuner`, only what `vskipper tune-tiles` imports to time
SGLang's extend kernel (no stand-ins on the path there), the kernel wheels it loaded and the distributions. Prints
one JSON object; exits 1 when a module does not import."""

from __future__ import annotations

import importlib
import json
import sys

import torch

SERVER_PATH = (
    "sglang.srt.layers.layernorm", "sglang.srt.layers.activation", "sglang.srt.layers.sampler",
    "sglang.srt.layers.quantization.fp8_utils", "sglang.srt.models.llama", "sglang.srt.models.qwen3",
    "sglang.srt.layers.attention.triton_backend", "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner", "sglang.srt.managers.scheduler",
    "sglang.srt.entrypoints.http_server", "sglang.launch_server",
)


def fake_cuda() -> None:
    torch.cuda.is_available = lambda: True
    torch.version.cuda = "13.0"
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H100 80GB HBM3"
    torch.cuda.device_count = lambda: 1


def rmsnorm_through_sglang() -> dict:
    from sglang.srt.layers.layernorm import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(96, eps=1e-6)
    norm.weight.data = torch.randn(96)
    x, residual = torch.randn(5, 96), torch.randn(5, 96)
    with torch.no_grad():
        return _compare(norm, x, residual)


def _compare(norm, x: torch.Tensor, residual: torch.Tensor) -> dict:
    plain = norm.forward_cuda(x.clone())
    fused, fused_residual = norm.forward_cuda(x.clone(), residual.clone())
    native = norm.forward_native(x.clone())
    native_fused, native_residual = norm.forward_native(x.clone(), residual.clone())
    return {"rmsnorm_max_err": float((plain - native).abs().max()),
            "fused_max_err": float((fused - native_fused).abs().max()),
            "fused_residual_max_err": float((fused_residual - native_residual).abs().max())}


def dispatched() -> dict:
    """The path SGLang's own dispatch (`BaseFusedOp.forward`) runs for RMSNorm, with and without a residual,
    SiLU-and-mul and the rotary embedding (Llama's, as its layers get it) in this process's environment: the method
    each call reached."""
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding import get_rope

    taken: dict[str, list[str]] = {}
    rope = get_rope(64, 64, 128, 500000, True, None, torch.float32)
    calls = (("RMSNorm", RMSNorm(8), (torch.randn(2, 8),)), ("RMSNorm+residual", RMSNorm(8), (torch.randn(2, 8),
             torch.randn(2, 8))), ("SiluAndMul", SiluAndMul(), (torch.randn(2, 8),)),
             ("RotaryEmbedding", rope, (torch.arange(2), torch.randn(2, 128), torch.randn(2, 64))))
    def recorder(label: str, name: str, bound):
        def record(*a, **k):
            taken.setdefault(label, []).append(name)
            return bound(*a, **k)
        return record

    for label, op, args in calls:
        for name in ("forward_native", "forward_cuda"):
            setattr(op, name, recorder(label, name, getattr(op, name)))
        with torch.no_grad():
            op(*args)
    return taken


VSKIPPER_SERVER = ("vskipper.sglang.server", "vskipper.sglang.models.ddllama", "vskipper.sglang.models.qwen3_skipper",
                   "vskipper.sglang.hooks")
# `vskipper tune-tiles` (`--tuner`): the tuner and SGLang's extend kernel it times, in a process without stand-ins
TUNER_PATH = ("vskipper.mixed.tuner", "vskipper.sglang.backend_read", "sglang.kernels.ops.attention.extend_attention")


def loaded_distributions() -> list[str]:
    import importlib.metadata

    owners = importlib.metadata.packages_distributions()
    return sorted({d for m in list(sys.modules) for d in owners.get(m.split(".")[0], ())})


def main() -> int:
    fake_cuda()
    failed = {}
    if "--tuner" in sys.argv:
        modules = TUNER_PATH
    else:
        modules = SERVER_PATH + (VSKIPPER_SERVER if "--distributions" in sys.argv else ())
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 (report every failure, by module)
            failed[name] = f"{type(exc).__name__}: {exc}"
    result = {"failed": failed}
    if "--tuner" in sys.argv:
        result["kernel_wheels"] = sorted(m for m in sys.modules if m.split(".")[0] in ("sgl_kernel", "flashinfer"))
        result["distributions"] = loaded_distributions()
    elif not failed:
        import sgl_kernel

        result["sgl_kernel"] = sgl_kernel.__file__
        result["torch_ops_sgl_kernel"] = [n for n in dir(torch.ops.sgl_kernel) if not n.startswith("_") and n != "name"]
        result.update(rmsnorm_through_sglang())
        result["dispatched"] = dispatched()
        if "--distributions" in sys.argv:
            result["distributions"] = loaded_distributions()
    print(json.dumps(result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
