"""vSkipper's runtime under SGLang's multi-process layout (pure Python: the HTTP process reads it too).

Every scheduler process runs the model, so every one builds a runtime. The tensor-parallel ranks that serve
the same requests take identical decisions: only the first (attention-TP rank 0) counts and reports. Each
data-parallel replica, and each attention-DP group, serves requests of its own: it writes its own state file
next to the first one's, and the HTTP process merges them into one attestation. Their Prometheus counters live
in SGLang's multiprocess directory, whose collector sums them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The server's run: set by the HTTP process before SGLang spawns its schedulers, written into every replica's
# state file, and the only run whose state files the HTTP process merges (a reused --state-file folder may hold
# files of an earlier run, with another data-parallel size).
ENV_RUN_ID = "VSKIPPER_RUN_ID"


@dataclass(frozen=True)
class Placement:
    """Where one scheduler process sits in SGLang's parallel layout."""

    attn_tp_rank: int = 0  # rank among the processes serving the same requests (tensor parallel)
    dp_rank: int = 0  # data-parallel replica
    attn_dp_rank: int = 0  # attention data-parallel group (--enable-dp-attention)
    pp_size: int = 1

    @property
    def reports(self) -> bool:
        """One process per group of requests counts and writes the attestation."""
        return self.attn_tp_rank == 0

    @property
    def replica(self) -> str:
        return f"dp{self.dp_rank}-adp{self.attn_dp_rank}"

    def state_file(self, base: Path) -> Path:
        if self.dp_rank == 0 and self.attn_dp_rank == 0:
            return base
        return base.with_name(f"{base.stem}.{self.replica}{base.suffix}")

    @classmethod
    def from_sglang(cls) -> Placement:
        """This process's placement as SGLang published it (the defaults where a rank is not published)."""
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()

        def read(name: str, default: int) -> int:
            try:
                value = getattr(parallel, name)
            except Exception:  # an unpublished rank raises; a single-process server has none
                return default
            return default if value is None else int(value)

        return cls(read("attn_tp_rank", read("tp_rank", 0)), read("dp_rank", 0), read("attn_dp_rank", 0),
                   read("pp_size", 1))


def replica_state_files(base: Path) -> list[Path]:
    """The state files of every replica writing next to `base` (the first replica's is `base` itself)."""
    return [base] + sorted(base.parent.glob(f"{base.stem}.dp*-adp*{base.suffix}"))


def remove_state_files(base: Path) -> None:
    """Remove the state files an earlier server left at `base` (before this server's schedulers start)."""
    for path in replica_state_files(base):
        path.unlink(missing_ok=True)


def of_run(parts: list[dict[str, Any]], run_id: str | None) -> list[dict[str, Any]]:
    """The replicas' attestations written by the run `run_id` (all of them when no run is named)."""
    return parts if run_id is None else [p for p in parts if p.get("run_id") == run_id]


def merge_attestations(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One attestation for the server from its replicas': every `*_total` counter summed (they count disjoint
    requests), the design fields from the first replica, and each replica's own switch under `replicas`."""

    def add(a: Any, b: Any) -> Any:
        if isinstance(a, dict) and isinstance(b, dict):
            return {k: add(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in {**a, **b}}
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return a + b
        return a

    def merge(a: dict, b: dict) -> dict:
        out = dict(a)
        for key, value in b.items():
            if key not in out:
                out[key] = value
            elif key.endswith("_total"):
                out[key] = add(out[key], value)
            elif isinstance(out[key], dict) and isinstance(value, dict):
                out[key] = merge(out[key], value)
        return out

    merged = parts[0]
    for part in parts[1:]:
        merged = merge(merged, part)
    if len(parts) > 1:
        merged = {**merged, "replicas": [{"placement": p.get("placement"), "machine": p.get("machine"),
                                          "switch": p.get("switch"), "updated": p.get("updated")} for p in parts]}
    return merged


def state_request_file(base: Path) -> Path:
    """Where the HTTP process stamps a request for fresh state files (every replica's writer watches it)."""
    return base.with_name(base.name + ".request")


def request_state(base: Path) -> int:
    """Ask every replica's writer for a fresh state file; returns the stamp their documents answer with."""
    stamp = time.time_ns()
    path = state_request_file(base)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(str(stamp))
    os.replace(tmp, path)
    return stamp


def read_state_request(base: Path) -> int:
    """The latest request stamp (0: none yet)."""
    try:
        return int(state_request_file(base).read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0
