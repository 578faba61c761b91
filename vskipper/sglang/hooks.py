"""vSkipper's hooks into SGLang's scheduler and prefix cache, registered through SGLang's plugin framework.

SGLang loads general plugins (entry point group `sglang.srt.plugins`) at the start of every process, the
scheduler's included, and applies their hooks before the scheduler is built. `register` is that entry point
(pyproject.toml); it registers nothing unless the process belongs to a `vskipper serve` server.

  admission round   AROUND Scheduler._get_new_batch_prefill_raw: before SGLang matches prefixes and forms the
                    round, the runtime previews the round's prefill mode and keys every waiting request's prefix
                    lookups by it; after, it commits the mode for the requests the round admitted
  prefix insert     AROUND <tree cache>.insert_req: a released request whose decode ran in another mode than
                    its prefill inserts its prompt's KV only
  executed config   AFTER Scheduler.get_init_info and AROUND Scheduler.run_batch (`vskipper.sglang.executed`):
                    what SGLang executes, read after boot, and the scheduler's own pass count per phase

SGLang only logs a hook that fails to apply, so the model class calls `check_applied` at load and refuses to
serve a routed arm without them.
"""

from __future__ import annotations

import os
from typing import Any

from vskipper.sglang import executed
from vskipper.sglang.spec import ENV_ARM, ServeConfigError

ADMISSION_TARGET = "sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw"
INSERT_TARGETS = (
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.insert_req",  # SGLang's default tree cache
    "sglang.srt.mem_cache.radix_cache.RadixCache.insert_req",
)
TARGETS = (ADMISSION_TARGET, *INSERT_TARGETS, *executed.TARGETS)


def _runtime():
    from vskipper.sglang import runtime

    return runtime.current_runtime()


def prefill_budget(scheduler: Any) -> int | None:
    """The prompt tokens one admission round takes: the chunk size when prefill is chunked, else SGLang's
    per-round prefill token cap."""
    chunk = getattr(scheduler, "chunked_prefill_size", None)
    if chunk is not None and chunk > 0:
        return int(chunk)
    cap = getattr(scheduler, "max_prefill_tokens", None)
    return int(cap) if cap else None


def around_admission_round(original, scheduler, *args, **kwargs):
    runtime = _runtime()
    if runtime is None:
        return original(scheduler, *args, **kwargs)
    runtime.key_candidates(scheduler.waiting_queue, prefill_budget(scheduler))
    result = original(scheduler, *args, **kwargs)
    new_batch = result[0]
    if new_batch is not None:
        runtime.admit(new_batch.reqs)
    return result


def around_insert_req(original, cache, req, *args, up_to: int, **kwargs):
    runtime = _runtime()
    if runtime is not None:
        up_to = runtime.kv_insert_limit(req.rid, up_to, len(req.origin_input_ids))
    return original(cache, req, *args, up_to=up_to, **kwargs)


def register() -> None:
    """SGLang general plugin entry point: register the hooks in processes of a vSkipper server."""
    if ENV_ARM not in os.environ:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(ADMISSION_TARGET, around_admission_round, HookType.AROUND)
    for target in INSERT_TARGETS:
        HookRegistry.register(target, around_insert_req, HookType.AROUND)
    executed.register(HookRegistry, HookType)


def check_applied() -> None:
    """Refuse to serve when a hook did not apply (SGLang logs hook failures and carries on)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    missing = [t for t in TARGETS if t not in HookRegistry._patched]
    if missing:
        raise ServeConfigError(
            f"vSkipper's SGLang hooks did not apply ({', '.join(missing)}): the vskipper package must be installed "
            "so SGLang finds its plugin (entry point group 'sglang.srt.plugins', name 'vskipper'), and no "
            "SGLANG_PLUGINS list may leave it out")
