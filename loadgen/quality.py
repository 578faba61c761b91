"""Quality helpers: the GSM8K composite answer filter and the paired difference-in-differences.

The two answer filters are lm-eval's for its gsm8k task:
- strict-match: `#### (\\-?[0-9\\.\\,]+)`, the first match (the marked answer);
- flexible-extract: `(-?[$0-9.,]{2,})|(-?[0-9]+)`, the last match, its first non-empty group.
Either yields `[invalid]` when nothing matches. The composite uses strict-match when it parses and flexible
extraction otherwise. Scoring is lm-eval's exact_match with ignore_case and the patterns `,`, `\\$`,
`(?s).*#### ` and `\\.$` removed from both prediction and reference.

The 2x2 design: A base model and B checkpoint natively, C base model and D checkpoint served. Per document the
DiD is (D - C) - (B - A); its mean over documents with a 95% t interval says what serving adds beyond the
checkpoint's own cost.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from loadgen.stats import Interval, mean_interval

INVALID = "[invalid]"
STRICT_PATTERN = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE_PATTERN = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
IGNORE_PATTERNS = (",", r"\$", r"(?s).*#### ", r"\.$")


def _regex_filter(text: str, pattern: re.Pattern, group_select: int) -> str:
    matches = pattern.findall(text)
    if not matches:
        return INVALID
    match = matches[group_select]
    if isinstance(match, tuple):
        groups = [g for g in match if g]
        if not groups:
            return INVALID
        match = groups[0]
    return match.strip()


def strict_match(text: str) -> str:
    return _regex_filter(text, STRICT_PATTERN, 0)


def flexible_extract(text: str) -> str:
    return _regex_filter(text, FLEXIBLE_PATTERN, -1)


def composite_extract(text: str) -> str:
    """Strict-match where it parses, flexible extraction otherwise."""
    strict = strict_match(text)
    return strict if strict != INVALID else flexible_extract(text)


def normalize(text: str) -> str:
    for pattern in IGNORE_PATTERNS:
        text = re.sub(pattern, "", text)
    return text.lower()


def exact_match(prediction: str, reference: str) -> bool:
    """lm-eval's exact_match for gsm8k: ignore case and the filter's ignore patterns on both sides."""
    return normalize(prediction) == normalize(reference)


def score_gsm8k(generation: str, reference: str, extractor=composite_extract) -> int:
    """1 when the extracted answer equals the reference (the full GSM8K solution or its final number)."""
    return int(exact_match(extractor(generation), reference))


def score_gsm8k_records(records, suite, extractor=composite_extract) -> dict[str, int]:
    """Per scored document of a suite (`doc["answer"]` holds the reference): 1 if the served generation's
    extracted answer matches. Unscored padding requests are skipped; a failed request scores 0."""
    by_id = {r.request_id: r for r in records}
    scores: dict[str, int] = {}
    for req in suite.requests:
        if not req.scored:
            continue
        answer = (req.doc or {}).get("answer")
        if not isinstance(answer, str):
            raise ValueError(f"request {req.id!r}: doc.answer is required to score GSM8K")
        rec = by_id.get(req.id)
        scores[req.id] = 0 if rec is None or not rec.ok else score_gsm8k(rec.text, answer, extractor)
    return scores


def did_per_document(a: Sequence[float], b: Sequence[float], c: Sequence[float],
                     d: Sequence[float]) -> list[float]:
    sizes = {len(a), len(b), len(c), len(d)}
    if len(sizes) != 1:
        raise ValueError(f"did: the four arms must score the same documents, got sizes A={len(a)} B={len(b)} "
                         f"C={len(c)} D={len(d)}")
    return [(dd - cc) - (bb - aa) for aa, bb, cc, dd in zip(a, b, c, d, strict=True)]


def difference_in_differences(a: Sequence[float], b: Sequence[float], c: Sequence[float],
                              d: Sequence[float], confidence: float = 0.95, scale: float = 100.0) -> Interval:
    """Mean over documents of (D - C) - (B - A), scaled (100: percentage points), with a t interval."""
    diffs = [scale * x for x in did_per_document(a, b, c, d)]
    return mean_interval(diffs, confidence)
