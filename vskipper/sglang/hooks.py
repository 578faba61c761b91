"""vSkipper's hooks into SGLang's scheduler and prefix cache, registered through SGLang's plugin framework.

SGLang loads general plugins (entry point group `sglang.srt.plugins`) at the start of every process, the
scheduler's included, and applies their hooks before the scheduler is built. `register` is that entry point
(pyproject.toml); it registers nothing unless the process belongs to a `vskipper serve` server.

  admission round   AROUND Scheduler._get_new_batch_prefill_raw: before SGLang matches prefixes and forms the
                    round, the runtime previews the round's prefill mode (from the waiting requests SGLang's
                    limits let in) and keys every waiting request's prefix lookups by it; after, it decides the
                    mode on the requests the round admitted (`Runtime.admit`)
  prefix insert     AROUND <tree cache>.insert_req: a released request whose decode ran in another mode than
                    its prefill inserts only what its admission prefilled, never less than the cache protects
  release           AROUND <tree cache>.on_release (every path that frees a request's KV row: finish, abort,
                    retraction, drain) and Scheduler._release_aborted_request (aborts from the waiting queue):
                    a request's record leaves with it; a retracted one keeps it until it is admitted again
  each pass         AROUND ModelRunner.forward: before, the model decides the pass and writes its plan into its
                    static buffers (`SkipperCausalLM.prepare_pass`); after, SGLang's report of a graph replay is
                    counted and the runtime counts the pass (`finish_pass`)
  decode capture    AROUND DecodeCudaGraphRunner.capture: before SGLang captures its decode graphs, a model whose
                    arm routes decode installs its graph variants (a dense and a routed graph per batch size,
                    `SkipperCausalLM.decode_graph_variants`); no state document is taken (nor so any device
                    copy or timing event waited for) through the capture (`Runtime.capturing_graphs`), and
                    AROUND the prefill graph runner's capture likewise
  prefill graphs    AFTER Scheduler.get_init_info, before the executed configuration's reader there: the routed
                    prefill graphs (`vskipper.sglang.prefill_graphs`), where the spec asks for them, captured and
                    checked at every count before the server reports ready (`SkipperCausalLM.capture_prefill_graphs`)
  replay veto       AROUND the graph runners' can_run_graph: a routed pass replays only a routed variant, never a
                    dense graph (`SkipperCausalLM.graph_veto`, `vskipper.sglang.replay`)
  executed config   AFTER Scheduler.get_init_info and AROUND Scheduler.run_batch (`vskipper.sglang.executed`):
                    what SGLang executes, read after boot, and the scheduler's own pass count per phase
  stand-in ops      AROUND RMSNorm.forward_native and SiluAndMul.forward_native, only where the server runs the
                    CUDA stand-ins' Triton ops (`--stand-in-ops triton`, `vskipper.sglang.stand_in_ops`)

SGLang only logs a hook that fails to apply, so the model class calls `check_applied` at load and refuses to
serve a routed arm without them.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

from vskipper.sglang import active, executed, stand_in_ops
from vskipper.sglang.admission import AdmissionLimits
from vskipper.sglang.part_times import pass_tokens
from vskipper.sglang.spec import ENV_ARM, ServeConfigError

ADMISSION_TARGET = "sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw"
INSERT_TARGETS = (
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.insert_req",  # SGLang's default tree cache
    "sglang.srt.mem_cache.radix_cache.RadixCache.insert_req",
)
RELEASE_TARGETS = (
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.on_release",
    "sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache.on_release",  # every other tree cache
)
QUEUE_ABORT_TARGET = "sglang.srt.managers.scheduler.Scheduler._release_aborted_request"
FORWARD_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
GRAPH_TARGETS = (
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph",
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.can_run_graph",
    "sglang.srt.model_executor.cpu_graph_runner.CPUGraphRunner.can_run_graph",
)
CAPTURE_TARGET = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture"
PREFILL_CAPTURE_TARGET = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.capture"
# SGLang's opt-in metadata glue graph (SGLANG_ENABLE_METADATA_GLUE_GRAPH): captured lazily while serving, at a decode
# replay's third run of a batch size
GLUE_RUN_TARGET = "sglang.srt.model_executor.runner.metadata_glue_graph.MetadataGlueGraph.run"
TARGETS = (ADMISSION_TARGET, *INSERT_TARGETS, *RELEASE_TARGETS, QUEUE_ABORT_TARGET, FORWARD_TARGET, *GRAPH_TARGETS,
           CAPTURE_TARGET, PREFILL_CAPTURE_TARGET, GLUE_RUN_TARGET, *executed.TARGETS)


_runtime = active.current_runtime


def prefill_budget(scheduler: Any) -> int | None:
    """The prompt tokens one admission round takes: the chunk size when prefill is chunked, else SGLang's
    per-round prefill token cap."""
    chunk = getattr(scheduler, "chunked_prefill_size", None)
    if chunk is not None and chunk > 0:
        return int(chunk)
    cap = getattr(scheduler, "max_prefill_tokens", None)
    return int(cap) if cap else None


def prefill_chunk(scheduler: Any) -> int | None:
    """The most tokens one of the scheduler's prefill passes holds where it chunks its prefill (its chunk: the
    PrefillAdder never takes more, a mixed chunk's decode rows included), else None: unchunked, a round's first
    prompt passes SGLang's per-round cap whole."""
    chunk = getattr(scheduler, "chunked_prefill_size", None)
    return int(chunk) if chunk is not None and chunk > 0 else None


def admission_limits(scheduler: Any, running_batch: Any) -> AdmissionLimits:
    """What SGLang's next admission round can take, read as its PrefillAdder will: the prefill budget, the free
    plus evictable KV tokens less the running requests' decode reservations, and the free request slots. A limit
    this SGLang does not expose is left open (the admitted round's decision covers it)."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    running = list(getattr(running_batch, "reqs", None) or ())
    try:
        ratio = float(scheduler.new_token_ratio_tracker.current)
        reserved = sum(min(max(r.sampling_params.max_new_tokens - len(r.output_ids), 0), CLIP_MAX_NEW_TOKENS)
                       for r in running) * ratio
        kv_tokens = (scheduler.token_to_kv_pool_allocator.available_size() + scheduler.tree_cache.evictable_size()
                     - reserved)
    except AttributeError:
        kv_tokens = None
    try:
        requests = scheduler.get_num_allocatable_reqs(len(running), running_batch=running_batch)
        if scheduler.max_running_requests:
            requests = min(requests, scheduler.max_running_requests - len(running))
    except (AttributeError, TypeError):
        requests = None
    return AdmissionLimits(prefill_budget(scheduler), kv_tokens, requests, CLIP_MAX_NEW_TOKENS,
                           int(getattr(scheduler, "page_size", 1) or 1))


def around_admission_round(original, scheduler, *args, **kwargs):
    runtime = _runtime()
    if runtime is None:
        return original(scheduler, *args, **kwargs)
    running_batch = kwargs.get("running_batch", args[1] if len(args) > 1 else None)
    runtime.key_candidates(scheduler.waiting_queue, admission_limits(scheduler, running_batch))
    result = original(scheduler, *args, **kwargs)
    new_batch = result[0]
    if new_batch is not None:
        runtime.admit(new_batch.reqs)
    return result


def around_insert_req(original, cache, req, *args, up_to: int, **kwargs):
    runtime = _runtime()
    if runtime is not None:
        up_to = runtime.kv_insert_limit(req.rid, up_to, req.kv.cache_protected_len)
    return original(cache, req, *args, up_to=up_to, **kwargs)


def around_on_release(original, cache, req, *args, **kwargs):
    result = original(cache, req, *args, **kwargs)
    runtime = _runtime()
    if runtime is not None:
        runtime.release(req.rid, finished=req.finished())
    return result


def around_release_aborted_request(original, scheduler, req, *args, **kwargs):
    result = original(scheduler, req, *args, **kwargs)
    runtime = _runtime()
    if runtime is not None:
        runtime.abort_queued(req.rid)
    return result


def _model():
    return active.active_model()


def around_model_forward(original, runner, forward_batch, *args, **kwargs):
    model = _model() if getattr(runner, "model", None) is not None else None
    if model is None or runner.model is not model:
        return original(runner, forward_batch, *args, **kwargs)
    model.prepare_pass(forward_batch)
    try:
        if model.part_clock is None:
            output = original(runner, forward_batch, *args, **kwargs)
        else:  # the measurement mode: the pass timed part by part (its K/V writes through the runner's pool)
            model.part_clock.wrap(runner.token_to_kv_pool, "set_kv_buffer", "kv_write")
            output = model.part_clock.around_pass(forward_batch.forward_mode,
                                                  lambda: original(runner, forward_batch, *args, **kwargs),
                                                  model.control_pass(), pass_tokens(forward_batch),
                                                  model.pass_is_routed(forward_batch))
    except BaseException:
        model.slot.prepared = None
        raise
    model.finish_pass(forward_batch, bool(getattr(output, "can_run_graph", False)))
    return output


def around_can_run_graph(original, graph_runner, forward_batch, *args, **kwargs):
    answer = original(graph_runner, forward_batch, *args, **kwargs)
    model = _model()
    return answer if model is None else model.graph_veto(forward_batch, bool(answer))


def _capturing_model(graph_runner):
    """The skipper model a graph runner captures, or None."""
    model = _model()
    runner = getattr(graph_runner, "model_runner", None)
    return model if model is not None and getattr(runner, "model", None) is model else None


def _capture_held(model):
    """Around a graph capture of `model`: its runtime takes no state document, which waits for and queries the
    device's copies and timing events, refused by CUDA from any thread while it captures in its global mode
    (`Runtime.capturing_graphs`). Nothing for another model's capture."""
    return model.runtime.capturing_graphs() if model is not None else nullcontext()


def around_decode_capture(original, graph_runner, *args, **kwargs):
    model = _capturing_model(graph_runner)
    if model is not None:
        variants = model.decode_graph_variants(graph_runner)
        if variants is not None:
            graph_runner.attention_graph_variants = variants
    with _capture_held(model):
        return original(graph_runner, *args, **kwargs)


def around_prefill_capture(original, graph_runner, *args, **kwargs):
    with _capture_held(_capturing_model(graph_runner)):
        return original(graph_runner, *args, **kwargs)


def after_boot_capture(result, scheduler, *args, **kwargs) -> None:
    """Once SGLang's scheduler is built (its pools allocated, its own graphs captured) and before it reports
    ready: the skipper model's routed prefill graphs captured and checked, where the spec asks for them, at the
    counts a pass within the scheduler's prefill chunk reaches (`SkipperCausalLM.capture_prefill_graphs`)."""
    model = _model()
    runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    if model is not None and getattr(runner, "model", None) is model:
        model.capture_prefill_graphs(runner.attn_backend, prefill_chunk(scheduler))


def glue_captures(glue, key) -> bool:
    """Whether this run of SGLang's metadata glue graph for `key` captures its graph (`MetadataGlueGraph.run`: its
    warm-up runs done, no graph yet, not disabled), read from its own state; True where that state is not as this
    SGLang keeps it (holding the state off a run that captures nothing costs a wait at most)."""
    try:
        if glue.disabled:
            return False
        state = glue._states.get(key)
        return state is not None and state["graph"] is None and state["warmups"] >= glue.NUM_WARMUP
    except (AttributeError, KeyError, TypeError):
        return True


def around_glue_graph_run(original, glue, attn_backend, fb_view, key, *args, **kwargs):
    """SGLang's metadata glue graph captures in the serving loop, not at start-up: the run that captures holds the
    skipper model's runtime from taking a state document (as the graph runners' captures do); every other run
    goes straight through."""
    model = _model()
    held = _capture_held(model) if model is not None and glue_captures(glue, key) else nullcontext()
    with held:
        return original(glue, attn_backend, fb_view, key, *args, **kwargs)


def register() -> None:
    """SGLang general plugin entry point: register the hooks in processes of a vSkipper server."""
    if ENV_ARM not in os.environ:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(ADMISSION_TARGET, around_admission_round, HookType.AROUND)
    for target in INSERT_TARGETS:
        HookRegistry.register(target, around_insert_req, HookType.AROUND)
    for target in RELEASE_TARGETS:
        HookRegistry.register(target, around_on_release, HookType.AROUND)
    HookRegistry.register(QUEUE_ABORT_TARGET, around_release_aborted_request, HookType.AROUND)
    HookRegistry.register(FORWARD_TARGET, around_model_forward, HookType.AROUND)
    for target in GRAPH_TARGETS:
        HookRegistry.register(target, around_can_run_graph, HookType.AROUND)
    HookRegistry.register(CAPTURE_TARGET, around_decode_capture, HookType.AROUND)
    HookRegistry.register(PREFILL_CAPTURE_TARGET, around_prefill_capture, HookType.AROUND)
    HookRegistry.register(GLUE_RUN_TARGET, around_glue_graph_run, HookType.AROUND)
    # before the executed configuration's reader on the same target (hooks wrap in the order registered), so that
    # the attestation it has written holds the captures
    HookRegistry.register(executed.BOOTED_TARGET, after_boot_capture, HookType.AFTER)
    executed.register(HookRegistry, HookType)
    stand_in_ops.register(HookRegistry, HookType)


def check_applied(targets: tuple[str, ...] | None = None) -> None:
    """Refuse to serve when a hook did not apply (SGLang logs hook failures and carries on): `targets`, or every
    hook this process needs."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    wanted = (*TARGETS, *stand_in_ops.targets()) if targets is None else targets
    missing = [t for t in wanted if t not in HookRegistry._patched]
    if missing:
        raise ServeConfigError(
            f"vSkipper's SGLang hooks did not apply ({', '.join(missing)}): the vskipper package must be installed "
            "so SGLang finds its plugin (entry point group 'sglang.srt.plugins', name 'vskipper'), and no "
            "SGLANG_PLUGINS list may leave it out")
