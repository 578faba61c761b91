"""The routed-layer body: one routed decoder layer over its RUN and Project-Only cohorts, whatever hosts it.

Per layer, x = the layer input, u = LN1 x, w = the tape's branch weight (`vskipper.mixed.tape`):

  RUN row           q, k, v of u;  K/V written;  h = x + o_proj(Attn(q));  y = h + w * MLP(LN2 h)
  Project-Only row  k, v of u;     K/V written;  y = x + w * Proj(LN2 x)

With r = h for a RUN row and r = x for a Project-Only row (the residual the layer hands on), both branches read
LN2 r: the body normalizes r once over every row, then each cohort takes its rows.

The body hands y on as upstream decoder layers do, as a pair (`Handoff`): the residual (h for a RUN row, x for
a Project-Only row) and the branch's weighted output, whose sum the next layer's fused add-norm forms (or the
host, where its layers hand on y itself).

A Project-Only row pays for its layer's K and V (Qwen3: k_norm, then RoPE) and the projector, nothing else:
no Q, no attention read, no o_proj, no MLP (save a prefill read through the host's attention backend, which reads
every batch row: a Project-Only row's zero query there costs its share of the read). Every row's K/V is written
before any RUN row reads (Invariant 1), so a RUN row attends to every token's K/V, Project-Only tokens' included.

The host layer hands its own modules to the body through `LayerOps`: the SGLang layer passes SGLang's
`qkv_proj`, `o_proj`, MLP and KV pool (`vskipper.sglang.models.routed`), the engine-free stack passes its own
(`vskipper.mixed.bench_stack`). The body owns the cohort logic and the weighted scatter; the host owns the math
of each projection (quantization, tensor-parallel reductions, RoPE variants).

Two executions of the same semantics:

  torch   (CPU; layers without plain weights) the cohorts are packed with one `nonzero` per layer (the RUN cohort takes
          the rest, `nonzero_static`): their sizes are shapes, never values read on the host.
          K and V are every row's, in one projection over the batch (its weight read once, no cohort
          reordering before the write); Q, the read, o_proj and the MLP see the RUN rows only, the projector
          the Project-Only rows only (a read through the host's backend, where the pass takes it, reads every
          batch row, a Project-Only row's with a zero query whose output is not read). The host may rotate the
          RUN rows' Q and every row's K in one call (`LayerOps.q_kv`); o_proj's output is added onto x at the
          RUN rows in one `index_add`. When no row
          projects, the all-RUN fast path calls the host's own dense attention and MLP over the whole batch.
          (`nonzero` synchronizes on a GPU, once per routed layer, where the triton execution is the one that
          does not.) The served layer runs this execution on CPU and wherever a layer has no plain weights.
  triton  (GPU decode and prefill: the served layer on CUDA and the bench stack's decode) every kernel keeps its
          launch shape for the pass's rows and bounds its work by a device count (`vskipper.mixed.cohorts`,
          packed by a device prefix sum): K/V over every row; the RUN cohort's Q as a count-bounded GEMM over its
          gathered rows, q_norm, then RoPE with every row's K in one call where the host can, then the read over
          the cohort's packed slots (`reads` marks the live ones; slots past the count read nothing). The Q GEMM
          stores each RUN row's query in its batch row, which RoPE rotates beside every row's key
          (`LayerOps.batch_q_kv`); the masked decode read and the packed prefill read (flash-attention over each
          slot's request) gather each slot's query, request and position themselves (`LayerOps.read_cohort`): no
          gather or scatter launched around them. A prefill read through the host's attention backend reads every
          batch row's query (`LayerOps.reads_every_query`: a Project-Only row's finite, from the Q GEMM's storage
          zero-filled, plus Q's bias where it has one) and leaves its outputs in batch rows, where o_proj gathers
          the RUN rows' in its operand load. Then o_proj as a count-bounded GEMM scattered onto
          the RUN rows' residual (onto x itself where the host hands x over, `x_owned`: a residual no one else
          holds, as the Llama layer's add-norm residual, which upstream's own layer updates in place too;
          elsewhere onto a copy); the two cohort FFNs in one launch per stage (`cohort_ffn_pair`), each storing
          its rows of the branch output. No host read, no all-RUN test (a pass with every row RUN runs the same
          kernels at the full count); a Project-Only row computes its K/V
          and the adapter alone: no Q, no read (through the backend, a zero query whose output is not read), no
          o_proj, no MLP. Where the tile table measured cuBLAS faster than an operation's tile at a memory-bound
          capacity, that GEMM runs in the gathered form over every slot, its slots past the count masked
          (`vskipper.mixed.gathered`): the same values, no host read either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from vskipper.mixed.cohorts import Cohorts


class Handoff(NamedTuple):
    """A routed layer's output y = residual + delta, left unsummed for the next layer's fused add-norm."""

    delta: torch.Tensor  # [rows, d]: w * MLP(LN2 h) (RUN rows), w * Proj(LN2 x) (Project-Only rows)
    residual: torch.Tensor  # [rows, d]: h (RUN rows), x (Project-Only rows)

    def output(self, in_place: bool = False) -> torch.Tensor:
        """y, for a host whose layers hand on the layer output itself; `in_place`: y forms on the residual, which
        the host handed over (`routed_layer`'s `x_owned`: the residual is then x itself)."""
        return self.residual.add_(self.delta) if in_place else self.residual + self.delta


class LayerOps(Protocol):
    """A routed layer's own modules, as the body calls them. `rows` (int64 [n]) names the batch rows a call
    covers (their positions, requests and cache slots); None covers every row."""

    post_attention_layernorm: nn.Module
    projector: nn.Module  # the FlexiDepth adapter (`ProjectorAdapter`): d -> m -> d
    # the triton execution's read takes the RUN rows' queries in their batch rows (`batch_q_kv`, `read_cohort`); where
    # it reads every batch row's query (SGLang's prefill backend), the Project-Only rows' are finite (zeros, or Q's
    # bias; the gathered Q form's: their own queries), and its outputs stay in batch rows, where o_proj reads the
    # RUN rows'
    reads_every_query: bool

    def attention(self, u: torch.Tensor) -> torch.Tensor:
        """The host's dense attention over every row (K/V write, read, o_proj): the all-RUN fast path."""

    def kv(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v only (no q) of every row u of the pass."""

    def q_kv(self, u: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q of the batch rows `rows` alone, k, v of every row u of the pass), rotated (Qwen3: normed) like `kv`,
        where the host may rotate both in one call. q is in the form `read` takes: packed [len(rows), heads * hd],
        or in the pass's batch slots [rows of u, heads * hd] (zeros elsewhere) where the host's read reads every
        batch row's query (a prefill read through SGLang's backend)."""

    def batch_q_kv(self, u: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v) for the triton execution: its queries q [rows, heads * hd] in batch rows (the RUN rows' from
        the cohort Q GEMM; the other rows' of no meaning, or finite where `reads_every_query`) normed (Qwen3) and
        rotated with every row's k, v of u, in one call where the host can; nothing gathered or scattered."""

    def write_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write every row's k, v [rows, ...] (batch order) to the host's KV cache at this layer."""

    def read(self, q: torch.Tensor, rows: torch.Tensor | None, reads: torch.Tensor | None = None) -> torch.Tensor:
        """The attention read [n, heads * hd] of the batch rows `rows` (every row where None) over the KV cache,
        their queries q packed or as `q_kv` hands them; the outputs packed. `reads` (bool [n]): rows outside it
        read nothing and yield zero."""

    def read_cohort(self, q: torch.Tensor, rows: torch.Tensor, reads: torch.Tensor) -> torch.Tensor:
        """The triton execution's read over a cohort's packed slots: slot m, where reads[m], reads for batch row
        rows[m] with its query q[rows[m]] (q [n, heads * hd] in batch rows, `batch_q_kv`); [len(rows), heads *
        hd], packed, zeros for slots outside `reads`. The masked decode read and the packed prefill read gather
        the rows' queries, requests and positions themselves (no gather launched before them). A read of every
        batch row (`reads_every_query`) returns every row's output in batch rows instead ([n, heads * hd]), no
        gather after it either: o_proj reads the RUN rows' where they lie."""

    def o_proj(self, a: torch.Tensor) -> torch.Tensor:
        """The output projection, reduced across the host's tensor-parallel group."""

    def mlp(self, v: torch.Tensor) -> torch.Tensor:
        """The layer's MLP, reduced across the host's tensor-parallel group."""

    def mlp_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate, up, down) weights for the count-bounded kernels: the triton execution only (where the host
        found plain weights on one rank; elsewhere its MLP stays behind its own linear methods)."""

    def attention_weights(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(W_q [heads * hd, d], Q's bias or None, W_o [d, heads * hd]) for the count-bounded kernels: the triton
        execution only, under the same conditions as `mlp_weights` (and no o_proj bias)."""

    def projector_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The adapter's (gate_proj [m, d], down_proj [m, d], up_proj [d, m]) weights for the count-bounded kernels,
        in the order of `mlp_weights` (gate, the d -> m one its product takes, then the m -> d one)."""


def routed_layer(ops: LayerOps, x: torch.Tensor, u: torch.Tensor, run: torch.Tensor, weights: torch.Tensor,
                 backend: str = "torch", cohorts: Cohorts | None = None, tiles: Any = None,
                 note: Callable[[str], None] | None = None, x_owned: bool = False) -> Handoff:
    """The layer output y (as a `Handoff`) from its input x, u = LN1 x, the tape's run mask and branch weights
    [rows].

    `x_owned`: the host hands x over, as upstream's fused add-norm owns the residual it updates in place; the
    body then adds o_proj's output onto x itself, and the hand-off's residual is x (no copy of x first). Otherwise
    x is left as it came.

    `note`, when given, hears the path the torch execution took ('all_run' or 'cohorts'); the triton execution
    has one path ('cohorts')."""
    if backend == "torch":
        return _routed_torch(ops, x, u, run, weights, note, x_owned)
    if backend == "triton":
        if cohorts is None:
            raise ValueError("backend 'triton' needs the layer's device cohort maps ('cohorts')")
        if note is not None:
            note("cohorts")
        return _routed_triton(ops, x, u, weights, cohorts, tiles, x_owned)
    raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")


def _routed_torch(ops: LayerOps, x: torch.Tensor, u: torch.Tensor, run: torch.Tensor, weights: torch.Tensor,
                  note: Callable[[str], None] | None, x_owned: bool) -> Handoff:
    w = weights.view(-1, 1).to(x.dtype)
    proj_rows = torch.nonzero(~run).view(-1)
    all_run = proj_rows.shape[0] == 0
    if note is not None:
        note("all_run" if all_run else "cohorts")
    if all_run:  # the fast path: no gather, no scatter; the branch weight still scales the MLP
        a = ops.attention(u)
        h = x.add_(a) if x_owned else x + a
        return Handoff(w * ops.mlp(ops.post_attention_layernorm(h)), h)
    # The RUN cohort's size follows from the Project-Only one: no second wait for the device.
    n_run = run.shape[0] - proj_rows.shape[0]
    residual = x
    if n_run:
        run_rows = torch.nonzero_static(run, size=n_run).view(-1)
        q, k, v = ops.q_kv(u, run_rows)  # q: the RUN rows'; k, v: every row's, in batch order
        ops.write_kv(k, v)
        a = ops.o_proj(ops.read(q, run_rows))
        residual = x.index_add_(0, run_rows, a) if x_owned else x.index_add(0, run_rows, a)  # h at the RUN rows
    else:
        ops.write_kv(*ops.kv(u))
    normed = ops.post_attention_layernorm(residual)  # LN2 h (RUN rows), LN2 x (Project-Only rows)
    delta = torch.empty_like(x)
    if n_run:
        delta.index_copy_(0, run_rows, ops.mlp(normed.index_select(0, run_rows)))
    delta.index_copy_(0, proj_rows, ops.projector(normed.index_select(0, proj_rows)).to(x.dtype))
    return Handoff(delta.mul_(w), residual)


def _routed_triton(ops: LayerOps, x: torch.Tensor, u: torch.Tensor, weights: torch.Tensor, cohorts: Cohorts,
                   tiles: Any, x_owned: bool) -> Handoff:
    q, _, _ = triton_attention_in(ops, u, cohorts, tiles)
    # packed: the slots that hold a RUN row read; or every batch row's output, in batch rows (`reads_every_query`)
    a = ops.read_cohort(q, cohorts.run_idx, cohorts.live)
    return triton_attention_out(ops, x, a, weights, cohorts, tiles, x_owned)


def triton_attention_in(ops: LayerOps, u: torch.Tensor, cohorts: Cohorts,
                        tiles: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The triton execution's work before the read: the RUN cohort's Q (its rows' queries in their batch rows,
    rotated beside every row's key; the others' of no meaning, finite where the read reads every row: a
    Project-Only row's output there is never read, o_proj reads the RUN rows'), every row's K/V written. Returns
    (q, k, v), k and v every row's in batch order. It reads nothing the host decides per pass besides what `ops`,
    `u` and the maps hold: a captured segment of it replays over whatever they hold then."""
    from vskipper.mixed.kernels import cohort_gemm

    w_q, b_q, _ = ops.attention_weights()
    q = cohort_gemm(u, cohorts.run_idx, cohorts.n_run, w_q, tile=tiles, batch_rows=True,
                    finite_others=ops.reads_every_query)
    if b_q is not None:
        q += b_q
    q, k, v = ops.batch_q_kv(u, q)
    ops.write_kv(k, v)
    return q, k, v


def triton_attention_out(ops: LayerOps, x: torch.Tensor, a: torch.Tensor, weights: torch.Tensor, cohorts: Cohorts,
                         tiles: Any, x_owned: bool) -> Handoff:
    """The triton execution's work after the read `a` (`LayerOps.read_cohort`'s): o_proj onto the RUN rows'
    residual, LN2, and both cohorts' FFNs weighted into the branch output."""
    from vskipper.mixed.kernels import CohortFFN, cohort_ffn_pair, cohort_scatter_add

    _, _, w_o = ops.attention_weights()
    h = x if x_owned else x.clone()  # Project-Only rows: h = x
    # RUN rows: h = x + o_proj(a), the RUN rows' outputs gathered by the kernel where they lie in batch rows
    cohort_scatter_add(a, cohorts.run_idx, cohorts.n_run, w_o, h, tile=tiles, batch_rows=ops.reads_every_query)
    # Every row is in exactly one cohort (n_run + n_proj = rows), so each branch stores its rows of delta: no
    # zero fill, no read of delta (where a down GEMM serves in the gathered form, which adds, the pair zeroes it).
    delta = torch.empty_like(h)
    v = ops.post_attention_layernorm(h)
    cohort_ffn_pair(v, weights, delta, CohortFFN(cohorts.run_idx, cohorts.n_run, *ops.mlp_weights()),
                    CohortFFN(cohorts.proj_idx, cohorts.n_proj, *ops.projector_weights()), tiles=tiles,
                    accumulate=False)
    return Handoff(delta, h)
