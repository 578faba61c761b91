"""What one SGLang admission round can take, and how many prompt tokens its candidates bring (pure Python).

Before SGLang forms a round, vSkipper previews the round's prefill mode, because the mode keys the prefix
lookups SGLang makes while it forms the round. The candidates are the waiting requests, in queue order, that the
round's limits let in, counted as SGLang's PrefillAdder counts them: the prefill token budget (the request that
crosses it is chunked, and counted whole), the KV tokens a request reserves (its prefill plus its remaining
output, clipped, plus one page), and the free request slots. The preview is a forecast: the mode is decided on
the round SGLang actually admits (`Runtime.admit`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # sglang.srt.constants: the rid of /health_generate's probe request


def is_health_check(rid: str) -> bool:
    """A request of /health_generate's probe: served, but never counted as traffic."""
    return str(rid).startswith(HEALTH_CHECK_RID_PREFIX)


def prompt_tokens(req: Any) -> int:
    """Tokens an admission puts through prefill before prefix hits (a retracted request re-prefills its output)."""
    return len(req.origin_input_ids) + len(getattr(req, "output_ids", None) or ())


def reserved_output_tokens(req: Any, clip: int) -> int:
    """Output tokens SGLang reserves KV for when it admits `req` (what is left of max_new_tokens, clipped)."""
    return min(max(req.sampling_params.max_new_tokens - len(getattr(req, "output_ids", None) or ()), 0), clip)


@dataclass(frozen=True)
class AdmissionLimits:
    """The limits of the next admission round; None leaves a limit open."""

    prefill_tokens: int | None = None  # the chunk size when prefill is chunked, else the per-round token cap
    kv_tokens: float | None = None  # free + evictable KV tokens, less the running requests' decode reservations
    requests: int | None = None  # free request slots
    clip_new_tokens: int = 4096  # SGLang's CLIP_MAX_NEW_TOKENS
    page_size: int = 1

    def candidate_tokens(self, waiting: Iterable[Any]) -> int:
        """The prompt tokens of the waiting requests, in order, that these limits let into the round."""
        total = admitted = 0
        kv = 0.0
        for req in waiting:
            if self.requests is not None and admitted >= self.requests:
                break
            if self.prefill_tokens is not None and total >= self.prefill_tokens:
                break
            tokens = prompt_tokens(req)
            if self.kv_tokens is not None:
                kv += tokens + reserved_output_tokens(req, self.clip_new_tokens) + self.page_size
                if kv > self.kv_tokens:
                    break
            total += tokens
            admitted += 1
        return total
