"""A routed prefill pass's routed layers replayed from CUDA graphs (`ENV_PREFILL_GRAPHS`): an opt-in mode.

A routed prefill pass is eager in SGLang (its prefill graphs hold no routed variant, `ROUTED_GRAPH_PHASES`), and on
a GPU below a few thousand tokens its time is the host's launches: each routed layer of the triton execution issues
its route, cohort maps, Q GEMM, RoPE, K/V write, read, o_proj scatter, norm and FFN pair one launch at a time. Here
each routed layer's work is captured once per token count (`ServeSpec.prefill_graphs`) and replayed
(`vskipper.mixed.segment_graphs`), as the execution's prefill read allows (`GRAPH_READS`): with the packed read,
which reads only device values, the whole layer is one segment; with the read through SGLang's attention backend,
whose metadata is the pass's own, the work before the read and after it are two segments and the read stays eager
between them, as SGLang's breakable prefill graphs break at attention. The dense layers run as they do in every
other pass.

Per pass: the least captured count that holds its rows (none: the pass runs eagerly); its per-row inputs copied
into static buffers of that count (positions, KV slots, request keys and slots, dense-mode rows, valid rows; the
rows past the pass's are padding: position 0, KV slot 0, SGLang's padding slot, request slot 0, valid False, so
every routed layer runs them, `vskipper.skippers.base`) and the embeddings with them; the skipper's per-pass state
replayed from its own segment into storage the layers' segments read. Per routed layer: the layer's input x and
LN1 x copied into static rows; with the packed read its segment replayed (the route, the maps recording it on the
graph tape, Q, RoPE, every row's K/V written at the static slots, the RUN cohort's read, o_proj onto a copy of x,
LN2, the FFN pair); with the backend read its segment before the read replayed (through the K/V write), SGLang's
read of the pass's rows, its output copied into static rows, the segment after the read replayed (from o_proj).
The layer's hand-off is handed on as views of the segment's outputs, the pass's rows alone (the last layer a rank
runs hands on copies: SGLang may keep the model's hidden states beyond the pass). Each segment copies
its outputs into static rows every routed layer shares (a layer's are consumed before the next layer's segments
replay): a capture holds none of its own. The pass is counted from the graph tape: padding rows are RUN, so the
pass's Project-Only rows are the tape's and its RUN rows its rows less those (`Runtime.finish`).

What a pass costs the host here: per routed layer one replay and two copies (packed), or two replays, the read's
launches and three copies (backend), in place of the layer's launches; per pass about a dozen copies and fills, and
the last layer's two copies of its hand-off.
What it costs the device: the padding rows' work at every routed layer, the copies (about seven of a layer's
rows' width a routed layer, well under 1% of a pass).

A server captures and checks every count it keeps before it serves (`capture_all`, from the hook after SGLang's
scheduler is built): no served pass waits on a capture, nor on a check that reads the device. Where it chunks its
prefill, it leaves out the counts no pass reaches (those above the least count that holds its prefill chunk,
`reached_by`): they would cost its start and device memory for nothing. Where no capture came first (a model
driven outside a server), a count's first pass runs each segment eagerly, captures it and replays it.
"""

from __future__ import annotations

import logging
import os
import time
from bisect import bisect_left
from types import SimpleNamespace
from typing import Any

import torch

from vskipper.mixed.cohorts import CohortBuilder
from vskipper.mixed.routed_layer import Handoff, routed_layer, triton_attention_in, triton_attention_out
from vskipper.mixed.segment_graphs import CaptureFailed, RerunGraph, SegmentGraphs, difference
from vskipper.mixed.tape import RouteTape, tape_capacity
from vskipper.sglang.runtime import Step
from vskipper.sglang.spec import ENV_PREFILL_GRAPH_STAND_IN, ENV_PREFILL_GRAPHS

logger = logging.getLogger(__name__)

# The prefill reads a routed layer's graphs serve with: what each is captured as
GRAPH_READS = {
    "packed": "one segment a routed layer, its read inside (the triton execution's packed read reads only device "
              "values: each row's request slot and position from static rows, SGLang's pools at fixed addresses)",
    "backend": "two segments a routed layer, SGLang's backend read eager between them (its metadata is the pass's)",
}
# A count whose segments' checks at start strayed further than this from their eager runs (of the largest value,
# `vskipper.mixed.segment_graphs.difference`; NaN or infinity on one side alone is further) serves its passes
# eagerly: a replay of the same kernels over the same inputs agrees with its eager run but for the order of a
# reduction, so a straying one replays something else (a kernel outside the capture, a value kept from it)
CHECK_REFUSES = 0.05
# Why a routed prefill pass runs eagerly where graphs are asked for (`PrefillGraphs.passes`), and how its routed
# layers ran as Prometheus counts it (`vskipper.metrics_names.PREFILL_LAYER_RUNS`, `Step.prefill_layers`)
EAGER_REASONS = {"longer than every count": "eager_longer", "its count's capture failed or strayed": "eager_refused"}

# Tests: what makes each graph where no CUDA graph can be captured (`vskipper.mixed.segment_graphs.RerunGraph`);
# None: CUDA graphs, on CUDA only (or as `ENV_PREFILL_GRAPH_STAND_IN` asks a server, `graph_stand_in`).
PREFILL_GRAPH_STAND_IN = None


def graph_stand_in():
    """What makes each graph in place of a CUDA graph: `PREFILL_GRAPH_STAND_IN` where a test set it, the rerunning
    stand-in where `ENV_PREFILL_GRAPH_STAND_IN` asks for it under Triton's interpreter (a test's server), else None
    (CUDA graphs)."""
    if PREFILL_GRAPH_STAND_IN is not None:
        return PREFILL_GRAPH_STAND_IN
    if os.environ.get(ENV_PREFILL_GRAPH_STAND_IN) == "rerun" and os.environ.get("TRITON_INTERPRET") == "1":
        return RerunGraph
    return None


def hierarchical_cache() -> bool:
    """Whether this process's SGLang serves with its hierarchical cache (`--enable-hierarchical-cache`); False
    where no server configuration is published (a model built outside a server)."""
    from sglang.srt.runtime_context import _CONTEXT, get_memory

    return _CONTEXT.is_config_namespace_published("memory") and bool(get_memory().enable_hierarchical_cache)


def prefill_graph_blocker(arm, execution, part_clock: bool, device: torch.device,
                          hierarchical: bool = False) -> str | None:
    """Why a routed prefill pass cannot replay its routed layers from graphs here, or None."""
    if "prefill" not in arm.routed_phases:
        return f"arm {arm.name!r} does not route prefill"
    if execution.decode != "triton":
        return f"the routed layers run the torch execution ({execution.reason or 'not triton'}), whose sizes are " \
               f"read on the host"
    if part_clock:
        return "the part clock times each part of a pass on the host, which a replay does not run"
    if device.type != "cuda":
        return f"no CUDA graphs on {device.type}"
    if hierarchical and execution.prefill_read == "packed":
        return "SGLang's hierarchical cache (--enable-hierarchical-cache) loads a layer's prefix K/V from the host " \
               "while the pass runs, and the layer waits for it in Python, which a layer replayed with the packed " \
               "read does not run (the backend read, eager, waits)"
    return None


def reached_by(sizes: tuple[int, ...], chunk: int | None) -> tuple[int, ...]:
    """The counts of `sizes` (increasing) a prefill pass of at most `chunk` tokens can take: each up to the least
    that holds the chunk (every count where there is none)."""
    if chunk is None:
        return tuple(sizes)
    i = bisect_left(sizes, chunk)
    return tuple(sizes[:i + 1])


class PrefillGraphs:
    """The captured routed layers of routed prefill passes of up to `sizes[-1]` rows (module docstring), for the
    model whose `runtime` decides its passes. `layer_ops(layer, positions, batch, req_rows, parts)` gives the
    routed body a layer's `LayerOps` of the triton execution with its prefill read (`GRAPH_READS`; the model's
    `SGLangLayerOps`, `req_rows` each row's request slot); `graph` makes one graph (tests: `RerunGraph` on CPU)."""

    def __init__(self, sizes: tuple[int, ...], runtime, execution, layer_ops, hidden: int, q_size: int,
                 dtype: torch.dtype, device: torch.device, graph=None, asked: tuple[int, ...] | str = (),
                 last_layer: int | None = None) -> None:
        if not sizes:
            raise ValueError(f"{ENV_PREFILL_GRAPHS}: no token count to capture")
        self.sizes, self.runtime, self.execution, self.layer_ops = tuple(sizes), runtime, execution, layer_ops
        # the counts a pass may take: every count, until the start leaves out those no pass reaches (`capture_all`)
        self.reached = self.sizes
        # what was asked ("auto": `AUTO_PREFILL_GRAPHS`, else the counts), the scheduler's prefill chunk the start
        # read and the counts it left out (attested: keys fixed here, values set once at the start)
        self.reach: dict[str, Any] = {"asked": asked if isinstance(asked, str) else "counts", "prefill_chunk": None,
                                      "left_out": []}
        if execution.prefill_read not in GRAPH_READS:
            raise ValueError(f"prefill graphs serve the reads {sorted(GRAPH_READS)}, not {execution.prefill_read!r}")
        self.packed = execution.prefill_read == "packed"
        # the layer whose hand-off leaves the model (the last this rank runs): handed on as copies, not as views of
        # the static rows the next pass's replays write, since SGLang may keep the model's hidden states beyond the
        # pass (returned hidden states, copied to the host on a stream of their own; a pipeline stage's send)
        self.last_layer = last_layer
        self.graphs = SegmentGraphs(device, graph, hold=runtime.capturing_graphs)
        # what makes each graph, attested: a stand-in is named (tests only: no CUDA graph then)
        self.made_by = "CUDA graphs" if graph is None else f"stand-in {getattr(graph, '__name__', repr(graph))}"
        self._shape = (hidden, q_size, dtype, device)
        self._allocate(self.sizes[-1])
        self.loc: torch.Tensor | None = None  # KV slots, in SGLang's dtype for them (at the first pass)
        self._outputs: dict[str, torch.Tensor] = {}  # the segments' static outputs (`_out`), made at the first
        self.filled = 0  # rows the last pass wrote (a shorter pass resets the rest to padding; zeros are)
        self.steps: dict[int, Step] = {}  # per count: the step its segments were captured from
        # this pass's (count, the step its segments run, SGLang's batch, the pass's own step)
        self.active: tuple[int, Step, Any, Step] | None = None
        # passes by the count they replayed at, and the routed prefill passes run eagerly by why. Every key is made
        # here (the state writer reads these while the forward counts: values change, keys never)
        self.passes: dict[str, dict[str, int]] = {"by_tokens": dict.fromkeys(map(str, self.sizes), 0),
                                                  "eager": dict.fromkeys(EAGER_REASONS, 0)}
        # per count, why its capture failed (its passes then run eagerly), or None
        self.failed: dict[str, str | None] = dict.fromkeys(map(str, self.sizes))
        # per count, the seconds its captures and checks took before the server served (`capture_all`), or None
        self.boot: dict[str, float | None] = dict.fromkeys(map(str, self.sizes))
        # the backend read's K/V writes at start (`_check_kv_write`): what the pool holds against what each layer's
        # segment computed, the worst over every layer and pass of the count, and where; or why none is compared
        self.kv_write: dict[str, Any] = {"compared": 0, "worst_difference": None, "worst_at": None,
                                         "not_compared": "the packed read reads its K/V inside the segment"
                                         if self.packed else None}
        self._kv_worst: dict[int, tuple[float, str]] = {}
        # the row-visits of the routed layers the checks at start compared, by the branch they took (RUN counts the
        # padding rows), over the counts whose replays serve: where none took Project-Only (a trained gate that ran
        # every boot row, the s = 0 control) no served replay of the projector's path was checked, as `unchecked`
        # says
        self.boot_rows: dict[str, Any] = {"run": 0, "project_only": 0, "unchecked": None}
        # what the device had free once every capture held its pool (CUDA; the key made here, as every key the
        # state writer reads)
        self.graphs.memory["free_after_boot_bytes"] = None

    def _allocate(self, cap: int) -> None:
        """The static storage every capture of up to `cap` rows reads and writes: the graph tape and maps, each
        row's inputs and the read's output."""
        hidden, q_size, dtype, device = self._shape
        capacity = tape_capacity(cap)
        self.tape = RouteTape(capacity, self.runtime.routed_layers, dtype, device)
        self.builder = CohortBuilder(capacity, device)
        self.x = torch.zeros(cap, hidden, dtype=dtype, device=device)  # the embeddings, then each layer's input x
        self.u = torch.zeros(cap, hidden, dtype=dtype, device=device)  # LN1 x
        self.a = torch.zeros(cap, q_size, dtype=dtype, device=device)  # the read's output, in batch rows
        self.positions = torch.zeros(cap, dtype=torch.int64, device=device)
        self.keys = torch.zeros(cap, dtype=torch.int64, device=device)
        self.req_rows = torch.zeros(cap, dtype=torch.int64, device=device)  # each row's request slot (packed read)
        self.valid = torch.zeros(cap, dtype=torch.bool, device=device)
        self.dense = torch.zeros(cap, dtype=torch.bool, device=device)

    def attestation(self) -> dict[str, Any]:
        return {"tokens": list(self.sizes), "read": self.execution.prefill_read, "made_by": self.made_by,
                "passes": self.passes, "segments": self.graphs.counts,
                "capture_check": self.graphs.check, "memory": self.graphs.memory, "failed": self.failed,
                "captured_at_boot_s": self.boot, "reach": self.reach, "kv_write_check": self.kv_write,
                "boot_rows": self.boot_rows}

    def _segment(self, size: int, key, fn):
        """Segment `key`'s outputs at count `size`: replayed, or run eagerly where that count's capture failed (this
        pass's later segments too; its later passes run eagerly whole, `begin`). Once one capture failed, no count
        captures again (`SegmentGraphs.broken`): a count captured before it still replays."""
        if self.failed[str(size)] is not None:
            return fn()
        try:
            return self.graphs.run(key, fn)
        except CaptureFailed as exc:
            self.failed[str(size)] = exc.why
            logger.warning("routed prefill graphs at %d tokens: %s; passes of that count run eagerly", size, exc)
            return fn()

    def size_for(self, rows: int) -> int | None:
        """The least count that holds `rows` of those a pass may take (`reached`), or None."""
        i = bisect_left(self.reached, rows)
        return self.reached[i] if i < len(self.reached) else None

    def begin(self, step: Step, positions: torch.Tensor, forward_batch, embeddings: torch.Tensor,
              fused: bool, req_rows: torch.Tensor | None = None) -> bool:
        """Take a routed prefill pass (its rows' inputs into the static buffers, the skipper's state from its
        segment, the step counted from the graph tape), or leave it eager (False). `req_rows`: each row's request
        slot (the pass's plan), which the packed read reads."""
        n = step.rows
        size = self.size_for(n)
        if size is None:
            self._eager(step, "longer than every count")
            return False
        if self.failed[str(size)] is not None:
            self._eager(step, "its count's capture failed or strayed")
            return False
        if self.packed and req_rows is None:
            raise ValueError("the packed read's graphs read each row's request slot: begin() needs req_rows")
        self._inputs(n, positions, forward_batch.out_cache_loc, embeddings, step.keys, step.dense_rows, req_rows)
        graph_step = self._step(size, fused)
        step.tape, step.builder = self.tape, self.builder  # the pass is counted from the graph tape
        self.active = (size, graph_step, forward_batch, step)
        return True

    def _eager(self, step: Step, why: str) -> None:
        self.passes["eager"][why] += 1
        step.prefill_layers = EAGER_REASONS[why]

    def end(self) -> None:
        """After the pass's forward: counted as replayed at its count, or as eager where a capture failed in it."""
        if self.active is not None:
            size, step = str(self.active[0]), self.active[3]
            if self.failed[size] is None:
                self.passes["by_tokens"][size] += 1
                step.prefill_layers = "replayed"
            else:
                self._eager(step, "its count's capture failed or strayed")
        self.active = None

    def capture_all(self, layers, embed, parts_of, vocab: int, seed: int = 0, chunk: int | None = None) -> None:
        """Every kept count's segments captured and checked before the server serves (it calls this once booted,
        with SGLang's pools allocated and a forward context published), so that no served pass waits on a capture or a
        check: the hybrid arm's first routed prefill comes under load. Per count two passes of no request through
        the routed `layers` on this rank (`embed` the embedding, `parts_of` a layer's parts, `vocab` the token ids
        drawn from; `_boot_pass`): the first captures each segment and checks its first replay against its eager
        run, the second, as unlike the first as a served pass may be (fewer rows, so padded; other requests,
        positions, keys and dense-mode rows), checks its first later replay against an eager rerun
        (`SegmentGraphs.check`). Each row writes its own KV slot and each request's rows read their own keys (the
        packed read, inside the segment); the backend read, eager in every served pass, is stood in for by each
        row's query. The KV slots and request rows the passes take are put back as they were. A count whose
        capture fails is marked, as at a served pass (`_segment`), and so is one whose checks strayed
        (`_refuse_straying`); an eager run that fails (as out of memory) fails the server's start. No pass is
        counted; each count's seconds are attested (`captured_at_boot_s`), and the row-visits the checks compared by
        branch (`boot_rows`: where none took Project-Only, the projector's replay went unchecked, and a warning
        says so). `chunk`: the server's prefill chunk, the
        most tokens one of its prefill passes holds (SGLang's chunked prefill never makes a longer one; None where
        it does not chunk, and a round's first prompt may then be as long as it is): the counts above the least
        count that holds it are left out, never captured (`reached_by`), and the static storage sized for that
        count."""
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

        self.reached = reached_by(self.sizes, chunk)
        self.boot_rows.update(run=0, project_only=0, unchecked=None)
        left_out = list(self.sizes[len(self.reached):])
        self.reach.update(prefill_chunk=chunk, left_out=left_out)
        if left_out:
            logger.info("routed prefill graphs: %s tokens left out, above the least count that holds the server's "
                        "prefill chunk of %d tokens", ",".join(map(str, left_out)), chunk)
            if self.loc is None:  # no pass has run, so no capture holds the storage yet
                self._allocate(self.reached[-1])
        device, cap = self.x.device, self.reached[-1]
        pool, req_to_token = get_token_to_kv_pool(), get_req_to_token_pool().req_to_token
        layer_ids = [parts_of(layer).radix.layer_id for layer in layers]
        # every row its own KV slot past SGLang's padding slot (what they held is put back after)
        slots = 1 + torch.arange(cap, device=device) % max(1, pool.get_key_buffer(layer_ids[0]).shape[0] - 1)
        kept = [(pool.get_key_buffer(lid)[slots].cpu(), pool.get_value_buffer(lid)[slots].cpu()) for lid in layer_ids]
        rows_kept: dict[int, torch.Tensor] = {}
        generator = torch.Generator().manual_seed(seed)
        if not self.packed:  # each routed layer's K/V writes, as its first replay after the capture left them
            pool_layer = {layer.layer_id: lid for layer, lid in zip(layers, layer_ids, strict=True)}
            self.graphs.after_first_replay = lambda key, outputs: self._check_kv_write(key, outputs, pool, pool_layer)
        try:
            for size in self.reached:
                t0 = time.perf_counter()
                rows = [0, 0]  # this count's (RUN, Project-Only) row-visits, kept where its replays serve
                if device.type == "cuda":  # the eager runs' cached blocks back to the device, which a capture's
                    torch.cuda.synchronize(device)  # pool may then take (it cannot take another pool's)
                    torch.cuda.empty_cache()
                for round_ in range(2):
                    if self.failed[str(size)] is not None:
                        break
                    n, positions, req_rows, keys, dense = self._boot_pass(size, round_, req_to_token, slots,
                                                                          rows_kept, generator)
                    x = embed(torch.randint(0, vocab, (n,), generator=generator).to(device))
                    self._inputs(n, positions, slots[:n], x, keys, dense, req_rows)
                    step = self._step(size, True)
                    for layer in layers:
                        self._layer(layer, size, step, x, layer.input_layernorm(x), parts_of(layer),
                                    lambda q, k, v, rows: q[:rows])
                    # each layer's (RUN, Project-Only) rows of the pass, as its maps launch wrote them (a read of
                    # the device: the start serves nothing yet)
                    rows = [a + int(b) for a, b in zip(rows, self.tape.counts.sum(dim=0).tolist(), strict=True)]
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                self.boot[str(size)] = round(time.perf_counter() - t0, 3)
                self._refuse_straying(size)
                why = self.failed[str(size)]
                if why is None:  # a refused count serves eagerly: its checks vouch for no replay served
                    self.boot_rows["run"] += rows[0]
                    self.boot_rows["project_only"] += rows[1]
                logger.log(logging.WARNING if why else logging.INFO,
                           "routed prefill graphs at %d tokens captured and checked in %.1f s%s", size,
                           self.boot[str(size)], f"; its passes run eagerly: {why}" if why else "")
            if not self.boot_rows["project_only"] and any(self.failed[str(n)] is None for n in self.reached):
                self.boot_rows["unchecked"] = ("no row of the checks at start took Project-Only, so no replay of "
                                               "the projector's path was compared with its eager run")
                logger.warning("routed prefill graphs: %s (the skipper ran every boot row)",
                               self.boot_rows["unchecked"])
        finally:
            self.graphs.after_first_replay = None
            for lid, (k, v) in zip(layer_ids, kept, strict=True):
                pool.get_key_buffer(lid)[slots] = k.to(device)
                pool.get_value_buffer(lid)[slots] = v.to(device)
            for row, held in rows_kept.items():
                req_to_token[row] = held
            if device.type == "cuda":  # the pools as they were before any stream of SGLang's reads them; the
                torch.cuda.synchronize(device)  # captures' eager runs' cached blocks back to the device
                torch.cuda.empty_cache()
                # what the device has left for the served passes' activations once every capture holds its pool
                self.graphs.memory["free_after_boot_bytes"] = torch.cuda.mem_get_info(device)[0]

    def _check_kv_write(self, key, outputs, pool, pool_layer: dict[int, int]) -> None:
        """With the backend read, at start: right after the first replay of a routed layer's segment before the read
        that follows its capture (the second boot pass, over other tokens, before the eager rerun that checks it
        writes the pool again), the K and V it computed against what the pool holds at the pass's slots, which
        SGLang's backend reads when serving. The boot's read stands in for the backend's and reads no pool, so only
        this sees a write that did not replay (a kernel outside the capture leaves the first pass's K/V there). Not
        compared where the pool stores another dtype (an fp8 KV cache), whose rounding would read as a
        difference."""
        if not (isinstance(key, tuple) and len(key) == 3 and key[2] == "in"):
            return
        size, lid = key[0], pool_layer[key[1]]
        _, k_out, v_out, *_ = outputs
        k, v = pool.get_key_buffer(lid), pool.get_value_buffer(lid)
        if k.dtype != k_out.dtype:
            self.kv_write["not_compared"] = f"the KV pool stores {k.dtype}, the segments compute {k_out.dtype}"
            return
        n = self.filled  # the rows of the boot pass under way
        slots = self.loc[:n]
        worst = difference([k[slots].reshape(n, -1), v[slots].reshape(n, -1)], [k_out[:n], v_out[:n]])
        self.kv_write["compared"] += 1
        self._kv_worst[size] = max(self._kv_worst.get(size, (-1.0, "")), (worst, f"layer {lid} at {size} tokens"))
        worst, where = max(self._kv_worst.values())
        self.kv_write.update(worst_difference=worst, worst_at=where)

    def _refuse_straying(self, size: int) -> None:
        """Count `size` marked failed, so that its passes run eagerly, where a segment's check at start strayed
        further than `CHECK_REFUSES` (its capture kept), or, with the backend read, the K/V the pool holds did
        (`_check_kv_write`)."""
        if self.failed[str(size)] is not None:
            return
        worst, where = self._kv_worst.get(size, (0.0, ""))
        if worst > CHECK_REFUSES:
            self.failed[str(size)] = f"the K/V the pool holds strayed from what {where}'s segment computed by " \
                                     f"{worst:.3g} of the largest value (over {CHECK_REFUSES}): its write did not " \
                                     "replay"
            return
        strayed = [(worst, key) for key, worst in self.graphs.worst_by_key.items()
                   if isinstance(key, tuple) and key[0] == size and worst > CHECK_REFUSES]
        if strayed:
            worst, key = max(strayed, key=lambda found: found[0])  # keys of a count differ in kind: not compared
            self.failed[str(size)] = f"segment {key!r}'s replay strayed from its eager run by {worst:.3g} of the " \
                                     f"largest value (over {CHECK_REFUSES})"

    @staticmethod
    def _boot_pass(size: int, round_: int, req_to_token: torch.Tensor, slots: torch.Tensor,
                   rows_kept: dict[int, torch.Tensor], generator: torch.Generator):
        """A boot pass at count `size`: (rows, positions, request slots, keys, dense-mode rows). Round 0: every row,
        one request (of at most a request row's width, more where the count is wider); round 1: a quarter fewer
        rows in two requests, the second's rows in dense mode, other keys. Each request takes its own request row
        past the padding request 0 (where SGLang's pool has one: kept in `rows_kept` to be put back), its rows
        in order at positions from 0, their KV slots `slots` in order written into its row."""
        device = slots.device
        n = size if round_ == 0 or size == 1 else size - max(1, size // 4)
        halves = [n] if round_ == 0 else [h for h in (n // 2, n - n // 2) if h]
        width = req_to_token.shape[1]
        lengths = [min(width, h - start) for h in halves for start in range(0, h, width)]
        spare = req_to_token.shape[0] - 1
        positions, req_rows, keys, dense = [], [], [], []
        start = 0
        for i, length in enumerate(lengths):
            row = 1 + (2 * round_ + i) % spare if spare > 0 else 0
            rows_kept.setdefault(row, req_to_token[row].clone())
            req_to_token[row, :length] = slots[start:start + length].to(req_to_token.dtype)
            positions.append(torch.arange(length))
            req_rows.append(torch.full((length,), row))
            keys.append(torch.full((length,), int(torch.randint(1, 1 << 30, (1,), generator=generator))))
            dense.append(torch.full((length,), round_ == 1 and i == len(lengths) - 1 and len(lengths) > 1))
            start += length
        return (n, *(torch.cat(t).to(device) for t in (positions, req_rows, keys, dense)))

    def _step(self, size: int, fused: bool) -> Step:
        """The step count `size`'s segments run (made at its first pass), its skipper's state for the pass in the
        static buffers replayed from the state segment."""
        step = self.steps.get(size)
        if step is None:
            step = self.steps[size] = Step("prefill", True, self.runtime.skipper, None, self.tape, self.builder,
                                           self.dense[:size], size, keys=self.keys[:size])
        x, positions, valid = self.x[:size], self.positions[:size], self.valid[:size]
        step.state = self._segment(size, (size, "state"),
                                   lambda: self.runtime.pass_state(step, x, positions, valid, fused))
        return step

    def _inputs(self, n: int, positions: torch.Tensor, loc: torch.Tensor, embeddings: torch.Tensor,
                keys: torch.Tensor | None = None, dense: torch.Tensor | None = None,
                req_rows: torch.Tensor | None = None) -> None:
        """A pass's `n` rows into the static buffers (request keys, dense-mode rows and request slots where it has
        them); the padding rows up to the rows the last pass wrote reset (request slot 0: a padding row reads
        request 0's first key, and its output is dropped)."""
        if self.loc is None:
            self.loc = torch.zeros(self.x.shape[0], dtype=loc.dtype, device=self.x.device)
        self.positions[:n].copy_(positions)
        self.loc[:n].copy_(loc)
        if keys is not None:
            self.keys[:n].copy_(keys)
        if req_rows is not None:
            self.req_rows[:n].copy_(req_rows)
        self.valid[:n].fill_(True)
        if dense is not None:
            self.dense[:n].copy_(dense)
        else:
            self.dense[:n].fill_(False)
        self.x[:n].copy_(embeddings)
        if self.filled > n:  # rows a longer pass wrote: padding now (the rows past them are padding already)
            for t in (self.positions, self.loc, self.keys, self.req_rows):
                t[n:self.filled].zero_()
            self.valid[n:self.filled].fill_(False)
            self.dense[n:self.filled].fill_(False)
        self.filled = n

    def layer(self, layer, x: torch.Tensor, u: torch.Tensor, parts) -> Handoff:
        """Routed layer `layer`'s hand-off for this pass from its input x and u = LN1 x, replayed (module
        docstring)."""
        size, step, forward_batch, _ = self.active
        attn = parts.attn

        def read(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> torch.Tensor:
            k, v = (t[:n].view(n, attn.num_kv_heads, attn.head_dim) for t in (k, v))
            return parts.radix(q[:n], k, v, forward_batch, save_kv_cache=False)  # the pass's read, its K/V written

        return self._layer(layer, size, step, x, u, parts, read)

    def _layer(self, layer, size: int, step: Step, x: torch.Tensor, u: torch.Tensor, parts, read) -> Handoff:
        """`layer`: x and u into the static rows, then with the packed read its one segment; with the backend
        read its segment before the read, `read(q, k, v, rows)` of the pass's rows into the static read output,
        its segment after the read (`GRAPH_READS`)."""
        n = x.shape[0]
        self.x[:n].copy_(x)
        self.u[:n].copy_(u)
        lid = layer.layer_id
        if self.packed:
            delta, h = self._segment(size, (size, lid, "layer"), lambda: self._whole(layer, step, parts))
        else:
            q, k, v, cohorts, weights = self._segment(size, (size, lid, "in"),
                                                      lambda: self._attention_in(layer, step, parts))
            self.a[:n].copy_(read(q, k, v, n).view(n, -1))
            delta, h = self._segment(size, (size, lid, "out"),
                                     lambda: self._attention_out(layer, step, parts, cohorts, weights))
        if lid == self.last_layer:
            return Handoff(delta[:n].clone(), h[:n].clone())
        return Handoff(delta[:n], h[:n])

    def _ops(self, layer, size: int, parts):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        # the static KV slots stand in for the batch's: the segment writes every row's K/V there
        batch = SimpleNamespace(out_cache_loc=self.loc[:size], forward_mode=ForwardMode.EXTEND)
        return self.layer_ops(layer, self.positions[:size], batch, self.req_rows[:size], parts)

    def _route(self, layer, step: Step, parts):
        """The layer's route over the static LN1 rows, recorded on the graph tape with the cohort maps built:
        (cohorts, branch weights)."""
        u = self.u[:step.rows]
        if layer._slot.fused_gate:
            from vskipper.mixed.router import gate_route

            route = gate_route(step.skipper, u, step.state, parts.router)
        else:
            router = parts.router if step.skipper.requires_router_weights else None
            route = step.skipper.route(layer.layer_id, u, step.state, router)
        cohorts = step.builder.record_and_build(step.tape, layer.layer_id, route, step.dense_rows)
        _, weights = step.tape.layer(layer.layer_id, step.rows)
        return cohorts, weights

    def _whole(self, layer, step: Step, parts) -> Handoff:
        """The packed read's one segment: the route and maps, Q, RoPE, every row's K/V written, the RUN cohort's
        packed read, o_proj onto a copy of x in the static residual rows, LN2, the FFN pair (the triton body's
        steps, `routed_layer`)."""
        size = step.rows
        cohorts, weights = self._route(layer, step, parts)
        h = self._out("h", self.x[:size])
        delta, h = routed_layer(self._ops(layer, size, parts), h, self.u[:size], None, weights, "triton", cohorts,
                                self.execution.tiles, x_owned=True)  # the triton body reads no run mask
        return Handoff(self._out("delta", delta), h)

    def _attention_in(self, layer, step: Step, parts):
        """The segment before the read: the route, the maps recording it, Q, RoPE, every row's K/V written."""
        cohorts, weights = self._route(layer, step, parts)
        q, k, v = triton_attention_in(self._ops(layer, step.rows, parts), self.u[:step.rows], cohorts,
                                      self.execution.tiles)
        return self._out("q", q), self._out("k", k), self._out("v", v), cohorts, weights

    def _attention_out(self, layer, step: Step, parts, cohorts, weights) -> Handoff:
        """The segment after the read: o_proj onto a copy of x in the static residual rows (a replay of it twice
        gives the same), LN2, the FFN pair."""
        size = step.rows
        h = self._out("h", self.x[:size])
        delta, h = triton_attention_out(self._ops(layer, size, parts), h, self.a[:size], weights, cohorts,
                                        self.execution.tiles, x_owned=True)
        return Handoff(self._out("delta", delta), h)

    def _out(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """`t` copied into the static output rows `name` (one set for every routed layer: a layer's outputs are
        consumed before the next layer's segments replay), which the segment returns in its place: a capture's
        own outputs are then its intermediates, whose memory the later captures share, rather than held per
        layer and count."""
        rows, width = t.shape
        out = self._outputs.get(name)
        if out is None or out.shape[1] != width or out.dtype != t.dtype:
            out = self._outputs[name] = torch.empty(self.x.shape[0], width, dtype=t.dtype, device=t.device)
        view = out[:rows]
        view.copy_(t)
        return view
