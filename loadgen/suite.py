"""Frozen suites: JSONL files of requests with token-id prompts.

One request per line:

    {"id": "gsm8k:test:17", "input_ids": [128000, ...], "scored": true,
     "doc": {...},                     # optional: the document the quality scorer reads (e.g. its answer)
     "max_new_tokens": 256}            # optional: a per-request generation cap

A suite's identity is the SHA-256 of its canonical lines (`Suite.digest`), which the declared-cell-size gate
checks. `build_suite` tokenizes a local JSONL of prompts with a local tokenizer directory (its
`tokenizer.json`, read with the `tokenizers` library; no hub access); `pad_suite` appends unscored requests
from another suite to reach a target size (the paper pads GSM8K and CoQA load with training-split prompts).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class SuiteError(ValueError):
    pass


@dataclass(frozen=True)
class SuiteRequest:
    id: str
    input_ids: tuple[int, ...]
    scored: bool = True
    doc: Mapping[str, Any] | None = None
    max_new_tokens: int | None = None

    @classmethod
    def from_dict(cls, d: Any, where: str) -> SuiteRequest:
        if not isinstance(d, Mapping):
            raise SuiteError(f"{where}: must be a JSON object")
        rid = d.get("id")
        if not isinstance(rid, str) or not rid:
            raise SuiteError(f"{where}.id: required, a non-empty string")
        ids = d.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise SuiteError(f"{where}.input_ids: required, a non-empty list of non-negative token ids")
        scored = d.get("scored", True)
        if not isinstance(scored, bool):
            raise SuiteError(f"{where}.scored: must be true or false")
        cap = d.get("max_new_tokens")
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise SuiteError(f"{where}.max_new_tokens: must be a positive integer")
        doc = d.get("doc")
        if doc is not None and not isinstance(doc, Mapping):
            raise SuiteError(f"{where}.doc: must be an object")
        unknown = sorted(set(d) - {"id", "input_ids", "scored", "doc", "max_new_tokens"})
        if unknown:
            raise SuiteError(f"{where}.{unknown[0]}: unknown field")
        return cls(rid, tuple(ids), scored, doc, cap)

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "input_ids": list(self.input_ids), "scored": self.scored}
        if self.doc is not None:
            d["doc"] = dict(self.doc)
        if self.max_new_tokens is not None:
            d["max_new_tokens"] = self.max_new_tokens
        return d

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class Suite:
    name: str
    requests: tuple[SuiteRequest, ...]
    digest: str = field(default="")

    def __post_init__(self) -> None:
        if not self.requests:
            raise SuiteError(f"suite {self.name!r}: has no requests")
        seen: set[str] = set()
        for r in self.requests:
            if r.id in seen:
                raise SuiteError(f"suite {self.name!r}: duplicate request id {r.id!r}")
            seen.add(r.id)
        object.__setattr__(self, "digest", _digest(self.requests))

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def ids(self) -> list[str]:
        return [r.id for r in self.requests]

    def lines(self) -> list[str]:
        return [_canonical(r) for r in self.requests]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(line + "\n" for line in self.lines()))
        return path


def _canonical(r: SuiteRequest) -> str:
    return json.dumps(r.as_dict(), sort_keys=True, separators=(",", ":"))


def _digest(requests: Iterable[SuiteRequest]) -> str:
    h = hashlib.sha256()
    for r in requests:
        h.update(_canonical(r).encode())
        h.update(b"\n")
    return h.hexdigest()


def load_suite(path: str | Path, name: str | None = None) -> Suite:
    path = Path(path)
    if not path.is_file():
        raise SuiteError(f"suite: no file at {path}")
    requests = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SuiteError(f"{path.name}:{n}: not JSON ({exc.msg})") from None
        requests.append(SuiteRequest.from_dict(data, where=f"{path.name}:{n}"))
    return Suite(name or path.stem, tuple(requests))


def _load_tokenizer(tokenizer_dir: str | Path):
    from tokenizers import Tokenizer

    path = Path(tokenizer_dir)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise SuiteError(f"tokenizer: no tokenizer.json at {path}")
    return Tokenizer.from_file(str(file))


def build_suite(prompts: str | Path, tokenizer_dir: str | Path, *, name: str | None = None,
                id_prefix: str = "prompt", text_field: str = "prompt", id_field: str = "id",
                scored: bool = True, add_special_tokens: bool = True,
                max_new_tokens: int | None = None) -> Suite:
    """Tokenize a local JSONL of prompts (one object per line with `text_field`; other fields become `doc`)."""
    tok = _load_tokenizer(tokenizer_dir)
    prompts = Path(prompts)
    if not prompts.is_file():
        raise SuiteError(f"prompts: no file at {prompts}")
    requests = []
    for n, line in enumerate(prompts.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SuiteError(f"{prompts.name}:{n}: not JSON ({exc.msg})") from None
        text = obj.get(text_field) if isinstance(obj, dict) else None
        if not isinstance(text, str) or not text:
            raise SuiteError(f"{prompts.name}:{n}.{text_field}: required, a non-empty string")
        rid = obj.get(id_field)
        rid = f"{id_prefix}:{len(requests)}" if rid is None else str(rid)
        ids = tok.encode(text, add_special_tokens=add_special_tokens).ids
        if not ids:
            raise SuiteError(f"{prompts.name}:{n}.{text_field}: tokenizes to no tokens")
        doc = {k: v for k, v in obj.items() if k not in (text_field, id_field)} or None
        requests.append(SuiteRequest(rid, tuple(ids), scored, doc, max_new_tokens))
    return Suite(name or prompts.stem, tuple(requests))


def pad_suite(suite: Suite, extra: Suite, size: int, name: str | None = None) -> Suite:
    """Append the first requests of `extra` (as unscored load) until the suite has `size` requests."""
    if size < len(suite):
        raise SuiteError(f"pad: target size {size} is below the suite's {len(suite)} requests")
    need = size - len(suite)
    have = {r.id for r in suite.requests}
    pool = [r for r in extra.requests if r.id not in have]
    if len(pool) < need:
        raise SuiteError(f"pad: need {need} extra requests, suite {extra.name!r} offers {len(pool)} new ones")
    padding = tuple(SuiteRequest(r.id, r.input_ids, False, r.doc, r.max_new_tokens) for r in pool[:need])
    return Suite(name or suite.name, suite.requests + padding)
