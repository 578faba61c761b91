"""What the skipper model classes share: the per-pass step slot, the SGLang side of the routed-layer body, the
model wrapper that plans each pass, and the router/adapter weight loading.

A routed layer runs, on a pass with routed rows, the routed-layer body of `vskipper.mixed.routed_layer` over
SGLang's own modules (`SGLangLayerOps`):

  every row          K and V (the K/V rows of `qkv_proj` through its linear method, one projection over the
                     batch; Qwen3: k_norm, then RoPE), written to the KV pool (`set_kv_buffer`, Invariant 1)
  RUN rows           Q (the Q rows of `qkv_proj`; Qwen3: q_norm, then RoPE, in one call with every row's K, the
                     queries in their batch rows), the RUN-masked attention read over
                     SGLang's KV pool, `o_proj`, the MLP (`gate_up_proj`/`down_proj` through their linear
                     methods, so quantization and the tensor-parallel reduction stay SGLang's)
  Project-Only rows  the adapter: no Q, no attention read, no `o_proj`, no MLP
  every row RUN      the torch execution: upstream's own attention and MLP over the whole batch (the all-RUN fast
                     path); the triton execution has no such test (it would read the device): its count-bounded
                     kernels run at the full count and the Project-Only ones return at once

Rows of dense-mode requests in a routed pass RUN with unit weight (the tape's `dense_rows`), so they compute what
the dense forward computes. The attention read is `vskipper.mixed.attention`'s over SGLang's token-level page
table (`req_to_token`): only RUN rows read. On CPU (the torch execution) decode reads with SGLang's torch-native
decode read over the RUN rows alone (`DECODE_READS`) and prefill by the pass (`PREFILL_READS['sized']`): one short
request through SGLang's backend over every row (Project-Only rows with a zero query, their outputs not read),
every other pass with SDPA per request over the RUN rows; the
triton execution (CUDA) decodes with the masked split-KV kernel, which gathers each RUN slot's query, request and
position from the batch rows itself, and prefills with the packed flash-attention over the RUN cohort's slots, or
through the host's backend where the device's table measured that faster (`PREFILL_READS`). Off CPU a routed
pass, decode or
prefill, reads no tensor value on the host (the triton execution, `CohortExecution`): cohort sizes are device
counts, and the counters are read from the tape after the forward without waiting for the device
(`Runtime.finish`).

The model files add only how their upstream layer hands the residual across the layer boundary.

(No `EntryClass`: SGLang's registry imports this module and registers nothing from it.)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from operator import is_
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_context import (
    get_attn_backend,
    get_req_to_token_pool,
    get_token_to_kv_pool,
)
from sglang.srt.model_executor.runner_utils.capture_mode import get_capture_attention_variant
from sglang.srt.models.utils import apply_qk_norm

from vskipper.mixed.attention import paged_attention, prefill_attention
from vskipper.mixed.backend import select_backend
from vskipper.mixed.plan_buffers import PlanBuffers, expand_rows
from vskipper.mixed.routed_layer import Handoff, routed_layer
from vskipper.mixed.tiles import ReadTile, TileTableError, table_label
from vskipper.mixed.warm import WarmOps, warm_routed_layer
from vskipper.sglang import active
from vskipper.sglang.part_times import PartClock, PassClock, clock_phase, cuda_events
from vskipper.sglang.replay import PHASES, ReplayLedger
from vskipper.sglang.runtime import Step, get_runtime
from vskipper.sglang.spec import (
    ENV_EXECUTION,
    ENV_PREFILL_READ,
    ENV_TILE_TABLE,
    ROUTED_GRAPH_PHASES,
    ServeConfigError,
)
from vskipper.skippers.modules import ProjectorAdapter, SkipRouter, is_router_tensor, router_sizes


@dataclass
class PassPlan:
    """What the routed layers of one pass read besides the batch, fixed on the host before the forward."""

    req_rows: torch.Tensor  # int64 [rows]: each row's request slot in SGLang's req_to_token
    context: int  # decode: the longest context of the pass (host mirror of seq_lens); prefill: unused
    # prefill, a pass of one request whose length is on the host: the query-key pairs of a causal read over its
    # whole sequence, as SGLang's torch-native backend reads it (`PREFILL_READS['sized']`); 0 elsewhere
    read_pairs: int = 0


# How RUN tokens of a mixed prefill pass read attention (each still attends to every token's K/V).
PREFILL_READS = {
    "rows": "the RUN rows alone, SDPA per request in blocks of positions, each over the request's KV pages up to "
            "its last position, or where no request spans many keys one SDPA call over every request, each padded "
            "to the most reading rows (`prefill_attention`); Project-Only rows read nothing",
    "backend": "SGLang's attention backend over every row (its extend kernel takes a causal prefix of each "
               "request, not a subset of rows): Project-Only rows enter with a zero query and their output is "
               "dropped; they compute no Q, o_proj or MLP",
    "packed": "the RUN rows alone, one count-bounded Triton flash-attention over their packed cohort slots, each "
              "over its request's KV pages up to its position (`packed_prefill_attention`): Project-Only rows "
              "read nothing; no value read on the host (the triton execution's)",
    "sized": "'backend' for a pass of one request whose causal read is small (`SIZED_READ_MACS`), 'rows' for every "
             "other pass (the torch execution's on CPU)",
}
# `PREFILL_READS['sized']`: a pass of one request reads through SGLang's backend where its causal read computes fewer
# query-key products than this (pairs over the whole sequence x heads x head_dim on this rank), the RUN rows alone
# beyond. Below it a read is its fixed costs, and the backend's extend loop, one SDPA call over every row (Project-Only
# rows with a zero query), costs a half to a third of the RUN rows' blocks; above it the RUN rows' share of the
# pairs wins. One request alone: several requests' RUN rows of short prompts share one call (`_batched_read`), which
# beat the backend's loop at every size measured (a tie at 4 x 256 tokens of the tiny model's heads). Measured on CPU with `benchmarks/prefill_read_bench.py` (half the
# rows RUN; one thread): the two reads cost alike at 2-5 M products for heads 16/4 of 64 (64-96 tokens), 32/8 of 128
# (32-48 tokens) and 4/2 of 16 (256-384 tokens); the 'rows' read cost 1.5-2.2x the backend's at 16 tokens of each,
# 0.6-0.8x at 4x the threshold.
SIZED_READ_MACS = 1 << 22


def sized_read_takes_backend(read_pairs: int, heads: int, head_dim: int) -> bool:
    """Whether `PREFILL_READS['sized']` reads a pass through SGLang's backend: one request (`PassPlan.read_pairs`,
    0 for several) whose causal read computes fewer than `SIZED_READ_MACS` query-key products on this rank."""
    return 0 < read_pairs * heads * head_dim < SIZED_READ_MACS


# How RUN rows of a mixed decode pass read attention in the torch execution (the triton execution has its masked
# split-KV kernel).
DECODE_READS = {
    "masked": "one padded read of every RUN row bounded by the planned context, masked per row: no value read on "
              "the host",
    "backend": "SGLang's torch-native backend's own decode read over the RUN rows alone (the pass's batch narrowed "
               "to their requests and lengths): the kernel a dense decode pass runs, per RUN row (CPU)",
}


@dataclass(frozen=True)
class CohortExecution:
    """How this process's routed layers run a mixed pass, in both phases.

    decode   triton: on CUDA (or under TRITON_INTERPRET=1, for tests): the count-bounded cohort GEMMs of
             `vskipper.mixed.kernels` with tiles from the device's table (or, where the table measured cuBLAS
             faster at a memory-bound capacity, their gathered form: attested as `gathered`), the RUN-masked
             decode read (`masked_decode_attention`) over SGLang's KV pool; every kernel keeps its launch shape,
             no host read
             torch: the cohort execution over packed rows (CPU; and wherever a layer's MLP has no plain weight view)
    prefill  the same execution as decode. triton: the same count-bounded GEMMs over the pass's tokens (cohort
             sizes stay device values, cohorts packed by a device prefix sum, no all-RUN test on the host), the
             attention read over the RUN cohort's packed slots alone (`PREFILL_READS['packed']`; 'backend' reads
             through SGLang's backend instead, Project-Only rows with a zero query: both need no host value; the
             backend where the device's table measured the packed read no faster than the backend's read of every
             row, or SDPA's where it did not time the backend's; `prefill_read_why` says what it weighed).
             torch: packed cohorts by `nonzero` (a host wait per layer on a GPU), its read one of
             `PREFILL_READS`: `sized` on CPU (a short prompt's through the backend, every other pass's RUN rows
             alone), `backend` on CUDA (the per-request SDPA with an explicit mask is far slower there than
             SGLang's extend kernel, whose wasted reads of Project-Only rows cost a few percent of a prefill)
    """

    decode: str
    tiles: Any = None  # a TileTable (CUDA), None: the interpreter's tile
    reason: str = ""  # why the triton execution was not taken, where it was not
    prefill_read: str = "rows"
    prefill_read_why: str = ""  # what the triton execution's prefill read was chosen on, where the table timed it
    decode_read: str = "masked"  # the torch execution's decode read (`DECODE_READS`)

    def __post_init__(self) -> None:
        if self.prefill_read not in PREFILL_READS:
            raise ValueError(f"prefill_read must be one of {sorted(PREFILL_READS)}, got {self.prefill_read!r}")
        if self.decode_read not in DECODE_READS:
            raise ValueError(f"decode_read must be one of {sorted(DECODE_READS)}, got {self.decode_read!r}")
        if self.decode == "triton" and self.prefill_read in ("rows", "sized"):
            raise ValueError("the triton execution prefills with prefill_read 'packed' or 'backend' (the 'rows' "
                             "read groups rows by request on the host)")

    @property
    def prefill(self) -> str:
        """The same execution as decode's (attested apart)."""
        return self.decode

    def attestation(self) -> dict[str, Any]:
        tiles = getattr(self.tiles, "source", None) if self.tiles is not None else (
            "interpreter tile" if self.decode == "triton" else None)
        read = {"decode_read": self.decode_read} if self.decode == "torch" else {}
        if self.tiles is not None:  # the packed read's launch: the table's (measured) or the kernel's default
            read["prefill_read_tile"] = {**asdict(self.tiles.read_tile), "measured": self.tiles.read is not None}
            # the slot counts at which an operation runs in the gathered cuBLAS form instead of its tile
            read["gathered"] = self.tiles.gathered_ranges()
            # where the two cohort FFNs launch apart as the table says (measured faster, or the grouped launch
            # failed when tuned); they launch apart where an FFN GEMM serves gathered too (`gathered`)
            read["ffn_apart"] = self.tiles.apart_ranges()
            # where an operation serves split K (a reduce launch after it): not where it serves gathered; the
            # FFNs' down GEMMs where the two launch grouped as the MLP's down tile splits
            read["split_k"] = self.tiles.split_ranges()
            # what the tuner measures that this table holds no measurement of (a table an older tuner wrote)
            read["tiles_lack"] = self.tiles.lacks()
        return {"decode": self.decode, **read, "prefill": self.prefill, "prefill_read": self.prefill_read,
                **({"prefill_read_why": self.prefill_read_why} if self.prefill_read_why else {}),
                "tiles": tiles, **({"why": self.reason} if self.reason else {})}


TORCH_EXECUTION = CohortExecution("torch")


def triton_blocker(layer) -> str | None:
    """Why the triton execution cannot run this routed layer, or None. The kernels read the MLP's gate/up/down
    weights and the Q rows of qkv_proj and o_proj directly, so they need unquantized, unpacked weights, no o_proj
    bias, and the whole MLP and o_proj on this rank (a TP rank's partial sum would need a reduction the kernels'
    in-place scatter does not do)."""
    mlp, attn = layer.mlp, layer.self_attn
    for name, module in (("mlp.gate_up_proj", mlp.gate_up_proj), ("mlp.down_proj", mlp.down_proj),
                         ("self_attn.qkv_proj", attn.qkv_proj), ("self_attn.o_proj", attn.o_proj)):
        if not kv_only_supported(module):
            return f"layer {layer.layer_id}: {name} is quantized or packed"
    if getattr(attn.o_proj, "bias", None) is not None:
        return f"layer {layer.layer_id}: self_attn.o_proj has a bias (the scattered o_proj adds none)"
    for name, module in (("MLP", mlp.down_proj), ("attention", attn.o_proj)):
        if getattr(module, "tp_size", 1) > 1:
            return f"layer {layer.layer_id}: the {name} is split over {module.tp_size} tensor-parallel ranks"
    head_dim = attn.head_dim
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"layer {layer.layer_id}: head_dim {head_dim} is not a power of two >= 16"
    return None


def given_table_unused(execution: CohortExecution, tile_table: Path | None) -> str | None:
    """What the attestation says of a tile table handed to a server whose execution holds none (the torch
    execution, or the interpreter's tile): that it went unused; None where it serves or none was given."""
    if tile_table is None or execution.tiles is not None:
        return None
    why = "the torch execution" if execution.decode == "torch" else "the interpreter's tile"
    return f"{table_label(tile_table)} given, unused: {why} serves"


def served_prefill_backend() -> str | None:
    """The prefill attention backend this process's SGLang serves with as configured (`--attention-backend`, or
    `--prefill-attention-backend`, which wins); None where none was named (SGLang picks one as it builds) or no
    server configuration is published (a model built outside a server)."""
    from sglang.srt.runtime_context import attention_backends

    try:
        return attention_backends()[0]
    except ValueError:  # "config namespace 'exec' not published"
        return None


def cohort_execution(layers, device: torch.device, requested: str = "auto",
                     tile_table: Path | None = None, attention_backend: str | None = None) -> CohortExecution:
    """The execution for these routed layers on `device`: `auto` takes triton on CUDA where every layer allows it
    (`triton_blocker`), torch elsewhere. The triton execution prefills with the packed read (through the backend
    where the table measured the packed read no faster than every row's read by `attention_backend`, the server's
    prefill backend, or by SDPA where the table did not time that one: `TileTable.prefill_read`), its
    GEMMs and that read tiled by the table at `tile_table` (measured on this device) or else the one shipped for
    it; the torch one reads through SGLang's attention backend on CUDA and by the pass's size on CPU, and decodes with
    SGLang's torch-native read over the RUN rows on CPU, the masked one elsewhere."""
    if select_backend(requested, device) == "triton":
        why = next((why for why in map(triton_blocker, layers) if why is not None), None)
        if why is None:
            from vskipper.mixed.kernels import device_tile_table

            if device.type != "cuda":  # the interpreter (tests): the packed read
                return CohortExecution("triton", None, prefill_read="packed")
            table = device_tile_table(device, tile_table)
            read, read_why = table.prefill_read(attention_backend)
            return CohortExecution("triton", table, prefill_read=read, prefill_read_why=read_why)
    else:
        why = ""
    return CohortExecution("torch", reason=why, prefill_read="backend" if device.type == "cuda" else "sized",
                           decode_read="backend" if device.type == "cpu" else "masked")


def asked_prefill_read(execution: CohortExecution, asked: str) -> CohortExecution:
    """`execution` prefilling with the read `asked` (`ENV_PREFILL_READ`) in place of the table's choice, which
    `prefill_read_why` keeps; as it is where `asked` is auto. Only the triton execution takes one: refused by name
    for the torch execution."""
    if asked == "auto":
        return execution
    if execution.decode != "triton":
        raise ServeConfigError(f"{ENV_PREFILL_READ}={asked}: the triton execution's prefill read, and the routed "
                               f"layers run the torch execution ({execution.reason or 'not triton'})")
    chose = f"{execution.prefill_read}" + (f" ({execution.prefill_read_why})" if execution.prefill_read_why else "")
    return replace(execution, prefill_read=asked,
                   prefill_read_why=f"{ENV_PREFILL_READ}={asked}, in place of the execution's choice: {chose}")


@dataclass
class PreparedPass:
    """A pass decided before its forward: SGLang's batch it belongs to, the step (None: not planned, e.g. a
    graph-capture batch), and where routed, the plan whose per-row fields live in the model's `PlanBuffers`
    (an eager pass's request slots: where SGLang's lie, `reads_in_place`)."""

    forward_batch: Any
    step: Step | None
    plan: PassPlan | None
    used: bool = False  # a forward has run it


class StepSlot:
    """The current forward pass's `Step` and `PassPlan`, set by the model around its forward and read by its
    routed layers; the pass prepared before the forward; and the model's cohort execution."""

    def __init__(self) -> None:
        self.step: Step | None = None
        self.plan: PassPlan | None = None
        self.prepared: PreparedPass | None = None
        self.runtime = None
        self.execution: CohortExecution = TORCH_EXECUTION
        self.part_clock: PartClock | None = None  # the measurement mode's clock (`vskipper.sglang.part_times`)
        self.fused_gate = False  # a trained gate's routes from `vskipper.mixed.router` (the triton execution)
        self.prefill_graphs = None  # `vskipper.sglang.prefill_graphs.PrefillGraphs`, where the spec asks for them


def plan_pass(forward_batch, rows: int, context: int | None = None) -> PassPlan:
    """Each row's request slot and the decode context bound (`context` where the caller read it already), from
    SGLang's batch and its host mirrors. A prefill batch whose request slots are on the host (a host mirror,
    `req_pool_indices_cpu`, or a CPU batch) and has its extend lengths there (`extend_seq_lens_cpu`) gets its
    slots expanded on the host (off it, the plan buffers then take the whole plan in one copy); elsewhere they are
    expanded on the device. A decode batch's slots are SGLang's own."""
    if forward_batch.forward_mode.is_decode():
        if context is None:
            lens = forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens
            context = int(lens.max())
        return PassPlan(forward_batch.req_pool_indices, context)
    slots = getattr(forward_batch, "req_pool_indices_cpu", None)
    if slots is None and forward_batch.req_pool_indices.device.type == "cpu":
        slots = forward_batch.req_pool_indices
    extend = getattr(forward_batch, "extend_seq_lens_cpu", None)
    lens = getattr(forward_batch, "seq_lens_cpu", None)
    pairs = 0
    if lens is not None and len(lens) == 1:  # one request: its causal read's pairs (`PREFILL_READS['sized']`)
        length = int(lens.item())
        pairs = length * (length + 1) // 2
    if slots is not None and extend is not None:
        return PassPlan(expand_rows(slots.numpy(), extend, rows), 0, pairs)
    return PassPlan(torch.repeat_interleave(forward_batch.req_pool_indices, forward_batch.extend_seq_lens,
                                            output_size=rows), 0, pairs)


def reads_in_place(req_rows: torch.Tensor, device: torch.device, rows: int) -> bool:
    """Whether an eager pass's kernels can read these request slots where they lie, as the plan buffers' field
    would hold them: on the buffers' device, int64, contiguous, 16-byte aligned (as the kernels reading the
    slots are compiled to expect), one a row. Otherwise the buffers take them."""
    return (req_rows.device == device and req_rows.dtype == torch.int64 and req_rows.shape == (rows,)
            and req_rows.is_contiguous() and req_rows.data_ptr() % 16 == 0)


def in_batch_slots(q: torch.Tensor, rows: torch.Tensor, n: int, reads: torch.Tensor | None = None) -> torch.Tensor:
    """The queries q [len(rows), w] of batch rows `rows` placed in their slots of a pass of n rows, zeros elsewhere
    (a zero query reads uniformly, never 0/0). With `reads` (packed cohort slots, bool) a slot outside it lands in
    one row past the pass, which is dropped: no value is read on the host."""
    to = rows if reads is None else torch.where(reads, rows, n)
    return q.new_zeros(n + 1, q.shape[1]).index_copy_(0, to, q)[:n]


def kv_only_supported(qkv_proj) -> bool:
    """Whether a fused `qkv_proj`'s linear method has a row view of its K/V rows (unquantized, unpacked weights).
    Elsewhere (quantized or packed weights) Project-Only rows run the whole `qkv_proj` and drop Q (attested)."""
    # SGLang sets `use_intel_amx_backend` on the module itself (`use_intel_amx_backend` reads it with a default:
    # nn.Module's failed lookup first, a few microseconds a pass)
    return type(qkv_proj.quant_method) is UnquantizedLinearMethod \
        and not qkv_proj.__dict__.get("use_intel_amx_backend", False)


class _Kept:
    """What `build` made of the objects at `paths` from `root` (dotted attribute paths over submodules, parameters
    and plain attributes), kept while every step of every path still holds the same object and every tensor
    reached lies at the same storage. A step is checked where nn.Module keeps it (its submodules', parameters' or
    buffers' table, or the instance's own dict): a dict lookup, where nn.Module's `__getattr__` costs the host
    about a microsecond (a routed layer looked up some thirty a pass). A reload in place shows through the views;
    one into new storage, or a module or parameter set anew, builds them anew."""

    __slots__ = ("tables", "names", "objects", "tensors", "storage", "value")

    def __init__(self, root, paths: tuple[str, ...], build: Callable[..., Any]) -> None:
        links: dict[tuple[int, str], tuple[dict, str, Any]] = {}
        ends = []
        for path in paths:
            obj = root
            for name in path.split("."):
                table = _table(obj, name)
                obj = table.get(name)
                links[(id(table), name)] = (table, name, obj)
                if obj is None:  # absent (a Llama layer's q_norm), or a parameter registered as None (a bias)
                    break
            ends.append(obj)
        self.tables, self.names, self.objects = zip(*links.values(), strict=True)
        self.tensors = tuple(t for t in ends if isinstance(t, torch.Tensor))
        self.storage = [t.data_ptr() for t in self.tensors]
        self.value = build(*ends)

    def holds(self) -> bool:
        # the loops in C (map): a layer's two dozen steps and seven tensors in about a microsecond
        return all(map(is_, map(dict.get, self.tables, self.names), self.objects)) \
            and list(map(torch.Tensor.data_ptr, self.tensors)) == self.storage


def _table(owner, name: str) -> dict:
    """The dict `owner.name` is looked up in (for an absent name, the one it would be added to as a submodule)."""
    if isinstance(owner, torch.nn.Module):
        for table in (owner._modules, owner._parameters, owner._buffers):
            if name in table:
                return table
    if name in owner.__dict__:
        return owner.__dict__
    if hasattr(owner, name):
        raise TypeError(f"{type(owner).__name__}.{name} is no submodule, parameter or instance attribute: it "
                        f"cannot be kept")
    return owner._modules if isinstance(owner, torch.nn.Module) else owner.__dict__


def kept(owner, key: Any, paths: tuple[str, ...], build: Callable[..., Any]) -> Any:
    """`build(*objects at paths)`, made once and kept on `owner` under `key` while those objects stay (`_Kept`): a
    routed layer asks for its modules and weight views at every pass, where looking them up and slicing them anew
    costs the host more than a launch."""
    store = owner.__dict__.setdefault("_vskipper_kept", {})
    held = store.get(key)
    if held is None or not held.holds():
        held = store[key] = _Kept(owner, paths, build)
    return held.value


def row_projection(qkv_proj, rows: slice, u: torch.Tensor) -> torch.Tensor:
    """The output columns `rows` of `qkv_proj(u)` (its Q rows, or its K/V rows) through its own linear method,
    from a view of those weight rows (made once, `kept`): only where `kv_only_supported`."""
    layer, rows_bias = kept(qkv_proj, ("rows", rows.start, rows.stop), ("weight", "bias"), lambda weight, bias: (
        SimpleNamespace(weight=weight[rows]), None if bias is None else bias[rows]))
    return qkv_proj.quant_method.apply(layer, u, rows_bias)


class LayerParts(NamedTuple):
    """A routed layer's modules and weight views as its body reads them each pass (`layer_parts`)."""

    attn: Any  # self_attn
    qkv_proj: Any
    rotary_emb: Any
    radix: Any  # self_attn.attn: SGLang's attention layer over the engine's backend
    q_norm: Any  # Qwen3's per-head norms (None elsewhere)
    k_norm: Any
    post_attention_layernorm: Any
    projector: ProjectorAdapter
    router: SkipRouter
    # for the count-bounded kernels (the triton execution only, where `triton_blocker` found plain weights on one
    # rank): (W_q, Q's bias or None, W_o), (gate, up, down) and the adapter's (gate_proj, down_proj, up_proj)
    attention: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None
    mlp: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    adapter: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


_PART_PATHS = ("self_attn", "self_attn.qkv_proj", "self_attn.rotary_emb", "self_attn.attn", "self_attn.q_norm",
               "self_attn.k_norm", "post_attention_layernorm", "router_proj", "router", "self_attn.qkv_proj.weight",
               "self_attn.qkv_proj.bias", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight",
               "router_proj.gate_proj.weight", "router_proj.down_proj.weight", "router_proj.up_proj.weight")


def _parts(attn, qkv_proj, rotary_emb, radix, q_norm, k_norm, post_norm, projector, router, qkv, bias, o, gate_up,
           down, p_gate, p_down, p_up) -> LayerParts:
    q = attn.q_size
    attention = None if qkv is None or o is None else (qkv[:q], None if bias is None else bias[:q], o)
    mlp = None if gate_up is None or down is None else (*gate_up.chunk(2, dim=0), down)
    return LayerParts(attn, qkv_proj, rotary_emb, radix, q_norm, k_norm, post_norm, projector, router, attention,
                      mlp, (p_gate, p_down, p_up))


def layer_parts(layer) -> LayerParts:
    """`layer`'s `LayerParts`, made once and kept while its modules and weights stay (`kept`)."""
    return kept(layer, "parts", _PART_PATHS, _parts)


class SGLangLayerOps:
    """`LayerOps` over an SGLang decoder layer (Llama or Qwen3) for one pass (`vskipper.mixed.routed_layer`)."""

    def __init__(self, layer, positions: torch.Tensor, forward_batch, plan: PassPlan, backend: str = "torch",
                 prefill_read: str = "rows", decode_read: str = "masked", read_tile: ReadTile | None = None,
                 parts: LayerParts | None = None) -> None:
        self.layer, self.positions, self.fb, self.plan = layer, positions, forward_batch, plan
        self.parts = parts = layer_parts(layer) if parts is None else parts
        self.backend, self.prefill_read, self.decode_read = backend, prefill_read, decode_read
        self.read_tile = read_tile  # the packed prefill read's launch on a GPU (the device table's)
        self.written: tuple[torch.Tensor, torch.Tensor] | None = None  # every row's K/V of this pass, once written
        self.q_all: torch.Tensor | None = None  # every row's Q, where `kv` ran the whole qkv_proj (no row view)
        self.q_slotted: torch.Tensor | None = None  # the queries `q_kv` handed over in batch slots (a backend read)
        self.attn = parts.attn
        self.post_attention_layernorm = parts.post_attention_layernorm
        self.projector = parts.projector
        # a prefill read through SGLang's backend reads every batch row's query (the others gather the RUN rows')
        self.reads_every_query = not forward_batch.forward_mode.is_decode() and prefill_read == "backend"

    def _positions(self, rows: torch.Tensor | None) -> torch.Tensor:
        """The positions of batch rows `rows`, for the reads of packed rows (one read a layer asks for them)."""
        return self.positions if rows is None else self.positions.index_select(0, rows)

    def attention(self, u: torch.Tensor) -> torch.Tensor:
        return self.attn(positions=self.positions, hidden_states=u, forward_batch=self.fb)

    def kv(self, u: torch.Tensor):
        k, v = self._kv(u)
        # The rotary embedding rotates a query and a key: one head of k stands in for the query it never needs.
        _, k = self.parts.rotary_emb(self.positions, k[:, : self.attn.head_dim].clone(), k)
        return k, v

    def _kv(self, u: torch.Tensor, normed: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's k (Qwen3: normed, unless `normed` is False; not rotated) and v: views of the K/V
        projection's rows, strided as upstream's views of `qkv_proj`'s output are (RoPE, k_norm and the KV write
        take them so): no copy."""
        a, qkv_proj, k_norm = self.attn, self.parts.qkv_proj, self.parts.k_norm
        if kv_only_supported(qkv_proj):
            kv = row_projection(qkv_proj, slice(a.q_size, None), u)
        else:  # no row view: the whole qkv_proj, its Q kept for `q_kv` (computed and dropped for other rows)
            qkv = qkv_proj(u)[0]
            self.q_all, kv = qkv[:, : a.q_size], qkv[:, a.q_size:]
        k, v = kv.split([a.kv_size, a.kv_size], dim=-1)
        if normed and k_norm is not None:  # Qwen3: per-head k_norm before RoPE
            return k_norm(k.reshape(-1, a.head_dim)).view(k.shape), v
        return k, v

    def q_kv(self, u: torch.Tensor, rows: torch.Tensor):
        a = self.attn
        k, v = self._kv(u)
        q = row_projection(self.parts.qkv_proj, slice(None, a.q_size), u.index_select(0, rows)) \
            if self.q_all is None else self.q_all.index_select(0, rows)
        # One rotary call for both: the rows' queries in their batch slots (zeros in the others, rotated to zeros
        # and never read) beside every row's key. A read through SGLang's backend takes them there as they are.
        q, k = self.parts.rotary_emb(self.positions, in_batch_slots(self._q_norm(q), rows, u.shape[0]), k)
        if self._backend_prefill():
            self.q_slotted = q
            return q, k, v
        return q.index_select(0, rows), k, v

    def batch_q_kv(self, u: torch.Tensor, q: torch.Tensor):
        q, k, v = self._qk_normed(u, q)
        q, k = self.parts.rotary_emb(self.positions, q, k)
        return q, k, v

    def _qk_normed(self, u: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v) before RoPE, q with as many rows as the pass: Qwen3's q_norm and k_norm as upstream's layer
        applies them (`apply_qk_norm`: in place, with no copy of k, where SGLang's fused kernel serves), other
        families' q and k as they are."""
        parts = self.parts
        k, v = self._kv(u, normed=False)
        if parts.k_norm is not None:
            q, k = apply_qk_norm(q, k, parts.q_norm, parts.k_norm, self.attn.head_dim)
        return q, k, v

    def _q_norm(self, q: torch.Tensor) -> torch.Tensor:
        """Qwen3's per-head q_norm (before RoPE); other families' q as it is."""
        q_norm = self.parts.q_norm
        return q if q_norm is None else q_norm(q.reshape(-1, self.attn.head_dim)).view(q.shape)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        a = self.attn
        k, v = k.view(-1, a.num_kv_heads, a.head_dim), v.view(-1, a.num_kv_heads, a.head_dim)
        get_token_to_kv_pool().set_kv_buffer(self.parts.radix, KVWriteLoc(self.fb.out_cache_loc), k, v)
        self.written = (k, v)  # a backend read hands them to SGLang's extend kernel, which takes them as operands

    def read(self, q: torch.Tensor, rows: torch.Tensor | None, reads: torch.Tensor | None = None) -> torch.Tensor:
        a = self.attn
        pool = get_token_to_kv_pool()
        lid = self.parts.radix.layer_id
        if self._backend_prefill():  # every batch row's query: a packed q goes into its batch slots
            slotted = rows is None or q is self.q_slotted  # as `q_kv` handed it
            return self._backend_read(q if slotted else in_batch_slots(q, rows, self.positions.shape[0], reads),
                                      rows, reads)
        req = self.plan.req_rows if rows is None else self.plan.req_rows.index_select(0, rows)
        qh = q.view(q.shape[0], a.num_heads, a.head_dim)
        if self.fb.forward_mode.is_decode():  # `DECODE_READS`
            if self.decode_read == "backend":
                return self._backend_decode_read(q, rows)
            read, kwargs = paged_attention, {"length": self.plan.context}
        else:
            read, kwargs = prefill_attention, {}
        out = read(qh, pool.get_key_buffer(lid), pool.get_value_buffer(lid), get_req_to_token_pool().req_to_token,
                   req, self._positions(rows), self.parts.radix.scaling, reads, **kwargs)
        return out.reshape(q.shape[0], -1)

    def _backend_prefill(self) -> bool:
        return not self.fb.forward_mode.is_decode() and self.reads_through_backend()

    def reads_through_backend(self) -> bool:
        """Whether this prefill pass's read goes through SGLang's backend: `backend`, or `sized` for a pass of one
        short request (`SIZED_READ_MACS`)."""
        if self.prefill_read == "sized":
            return sized_read_takes_backend(self.plan.read_pairs, self.attn.num_heads, self.attn.head_dim)
        return self.prefill_read == "backend"

    def read_cohort(self, q: torch.Tensor, rows: torch.Tensor, reads: torch.Tensor) -> torch.Tensor:
        """The masked decode read, or the packed prefill read, over the cohort's packed slots (launch shape: the
        pass's rows), each slot's query, request slot and position gathered by the kernel from the batch rows;
        slots outside `reads` read nothing. Or the prefill read through SGLang's backend (`reads_every_query`),
        over every batch row's query, its outputs in batch rows (o_proj gathers the RUN rows')."""
        from vskipper.mixed.kernels import masked_decode_attention, packed_prefill_attention

        if self.reads_every_query:
            return self._backend_read(q, None)
        a = self.attn
        pool = get_token_to_kv_pool()
        lid = self.parts.radix.layer_id
        args = (q.view(q.shape[0], a.num_heads, a.head_dim), pool.get_key_buffer(lid), pool.get_value_buffer(lid),
                get_req_to_token_pool().req_to_token, self.plan.req_rows, self.positions, reads,
                self.parts.radix.scaling)
        if self.fb.forward_mode.is_decode():
            out = masked_decode_attention(*args, idx=rows)
        else:  # `PREFILL_READS['packed']`
            out = packed_prefill_attention(*args, tile=self.read_tile, idx=rows)
        return out.reshape(rows.shape[0], -1)

    def _backend_decode_read(self, q: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The decode read of `DECODE_READS['backend']`: SGLang's attention layer and torch-native backend over the
        pass's batch narrowed to the RUN rows (their request slots and lengths; every row's K/V is already in the
        pool). Only a backend that plans nothing per batch can read a narrowed batch: the torch-native one."""
        backend = get_attn_backend()
        if not isinstance(backend, TorchNativeAttnBackend):
            raise RuntimeError(f"decode_read 'backend' reads through SGLang's torch-native attention backend, not "
                               f"{type(backend).__name__}")
        fb = self.fb
        if rows is not None:
            fb = copy.copy(fb)
            for name in ("req_pool_indices", "seq_lens", "out_cache_loc"):
                setattr(fb, name, getattr(self.fb, name).index_select(0, rows))
            if getattr(self.fb, "seq_lens_cpu", None) is not None:
                fb.seq_lens_cpu = self.fb.seq_lens_cpu.index_select(0, rows.cpu())
        return self.parts.radix(q, None, None, fb, save_kv_cache=False)

    def _backend_read(self, q: torch.Tensor, rows: torch.Tensor | None,
                      reads: torch.Tensor | None = None) -> torch.Tensor:
        """The prefill read through SGLang's attention backend (`PREFILL_READS['backend']`): every batch row's query
        q [n, heads * hd] (rows outside `rows` zero) over the K/V this pass wrote; the outputs of batch rows
        `rows`, in their order, zeros for slots outside `reads` (every row's outputs where `rows` is None)."""
        if self.written is None:
            raise RuntimeError("the backend read runs after the pass's K/V is written (write_kv)")
        k, v = self.written
        out = self.parts.radix(q, k, v, self.fb, save_kv_cache=False)
        if rows is None:
            return out
        out = out.index_select(0, rows)
        return out if reads is None else torch.where(reads.view(-1, 1), out, 0)

    def o_proj(self, a: torch.Tensor) -> torch.Tensor:
        return self.attn.o_proj(a)[0]

    def mlp(self, v: torch.Tensor) -> torch.Tensor:
        return self.layer.mlp(v)

    def mlp_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _plain(self.parts.mlp, "MLP")

    def attention_weights(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        return _plain(self.parts.attention, "attention")

    def projector_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.parts.adapter


def _plain(weights: tuple | None, what: str) -> tuple:
    if weights is None:
        raise RuntimeError(f"the layer's {what} has no plain weights for the count-bounded kernels (triton_blocker)")
    return weights


def mlp_weights(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of an SGLang layer's MLP gate and up rows of `gate_up_proj` and of `down_proj` (the triton execution
    only, where `triton_blocker` found plain weights on one rank)."""
    return _plain(layer_parts(layer).mlp, "MLP")


def attention_weights(layer) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A view of the Q rows of an SGLang layer's `qkv_proj` (and of its bias), and `o_proj`'s weight (the triton
    execution only, where `triton_blocker` found plain weights on one rank and no o_proj bias)."""
    return _plain(layer_parts(layer).attention, "attention")


def warm_layer(layer, execution: CohortExecution, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
    """Compile the triton execution's launches before serving (`vskipper.mixed.warm`): the routed body, its cohort
    maps with it, over `layer`'s own weights at a pass in each range of the execution's tiles (on the GPU up to
    2,049 rows: some hundred MB of activations, handed back before the engine sizes its KV pool). A launch
    compiled while serving would hold every pass behind it."""
    ops = WarmOps(attention_weights(layer), mlp_weights(layer), layer.router_proj, layer.post_attention_layernorm,
                  layer.self_attn.kv_size, execution.prefill_read == "backend")
    warm_routed_layer(ops, hidden, dtype, device, execution.tiles)
    if device.type == "cuda":  # its activations handed back: the engine sizes its KV pool from what is free next
        torch.cuda.empty_cache()


def project_only_q(qkv_projs, execution: CohortExecution) -> str:
    """What a Project-Only row's Q costs, as attested."""
    torch_path = "skipped: K/V rows of qkv_proj" if all(kv_only_supported(q) for q in qkv_projs) \
        else "computed and dropped: a quantized or packed qkv_proj has no K/V row view"
    return "skipped: the RUN cohort's count-bounded Q GEMM" if execution.decode == "triton" else torch_path


def graph_backends() -> dict[str, str]:
    """The CUDA graph backend SGLang runs each phase with ('disabled': eager; also where no configuration is
    published, outside a server)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase
    from sglang.srt.runtime_context import get_exec

    try:
        config = get_exec().graph.cuda_graph_config
    except ValueError:
        config = None
    return {phase: getattr(config, phase).backend if config is not None else Backend.DISABLED
            for phase in Phase.ALL}


def refuse_graph_replay(arm, backends: dict[str, str]) -> None:
    """A replayed graph never calls the model's Python forward: a routed pass would run whatever the graph
    captured. SGLang captures a routed variant for decode only (`ROUTED_GRAPH_PHASES`, `SkipperGraphVariants`),
    so an arm that routes another phase serves it eagerly and refuses to start with that phase's graphs on."""
    for phase in arm.routed_phases:
        backend = backends.get(phase, "disabled")
        if phase not in ROUTED_GRAPH_PHASES and backend != "disabled":
            raise ServeConfigError(f"arm {arm.name!r} routes {phase}, but SGLang would replay {phase} passes from "
                                   f"CUDA graphs (--cuda-graph-backend-{phase} {backend}), which hold no routed "
                                   f"variant: serve it with --cuda-graph-backend-{phase} disabled")


# SGLang's attention graph variants (the decode graph runner's plugin point): the labels a skipper model's decode
# graphs are captured under, one graph of each per captured batch size.
DENSE_VARIANT = "vskipper-dense"
ROUTED_VARIANT = "vskipper-routed"


class SkipperGraphVariants:
    """The decode graph runner's `attention_graph_variants` for a skipper model whose arm routes decode: it
    captures a dense and a routed graph at every batch size, and each pass replays the variant of its mode (the
    pass is decided before the runner looks, `SkipperCausalLM.prepare_pass`)."""

    capture_labels = (DENSE_VARIANT, ROUTED_VARIANT)

    def __init__(self, model) -> None:
        self.model = model

    def select(self, forward_batch) -> str:
        return ROUTED_VARIANT if self.model.pass_is_routed(forward_batch) else DENSE_VARIANT


def routed_graph_blocker(execution: CohortExecution, device: torch.device) -> str | None:
    """Why a routed decode graph cannot be captured here, or None: capture needs the triton execution on CUDA
    (the torch execution packs cohorts with `nonzero`, whose sizes are read on the host)."""
    if device.type != "cuda":
        return f"no CUDA graphs on {device.type}"
    if execution.decode != "triton":
        return f"the routed layers decode with the torch execution ({execution.reason or 'not triton'})"
    return None


def _router_config(config) -> dict:
    return {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "router_reduction_factor": getattr(config, "router_reduction_factor", 16),
            "proj_reduction_factor": getattr(config, "proj_reduction_factor", 16)}


class RoutedLayerMixin:
    """For a routed layer class placed before its upstream SGLang decoder layer: the checkpoint's `router` and
    `router_proj` modules, and the routed-layer body over the layer's own norms, attention and MLP."""

    def __init__(self, config, layer_id: int, slot: StepSlot, **upstream) -> None:
        super().__init__(config=config, layer_id=layer_id, **upstream)
        r, m = router_sizes(_router_config(config))
        self.layer_id = layer_id
        self.router = SkipRouter(config.hidden_size, r, config.rms_norm_eps)
        self.router_proj = ProjectorAdapter(config.hidden_size, m)
        self._slot = slot

    def routed_step(self) -> Step | None:
        """This pass's step when it has routed rows; None: the upstream (dense) forward runs."""
        step = self._slot.step
        return step if step is not None and step.routed else None

    def mixed_depth(self, step: Step, positions: torch.Tensor, x: torch.Tensor, forward_batch,
                    u: torch.Tensor | None = None, x_owned: bool = False) -> Handoff:
        """The layer output y [rows, d], as the body's `Handoff`, from its complete input x (the residual stream
        at the layer) and u = LN1 x (computed here when not given). `x_owned`: no one else holds x (the residual
        the Llama layer's add-norm formed; the sum the Qwen3 layer's fold formed, or a routed layer's y), so the
        body may update it in place (`routed_layer`)."""
        if u is None:
            u = self.input_layernorm(x)
        graphs = self._slot.prefill_graphs
        if graphs is not None and graphs.active is not None:  # this pass replays its routed layers
            return graphs.layer(self, x, u, layer_parts(self))
        execution = self._slot.execution
        triton = execution.decode == "triton"  # one execution for both phases
        parts = layer_parts(self)
        if triton and self._slot.fused_gate:  # a trained gate's route in two launches around its GEMMs
            from vskipper.mixed.router import gate_route

            route = gate_route(step.skipper, u, step.state, parts.router)
        else:
            router = parts.router if step.skipper.requires_router_weights else None
            route = step.skipper.route(self.layer_id, u, step.state, router)
        if triton:  # the tape's record and the cohort maps in one launch
            cohorts = step.builder.record_and_build(step.tape, self.layer_id, route, step.dense_rows)
        else:
            step.tape.record(self.layer_id, route, step.dense_rows)
        run, weights = step.tape.layer(self.layer_id, step.rows)
        ops = SGLangLayerOps(self, positions, forward_batch, self._slot.plan, "triton" if triton else "torch",
                             prefill_read=execution.prefill_read, decode_read=execution.decode_read,
                             read_tile=execution.tiles.read_tile if execution.tiles is not None else None,
                             parts=parts)
        if self._slot.part_clock is not None:  # the read the body takes, whichever it is, is the clock's `read`
            ops.read = self._slot.part_clock.timed(ops.read, "read")
            ops.read_cohort = self._slot.part_clock.timed(ops.read_cohort, "read")
        if triton:
            return routed_layer(ops, x, u, run, weights, "triton", cohorts, execution.tiles, x_owned=x_owned)
        return routed_layer(ops, x, u, run, weights, x_owned=x_owned)


def split_router_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         loaded: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Load the router/adapter tensors by their checkpoint names; pass every other tensor through.

    Upstream loaders would mangle them (`router_proj.gate_proj` looks like a stacked MLP shard), so they never
    reach them."""
    params = dict(model.named_parameters())
    for name, tensor in weights:
        if not is_router_tensor(name):
            yield name, tensor
            continue
        param = params.get(name)
        if param is None:
            raise KeyError(f"checkpoint tensor {name!r} has no parameter: its layer is not in 'routing_layers'")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
        loaded.add(name)


def check_router_weights(model: torch.nn.Module, loaded: set[str]) -> None:
    missing = sorted(n for n, _ in model.named_parameters() if is_router_tensor(n) and n not in loaded)
    if missing:
        raise KeyError(f"checkpoint lacks router/adapter tensor {missing[0]!r} ({len(missing)} missing)")


@contextmanager
def layers_built_routed(module, name: str, routed_class: type, routed_layers: tuple[int, ...], slot: StepSlot):
    """While an upstream model is constructed: its layer factory (the function `make_layers` calls, which looks
    up the layer class as `module.name` when it builds each layer) builds `routed_class` at the routed indices,
    with upstream's own arguments, and upstream's class elsewhere. A routed layer is built once, in place: no
    upstream layer is built and thrown away."""
    upstream = getattr(module, name)

    def build(**kwargs):
        if kwargs["layer_id"] in routed_layers:
            return routed_class(slot=slot, **kwargs)
        return upstream(**kwargs)

    setattr(module, name, build)
    try:
        yield
    finally:
        setattr(module, name, upstream)


class RouterWeightsMixin:
    """For a skipper model class placed before its SGLang base: the router/adapter tensors are taken out of
    the checkpoint stream by their real names (upstream's loader would read `router_proj.gate_proj` as an
    MLP shard), the rest goes to upstream's loader, and a missing router tensor is an error naming it."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        loaded: set[str] = set()
        result = super().load_weights(split_router_weights(self, weights, loaded))
        check_router_weights(self, loaded)
        return result



class SkipperCausalLM(RouterWeightsMixin):
    """For a skipper model class placed before its SGLang CausalLM base: the checkpoint's `routing_layers` are
    built as the class's `routed_layer_class` by upstream's own layer factory (`layers_built_routed`), and every
    forward pass is planned by the runtime (the step its routed layers read) and counted after.

    In a server every pass is decided before SGLang's forward (`prepare_pass`, from the hook around
    `ModelRunner.forward`): the runtime's host decisions, then the per-row plan (request keys, dense-mode rows,
    and a replayed graph's request slots; an eager pass reads SGLang's where they lie) written into the model's
    static `PlanBuffers`, which the forward only reads. Before SGLang's
    graph runner answers whether it replays the pass, the replay veto refuses a routed pass (`graph_veto`);
    after the pass, SGLang's report of whether it replayed is counted per phase and mode (`finish_pass`,
    `graph_passes_total`) and the runtime counts the pass. A forward called directly (outside
    `ModelRunner.forward`) is decided and counted in the forward (`plan_writes_total.in_forward`)."""

    upstream_layer: tuple[Any, str]  # (upstream's model module, the name its layer factory builds layers by)
    routed_layer_class: type  # the routed layer (`RoutedLayerMixin` before upstream's layer class)

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        slot = StepSlot()
        routed_layers = tuple(int(i) for i in (getattr(config, "routing_layers", None) or ()))
        module, name = self.upstream_layer
        with layers_built_routed(module, name, self.routed_layer_class, routed_layers, slot):
            super().__init__(config, quant_config=quant_config, prefix=prefix)
        self.slot = slot
        self.routed_layers = routed_layers
        for i in routed_layers:
            layer = self.model.layers[i]
            if self.model.start_layer <= i < self.model.end_layer and not isinstance(layer, self.routed_layer_class):
                raise RuntimeError(f"{type(self).__name__}: layer {i} was built as {type(layer).__name__}, not "
                                   f"{self.routed_layer_class.__name__}: upstream no longer builds its layers by "
                                   f"{module.__name__}.{name}")
        self.ledger = ReplayLedger()  # a routed decode variant is recorded once captured (`decode_graph_variants`)
        self.plan_writes = {"before_forward": 0, "in_forward": 0}
        device = self.model.embed_tokens.weight.device
        self.buffers = PlanBuffers(64, str(device))  # eager passes: grows to the largest pass
        self.graph_buffers: PlanBuffers | None = None  # decode passes a captured graph replays: frozen
        self.runtime = get_runtime(config.model_type, self.routed_layers, type(self).__name__, str(device))
        self.slot.runtime = self.runtime
        graphs = graph_backends()
        refuse_graph_replay(self.runtime.arm, graphs)
        layers = [self.model.layers[i] for i in self.routed_layers
                  if self.model.start_layer <= i < self.model.end_layer]
        qkv = [layer.self_attn.qkv_proj for layer in layers]
        spec = self.runtime.spec
        try:
            self.slot.execution = cohort_execution(layers, device, spec.execution, spec.tile_table,
                                                   served_prefill_backend())
        except TileTableError as exc:
            if spec.tile_table is None:
                raise ServeConfigError(f"{ENV_EXECUTION}={spec.execution}: {exc}") from None
            raise ServeConfigError(f"{ENV_TILE_TABLE}: {exc}") from None  # the message starts with the file
        except ValueError as exc:
            raise ServeConfigError(f"{ENV_EXECUTION}={spec.execution}: {exc}") from None
        if self.runtime.spec.execution == "triton" and self.slot.execution.decode != "triton":
            raise ServeConfigError(f"{ENV_EXECUTION}=triton, but the routed layers cannot run it: "
                                   f"{self.slot.execution.reason}")
        if self.runtime.skipper is not None:
            self.slot.execution = asked_prefill_read(self.slot.execution, spec.prefill_read)
        self.graph_blocker = routed_graph_blocker(self.slot.execution, device)
        if self.slot.execution.decode == "triton":
            from vskipper.mixed.router import gate_form

            self.slot.fused_gate = gate_form(self.runtime.skipper) is not None
        if self.runtime.skipper is not None and self.slot.execution.decode == "triton" and layers \
                and device.type != "meta":  # a loader that builds on the meta device has no memory to run in
            weight = self.model.embed_tokens.weight
            warm_layer(layers[0], self.slot.execution, weight.shape[1], weight.dtype, device)
            from vskipper.mixed.routes import fused_form, warm_routes

            if fused_form(self.runtime.skipper) is not None:  # the skipper's fused routes: one variant
                warm_routes(self.runtime.skipper, self.routed_layers, weight.dtype, device)
            if self.slot.fused_gate:  # the fused gate's two kernels: one variant each
                from vskipper.mixed.router import warm_gate

                warm_gate(self.runtime.skipper, layers[0].router, weight.dtype, device)
        self.slot.prefill_graphs = self.prefill_graphs_for(spec.prefill_graph_counts())
        active.register(self)  # for the SGLang hooks around the forward and the graph runners
        # Live counters (fixed keys, values only change), read whenever the attestation is written.
        # The variants this arm captured (a dense arm none) live beside the counters, outside `execution`,
        # which describes what the model and device run and is the same for every arm of one deployment.
        self.part_clock = self._part_clock() if spec.part_clock or spec.pass_spans or spec.stack_samples else None
        self.pass_clock = PassClock() if self.runtime.spec.interleave_control else None
        if self.pass_clock is not None:
            self.runtime.model_counters["pass_clock"] = self.pass_clock.attestation()
        self.runtime.model_counters.update({"graph_passes_total": self.ledger.passes,
                                            "routed_replays_vetoed_total": self.ledger.vetoed,
                                            "plan_writes_total": self.plan_writes,
                                            "routed_graph_variants": self.ledger.routed_graphs})
        routed_variant = ("decode: a routed graph beside the dense one at every captured batch size, for an arm "
                          "that routes decode" if self.graph_blocker is None
                          else f"none: routed passes run eagerly ({self.graph_blocker})")
        from vskipper.mixed.router import gate_form
        from vskipper.mixed.routes import fused_form

        self.runtime.execution.update({
            "routed_layers_backend": self.slot.execution.attestation(),
            "cuda_graphs": {"backends": graphs, "routed_variant": routed_variant},
            "tiles": given_table_unused(self.slot.execution, spec.tile_table) or self.slot.execution.attestation()["tiles"],
            "project_only_q": project_only_q(qkv, self.slot.execution),
            # what computes the skipper's per-pass state: one launch where it has a fused form and the layers run
            # the triton execution, else the skipper's own tensor ops
            "skipper_state": (fused_form(self.runtime.skipper) if self.slot.execution.decode == "triton" else None)
            or "the skipper's own tensor ops",
            # what computes a routed layer's route: a trained gate's fused form in the triton execution
            "skipper_route": (gate_form(self.runtime.skipper) if self.slot.fused_gate else None)
            or "the skipper's own route"})

    def prefill_graphs_for(self, sizes: tuple[int, ...]):
        """The routed prefill passes' graphs at token counts `sizes` (the spec's, `ServeSpec.prefill_graph_counts`), or None
        where none are asked for or the arm has no skipper; refused by name where they cannot be captured
        (`prefill_graph_blocker`). A stand-in (tests, `graph_stand_in`) makes each graph off CUDA."""
        from vskipper.sglang import prefill_graphs as pg

        layers = [self.model.layers[i] for i in self.routed_layers
                  if self.model.start_layer <= i < self.model.end_layer]
        if not sizes or self.runtime.skipper is None or not layers:
            return None
        weight = self.model.embed_tokens.weight
        stand_in = pg.graph_stand_in()
        blocker = pg.prefill_graph_blocker(self.runtime.arm, self.slot.execution, self.runtime.spec.part_clock,
                                           torch.device("cuda") if stand_in is not None else weight.device,
                                           pg.hierarchical_cache())
        if blocker is not None:
            raise ServeConfigError(f"{pg.ENV_PREFILL_GRAPHS}: {blocker}")
        execution = self.slot.execution

        def layer_ops(layer, positions, batch, req_rows, parts):
            return SGLangLayerOps(layer, positions, batch, PassPlan(req_rows, 0), "triton",
                                  prefill_read=execution.prefill_read, decode_read=execution.decode_read,
                                  read_tile=execution.tiles.read_tile if execution.tiles is not None else None,
                                  parts=parts)

        graphs = pg.PrefillGraphs(sizes, self.runtime, execution, layer_ops, weight.shape[1],
                                  layers[0].self_attn.q_size, weight.dtype, weight.device, stand_in,
                                  asked=self.runtime.spec.prefill_graphs, last_layer=self.model.end_layer - 1)
        self.runtime.model_counters["prefill_graphs"] = graphs.attestation()
        return graphs

    def capture_prefill_graphs(self, attn_backend, chunk: int | None = None) -> None:
        """Every count of the routed prefill graphs a pass of at most `chunk` tokens (the scheduler's prefill
        chunk; None: unchunked) can reach captured and checked (`PrefillGraphs.capture_all`), where the spec asks
        for them: once SGLang's scheduler is built (its pools allocated; `attn_backend` its model runner's), before
        the server serves."""
        graphs = self.slot.prefill_graphs
        if graphs is None:
            return
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
        from sglang.srt.utils.common import DynamicGradMode

        layers = [self.model.layers[i] for i in self.routed_layers
                  if self.model.start_layer <= i < self.model.end_layer]
        # the grad mode SGLang's event loop serves in: the tensors made here are written again while it serves
        with DynamicGradMode(), forward_context(ForwardContext(attn_backend=attn_backend)):
            graphs.capture_all(layers, self.model.embed_tokens, layer_parts,
                               self.model.embed_tokens.weight.shape[0], chunk=chunk)

    def _part_clock(self) -> PartClock:
        """The part clock over this rank's layers (of its passes' spans alone where only `pass_spans` asks for
        it), live in the attestation (`part_clock`), whose writer waits for the device's end of the passes first."""
        parts = self.runtime.spec.part_clock
        # on a GPU each pass's device time too; the forward's stack sampled where the spec asks
        clock = PartClock(events=cuda_events(), parts=parts, samples=self.runtime.spec.stack_samples)
        if parts:
            clock.install([(i, self.model.layers[i]) for i in range(self.model.start_layer, self.model.end_layer)],
                          self.routed_layers)
            self.slot.part_clock = clock
        self.runtime.model_counters["part_clock"] = clock.live()
        self.runtime.part_clock = clock
        return clock

    def decode_graph_variants(self, runner) -> SkipperGraphVariants | None:
        """Before SGLang's decode graph runner captures (the hook around `DecodeCudaGraphRunner.capture`): the
        variants to capture, or None where only the dense graph is captured (a dense arm; a routed arm whose
        routed layers cannot be captured, whose routed passes the replay veto then runs eagerly).

        For the routed variant the per-pass plan and the route tape get static storage sized for the largest
        captured batch: the graphs hold their addresses, and each replayed pass writes its plan into them."""
        if "decode" not in self.runtime.arm.routed_phases or self.graph_blocker is not None:
            return None
        if int(getattr(runner, "captured_req_width", 1)) != 1:  # speculative decoding: routed passes run eagerly
            return None
        capacity = max(int(bs) for bs in runner.capture_bs)
        weight = self.model.embed_tokens.weight
        if self.graph_buffers is None or self.graph_buffers.capacity < capacity:
            self.graph_buffers = PlanBuffers(capacity, weight.device)
            self.runtime.reserve_graph_tape(capacity, weight.dtype, weight.device)
        self.graph_buffers.frozen = True
        self.ledger.routed_graphs["decode"] = True
        return SkipperGraphVariants(self)

    def pass_is_routed(self, forward_batch) -> bool:
        """Whether the pass prepared for this batch routes (the graph variant it replays)."""
        prepared = self.slot.prepared
        return prepared is not None and prepared.step is not None and prepared.step.routed

    def capture_pass(self, forward_batch) -> PreparedPass:
        """The pass a routed decode graph is captured from: every per-row input is a view of the static plan
        buffers and the graph tape (whatever padding they hold now), so a replay computes the pass whose plan
        was written into them before it."""
        rows = forward_batch.batch_size
        views = self.graph_buffers.views(rows)
        step = self.runtime.capture_step(rows, views["dense_rows"], views["request_keys"])
        return PreparedPass(forward_batch, step, PassPlan(views["req_rows"], 0))

    def _decide(self, forward_batch) -> PreparedPass:
        """The runtime's host decisions for this pass and, where it routes, its plan in the static buffers."""
        rids = forward_batch.rids or []
        if len(rids) != forward_batch.batch_size:
            return PreparedPass(forward_batch, None, None)
        ids = forward_batch.positions if forward_batch.positions is not None else forward_batch.input_ids
        weight = self.model.embed_tokens.weight
        step = self.runtime.decide(forward_batch, ids.shape[0], weight.dtype, weight.device)
        plan = self.write_plan(forward_batch, step) if step.routed else None
        return PreparedPass(forward_batch, step, plan)

    def write_plan(self, forward_batch, step: Step) -> PassPlan:
        """Write the routed pass's per-row plan into the static buffers; the step and the plan read their views.
        A decode pass on the graph tape writes the graph buffers (a replay reads them), every other pass the
        eager ones. The step's keys and dense-mode rows are host tensors: the buffers take them in one copy. A
        graph's request slots go into its buffers too (a device-to-device copy of a decode batch's); an eager
        pass reads its slots where they lie when they are on the model's device already (SGLang's, or their
        expansion in prefill), and the buffers take them in the one copy where `plan_pass` found them on the
        host off it. A decode batch whose requests stand hands the same keys and dense-mode rows again, and
        only a graph's request slots are copied (`PlanBuffers.write`)."""
        plan = plan_pass(forward_batch, step.rows, step.context)
        graph = self.runtime.on_graph_tape(step)
        buffers = self.graph_buffers if graph else self.buffers
        in_place = not graph and reads_in_place(plan.req_rows, buffers.device, step.rows)
        buffers.write(None if in_place else plan.req_rows, step.keys, step.dense_rows)
        views = buffers.views(step.rows)
        step.keys = views["request_keys"]
        if step.dense_rows is not None:
            step.dense_rows = views["dense_rows"]
        return PassPlan(plan.req_rows if in_place else views["req_rows"], plan.context, plan.read_pairs)

    def prepare_pass(self, forward_batch) -> None:
        """Before SGLang's forward of this batch (the hook around `ModelRunner.forward`)."""
        self.slot.prepared = self._decide(forward_batch)
        self.plan_writes["before_forward"] += 1
        if self.pass_clock is not None:
            step = self.slot.prepared.step
            timed = step is not None and step.routed and step.phase == "decode" and not step.health_check
            self.pass_clock.start(clock_phase(step.phase, step.control) if timed else None,
                                  step.rows if timed else 0)

    def control_pass(self) -> bool:
        """Whether the pass prepared now is an interleaved control pass (`ENV_INTERLEAVE_CONTROL`)."""
        prepared = self.slot.prepared
        return prepared is not None and prepared.step is not None and prepared.step.control

    def graph_veto(self, forward_batch, graph_can_run: bool) -> bool:
        """SGLang's graph runner's answer for this batch after the replay veto (a routed pass runs eagerly)."""
        prepared = self.slot.prepared
        if prepared is None or prepared.step is None or prepared.step.phase not in PHASES:
            return graph_can_run
        return self.ledger.veto(prepared.step.phase, prepared.step.routed, graph_can_run)

    def finish_pass(self, forward_batch, replayed: bool) -> None:
        """After SGLang's forward of this batch: count it (replayed or eager, per phase and mode) and let the
        runtime count its rows from the tape."""
        prepared, self.slot.prepared = self.slot.prepared, None
        if prepared is None or prepared.forward_batch is not forward_batch or prepared.step is None:
            return
        self._count(prepared.step, replayed)

    def _count(self, step: Step, replayed: bool) -> None:
        """The ledger counts what the runtime counts: health probes' passes are not traffic."""
        if step.phase in PHASES and not step.health_check:
            self.ledger.record(step.phase, step.routed, replayed)
        # the triton execution's maps launches wrote each routed layer's counts into the tape (`mixed_depth`)
        self.runtime.finish(step, on_tape=self.slot.execution.decode == "triton")

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, get_embedding=False,
                pp_proxy_tensors=None):
        if input_embeds is None:
            input_embeds = self.model.embed_tokens(input_ids)
        # SGLang's eager runner hands the forward a copy of the batch it was asked to run (its static-buffer
        # slice), so the pass prepared for this ModelRunner.forward is the pending one, used once.
        prepared = self.slot.prepared
        inline = prepared is None or prepared.used
        variant = get_capture_attention_variant()
        if variant in (DENSE_VARIANT, ROUTED_VARIANT):  # SGLang captures a decode graph: no pass to count
            inline = False
            prepared = self.capture_pass(forward_batch) if variant == ROUTED_VARIANT \
                else PreparedPass(forward_batch, None, None)
        elif inline:  # called outside ModelRunner.forward: decided here
            prepared = self._decide(forward_batch)
            self.plan_writes["in_forward"] += 1
        prepared.used = True
        step = prepared.step
        if step is not None and step.routed:
            if input_embeds.shape[0] != step.rows:
                raise RuntimeError(f"the pass was planned for {step.rows} rows but its forward has "
                                   f"{input_embeds.shape[0]} (padded batches are not served routed)")
            fused = self.slot.execution.decode == "triton"
            graphs = self.slot.prefill_graphs
            req_rows = prepared.plan.req_rows if prepared.plan is not None else None
            if graphs is None or step.phase != "prefill" or \
                    not graphs.begin(step, positions, forward_batch, input_embeds, fused, req_rows):
                self.runtime.prepare_state(step, input_embeds, positions, fused=fused)
            self.slot.step, self.slot.plan = step, prepared.plan
        try:
            out = super().forward(input_ids, positions, forward_batch, input_embeds, get_embedding,
                                  pp_proxy_tensors)
        finally:
            self.slot.step = None
            self.slot.plan = None
            if self.slot.prefill_graphs is not None:
                self.slot.prefill_graphs.end()
        if inline and step is not None:
            self._count(step, replayed=False)
        return out
