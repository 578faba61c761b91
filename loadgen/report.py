"""Reports: per-cell JSON (raw per-request records and summaries), a Markdown table in the layout of the
paper's Table 2 (mean % change with 95% intervals of E2E, TPOT and TTFT mean and p99, and makespan), and PNG
plots (latency against offered load per arm; the % change map of E2E and makespan).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from loadgen.experiment import ABResult
from loadgen.metrics import flat_metrics

TABLE_COLUMNS = (("E2E", "e2e_mean", "mean"), ("E2E", "e2e_p99", "p99"), ("TPOT", "tpot_mean", "mean"),
                 ("TPOT", "tpot_p99", "p99"), ("TTFT", "ttft_mean", "mean"), ("TTFT", "ttft_p99", "p99"),
                 ("", "makespan_s", "makespan"))


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text)


def cell_label(result: ABResult) -> str:
    return result.label or f"{result.rate:g}req-s"


def write_cells(result: ABResult, out: Path) -> list[Path]:
    """One JSON per cell run (records + summary + attestations) and one per A/B result (comparison, gates)."""
    cells = out / "cells"
    cells.mkdir(parents=True, exist_ok=True)
    paths = []
    base = _slug(f"{cell_label(result)}-{result.treated}")
    if result.length_cell is not None:
        p = cells / f"{base}-lengths-{result.baseline}.json"
        p.write_text(json.dumps(result.length_cell.as_dict(), indent=1))
        paths.append(p)
    for rep in result.repetitions:
        for cell in (rep.baseline, rep.treated):
            p = cells / f"{base}-rep{rep.index}-{_slug(cell.arm_name)}.json"
            p.write_text(json.dumps(dict(cell.as_dict(), gates=rep.gates.as_dict()), indent=1))
            paths.append(p)
    summary = {k: v for k, v in result.as_dict().items() if k not in ("repetitions", "length_cell")}
    summary["repetitions"] = [{"index": r.index, "order": list(r.order), "gates": r.gates.as_dict(),
                               "baseline": r.baseline.summary, "arm": r.treated.summary} for r in result.repetitions]
    p = out / f"ab-{base}.json"
    p.write_text(json.dumps(summary, indent=1))
    paths.append(p)
    return paths


def markdown_table(results: Sequence[ABResult], title: str = "") -> str:
    """Mean % change against the baseline with 95% intervals; negative is better. n = accepted repetitions."""
    lines = []
    if title:
        lines += [f"### {title}", ""]
    head = ["Rate", "arm", "n"] + [f"{g} {s}".strip() for g, _, s in TABLE_COLUMNS]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|")
    for r in results:
        n = len(r.accepted)
        row = [cell_label(r), r.treated, str(n)]
        for _, metric, _ in TABLE_COLUMNS:
            iv = r.comparison.get(metric)
            row.append("n/a" if iv is None else iv.format())
        lines.append("| " + " | ".join(row) + " |")
    lines += comparability_lines(results)
    dropped = [f"- {cell_label(r)} {r.treated} {m}: {why}" for r in results for m, why in r.not_compared.items()
               if m in {metric for _, metric, _ in TABLE_COLUMNS}]
    if dropped:
        lines += ["", "Metrics not compared (n/a above):", *dropped]
    refused = [(r, x) for r in results for x in r.repetitions if not x.gates.passed]
    if refused:
        lines += ["", "Refused repetitions (left out of the comparison):"]
        lines += [f"- {cell_label(r)} {r.treated} rep {x.index}: " + "; ".join(str(f) for f in x.gates.refusals)
                  for r, x in refused]
    lines += ["", "Mean % change against the baseline over paired repetitions, ± the 95% t half-width; "
                  "negative is better. A single repetition has no interval and is never resolved."]
    return "\n".join(lines) + "\n"


COMPARABILITY_GATES = ("execution_difference", "cross_arm_identity")


def comparability_lines(results: Sequence[ABResult]) -> list[str]:
    """Per cell: the gates every repetition went through, whether the comparability gates passed, and the KV
    pool difference the cross-arm identity gate measured (the arm's pool may be smaller, never larger)."""
    lines = []
    for r in results:
        if not r.repetitions:
            continue
        checked = list(dict.fromkeys(g for x in r.repetitions for g in x.gates.checked))
        parts = []
        for gate in COMPARABILITY_GATES:
            ran = [x for x in r.repetitions if gate in x.gates.checked]
            if not ran:
                parts.append(f"{gate} not run")
                continue
            passed = sum(not any(f.gate == gate for f in x.gates.refusals) for x in ran)
            parts.append(f"{gate} passed {passed}/{len(ran)}")
        pools = [x.gates.details["cross_arm_identity"]["kv_pool"] for x in r.repetitions
                 if "kv_pool" in x.gates.details.get("cross_arm_identity", {})]
        if pools:
            kv = pools[-1]
            share = "n/a" if kv["smaller_by_share"] is None else f"{100 * kv['smaller_by_share']:.2f}%"
            parts.append(f"KV pool {r.treated} {kv['arm_tokens']} vs {r.baseline} {kv['baseline_tokens']} tokens "
                         f"(smaller by {kv['smaller_by_tokens']} tokens, {share} of the baseline's pool)")
        lines.append(f"- {cell_label(r)} {r.treated}: " + "; ".join(parts) + f". Gates: {', '.join(checked)}.")
    return ["", "Gates per cell (comparability: each arm executed the configuration declared for it, where one is; "
                "the arms differ only in arm, skipper and thresholds):"] + lines if lines else []


def _arm_means(results: Sequence[ABResult], which: str, metric: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in sorted(results, key=lambda r: r.rate):
        vals = [flat_metrics(getattr(rep, which).summary).get(metric) for rep in r.accepted]
        vals = [v for v in vals if v is not None]
        if vals:
            xs.append(r.rate)
            ys.append(sum(vals) / len(vals))
    return xs, ys


def plot_latency_vs_load(results: Sequence[ABResult], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("e2e_mean", "mean E2E (s)"), ("ttft_mean", "mean TTFT (s)"), ("tpot_mean", "mean TPOT (s)"))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (metric, label) in zip(axes, metrics, strict=True):
        for which in ("baseline", "treated"):
            names = {getattr(r, which) for r in results}
            xs, ys = _arm_means(results, which, metric)
            ax.plot(xs, ys, marker="o", label=", ".join(sorted(names)))
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_change_map(results: Sequence[ABResult], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, (metric, label) in zip(axes, (("e2e_mean", "mean E2E change (%)"),
                                          ("makespan_s", "makespan change (%)")), strict=True):
        rows = sorted((r for r in results if metric in r.comparison), key=lambda r: r.rate)
        xs = [r.rate for r in rows]
        ys = [r.comparison[metric].mean for r in rows]
        err = [0.0 if math.isnan(r.comparison[metric].half_width) else r.comparison[metric].half_width
               for r in rows]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3)
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(results: Sequence[ABResult], out: str | Path, title: str = "") -> dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for r in results:
        for p in write_cells(r, out):
            paths[p.name] = p
    table = out / "table.md"
    table.write_text(markdown_table(results, title))
    paths["table"] = table
    paths["latency_vs_load"] = plot_latency_vs_load(results, out / "latency_vs_load.png")
    paths["change_map"] = plot_change_map(results, out / "change_map.png")
    return paths
