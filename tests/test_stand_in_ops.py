"""The CUDA stand-in profile's Triton ops (`vskipper serve --stand-in-ops triton`): `vskipper.mixed.norms`' kernels
under TRITON_INTERPRET=1 against SGLang's own torch paths (`RMSNorm.forward_native`, `SiluAndMul.forward_native`,
`RotaryEmbedding.forward_native`), the hooks that put them in those paths' place and what they leave to SGLang, and the profile that asks for them.

No GPU here: the kernels' values are the interpreter's, whose fp32-to-bf16 conversion truncates where a GPU rounds to
nearest, so bf16 results are held to two units in the last place; float32 results to fp32 rounding. Their speed, and
whether a captured decode graph replays them, need a device (a run of `benchmarks/gpu/run.sh` with
`--stand-in-ops triton`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch

from vskipper.arms import get_arm
from vskipper.mixed.norms import NORM_MAX_WIDTH, rms_norm, rotary_embedding, silu_and_mul
from vskipper.sglang import stand_in_ops
from vskipper.sglang.spec import (
    ENV_STAND_IN_OPS,
    SHIMS_GPU_DIR,
    ServeConfigError,
    ServeSpec,
    serve_environment,
    serve_profile,
)
from vskipper.sglang.standalone import init_sglang

assert os.environ.get("TRITON_INTERPRET") == "1", "the kernel tests need TRITON_INTERPRET=1 (see conftest.py)"
ROOT = SHIMS_GPU_DIR.parents[2]
ULPS = {torch.float32: 1e-5, torch.bfloat16: 2 * 2 ** -7}  # relative


@pytest.fixture(scope="module")
def sglang_ops():
    init_sglang("cpu")
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm

    return RMSNorm, SiluAndMul


def _norm(rmsnorm_class, width: int, dtype: torch.dtype, **kwargs):
    torch.manual_seed(width)
    norm = rmsnorm_class(width, eps=1e-5, **kwargs).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
    return norm


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = expected.float().abs().clamp_min(1.0)
    err = ((actual.float() - expected.float()).abs() / scale).max().item()
    assert err <= ULPS[expected.dtype], err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 96), (1, 4096)])
def test_rms_norm_equals_sglangs_torch_path_with_and_without_the_residual_add(sglang_ops, dtype, shape):
    """One launch a pass gives what SGLang's ten-kernel chain gives: the norm of x, or of x + residual with the sum
    in x's dtype beside it, normalized from the unrounded fp32 sum; x and the residual are left as they were."""
    norm = _norm(sglang_ops[0], shape[-1], dtype)
    x, residual = torch.randn(shape, dtype=dtype) * 3, torch.randn(shape, dtype=dtype)
    x0, r0 = x.clone(), residual.clone()
    _close(rms_norm(x, norm.weight, norm.variance_epsilon), norm.forward_native(x))
    y, s = rms_norm(x, norm.weight, norm.variance_epsilon, residual)
    y_ref, s_ref = norm.forward_native(x, residual)
    _close(y, y_ref)
    _close(s, s_ref)
    assert torch.equal(x, x0) and torch.equal(residual, r0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 2 * 40), (2, 2, 2 * 1500)])
def test_silu_and_mul_equals_sglangs_torch_path_across_tiles_of_a_row(sglang_ops, dtype, shape):
    x = torch.randn(shape, dtype=dtype) * 4
    _close(silu_and_mul(x), sglang_ops[1]().forward_native(x))


def _rope(head: int, rotary: int, neox: bool, max_positions: int = 256):
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    return RotaryEmbedding(head, rotary, max_positions, 10000, neox, torch.float32)  # a cache in fp32, as on CUDA


def _qk(tokens: int, heads: int, kv_heads: int, head: int, dtype: torch.dtype):
    """The query and key views of one fused QKV projection's output, split as SGLang's layers split it."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head, dtype=dtype) * 3
    q, k, _ = qkv.split([heads * head, kv_heads * head, kv_heads * head], dim=-1)
    return q, k


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize(("head", "rotary"), [(64, 64), (48, 32)])
def test_rope_equals_sglangs_torch_path_on_the_query_and_key_views_of_a_fused_projection(sglang_ops, neox, head,
                                                                                         rotary):
    """NeoX halves and GPT-J pairs, the whole head rotated or its first part (the rest copied), on strided views of
    a QKV projection: in float32 the torch path's values; new contiguous tensors of the operands' shapes, the
    operands left as they were. In bfloat16 the rotation in fp32 rounded once (the torch path's own ops in fp32,
    rounded at the end), where the torch path rounds the cosines, the sines, each product and each sum."""
    torch.manual_seed(head + rotary)
    rope = _rope(head, rotary, neox)
    positions = torch.randint(0, 256, (7,))
    q, k = _qk(7, 4, 2, head, torch.float32)
    q0, k0 = q.clone(), k.clone()
    got = rotary_embedding(positions, q, k, rope.cos_sin_cache, head, rotary, neox)
    for g, w in zip(got, rope.forward_native(positions, q, k), strict=True):
        _close(g, w)
        assert g.is_contiguous()
    assert torch.equal(q, q0) and torch.equal(k, k0)
    # int32 positions, every other one of a longer tensor (a strided view): the same values
    strided = torch.zeros(14, dtype=torch.int32)
    strided[::2] = positions
    for g, w in zip(rotary_embedding(strided[::2], q, k, rope.cos_sin_cache, head, rotary, neox),
                    rope.forward_native(positions, q, k), strict=True):
        _close(g, w)
    q3, k3 = q.view(7, 4, head).bfloat16(), k.view(7, 2, head).bfloat16()  # (tokens, heads, head) operands too
    got = rotary_embedding(positions, q3, k3, rope.cos_sin_cache, head, rotary, neox)
    for g, w in zip(got, rope.forward_native(positions, q3.float(), k3.float()), strict=True):
        _close(g, w.bfloat16())
    for g, w in zip(got, rope.forward_native(positions, q3, k3), strict=True):  # the torch path's own roundings
        row_max = w.float().abs().amax(dim=(-2, -1), keepdim=True)
        assert ((g.float() - w.float()).abs() <= 4 * 2 ** -8 * row_max).all()


def test_the_kernels_refuse_what_they_cannot_take_naming_why():
    w = torch.ones(8)
    with pytest.raises(ValueError, match="rows not contiguous"):
        rms_norm(torch.randn(8, 4).t(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match=r"weight \(8,\) on cpu for rows of 6 on cpu"):
        rms_norm(torch.randn(2, 6), w, 1e-6)
    with pytest.raises(ValueError, match=f"exceed {NORM_MAX_WIDTH}"):
        rms_norm(torch.randn(1, NORM_MAX_WIDTH + 1), torch.ones(NORM_MAX_WIDTH + 1), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(torch.randn(2, 8), w, 1e-6, residual=torch.randn(3, 8))
    with pytest.raises(ValueError, match="an even width"):
        silu_and_mul(torch.randn(2, 7))
    cache, positions = _rope(16, 16, True).cos_sin_cache, torch.arange(3)
    q, k = torch.randn(3, 32), torch.randn(3, 16)
    for args, why in (((positions[:0], q[:0], k[:0], cache, 16, 16), "no tokens"),
                      ((positions.float(), q, k, cache, 16, 16), r"positions of shape \(3,\) and torch.float32"),
                      ((positions, q, k, cache, 16, 15), "a rotary width of 15 in heads of 16"),
                      ((positions, q, k, cache, 16, 8), r"a cos/sin cache of shape \(256, 16\) for a rotary width "
                                                        "of 8"),
                      ((positions, q.t().contiguous().t(), k, cache, 16, 16), r"a query of shape \(3, 32\) and "
                                                                             r"strides \(1, 3\) that no view of "
                                                                             r"\(3, heads, 16\) takes"),
                      ((positions, q, torch.randn(3, 24), cache, 16, 16), r"a key of shape \(3, 24\)"),
                      ((positions, torch.randn(3, 4096 * 16), k, cache, 16, 16), "4096 query heads of 8 pairs "
                                                                                 "exceed 16384 a program")):
        with pytest.raises(ValueError, match=f"rotary_embedding: {why}"):
            rotary_embedding(*args, neox=True)


@pytest.fixture
def calls(monkeypatch):
    counted: Counter = Counter()
    monkeypatch.setattr(stand_in_ops, "_calls", counted)
    return counted


def test_the_hooks_take_the_layers_norms_and_silu_and_count_each_call_by_its_path(sglang_ops, calls):
    rmsnorm_class, silu_class = sglang_ops
    norm = _norm(rmsnorm_class, 64, torch.float32)
    x, residual = torch.randn(6, 64), torch.randn(6, 64)
    _close(stand_in_ops.around_rmsnorm(rmsnorm_class.forward_native, norm, x), norm.forward_native(x))
    y, s = stand_in_ops.around_rmsnorm(rmsnorm_class.forward_native, norm, x, residual)
    y_ref, s_ref = norm.forward_native(x, residual)
    _close(y, y_ref)
    _close(s, s_ref)
    _close(stand_in_ops.around_rmsnorm(rmsnorm_class.forward_native, norm, x.t().contiguous().t()),
           norm.forward_native(x))  # a strided x is made contiguous first, as the torch path makes it
    z = torch.randn(4, 2 * 48)
    _close(stand_in_ops.around_silu_and_mul(silu_class.forward_native, silu_class(), z),
           silu_class().forward_native(z))
    rope, positions = _rope(16, 16, True), torch.randint(0, 256, (6,))
    q, k = _qk(6, 4, 2, 16, torch.float32)
    for got, want in zip(stand_in_ops.around_rope(type(rope).forward_native, rope, positions.view(2, 3), q, k),
                         rope.forward_native(positions, q, k), strict=True):  # positions flattened, as the path does
        _close(got, want)
    assert calls == {("rmsnorm", "triton"): 3, ("silu_and_mul", "triton"): 1, ("rope", "triton"): 1}
    assert stand_in_ops.attestation()["calls_total"] == {"rmsnorm": {"triton": 3}, "rope": {"triton": 1},
                                                         "silu_and_mul": {"triton": 1}}


def test_what_the_kernels_do_not_take_runs_sglangs_torch_path_and_says_why(sglang_ops, calls, monkeypatch):
    rmsnorm_class, silu_class = sglang_ops
    x, residual = torch.randn(3, 64), torch.randn(3, 64)
    cases = [
        (_norm(rmsnorm_class, 64, torch.float32, cast_x_before_out_mul=True), (x,), {}, "a cast before the weight"),
        (_norm(rmsnorm_class, 64, torch.float32, fp32_residual=True), (x, residual), {}, "an fp32 residual"),
        (_norm(rmsnorm_class, 64, torch.float32, var_hidden_size=32), (x,), {}, "a variance over part of the row"),
        (_norm(rmsnorm_class, 64, torch.float32), (x, residual), {"post_residual_addition": residual},
         "a post-residual addition"),
        (_norm(rmsnorm_class, 64, torch.float32), (x, residual.double()), {},
         "a residual of another shape or dtype, or its rows not contiguous"),
    ]
    for norm, args, kwargs, why in cases:
        got = stand_in_ops.around_rmsnorm(rmsnorm_class.forward_native, norm, *args, **kwargs)
        want = norm.forward_native(*args, **kwargs)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                        strict=True):
            assert torch.equal(a, b)
        assert calls[("rmsnorm", f"torch: {why}")] == 1, (why, calls)
    # a weight SGLang never moves to the rows' device (a norm without a weight parameter): no kernel reads it there
    assert stand_in_ops.rmsnorm_why(_norm(rmsnorm_class, 64, torch.float32, has_weight=False), x.to("meta")) == \
        "weight (64,) on cpu for rows of 64 on meta"
    rope, positions = _rope(16, 16, True), torch.randint(0, 250, (3,))
    q, k = _qk(3, 4, 2, 16, torch.float32)
    native = type(rope).forward_native
    for kwargs, why in (({"offsets": torch.full((3,), 2)}, "position offsets"),
                        ({"unknown": 1}, "arguments ['unknown']")):
        try:
            got = stand_in_ops.around_rope(native, rope, positions, q, k, **kwargs)
        except TypeError:  # the torch path takes no such argument: the call went to it
            got = None
        if got is not None:
            for a, b in zip(got, native(rope, positions, q, k, **kwargs), strict=True):
                assert torch.equal(a, b)
        assert calls[("rope", f"torch: {why}")] == 1, (why, calls)
    assert stand_in_ops.rope_why(rope, positions, q, k, fused_set_kv_buffer_arg=object()) == "a fused K/V write"
    rope.sin_cos_cache = rope.cos_sin_cache
    assert stand_in_ops.rope_why(rope, positions, q, k) == "a precomputed sin/cos"
    del rope.sin_cos_cache
    rope._apply_rotary_emb_wrapped = lambda *a: None
    assert stand_in_ops.rope_why(rope, positions, q, k) == "another rotation than SGLang's apply_rotary_emb"
    assert stand_in_ops.rope_why(_rope(16, 16, True), positions, q[:, :24], k) == \
        "a query of shape (3, 24) and strides (128, 1) that no view of (3, heads, 16) takes"
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU tensor without the interpreter: no kernel can take it
    stand_in_ops.around_silu_and_mul(silu_class.forward_native, silu_class(), torch.randn(2, 8))
    assert calls[("silu_and_mul", "torch: a cpu tensor")] == 1
    assert stand_in_ops.rope_why(_rope(16, 16, True), positions, q, k) == "a cpu tensor"
    assert not any(path == "triton" for _, path in calls)


class _Registry:
    def __init__(self):
        self.hooks: list[tuple[str, str]] = []

    def register(self, target, hook, hook_type):
        self.hooks.append((target, hook.__name__, hook_type))


class _HookType:
    AROUND = "around"


def test_the_hooks_register_only_where_the_server_asked_for_the_triton_ops(monkeypatch):
    for ops, expected in (("torch", []), ("triton", [(stand_in_ops.RMSNORM_TARGET, "around_rmsnorm", "around"),
                                                     (stand_in_ops.SILU_TARGET, "around_silu_and_mul", "around"),
                                                     (stand_in_ops.ROPE_TARGET, "around_rope", "around")])):
        monkeypatch.setenv(ENV_STAND_IN_OPS, ops)
        registry = _Registry()
        stand_in_ops.register(registry, _HookType)
        assert registry.hooks == expected
        assert stand_in_ops.targets() == tuple(t for t, _, _ in expected)
        assert stand_in_ops.attestation()["ops"] == ops
    monkeypatch.delenv(ENV_STAND_IN_OPS)
    assert stand_in_ops.requested() == "torch"
    monkeypatch.setenv(ENV_STAND_IN_OPS, "cuda")
    with pytest.raises(ValueError, match="VSKIPPER_STAND_IN_OPS='cuda': one of torch, triton"):
        stand_in_ops.requested()


@pytest.mark.server
def test_sglangs_hook_registry_puts_the_kernels_in_its_own_modules_forward(tmp_path):
    """In a process of a vSkipper server on the stand-in ops (SGLang's fused ops forced onto their torch paths, as
    the stand-in profile without JIT forces them), vSkipper's plugin hooks SGLang's RMSNorm, SiLU-and-mul and RoPE: the
    modules' own `forward` then runs the kernels (counted), with the values it gave before, and the hooks are
    checked applied as a server checks them."""
    script = tmp_path / "probe.py"
    script.write_text('''
import json, torch
from vskipper.sglang.standalone import init_sglang
init_sglang("cpu")
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.plugins.hook_registry import HookRegistry
from vskipper.sglang import hooks, stand_in_ops
torch.manual_seed(0)
norm, silu = RMSNorm(64, eps=1e-5), SiluAndMul()
rope = get_rope(16, 16, 256, 500000, True, None, torch.float32)  # Llama-3's (no scaling), as its layers get it
x, r, z = torch.randn(5, 64), torch.randn(5, 64), torch.randn(5, 96)
positions, q, k = torch.arange(5), torch.randn(5, 64), torch.randn(5, 32)
before = [norm(x), *norm(x, r), silu(z), *rope(positions, q, k)]
hooks.register()
HookRegistry.apply_hooks()
hooks.check_applied(stand_in_ops.targets())
after = [norm(x), *norm(x, r), silu(z), *rope(positions, q, k)]
print(json.dumps({"err": max((a - b).abs().max().item() for a, b in zip(after, before)),
                  "attestation": stand_in_ops.attestation()}))
''')
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1", SGLANG_FORCE_FUSED_OP_BACKEND="torch",
               VSKIPPER_SERVED_ARM=json.dumps(get_arm("dense").as_dict()), **{ENV_STAND_IN_OPS: "triton"})
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    probe = json.loads(run.stdout.strip().splitlines()[-1])
    assert probe["err"] < 1e-5
    assert probe["attestation"] == {"ops": "triton", "calls_total": {"rmsnorm": {"triton": 2}, "rope": {"triton": 1},
                                                                     "silu_and_mul": {"triton": 1}}}


def test_the_stand_in_profile_asks_for_the_triton_ops_and_every_other_profile_refuses_them(tmp_path):
    profile = serve_profile("gpu", real_sgl_kernel=False, ops="triton")
    assert dict(profile.environment)[ENV_STAND_IN_OPS] == "triton"
    assert dict(profile.environment)["SGLANG_FORCE_FUSED_OP_BACKEND"] == "torch"
    assert "vskipper.mixed.norms" in profile.attestation()["ops"]
    default = serve_profile("gpu", real_sgl_kernel=False)
    assert dict(default.environment)[ENV_STAND_IN_OPS] == "torch"
    assert default.attestation()["ops"] == "SGLang's own paths for RMSNorm, SiLU-and-mul and RoPE"
    # the caller's environment never chooses them: only the profile's does
    env = serve_environment(ServeSpec(get_arm("dense"), 0, 0), base={ENV_STAND_IN_OPS: "triton"},
                            profile=serve_profile("cpu", real_sgl_kernel=False))
    assert ENV_STAND_IN_OPS not in env
    for kwargs, where in (({"platform": "cpu", "real_sgl_kernel": False}, "the CPU profile"),
                          ({"platform": "gpu", "real_sgl_kernel": True}, "SGLang's own kernels"),
                          ({"platform": "gpu", "real_sgl_kernel": False, "jit": True}, "--gpu-jit")):
        with pytest.raises(ServeConfigError, match=f"--stand-in-ops triton: only the CUDA stand-in profile without "
                                                   f"--gpu-jit .*not {where}"):
            serve_profile(ops="triton", **kwargs)
    with pytest.raises(ServeConfigError, match="--stand-in-ops must be one of torch, triton, got 'cuda'"):
        serve_profile("gpu", real_sgl_kernel=False, ops="cuda")


def test_the_stand_in_ops_benchmark_times_both_paths_beside_their_launches(tmp_path):
    """`benchmarks/stand_in_ops_bench.py` at a tiny count, in a child process: each op's two paths timed, and the
    launches a call makes on a GPU (bfloat16 operands: the torch path casts to fp32 and back); its figures mean
    nothing here."""
    out = tmp_path / "ops.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stand_in_ops_bench.py"), "--calls", "20",
                          "--repetitions", "2", "--json", str(out)], capture_output=True, text=True, timeout=240,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dtype"] == "bfloat16"
    launches = {op: (sum(r["torch_launches"]), sum(r["hooked_launches"])) for op, r in report["ops"].items()}
    assert launches == {"rmsnorm": (8, 1), "add+rmsnorm": (11, 1), "silu_and_mul": (2, 1), "rope": (21, 1)}
    for op, r in report["ops"].items():
        assert len(r["torch_us"]) == len(r["hooked_us"]) == 2 and r["hooked_over_torch"] > 0
        assert f"  {op}" in run.stdout


def test_the_host_benchmark_serves_every_arm_on_the_stand_in_ops_where_asked(tmp_path):
    """`host_time_bench.py --stand-in-ops triton`: SGLang's RMSNorm, SiLU-and-mul and RoPE hooked in the benchmark's
    process as a server hooks them, every call of every arm taking the kernels (none falling back)."""
    out = tmp_path / "host.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_time_bench.py"), "--quick", "--only",
                          "pass", "--stand-in-ops", "triton", "--json", str(out)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "every arm's RMSNorm, SiLU-and-mul and RoPE on the CUDA stand-ins' Triton kernels" in run.stdout
    (line,) = [ln for ln in run.stdout.splitlines() if ln.startswith("stand-in ops' calls by path: ")]
    assert "torch" not in line and "'rmsnorm': {'triton':" in line and "'silu_and_mul': {'triton':" in line
    report = json.loads(out.read_text())
    assert report["stand_in_ops"] == "triton"
    assert report["launches"]["prefill 2x8"]["dense"]["by_kernel"] == {"rms_norm_kernel": 17, "rope_kernel": 8,
                                                                        "silu_mul_kernel": 8}
