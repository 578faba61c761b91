"""Every Triton kernel of `vskipper.mixed.kernels`, `.norms`, `.routes` and `.router`, compiled ahead of time for a
GPU's architecture, no GPU needed.

    python -m vskipper.mixed.compile_check [--device NAME ...] [--tile-table FILE] [--json FILE]

Triton's compiler and the ptxas it ships lower each kernel to a cubin for the device's compute capability, at the
launch configurations a server uses on it: every tile its tile table holds (the measured table where one ships,
the shared-memory default elsewhere, or the one `--tile-table` gives, as `vskipper serve --tile-table` would serve
it) for the cohort GEMMs and the packed prefill read, and the served Llama-3-8B shapes (bf16, head_dim 128,
four query heads a KV head) for the attention reads, the cohort maps, RandomSkip's fused routes over the 16 routed
layers, a trained gate's fused route (the release's router width), and the CUDA stand-ins' norms, SiLU-and-mul and
RoPE (`vskipper serve --stand-in-ops triton`; Qwen3's per-head norms at head_dim too). Each launch is specialized as
Triton's JIT specializes it (its own argument specialization applied to example arguments of the served shapes: unit
strides folded, aligned pointers and multiples of 16 marked divisible), so the shared memory, registers and spills
are those of the kernel the device compiles, not of a generic one. A kernel that does not compile, or
whose shared memory exceeds the device's per-block limit, is a failure found here instead of on the device. Each
launch's registers a thread and spilled bytes are ptxas's own report (`ptxas -v` on the same PTX, with the ptxas
Triton picks for the architecture): a spill is printed beside the launch. The interpreter (`TRITON_INTERPRET=1`,
the tests') checks what the kernels compute; this checks that they build, and what they cost in registers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from vskipper.modelspec import PRESETS
from vskipper.roofline import Device, lookup_device

DEFAULT_DEVICES = ("H100-SXM", "A100-SXM4-80GB", "RTX-A6000")
# Llama-3-8B as served (bf16): the launches' example arguments.
MODEL = PRESETS["llama-3-8b"]
HEADS, KV_HEADS, HEAD_DIM = MODEL.num_attention_heads, MODEL.num_kv_heads, MODEL.head_dim
PROJ_REDUCTION = 16  # the FlexiDepth projector's width: intermediate / 16 (the release's proj_reduction_factor)
COHORT_MAP_ROWS = 8192  # a prefill chunk (the count is not specialized: one variant for every pass)
REQ_TO_TOKEN_WIDTH = 8192 + 4  # SGLang's req_to_token rows: the context length (the device run's) plus 4
ROWS, POOL_SLOTS, REQUESTS = 256, 4096, 8
# where the launches' kernels are found
KERNEL_MODULES = ("vskipper.mixed.kernels", "vskipper.mixed.norms", "vskipper.mixed.routes", "vskipper.mixed.router")
ROUTED_LAYERS = MODEL.num_routed_layers  # the served routed layers (the deeper half)


def kernel_function(name: str):
    """The Triton kernel named `name` in `KERNEL_MODULES`."""
    import importlib

    for module in KERNEL_MODULES:
        fn = getattr(importlib.import_module(module), name, None)
        if fn is not None:
            return fn
    raise KeyError(f"no Triton kernel {name!r} in {', '.join(KERNEL_MODULES)}")


@dataclass(frozen=True)
class Launch:
    """One kernel at one launch configuration, specialized as Triton's JIT specializes it for the served arguments:
    an integer equal to 1 becomes a constant, an integer that is a multiple of 16 and a 16-byte aligned pointer
    are marked divisible by 16 (what lets the compiler vectorize and pipeline the loads)."""

    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, int | bool], ...]  # the launch's own (block sizes, switches)
    specialized: tuple[tuple[str, int], ...]  # arguments the JIT folds into constants
    divisible: tuple[str, ...]
    num_warps: int
    num_stages: int

    def label(self) -> str:
        consts = ", ".join(f"{k}={v}" for k, v in self.constexprs)
        unaligned = [n for n, kind in self.signature if kind.startswith("*") and n not in self.divisible]
        return (f"{self.kernel}({consts}; warps {self.num_warps}, stages {self.num_stages}"
                f"{'; unaligned ' + ', '.join(unaligned) if unaligned else ''})")


def _t(*shape: int, dtype=None):
    import torch

    return torch.empty(*shape, dtype=dtype or torch.bfloat16, device="meta")


def _launch(kernel: str, args: dict, constexprs: dict, num_warps: int, num_stages: int) -> Launch:
    """`kernel` called with `args` (meta tensors and scalars of the served shapes), specialized by Triton's own
    argument specialization, the one its JIT applies at a launch."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    fn = kernel_function(kernel)
    names = fn.arg_names
    # a JIT function keeps its `do_not_specialize`, the interpreter's its decorator's keywords
    kept = getattr(fn, "do_not_specialize", None) or getattr(fn, "kwargs", {}).get("do_not_specialize") or ()
    unspecialized = {names[n] if isinstance(n, int) else n for n in kept}
    if set(names) != set(args) | set(constexprs):
        raise ValueError(f"{kernel}: the launch names {sorted(set(args) | set(constexprs))}, the kernel {names}")
    signature, specialized, divisible = [], [], []
    for name in names:
        if name in constexprs:
            continue
        kind, spec = native_specialize_impl(CUDABackend, args[name], False, name not in unspecialized, True)
        if kind == "constexpr":
            specialized.append((name, spec))
            continue
        signature.append((name, kind))
        if spec and CUDABackend.parse_attr(spec):
            divisible.append(name)
    return Launch(kernel, tuple(signature), tuple(constexprs.items()), tuple(specialized), tuple(divisible),
                  num_warps, num_stages)


def _workspace(out, n: int, split_k: int, grouped: bool = False) -> dict:
    """The split-K workspace arguments as `kernels.py` passes them: an unsplit launch's output in their place
    (unread), a split one's fp32 planes [split_k, rows, n] (`SplitK`; `grouped`, the grouped down launch's, a
    half of them per cohort: [2, split_k, rows, n])."""
    import torch

    strides = ("stride_ws_c",) * grouped + ("stride_ws_s", "stride_ws_m")
    if split_k == 1:
        return {"ws_ptr": out, **dict.fromkeys(strides, 0)}
    ws = _t(*(2,) * grouped, split_k, ROWS, n, dtype=torch.float32)
    return {"ws_ptr": ws, **{name: ws.stride(dim) for dim, name in enumerate(strides)}}


def _gemm_args(op: str, split_k: int = 1) -> tuple[str, dict, list[dict]]:
    """(kernel, example arguments, the switches of each launch) of one tile-table op's GEMM, as `kernels.py` calls
    it: W is [N, K] (the down GEMMs scatter onto the hidden rows), K split `split_k` ways (Q and the down GEMMs)."""
    import torch

    from vskipper.mixed.tuner import op_dims

    k, n = op_dims(op, MODEL.hidden_size, MODEL.intermediate_size, MODEL.intermediate_size // PROJ_REDUCTION,
                   HEADS * HEAD_DIM)
    # the cohort counts are one buffer [RUN, Project-Only] (`CohortBuilder`): the projector reads the second, 8 bytes
    # in, a pointer the JIT does not mark divisible
    counts = _t(2, dtype=torch.int64)
    idx, count = _t(ROWS, dtype=torch.int64), counts[1:2] if op.startswith("proj") else counts[0:1]
    if op.endswith("gate_up") or op == "attn_q":
        x, w, out = _t(ROWS, k), _t(n, k), _t(ROWS, n)
        args = {"x_ptr": x, "idx_ptr": idx, "count_ptr": count, "out_ptr": out, "N": n, "K": k,
                "stride_xm": x.stride(0), "stride_xk": x.stride(1), "stride_wn": w.stride(0),
                "stride_wk": w.stride(1), "stride_om": out.stride(0), "stride_on": out.stride(1)}
        if op == "attn_q":  # into the RUN rows' batch rows, whichever read serves (the packed form serves none)
            return ("cohort_gemm_kernel", {**args, "w_ptr": w, **_workspace(out, n, split_k)},
                    [{"SCATTER": True, "SPLIT_K": split_k}])
        return "cohort_gate_up_kernel", {**args, "wg_ptr": w, "wu_ptr": w}, [{}]
    a, w, y = _t(ROWS, k), _t(n, k), _t(ROWS, n)
    args = {"a_ptr": a, "idx_ptr": idx, "count_ptr": count, "wd_ptr": w, "y_ptr": y, "D": n, "N": k,
            "stride_am": a.stride(0), "stride_an": a.stride(1), "stride_wd": w.stride(0), "stride_wn": w.stride(1),
            "stride_ym": y.stride(0), "stride_yd": y.stride(1), **_workspace(y, n, split_k)}
    if op == "attn_o":  # the unweighted scatter onto the residual (the index stands in for the weights), its
        # operand packed (the masked and packed reads' outputs) or gathered from batch rows (a read of every row)
        return "cohort_down_scatter_kernel", {**args, "w_ptr": idx}, [{"WEIGHTED": False, "ACCUMULATE": True,
                                                                       "SPLIT_K": split_k, "GATHER_A": gather}
                                                                      for gather in (False, True)]
    # the FFNs' down GEMM stores (the served body) or adds (the bench stack, the tuner)
    return "cohort_down_scatter_kernel", {**args, "w_ptr": _t(ROWS)}, [{"WEIGHTED": True, "ACCUMULATE": acc,
                                                                        "SPLIT_K": split_k, "GATHER_A": False}
                                                                       for acc in (False, True)]


def _reduce_launches(splits: set[int]) -> list[Launch]:
    """The split GEMMs' epilogue (`split_k_reduce_kernel`) at each of `splits`, in the forms served: the FFNs' down
    GEMM weighted (stored or added; the projector's reading the second of the builder's counts, a pointer the JIT
    does not mark divisible), o_proj's unweighted add, Q stored into its batch rows."""
    import torch

    from vskipper.mixed import kernels as kn

    n = MODEL.hidden_size
    idx, counts, y = _t(ROWS, dtype=torch.int64), _t(2, dtype=torch.int64), _t(ROWS, n)
    forms = [(_t(ROWS), counts[c], True, acc) for c in (slice(0, 1), slice(1, 2)) for acc in (False, True)]
    forms += [(idx, counts[0:1], False, True), (idx, counts[0:1], False, False)]
    out = []
    for split_k in sorted(splits):
        ws = _t(split_k, ROWS, n, dtype=torch.float32)
        for w, count, weighted, accumulate in forms:
            out.append(_launch("split_k_reduce_kernel",
                               {"ws_ptr": ws, "idx_ptr": idx, "count_ptr": count, "w_ptr": w, "y_ptr": y, "N": n,
                                "stride_ws_s": ws.stride(0), "stride_ws_m": ws.stride(1), "stride_ym": y.stride(0),
                                "stride_yn": y.stride(1)},
                               {"BLOCK_M": kn.REDUCE_BLOCK_M, "BLOCK_N": kn.REDUCE_BLOCK_N, "SPLIT_K": split_k,
                                "WEIGHTED": weighted, "ACCUMULATE": accumulate, "SCATTER": True}, 4, 3))
    return out


def _grouped_args(op: str, block_n: int, split_k: int = 1) -> tuple[str, dict, list[dict]]:
    """(kernel, example arguments, switches) of the grouped launch of a routed layer's two cohort FFNs
    (`kernels.cohort_ffn_pair`) at a tile of the MLP's `op` (its `block_n` sets where the projector's column tiles
    start, and the down's `split_k` its K split): the MLP over the RUN cohort, the projector over the Project-Only
    one; the down GEMMs store (the served body: a gathered FFN is never grouped)."""
    import torch
    from triton import cdiv

    d, n1, n2 = MODEL.hidden_size, MODEL.intermediate_size, MODEL.intermediate_size // PROJ_REDUCTION
    counts, idx = _t(2, dtype=torch.int64), _t(ROWS, dtype=torch.int64)
    if op == "mlp_gate_up":
        x, w1, w2, a1, a2 = _t(ROWS, d), _t(n1, d), _t(n2, d), _t(ROWS, n1), _t(ROWS, n2)
        return "grouped_gate_up_kernel", {
            "x_ptr": x, "idx_ptr": idx, "count_ptr": counts[0:1], "wg_ptr": w1, "wu_ptr": w1, "out_ptr": a1, "N": n1,
            "idx2_ptr": idx, "count2_ptr": counts[1:2], "wg2_ptr": w2, "wu2_ptr": w2, "out2_ptr": a2, "N2": n2,
            "K": d, "TILES_N": cdiv(n1, block_n), "stride_xm": x.stride(0), "stride_xk": x.stride(1),
            "stride_wn": w1.stride(0), "stride_wk": w1.stride(1), "stride_om": a1.stride(0), "stride_on": a1.stride(1),
            "stride_w2n": w2.stride(0), "stride_w2k": w2.stride(1), "stride_o2m": a2.stride(0),
            "stride_o2n": a2.stride(1)}, [{}]
    a1, a2, w1, w2, y = _t(ROWS, n1), _t(ROWS, n2), _t(d, n1), _t(d, n2), _t(ROWS, d)
    return "grouped_down_scatter_kernel", {
        "a_ptr": a1, "idx_ptr": idx, "count_ptr": counts[0:1], "wd_ptr": w1, "N": n1, "a2_ptr": a2,
        "idx2_ptr": idx, "count2_ptr": counts[1:2], "wd2_ptr": w2, "N2": n2, "w_ptr": _t(ROWS), "y_ptr": y, "D": d,
        "TILES_D": cdiv(d, block_n), "stride_am": a1.stride(0), "stride_an": a1.stride(1), "stride_wd": w1.stride(0),
        "stride_wn": w1.stride(1), "stride_a2m": a2.stride(0), "stride_a2n": a2.stride(1),
        "stride_wd2": w2.stride(0), "stride_w2n": w2.stride(1), "stride_ym": y.stride(0),
        "stride_yd": y.stride(1), **_workspace(y, d, split_k, grouped=True)}, [{"ACCUMULATE": False, "SPLIT_K": split_k}]


def _gemm_launches(table) -> list[Launch]:
    """The cohort GEMM kernels at every tile of the device's table, and the grouped FFN launches at the MLP's;
    each operation that splits K also at its first tile split as the tuner tries it (`SPLIT_SEEDS`), and the
    split GEMMs' reduce at every split of these."""
    from vskipper.mixed.tiles import SPLIT_OPERATIONS
    from vskipper.mixed.tuner import SPLIT_SEEDS

    out: dict[Launch, None] = {}
    splits = set()
    for op, entries in table.entries.items():
        tiles = [t for _lo, _hi, t in entries]
        if op in SPLIT_OPERATIONS:
            tiles += [replace(tiles[0], split_k=s) for s in SPLIT_SEEDS]
        for t in tiles:
            forms = [_gemm_args(op, t.split_k)]
            if op in ("mlp_gate_up", "mlp_down"):  # the grouped launch at the MLP's tile
                forms.append(_grouped_args(op, t.block_n, t.split_k))
            blocks = {"BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k}
            for kernel, args, launches in forms:
                for switches in launches:
                    out[_launch(kernel, args, {**blocks, **switches}, t.num_warps, t.num_stages)] = None
            splits.add(t.split_k)
    return list(out) + _reduce_launches(splits - {1})


def _attention_launches(read_tile) -> list[Launch]:
    """The decode read, the packed prefill read at `read_tile` (the device table's), the cohort maps."""
    import torch
    from triton import next_power_of_2

    from vskipper.mixed import kernels as kn

    group = HEADS // KV_HEADS
    splits = kn.decode_splits(REQ_TO_TOKEN_WIDTH, kn.MASKED_DECODE_BLOCK_T)  # as `masked_decode_attention` takes
    block_g = next_power_of_2(group)
    q, k_pool = _t(ROWS, HEADS, HEAD_DIM), _t(POOL_SLOTS, KV_HEADS, HEAD_DIM)
    r2t = _t(REQUESTS, REQ_TO_TOKEN_WIDTH, dtype=torch.int32)
    req, pos, read = _t(ROWS, dtype=torch.int64), _t(ROWS, dtype=torch.int64), _t(ROWS, dtype=torch.bool)
    reads = {"q_ptr": q, "k_ptr": k_pool, "v_ptr": k_pool, "r2t_ptr": r2t, "req_ptr": req, "pos_ptr": pos,
             "read_ptr": read, "qk_scale": HEAD_DIM ** -0.5 * kn.LOG2E, "stride_ks": k_pool.stride(0),
             "stride_kh": k_pool.stride(1), "stride_r2t": r2t.stride(0)}
    mid_o = _t(ROWS, HEADS, splits, HEAD_DIM, dtype=torch.float32)
    mid_ml = _t(ROWS, HEADS, splits, 2, dtype=torch.float32)
    slots = _t(ROWS, dtype=torch.int64)  # the cohort's packed slots (the run map)
    split = {**reads, "mid_o_ptr": mid_o, "mid_ml_ptr": mid_ml, "stride_qr": q.stride(0), "stride_qh": q.stride(1)}
    launches = [  # the served decode read gathers its slots' rows (GATHER); the bench stack's dense one does not
        _launch("masked_decode_split_kernel", {**split, "idx_ptr": slots if gather else read},
                {"GROUP": group, "BLOCK_G": kn.masked_decode_block_g(group), "HEAD_DIM": HEAD_DIM,
                 "BLOCK_T": kn.MASKED_DECODE_BLOCK_T, "SPLITS": splits, "GATHER": gather}, 4, 3)
        for gather in (True, False)
    ] + [
        _launch("masked_decode_merge_kernel",
                {"mid_o_ptr": mid_o, "mid_ml_ptr": mid_ml, "read_ptr": read, "out_ptr": q, "stride_or": q.stride(0),
                 "stride_oh": q.stride(1)},
                {"HEADS": HEADS, "HEAD_DIM": HEAD_DIM, "SPLITS": splits, "BLOCK_S": next_power_of_2(splits)}, 4, 3),
        _launch("packed_prefill_kernel",  # the served prefill read gathers its slots' rows, as the decode read
                {**reads, "idx_ptr": slots, "out_ptr": q, "slots_total": ROWS, "stride_qm": q.stride(0),
                 "stride_qh": q.stride(1), "stride_om": q.stride(0), "stride_oh": q.stride(1)},
                {"GROUP": group, "BLOCK_G": block_g, "HEAD_DIM": HEAD_DIM,
                 "BLOCK_M": kn.packed_prefill_block_m(block_g, read_tile), "BLOCK_N": read_tile.block_n,
                 "GATHER": True},
                read_tile.num_warps, read_tile.num_stages),
    ]
    for dense in (False, True):  # a pass with dense-mode rows, and without
        launches.append(cohort_maps_launch(COHORT_MAP_ROWS, dense))
    return launches


def cohort_maps_launch(rows: int, dense: bool) -> Launch:
    """The cohort maps' launch as a served layer makes it for a pass of `rows` rows (`kernels.cohort_maps`): the
    route recorded into the tape on the way, with dense-mode rows or without."""
    import torch

    from vskipper.mixed import kernels as kn

    run, idx = _t(rows, dtype=torch.bool), _t(rows, dtype=torch.int64)
    route_w, tape_w = _t(rows), _t(rows)  # the skippers' weights come in the hidden dtype, the tape's
    return _launch("cohort_maps_kernel",
                   {"run_ptr": run, "rows": rows, "run_idx_ptr": idx, "proj_idx_ptr": idx,
                    "counts_ptr": _t(2, dtype=idx.dtype), "live_ptr": run, "w_ptr": route_w, "dense_ptr": run,
                    "tape_run_ptr": run, "tape_w_ptr": tape_w, "stride_run": 1, "stride_w": 1},
                   {"BLOCK": kn.COHORT_MAPS_BLOCK, "RECORD": True, "DENSE": dense}, kn.COHORT_MAPS_WARPS, 3)


def _norm_launches() -> list[Launch]:
    """The stand-in ops (`vskipper.mixed.norms`) as the hooks launch them: RMSNorm over the hidden width with its
    residual add and without (the input layernorm of the first layer, the final norm), over head_dim without
    (Qwen3's q and k norms), SiLU-and-mul over the MLP's width, and RoPE over the query's and key's heads of a fused
    QKV projection's output (its rows that wide, as the layers split it)."""
    import torch

    from vskipper.mixed import norms

    launches = []
    for width, residuals in ((MODEL.hidden_size, (True, False)), (HEAD_DIM, (False,))):
        x, w = _t(ROWS, width), _t(width)
        block, warps = norms.norm_launch(width)
        for residual in residuals:
            launches.append(_launch("rms_norm_kernel",
                                    {"x_ptr": x, "r_ptr": x, "w_ptr": w, "y_ptr": x, "s_ptr": x, "n_cols": width,
                                     "stride_x": x.stride(0), "stride_r": x.stride(0), "stride_y": x.stride(0),
                                     "stride_s": x.stride(0), "eps": 1e-5},
                                    {"RESIDUAL": residual, "BLOCK": block}, warps, 3))
    d = MODEL.intermediate_size
    x, y = _t(ROWS, 2 * d), _t(ROWS, d)
    launches.append(_launch("silu_mul_kernel", {"x_ptr": x, "y_ptr": y, "d": d, "stride_x": x.stride(0),
                                                "stride_y": y.stride(0)},
                            {"BLOCK": norms.SILU_BLOCK}, norms.SILU_WARPS, 3))
    qkv, out = _t(ROWS, (HEADS + 2 * KV_HEADS) * HEAD_DIM), _t(ROWS, HEADS, HEAD_DIM)
    positions, cache = _t(ROWS, dtype=torch.int64), _t(REQ_TO_TOKEN_WIDTH, HEAD_DIM, dtype=torch.float32)
    launches.append(_launch("rope_kernel",
                            {"pos_ptr": positions, "cs_ptr": cache, "q_ptr": qkv, "k_ptr": qkv, "qo_ptr": out,
                             "ko_ptr": out, "q_heads": HEADS, "k_heads": KV_HEADS, "stride_pos": 1,
                             "stride_cs": cache.stride(0), "stride_qt": qkv.stride(0), "stride_qh": HEAD_DIM,
                             "stride_kt": qkv.stride(0), "stride_kh": HEAD_DIM, "stride_qot": out.stride(0),
                             "stride_qoh": HEAD_DIM, "stride_kot": out.stride(0), "stride_koh": HEAD_DIM},
                            {"NEOX": True, **norms.rope_launch(HEAD_DIM, HEAD_DIM, HEADS)}, norms.ROPE_WARPS, 3))
    return launches


def _routes_launches() -> list[Launch]:
    """RandomSkip's fused routes (`vskipper.mixed.routes`) over the routed layers, at the device run's two arms'
    thresholds (r = 1, d = 0.5: a threshold of 2^31 is a 64-bit argument; r = 0, the control: 32-bit)."""
    import torch

    from vskipper.mixed import routes
    from vskipper.skippers.random_skip import _mix, _threshold

    keys, run = _t(ROWS, dtype=torch.int64), _t(ROUTED_LAYERS, ROWS, dtype=torch.bool)
    return [_launch("random_routes_kernel",
                    {"keys_ptr": keys, "pos_ptr": keys, "valid_ptr": run, "run_ptr": run, "w_ptr": _t(ROWS),
                     "rows": ROWS, "seed_mix": _mix(0), "thr_r": _threshold(r), "thr_d": _threshold(0.5)},
                    {"LAYERS": ROUTED_LAYERS, "BLOCK": routes.ROUTES_BLOCK}, routes.ROUTES_WARPS, 3)
            for r in (1.0, 0.0)]


def _gate_launches() -> list[Launch]:
    """A trained gate's two kernels (`vskipper.mixed.router`) at the served widths: the norm and tanh over the
    router's width (the hidden size over the release's reduction factor), the decision over the hidden size,
    FlexiDepth's weighted and the hard gate's unit branch weights."""
    import torch

    from vskipper.mixed import router
    from vskipper.mixed.kernels import next_power_of_2
    from vskipper.modelspec import router_sizes

    reduced, _ = router_sizes({"hidden_size": MODEL.hidden_size, "intermediate_size": MODEL.intermediate_size})
    z, t, valid = _t(ROWS, reduced), _t(ROWS, MODEL.hidden_size), _t(ROWS, dtype=torch.bool)
    norm = _launch("gate_norm_tanh_kernel", {"z_ptr": z, "w_ptr": _t(reduced), "y_ptr": z, "n_cols": reduced,
                                             "stride_z": z.stride(0), "stride_y": z.stride(0), "eps": 1e-6},
                   {"BLOCK": next_power_of_2(reduced)}, router.GATE_WARPS, 3)
    return [norm, *(_launch("gate_decide_kernel",
                            {"t_ptr": t, "head_ptr": _t(MODEL.hidden_size), "valid_ptr": valid, "run_ptr": valid,
                             "w_ptr": _t(ROWS), "n_cols": MODEL.hidden_size, "stride_t": t.stride(0),
                             "threshold": 0.5},
                            {"WEIGHTED": weighted, "BLOCK": next_power_of_2(MODEL.hidden_size)},
                            router.GATE_WARPS, 3) for weighted in (True, False))]


def launches_for(device: Device, tile_table: Path | None = None) -> list[Launch]:
    from vskipper.mixed.tiles import tile_table_for

    table = tile_table_for(device.name, path=tile_table)
    return (_gemm_launches(table) + _attention_launches(table.read_tile) + _norm_launches() + _routes_launches()
            + _gate_launches())


def compile_launch(launch: Launch, capability: int) -> dict:
    """Compile one launch for `capability`; {'shared': bytes} or {'error': ...}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    fn = kernel_function(launch.kernel)
    constexprs = {**dict(launch.constexprs), **dict(launch.specialized)}
    signature = {**dict(launch.signature), **{name: "constexpr" for name in constexprs}}
    attrs = {(fn.arg_names.index(name),): CUDABackend.parse_attr("D") for name in launch.divisible}
    try:
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", capability, 32),
                                  options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    except Exception as exc:  # the compiler's own error, reported with the launch that raised it
        return {"error": f"{type(exc).__name__}: {str(exc).strip()[:800]}"}
    return {"shared": int(compiled.metadata.shared), **ptxas_report(compiled.asm["ptx"], capability)}


def ptxas_report(ptx: str, capability: int) -> dict:
    """Registers a thread and spilled bytes (stores) of the kernel in `ptx`, by ptxas -v (the ptxas Triton uses
    for the architecture); {} where it reports neither."""
    from triton.backends.nvidia.compiler import get_ptxas

    arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        res = subprocess.run([get_ptxas(capability).path, "-v", "--gpu-name", arch, str(src), "-o",
                              str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True, timeout=120)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spills = re.search(r"(\d+) bytes spill stores", res.stderr)
    return {**({"registers": int(regs.group(1))} if regs else {}),
            **({"spill_bytes": int(spills.group(1))} if spills else {})}


def check(device_name: str, tile_table: Path | None = None) -> dict:
    import triton

    device = lookup_device(device_name)
    capability = device.capability
    results = []
    for launch in launches_for(device, tile_table):
        result = {"launch": launch.label(), **asdict(launch), **compile_launch(launch, capability)}
        if "shared" in result and result["shared"] > device.shared_mem_per_block:
            result["error"] = (f"needs {result['shared']} bytes of shared memory, more than the "
                               f"{device.shared_mem_per_block} a block of {device.name} may use")
        results.append(result)
    return {"device": device.name, "capability": capability, "triton": triton.__version__, "launches": results,
            "failed": [r["launch"] for r in results if "error" in r]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", action="append", help=f"catalogued device (default: {', '.join(DEFAULT_DEVICES)})")
    parser.add_argument("--tile-table", type=Path, help="a table measured on the device (`vskipper tune-tiles`) "
                        "instead of the shipped one; with exactly one --device, the one it names")
    parser.add_argument("--json", type=Path, help="write every launch's result here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 replaces the kernels by the interpreter's: unset it to compile them")
    if args.tile_table is not None and len(args.device or ()) != 1:
        parser.error("--tile-table is one device's table: pass exactly one --device")
    from vskipper.mixed.tiles import TileTableError

    try:
        reports = [check(name, args.tile_table) for name in (args.device or DEFAULT_DEVICES)]
    except TileTableError as exc:
        parser.error(f"--tile-table: {exc}")
    for report in reports:
        print(f"{report['device']} (sm_{report['capability']}, triton {report['triton']}): "
              f"{len(report['launches'])} launches, {len(report['failed'])} failed")
        for r in report["launches"]:
            status = f"FAILED: {r['error']}" if "error" in r else \
                f"{r['shared']} B shared, {r.get('registers', '?')} registers" + \
                (f", SPILLS {r['spill_bytes']} B" if r.get("spill_bytes") else "")
            print(f"  {r['launch']}: {status}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(reports, indent=1) + "\n")
    return 1 if any(r["failed"] for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
