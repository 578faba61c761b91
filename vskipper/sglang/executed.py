"""What a server executes, read from SGLang's scheduler once it has booted, and the scheduler's own pass counts.

The comparability gates of an A/B (loadgen's `execution_difference` and `cross_arm_identity`) compare what each
server ran, never its launch flags: SGLang resolves and overrides flags while it boots (a chunk size disabled,
graph capture turned off by the attention backend, a KV pool sized by the memory left after the weights). Two hooks in the scheduler process, registered with vSkipper's others (`vskipper.sglang.hooks`):

  booted      AFTER Scheduler.get_init_info, which SGLang calls once the scheduler is built (weights loaded, KV
              pool allocated, graphs captured) and before the server reports ready: reads the executed
              configuration from the scheduler, its model runner and its pools, then has the runtime rewrite
              its attestation
  run batch   AROUND Scheduler.run_batch: counts the scheduler's own passes per phase (extend -> prefill,
              decode -> decode), the count the runtime's per-mode pass counters must sum to

The runtime attests both (`executed`, `scheduler_passes_total`); see `executed_configuration` for the fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vskipper.sglang import active
from vskipper.sglang.admission import is_health_check

BOOTED_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_init_info"
RUN_BATCH_TARGET = "sglang.srt.managers.scheduler.Scheduler.run_batch"
TARGETS = (BOOTED_TARGET, RUN_BATCH_TARGET)

CPU_PROFILE = "cpu"  # vSkipper's execution profile on CPU: the routed layers through the torch cohort backend, eager


@dataclass
class _State:
    """This scheduler process's executed configuration (None until booted) and pass counts."""

    config: dict[str, Any] | None = None
    passes: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    counting: bool = False  # the run-batch hook is in place (known once booted)


_STATE = _State()


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _kv_pool_bytes(pool: Any) -> int:
    size = pool.get_kv_size_bytes()
    return int(sum(size)) if isinstance(size, tuple) else int(size)


def vskipper_profile(runtime: Any) -> str:
    """vSkipper's execution profile: the name of the one the server was launched with (`vskipper serve`'s
    `ServeProfile`, attested as `execution.profile`), else the CPU profile."""
    profile = getattr(getattr(runtime, "spec", None), "profile", None) or {}
    return profile.get("name") or CPU_PROFILE


def executed_configuration(scheduler: Any, profile: str) -> dict[str, Any]:
    """The configuration a booted scheduler executes, read from its objects:

    attention_backend           {prefill, decode}: the backends the model runner resolved and built
    sampling_backend            the sampler's backend (SGLang's kernel settings, read where the sampler reads it)
    decode_graph_batch_sizes    decode batch sizes captured as graphs ([] when decode runs eager)
    chunked_prefill_size        None when prefill is not chunked
    max_prefill_tokens, max_running_requests
    kv_pool                     {tokens: the scheduler's token capacity, bytes: the pool's K/V buffers}
    dtype, kv_dtype, page_size
    tp_size, dp_size, pp_size, dp_attention
    schedule_policy, overlap_scheduler, mixed_chunk, prefix_cache (the tree cache's class)
    sglang_version              the installed package's
    profile                     vSkipper's execution profile
    """
    import sglang
    from sglang.srt.runtime_context import get_exec, get_parallel

    runner = scheduler.tp_worker.model_runner
    parallel = get_parallel()
    return {
        "attention_backend": {"prefill": runner.prefill_attention_backend_str,
                              "decode": runner.decode_attention_backend_str},
        "sampling_backend": get_exec().kernel.sampling_backend,
        "decode_graph_batch_sizes": sorted(int(b) for b in getattr(runner, "decode_cuda_graph_capture_bs", ())),
        "chunked_prefill_size": scheduler.chunked_prefill_size,
        "max_prefill_tokens": int(scheduler.max_prefill_tokens),
        "max_running_requests": int(scheduler.max_running_requests),
        "kv_pool": {"tokens": int(scheduler.max_total_num_tokens),
                    "bytes": _kv_pool_bytes(scheduler.token_to_kv_pool_allocator.get_kvcache())},
        "dtype": _dtype_name(runner.dtype),
        "kv_dtype": _dtype_name(runner.kv_cache_dtype),
        "page_size": int(scheduler.page_size),
        "tp_size": int(parallel.tp_size),
        "dp_size": int(parallel.dp_size),
        "pp_size": int(parallel.pp_size),
        "dp_attention": bool(parallel.enable_dp_attention),
        "schedule_policy": str(scheduler.schedule_policy),
        "overlap_scheduler": bool(scheduler.enable_overlap),
        "mixed_chunk": bool(scheduler.is_mixed_chunk),
        "prefix_cache": type(scheduler.tree_cache).__name__,
        "sglang_version": sglang.__version__,
        "profile": profile,
    }


_UNDECLARED = object()


def _name(value: str) -> Any:
    return _UNDECLARED if value == "auto" else value


def _chunk(value: str) -> int | None:
    return int(value) if int(value) > 0 else None


def _graph_backend(value: str) -> Any:
    return [] if value == "disabled" else _UNDECLARED


# SGLang launch flags that name an executed field outright: flag -> (field path, the declared value of the
# flag's value, or for a switch the value it declares).
_VALUED_FLAGS: dict[str, tuple[tuple[str, ...], Any]] = {
    "--attention-backend": (("attention_backend", "both"), str),
    "--prefill-attention-backend": (("attention_backend", "prefill"), str),
    "--decode-attention-backend": (("attention_backend", "decode"), str),
    "--sampling-backend": (("sampling_backend",), str),
    "--chunked-prefill-size": (("chunked_prefill_size",), _chunk),
    "--max-prefill-tokens": (("max_prefill_tokens",), int),
    "--max-running-requests": (("max_running_requests",), int),
    "--dtype": (("dtype",), _name),
    "--kv-cache-dtype": (("kv_dtype",), _name),
    "--page-size": (("page_size",), int),
    "--tp-size": (("tp_size",), int),
    "--dp-size": (("dp_size",), int),
    "--pp-size": (("pp_size",), int),
    "--schedule-policy": (("schedule_policy",), str),
    "--cuda-graph-backend-decode": (("decode_graph_batch_sizes",), _graph_backend),
}
_SWITCH_FLAGS: dict[str, tuple[tuple[str, ...], Any]] = {
    "--disable-overlap-schedule": (("overlap_scheduler",), False),
    "--enable-mixed-chunk": (("mixed_chunk",), True),
    "--enable-dp-attention": (("dp_attention",), True),
    "--disable-cuda-graph": (("decode_graph_batch_sizes",), []),
}


def declared_execution(flags: Sequence[str]) -> dict[str, Any]:
    """The executed fields a launch's SGLang flags declare outright (a later flag wins, as in SGLang); what SGLang
    decides itself (the KV pool, limits left unset, `auto` dtypes) is not declared. `--attention-backend` declares
    both phases' backend, `--prefill-/--decode-attention-backend` one phase's, which wins (as in SGLang)."""
    out: dict[str, Any] = {}
    args = list(flags)
    i = 0
    while i < len(args):
        flag, _, inline = args[i].partition("=")
        i += 1
        if flag in _SWITCH_FLAGS:
            path, declared = _SWITCH_FLAGS[flag]
        elif flag in _VALUED_FLAGS:
            if not inline:
                if i >= len(args):
                    raise ValueError(f"launch flag {flag} has no value")
                inline, i = args[i], i + 1
            path, read = _VALUED_FLAGS[flag]
            declared = read(inline)
            if declared is _UNDECLARED:
                continue
        else:
            continue
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = declared
    if "attention_backend" in out:  # a phase's own flag wins over --attention-backend, as in SGLang
        backends = out["attention_backend"]
        both = backends.pop("both", None)
        out["attention_backend"] = {p: backends.get(p, both) for p in ("prefill", "decode")
                                    if backends.get(p, both) is not None}
    return out


def batch_phase(forward_mode: Any) -> str | None:
    """The phase a scheduler batch counts under, classified as the runtime classifies a forward pass."""
    if forward_mode.is_decode():
        return "decode"
    if forward_mode.is_extend():
        return "prefill"
    return None


_runtime = active.current_runtime


def after_boot(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    runtime = _runtime()
    _STATE.config = executed_configuration(scheduler, vskipper_profile(runtime))
    _STATE.counting = RUN_BATCH_TARGET in HookRegistry._patched
    if runtime is not None:
        runtime.state_changed()


def around_run_batch(original, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    phase = batch_phase(batch.forward_mode)
    reqs = getattr(batch, "reqs", None) or ()
    if phase is None or (reqs and all(is_health_check(r.rid) for r in reqs)):  # /health_generate: not traffic
        return original(scheduler, batch, *args, **kwargs)
    runtime = _runtime()
    counted = sum(runtime.counters.passes[phase].values()) if runtime is not None else 0
    _STATE.passes[phase] += 1  # before the pass, so the attestation the runtime writes after it includes it
    result = original(scheduler, batch, *args, **kwargs)
    if runtime is not None and sum(runtime.counters.passes[phase].values()) == counted:
        runtime.state_changed()  # the runtime did not count this pass: attest the disagreement
    return result


def attestation() -> dict[str, Any]:
    """The runtime's attestation entries: `executed` once booted, `scheduler_passes_total` once counting."""
    doc: dict[str, Any] = {}
    if _STATE.config is not None:
        doc["executed"] = _STATE.config
    if _STATE.counting:
        doc["scheduler_passes_total"] = dict(_STATE.passes)
    return doc


def register(registry: Any, hook_type: Any) -> None:
    registry.register(BOOTED_TARGET, after_boot, hook_type.AFTER)
    registry.register(RUN_BATCH_TARGET, around_run_batch, hook_type.AROUND)
