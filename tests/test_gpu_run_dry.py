"""benchmarks/gpu/run.sh on CPU (`--dry-run`: the CPU platform, a tiny FlexiDepth model with `--load-format dummy`),
so that device minutes are not spent on typos: every stage end to end against the real SGLang server, with the
four arms started once for all stages after the tiles stage, with its table as the stages start theirs (the script's own launcher, `VSKIPPER_GPU_RUN_SERVERS`; the headline stage
starts the hybrid arm at the sweep's tau itself); and the device plan's server commands parsed by SGLang's own
launch-flag parser. The numbers of a dry run mean nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from contextlib import ExitStack, nullcontext

import pytest

pytest.importorskip("sglang")

from benchmarks.gpu import headline, run, skip_limits  # noqa: E402
from loadgen.qstar import CELL_FACTORS  # noqa: E402
from loadgen.suite import load_suite  # noqa: E402
from tests.sglang_world import ROOT  # noqa: E402
from tests.test_serve_contract import sglang_parser  # noqa: E402
from vskipper.mixed.tiles import load_tile_table, table_label  # noqa: E402
from vskipper.sglang.spec import AUTO_PREFILL_GRAPHS  # noqa: E402
from vskipper.sglang.stack_samples import INTERVAL_S  # noqa: E402

pytestmark = pytest.mark.server  # the device run's stages against real SGLang servers

SCRIPT = ROOT / "benchmarks" / "gpu" / "run.sh"


def _stage(stage: str, out, env: dict, *options: str) -> subprocess.Popen:
    return subprocess.Popen([str(SCRIPT), stage, str(out), "--dry-run", *options], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)


def lease_out(out, lease: str):
    """The folder the dry run's fixture runs `lease` into, beside the stages' own."""
    return out.with_name(f"{out.name}-{lease}")


def _finish(proc: subprocess.Popen, stage: str, logs: dict) -> None:
    logs[stage], _ = proc.communicate(timeout=900)  # a stage's own limit is 530 s (VSKIPPER_STAGE_LIMIT_S)
    assert proc.returncode == 0, f"{stage}:\n{logs[stage][-3000:]}"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """`run.sh` install and tiles, then ladder, sweep and headline against the four arms started once with the
    tiles stage's table (the kernels stage, which needs no server, runs beside them), the clock stage (its own
    servers), then `all`, which finds every stage done, into one folder; beside it, against the same servers,
    lease-2 (packed) and then lease-3, which takes lease-2's Q* (`--earlier`), each into a folder of its own
    (`lease_out`)."""
    out = tmp_path_factory.mktemp("gpu-run")
    plan = run.Plan.dry()
    model = run.write_model(plan, out)
    arms = run.write_arms(out)
    thresholds = run.rule(plan, model)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    logs: dict[str, str] = {}
    _finish(_stage("install", out, env), "install", logs)
    _finish(_stage("tiles", out, env), "tiles", logs)
    kernels = _stage("kernels", out, env)
    try:
        with ExitStack() as stack:
            servers = {name: run.server_for(plan, stack, model, out / "servers" / name, name, arms,
                                            thresholds=thresholds)
                       for name in ("dense", run.ALWAYS, run.HYBRID, run.CONTROL)}
            run.ready(plan, list(servers.values()))
            given = out / "servers.json"
            given.write_text(json.dumps({name: s.url for name, s in servers.items()}))
            env[run.ENV_SERVERS] = str(given)
            for stage in ("ladder", "sweep", "headline"):
                _finish(_stage(stage, out, env), stage, logs)
            two, three = lease_out(out, "lease-2"), lease_out(out, "lease-3")
            # --within as a lease is run (its cut is tested on its own): wide enough for a loaded host's ladder
            _finish(_stage("lease-2", two, env, "--within", "900", "--pack", f"{two}.tar.gz"), "lease-2", logs)
            _finish(_stage("lease-3", three, env, "--earlier", str(two)), "lease-3", logs)
        _finish(kernels, "kernels", logs)
        _finish(_stage("clock", out, env), "clock", logs)  # its own servers, each with its part clock on
        _finish(_stage("all", out, env), "all", logs)
    finally:
        kernels.kill()
    return out, logs


def test_install_reports_the_platform_torch_and_triton(dry_run):
    out, logs = dry_run
    env = json.loads((out / "env.json").read_text())
    assert env["mode"] == "--dry-run" and env["torch"].startswith("2.13") and env["triton"]
    assert "no bundle installed" in logs["install"]


def test_ladder_finds_q_star_on_dense_and_serves_dense_every_headline_cell(dry_run):
    out, logs = dry_run
    plan = run.Plan.dry()
    ladder = json.loads((out / "ladder.json").read_text())
    assert ladder["left"] == [] and "dense up and warm" in logs["ladder"]
    q = ladder["q_star"]
    assert q["rates"] == list(range(q["rates"][0], q["rates"][0] + len(q["rates"])))  # contiguous, step 1
    assert len(q["rates"]) <= plan.ladder_max_rates and q["q_star"] in q["rates"]
    assert q["rates"][0] <= ladder["calibration"]["ladder_start"] <= q["rates"][-1]
    assert ladder["calibration"]["ladder_start"] <= ladder["calibration"]["ladder_start_max"] == plan.ladder_start_max
    # Q*'s cell decoded within its window; a rate past it may not (on shared CPU cores a dry cell's window is about a
    # second, and a stall of the host that long left one with no token in it: 0 tok/s, no growth, which ends the climb)
    assert all(t >= 0 for t in q["tok_s"]) and q["tok_s_at_q_star"] > 0
    cells = [headline.Cell.from_dict(c) for c in ladder["cells"]]
    assert [(c.load, c.repetition) for c in cells] == [(load, r) for load in headline.SERVE_ORDER
                                                       for r in range(plan.repetitions)]
    for c in cells:
        assert c.rate == pytest.approx(CELL_FACTORS[c.load] * q["q_star"])
        dense = ladder["dense"][c.key]  # dense served the cell: the suite's every request at the cell's rate
        assert dense["requests"] == c.requests and dense["rate"] == c.rate and dense["seed"] == c.seed
        assert dense["suite"]["digest"] == ladder["suites"][c.load]["digest"]
        assert dense["e2e"]["n"] == c.requests and dense["window_s"] > 0 and dense["window_req_s"] >= 0
    for suite in ladder["suites"].values():  # GSM8K-shaped, forced lengths from the plan's ranges
        assert load_suite(out / suite["path"]).digest == suite["digest"]
        assert plan.prompt_tokens[0] <= suite["prompt_tokens"]["min"] <= suite["prompt_tokens"]["max"] <= \
            plan.prompt_tokens[1]
        assert plan.output_tokens[0] <= suite["output_tokens"]["min"] <= suite["output_tokens"]["max"] <= \
            plan.output_tokens[1]
    assert ladder["served"]["arm"] == "dense"


def test_headline_pairs_each_routed_arm_with_dense_on_the_same_cells_and_every_gate_passes(dry_run):
    out, logs = dry_run
    plan = run.Plan.dry()
    result = json.loads((out / "headline.json").read_text())
    assert result["left"] == [] and result["idle"] is False and set(result["arms"]) == set(run.HEADLINE_ARMS)
    rule = result["thresholds"]["rule"]
    assert (rule["enter_tokens"], rule["exit_tokens"]) == plan.dry_thresholds
    hybrid = result["arms"]["hybrid-rule"]
    assert hybrid["served"]["thresholds"]["enter_tokens"] == rule["enter_tokens"]  # attested
    assert hybrid["thresholds"]["source"] == "dry-run (CPU)"
    assert hybrid["served"]["arm"] == run.HYBRID
    tau = result["arms"]["hybrid-tau"]
    if tau.get("skipped"):  # the sweep's tau on a CPU is noise: it may give the rule's thresholds (and says so)
        assert "tau" in tau["skipped"] and result["thresholds"]["tau"] == {"skipped": tau["skipped"]}
    else:  # a positive tau (its interval's upper end) scales V*; one at or below 0 serves the least thresholds
        comparison = json.loads((out / "sweep.json").read_text())["comparison"]
        served_tau = (comparison.get("tau_ms_interval") or [None, comparison["tau_ms"]])[1]
        assert tau["thresholds"]["tau_ms"] == served_tau
        if served_tau <= 0:  # (20 / 10 here)
            assert (tau["thresholds"]["enter_tokens"], tau["thresholds"]["exit_tokens"]) == (20, 10)
        assert tau["thresholds"]["source"].startswith("measured tau")
        assert tau["served"]["thresholds"]["enter_tokens"] == tau["thresholds"]["enter_tokens"]
        assert tau["served"]["thresholds"]["source"] == "flags"
        assert tau["served"]["thresholds"]["prefill_floor_tokens"] == tau["thresholds"]["prefill_floor_tokens"]
        assert "hybrid-tau up and warm" in logs["headline"]
    assert hybrid["served"]["thresholds"]["prefill_floor_source"] == "vskipper.constants"  # the rule's arm
    for key, (name, _role, _variant, loads) in run.HEADLINE_ARMS.items():
        arm = result["arms"][key]
        if arm.get("skipped"):
            continue
        assert arm["gates_passed"] and set(arm["loads"]) == set(loads), key
        assert arm["served"]["arm"] == name and arm["table"].count("| " + key + " |") == len(loads)
        for load, cell in arm["loads"].items():
            assert cell["repetitions_accepted"] == cell["repetitions_run"] == plan.repetitions
            for gates in cell["gates"]:
                assert gates["passed"] and {"work_identity", "mechanism_evidence", "served_design",
                                            "cross_arm_identity"} <= set(gates["checked"])
            # a % change of the window's request throughput needs dense to finish a request inside its window,
            # which a dry run's cell of 1.5 s on a loaded machine may not (loadgen then compares no such figure)
            dense_windows = [json.loads((out / "ladder" / "dense" / f"{load}-rep{r}.json").read_text())["summary"]
                             ["window_req_s"] for r in range(plan.repetitions)]
            assert {"e2e_mean", "e2e_p99", "ttft_mean", "ttft_p99", "tpot_mean", "tpot_p99"} <= set(cell["comparison"])
            assert ("window_req_s" in cell["comparison"]) == all(dense_windows)
            assert cell["comparison"]["e2e_mean"]["n"] == plan.repetitions
            assert cell["comparison"]["e2e_mean"]["half_width"] is None  # one repetition: no interval
            assert cell["dense"]["e2e_mean_s"] > 0 and cell["arm"]["e2e_mean_s"] > 0
            # each side's cells from one start of its server, both on this machine (its host's name, no GPU):
            # nothing for the figures to say; and the makespan's rate also by its geometric change
            sides = cell["provenance"]
            assert len(sides["dense"]["starts"]) == len(sides["arm"]["starts"]) == 1, (key, load, sides)
            assert sides["dense"]["machines"] == sides["arm"]["machines"] == [platform.node()], (key, load, sides)
            assert headline.served_apart(cell) == ""
            assert cell["geometric"]["makespan_req_s"]["n"] == plan.repetitions
            for side in ("dense", "arm"):  # each side's passes as its server's clock timed them (CPU: the host's)
                for phase in ("prefill", "decode"):
                    spans = cell["pass_spans"][side][phase]
                    assert spans["host_ms"] > 0 and spans["passes"] > 0 and spans["device_ms"] is None
            cells = [c for c in json.loads((out / "ladder.json").read_text())["cells"] if c["load"] == load]
            for c in cells:  # the arm served the very cell dense served: suite, rate, arrival seed
                mine = json.loads((out / "headline" / key / f"{load}-rep{c['repetition']}.json").read_text())
                dense = json.loads((out / "ladder" / "dense" / f"{load}-rep{c['repetition']}.json").read_text())
                assert (mine["suite"], mine["rate"], mine["seed"]) == (dense["suite"], dense["rate"], dense["seed"])
                assert [r["scheduled_s"] for r in mine["records"]] == [r["scheduled_s"] for r in dense["records"]]
    always = result["arms"]["always"]["loads"][headline.KNEE]["routed_share"]
    assert always == {"prefill": 1.0, "decode": 1.0}
    # what the queueing model predicts from the sweep's lines, beside each arm's measured change
    for key, (_name, _role, _variant, loads) in run.HEADLINE_ARMS.items():
        arm = result["arms"][key]
        if not arm.get("skipped"):
            assert set(arm["model"]) == set(loads), key
            assert all(set(headline.MODEL_METRICS) <= set(p) and len(p["reps"]) == plan.repetitions
                       for p in arm["model"].values()), key
            # every sweep length has SGLang's stamps: the prefill lines are the forward's; the model's dense E2E
            # of each repetition stands beside the cells'
            assert all(p["prefill_from"] == "forward" and len(p["dense_e2e_mean_s"]) == plan.repetitions
                       for p in arm["model"].values()), key
    assert result["arms"]["always"]["model"][headline.KNEE]["routed_share"] == {"prefill": 1.0, "decode": 1.0}
    # beside it, the same arms with their routed passes at the skip's limit (the control skips nothing: none)
    for key in ("always", "hybrid-rule"):
        assert all(set(headline.MODEL_METRICS) <= set(p["at_limit"]) for p in result["arms"][key]["model"].values())
    assert all("at_limit" not in p for p in result["arms"]["control"]["model"].values())
    # the skip's limit: always-route at the limit on the ladder's cells, every load
    limit = result["skip_limit"]
    assert limit["skip"] == run.SKIP_RATIO and set(limit["loads"]) == set(headline.LOADS)
    assert all(p["routed_share"] == {"prefill": 1.0, "decode": 1.0} for p in limit["loads"].values())
    parts = result["limit_parts"]  # where the sweep's always-route falls short of it, phase by phase
    assert tuple(parts["parts"]) == headline.LIMIT_PARTS and parts["parts"]["both at the limit"] == limit["loads"]
    summary = (out / "summary.md").read_text()
    assert "What the queueing model" in summary and "The skip's limit: what the queueing model" in summary
    assert "Where the sweep's random-r1-d0.5-always falls short of the skip's limit" in summary
    assert "a prefill pass's from the forward of each prompt" in summary
    assert ("The model's dense mean E2E beside the cells' measured dense (mean over the repetitions): 0.75 Q* "
            in summary)
    # skip_limits.py on the run's folder: the same limit at d = 0.5 (the suites drawn again match the ladder's)
    assert skip_limits.main([str(out), "--d", "0.5,1", "--json", str(out / "limits.json")]) == 0
    limits = json.loads((out / "limits.json").read_text())["limits"]
    assert limits[0]["loads"] == limit["loads"] and limits[1]["skip"] == 1.0
    figures = {(r["arm"], r["figure"]): r for r in result["figures"]}
    knee = figures["hybrid-rule", "mean E2E change at 0.95 Q*"]
    assert knee["limit"] == "below -36.8% (the paper's)" and knee["paper_a100"] == [-36.8, 2.0]
    # one repetition: no interval; the skip's limit from a CPU sweep may add either note (`figure_rows`)
    assert knee["verdict"].startswith("n = 1: no interval")
    assert knee["skip_limit"] == limit["loads"][headline.KNEE]["e2e_mean"]
    rps = figures["hybrid-rule", "request throughput in the injection window at 1.25 Q*"]
    assert rps["paper_a100"] == [11.3, 0.2]
    # measured where dense finished a request inside each overload cell's window (see the cells above), else none
    compared = "window_req_s" in result["arms"]["hybrid-rule"]["loads"][headline.OVERLOAD]["comparison"]
    assert (rps["measured"] or {}).get("n") == (plan.repetitions if compared else None)


def test_headline_serves_the_hybrid_arm_at_the_thresholds_a_measured_tau_gives(dry_run, tmp_path):
    """The tau arm's path from a positive tau (this CPU's own tau is noise, often at or below 0, which serves the
    least thresholds): the headline stage again on a copy of the run with a sweep whose tau is given (50 x the
    rule's), so V* = 50 x 40 tokens; the arms already served are read from their files, the tau arm is started
    with its thresholds as flags (and the run's tile table)."""
    out, _ = dry_run
    copy = tmp_path / "run"
    # the tiles stage's table copied too: the arms attest it by name and content, so the tau arm, started here,
    # and dense's cells, served from the original folder, attest the same table (the cross-arm gate compares them)
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("servers", "server", "kernels"))
    (copy / "headline.json").unlink()
    rule = json.loads((out / "headline.json").read_text())["thresholds"]["rule"]
    sweep = json.loads((out / "sweep.json").read_text())
    given = 50 * rule["tau_ms"]
    sweep["comparison"]["tau_ms"] = given
    sweep["comparison"]["tau_ms_interval"] = [given, given]  # a tau given, not measured: its upper end is itself
    (copy / "sweep.json").write_text(json.dumps(sweep))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", run.ENV_SERVERS)}
    proc = _stage("headline", copy, env)
    logs: dict[str, str] = {}
    _finish(proc, "headline", logs)
    assert "hybrid-tau up and warm" in logs["headline"] and "hybrid-rule up" not in logs["headline"]
    original = json.loads((out / "headline.json").read_text())["arms"]["hybrid-tau"]
    if not original.get("skipped"):  # the run's own tau arm, served at its own thresholds: set aside, not reused
        was = original["served"]["thresholds"]
        aside = copy / "headline" / (f"hybrid-tau-enter{was['enter_tokens']}-exit{was['exit_tokens']}"
                                     f"-floor{was['prefill_floor_tokens']}")
        assert f"set aside as {aside.name}" in logs["headline"] and (aside / "served.json").is_file()
    result = json.loads((copy / "headline.json").read_text())
    tau = result["arms"]["hybrid-tau"]
    assert (tau["thresholds"]["enter_tokens"], tau["thresholds"]["exit_tokens"]) == (2500, 2000)
    assert tau["thresholds"]["source"].startswith(f"measured tau {given:.3g} ms, 95% [{given:.3g}, {given:.3g}], "
                                                  "served at its upper end (sweep")
    attested = tau["served"]["thresholds"]
    assert (attested["enter_tokens"], attested["exit_tokens"], attested["source"]) == (2500, 2000, "flags")
    # the sweep's measured prefill floor, served as a flag
    floor = sweep["comparison"]["prefill_floor"]
    assert tau["thresholds"]["prefill_floor_tokens"] == floor["prefill_floor_tokens"]
    assert (attested["prefill_floor_tokens"], attested["prefill_floor_source"]) == \
        (floor["prefill_floor_tokens"], "flags")
    assert tau["gates_passed"] and set(tau["loads"]) == set(headline.LOADS)
    summary = (copy / "summary.md").read_text()
    assert "- hybrid-tau: enter 2500 / exit 2000 resident KV tokens served (attested source: flags; from measured " \
           "tau" in summary and "### hybrid-tau (random-r1-d0.5-hybrid) against dense" in summary


def test_sweep_measures_dense_the_control_and_the_routed_arm_and_compares_them(dry_run):
    out, _ = dry_run
    sweep = json.loads((out / "sweep.json").read_text())
    plan = run.Plan.dry()
    for name in ("dense", run.CONTROL, run.ALWAYS):
        arm = sweep["arms"][name]
        assert {(d["batch"], d["context"]) for d in arm["decode"]} == \
            {(b, c) for b in plan.batches for c in plan.contexts}
        assert all(d["decode_tok_s"] > 0 for d in arm["decode"])
        assert all(len(d["step_s_reps"]) == plan.decode_reps and d["step_s"] == statistics.median(d["step_s_reps"])
                   for d in arm["decode"])
        assert [p["tokens"] for p in arm["prefill"]] == list(plan.prefill_lengths)
        assert all(len(p["ttft_s_reps"]) == plan.prefill_reps for p in arm["prefill"])
        # where each prompt's TTFT went, by the real server's own stamps (--enable-metrics): a forward of its own,
        # and no part negative that one process's clock measures (`RequestRecord.ttft_parts`: `scheduled` and
        # `output` each span the tokenizer's and the scheduler's clocks, which a loaded host set 8 ms apart once)
        for p in arm["prefill"]:
            assert len(p["ttft_parts_s_reps"]) == plan.prefill_reps and p["ttft_parts_s"]["forward"] > 0
            for parts in p["ttft_parts_s_reps"]:
                assert parts["forward"] > 0 and parts["http"] > -1e-3, parts
                assert parts["scheduled"] + parts["output"] > -1e-3, parts
        assert arm["line"]["points"] == len(arm["decode"])
        # what it compiled while serving its cells: nothing in the interpreter (nothing compiles), but counted
        assert arm["compiles"] == {"compiles": 0, "seconds": 0.0, "kernels": {}, "cache_loads": {}}
        # each cell's passes as the server's clock timed them: the host's alone on a CPU (no device events)
        for cell in arm["decode"] + arm["prefill"]:
            assert cell["pass_spans"]["host_ms"] > 0 and cell["pass_spans"]["passes"] >= 1
            assert cell["pass_spans"]["device_ms"] is None
        # rounds of two prompts in one request: one admission round, one prefill pass of both prompts' tokens
        assert [(c["prompts"], c["tokens"]) for c in arm["prefill_rounds"]] == [(n, n * t) for n, t in
                                                                                plan.prefill_rounds]
        for cell in arm["prefill_rounds"]:
            assert len(cell["ttft_s_reps"]) == plan.prefill_reps and cell["ttft_s"] > 0
            assert cell["pass_spans"]["passes"] == 1
            assert all(r["tokens"] == cell["tokens"] for r in cell["pass_spans"]["reps"])
    comparison = sweep["comparison"]
    (row,) = comparison["prefill_round_speedup"]
    assert (row["prompts"], row["tokens"], row["passes"]) == (2, 64, {"routed": 1, "dense": 1})
    floor = comparison["prefill_floor"]  # from the lengths and the round: any of them on a CPU, or past the longest
    assert floor["prefill_floor_tokens"] in (*plan.prefill_lengths, max(plan.prefill_lengths) + 1)
    assert f"Measured prefill floor: {floor['prefill_floor_tokens']} prompt tokens a round" in \
        (out / "summary.md").read_text()
    assert len(comparison["decode_speedup"]) == len(plan.batches) * len(plan.contexts)
    assert len(comparison["prefill_speedup"]) == len(plan.prefill_lengths)
    assert comparison["routed_decode_graphs"].startswith("routed passes 0 replayed") and "tau_ms" in comparison
    cells = len(plan.batches) * len(plan.contexts)
    assert len(comparison["decode_over_control"]) == len(comparison["control_over_dense_decode"]) == cells
    limits = {}
    for row in comparison["decode_over_control"]:
        assert 0.5 < row["bandwidth_limit"] < 1.5 and row["routed_over_control_tok_s"] > 0
        limits[row["batch"], row["context"]] = row["bandwidth_limit"]
    for batch in plan.batches:  # the limit grows with the resident KV tokens (below 1 where the adapter's weights
        ordered = [limits[batch, c] for c in sorted(plan.contexts)]  # outweigh the reads skipped: tiny models)
        assert ordered == sorted(ordered) and len(set(ordered)) == len(ordered)
    for row in comparison["prefill_over_control"]:
        assert 1.0 < row["flop_limit"] < 1.5
    steps = {name: {(d["batch"], d["context"]): d["step_s_reps"] for d in sweep["arms"][name]["decode"]}
             for name in (run.CONTROL, run.ALWAYS)}
    for row in comparison["decode_over_control"]:  # s=0 step times over s=0.5's: every pairing's least and most
        cell = (row["batch"], row["context"])
        assert row["range"] == run.ratio_range(steps[run.CONTROL][cell], steps[run.ALWAYS][cell])
    ttfts = {name: {p["tokens"]: p["ttft_s_reps"] for p in sweep["arms"][name]["prefill"]}
             for name in ("dense", run.CONTROL)}
    for row in comparison["control_over_dense_prefill"]:
        assert row["range"] == run.ratio_range(ttfts["dense"][row["tokens"]], ttfts[run.CONTROL][row["tokens"]])
    assert [g["goal"] for g in comparison["goals"]] == [g[0] for g in run.SWEEP_GOALS]
    assert all(g["verdict"] in ("met", "missed", "within spread") for g in comparison["goals"])
    config = json.loads((out / "model" / "config.json").read_text())
    assert run.decode_bytes(config, 1000, 0.5) < run.decode_bytes(config, 1000, 0.0)
    assert run.decode_bytes(config, 0, 0.5) > run.decode_bytes(config, 0, 0.0)  # and the adapters where rows project
    # last, the reference: dense with SGLang's prefill graphs (none on CPU), its prefill cells only, beside dense
    reference = sweep["arms"][run.PREFILL_GRAPHS]
    assert reference["flags"] == [] and reference["decode"] == [] and "error" not in reference
    assert [p["tokens"] for p in reference["prefill"]] == list(plan.prefill_lengths)
    assert reference["served"]["arm"] == "dense"
    graphs = comparison["prefill_graphs"]
    assert graphs["passes"]["replayed"] == 0 and graphs["passes"]["eager"] >= len(plan.prefill_lengths)
    assert [r["tokens"] for r in graphs["dense_over_graphs"]] == [r["tokens"] for r in graphs["routed_over_graphs"]] \
        == list(plan.prefill_lengths)
    summary = (out / "summary.md").read_text()
    assert f"Against dense with SGLang's prefill graphs ({run.PREFILL_GRAPHS}: none on CPU; every other arm " \
           f"prefills eagerly, since prefill graphs hold no routed variant): 0 prefill passes replayed from graphs, " \
           f"{graphs['passes']['eager']} eager." in summary


def test_tiles_stage_writes_the_table_every_later_server_is_handed(dry_run):
    """On CPU the routed layers run the torch execution, so each server attests the table it was handed unused;
    on a GPU the same flag tiles its Triton GEMMs (`tests/test_tiles.py`: the table must name that GPU)."""
    out, _ = dry_run
    tiles = json.loads((out / "tiles.json").read_text())
    assert tiles["runs"]["tune-tiles"]["exit"] == 0 and tiles["runs"]["tune-tiles"]["seconds"] > 0
    path = out / "tiles" / run.TILES_JSON
    table = load_tile_table(path)
    assert table.device == run.DRY_TILES_DEVICE and "not a measurement" in table.source and table.read is not None
    assert tiles["table"] == json.loads(path.read_text()) and run.tuned_table(run.Plan.dry(), out) == path
    sweep = json.loads((out / "sweep.json").read_text())
    label = table_label(path)
    assert label.startswith(f"{run.TILES_JSON}, sha256 ")
    for name in ("dense", run.CONTROL, run.ALWAYS):
        assert sweep["arms"][name]["served"]["tiles"] == f"{label} given, unused: the torch execution serves"


def test_kernels_stage_writes_the_bench_figures_with_the_tuned_table(dry_run):
    out, _ = dry_run
    kernels = json.loads((out / "kernels.json").read_text())
    assert {k: v["exit"] for k, v in kernels["runs"].items()} == {"mixed_depth_bench": 0}
    assert kernels["tile_table"] == str(out / "tiles" / run.TILES_JSON)
    bench = json.loads((out / "kernels" / "mixed_depth_bench.json").read_text())
    assert {"kernels", "decode", "prefill", "served"} <= set(bench)  # every section ran, the served layer's too
    assert bench["tile_table"] == kernels["tile_table"]  # the bench was handed the tuned table


def test_the_clock_stage_times_each_arms_prefill_passes_part_by_part_on_a_server_with_its_part_clock(dry_run):
    """Always-route, the control and dense each on its own server with its part clock on, and always-route again
    timing its passes whole: at each shape (one prompt of the sweep's shortest length, one of its third, its first
    round) one pass a prompt or a round after an untimed one, the host's ms a pass by layer kind (the routed kind:
    the layers the model routes, which dense serves densely), each part's seconds; then the shapes rotated, read
    between and after a decode burst, each window with the server's busiest threads; and the summary's tables.
    The check of the served layer comes first (here the sweep's, in the same folder, stands)."""
    out, logs = dry_run
    plan = run.Plan.dry()
    clock = json.loads((out / "clock.json").read_text())
    assert clock["left"] == [] and clock["failed"] == []
    assert clock["check"]["runs"]["check-served"]["earlier_run"] and clock["check"]["report"]["cases"]
    assert [tuple(s) for s in clock["shapes"]] == run.clock_shapes(plan) == [(1, 32), (1, 64), (2, 32)]
    assert list(clock["arms"]) == [label for label, _, _ in run.CLOCK_SERVED]
    shapes = run.clock_shapes(plan)
    for (name, arm, parts), doc in zip(run.CLOCK_SERVED, clock["arms"].values(), strict=True):
        assert f"{name} up and warm" in logs["clock"] and doc["served"]["arm"] == arm and doc["parts"] is parts
        for cell, (n, length) in zip(doc["cells"], shapes, strict=True):
            # one pass a prompt or a round: the untimed one before fell outside the window
            assert (cell["passes"], cell["tokens"]) == (run.CLOCK_REPS, run.CLOCK_REPS * n * length) \
                == tuple(cell["expected"].values())
            assert cell["model"] > 0 and cell["device"] is None and len(cell["answered_s_reps"]) == run.CLOCK_REPS
            # the forward's thread computed on this CPU (its waits are whatever the host made it wait)
            assert 0 < cell["cpu"] and cell["waits"] >= 0 and cell["gc"] >= 0
            if parts:  # layers 2-3 are the routed kind in every arm (dense serves them densely), 0-1 the dense kind
                assert cell["routed"] > 0 and cell["dense"] > 0
                assert set(run.clock_parts(cell)) >= {"routed mlp", "dense mlp", "outside"}
                # every layer's parts wrapped: tens of calls a pass, each costing the host what the server measured
                assert cell["calls"] > 4 * 5 and 0 < cell["own"] < cell["model"]
            else:  # the forward timed whole: no layer's part, one timed call a pass (the pass), not measured
                assert cell["routed"] is None and cell["dense"] is None and set(run.clock_parts(cell)) == {"outside"}
                assert cell["calls"] == 1 and cell["own"] is None
        # the same shapes rotated, then rotated with the clock read between: every pass in the window, none more
        assert list(doc["sequences"]) == list(run.CLOCK_SEQUENCES)
        for seq in doc["sequences"].values():
            assert (seq["passes"], seq["tokens"]) == (run.CLOCK_REPS * len(shapes),
                                                      run.CLOCK_REPS * sum(n * length for n, length in shapes)) \
                == tuple(seq["expected"].values())
            assert seq["model"] > 0 and len(seq["answered_s_reps"]) == run.CLOCK_REPS * len(shapes)
            # the scheduler's own thread issued the passes (its CPU in the window, from the server's attestations)
            assert any(t["name"] == "MainThread" and t["cpu_s"] > 0 for t in seq["threads"])
        # every server sampled its forward's stack in its passes: SGLang's forward and vSkipper's hooks were there
        windows = [*doc["cells"], *doc["sequences"].values()]
        total, counts = run.sampled(windows)
        assert total >= len(windows)
        assert any(key.startswith(("vskipper/sglang/hooks.py:", "vskipper/sglang/models/"))
                   for key in counts["vskipper"])
    summary = (out / "summary.md").read_text()
    assert f"| {run.CLOCK_SPANS} | no |" in summary and f"| {run.ALWAYS} | yes |" in summary
    assert "## Where a prefill pass's host time goes (the part clock)" in summary
    assert f"| 1 x 32 | {run.ALWAYS} |" in summary
    assert f"{run.ALWAYS} against {run.CONTROL} at 2 x 32: host ms a pass by layer kind and part" in summary
    assert f"{run.CONTROL} against dense at 1 x 64:" in summary
    assert "Where the forward's host time went, by samples of its Python stack" in summary
    assert f"{run.ALWAYS}, the innermost frame of vSkipper's code (" in summary


def test_the_clock_section_renders_what_an_unfinished_stage_holds_and_says_what_makes_a_window_doubtful():
    """One arm done (its window a pass short, a reading late, a compilation inside), one failed, one left: the
    arm's row with its doubts, no comparison without the arm it compares against, the failure and what is left."""
    cell = {"answered_s": 0.05, "model": 40.0, "routed": 20.0, "dense": 18.0, "outside": 2.0, "device": 44.0,
            "cpu": 30.0, "waits": 1200.0, "gc": 0.0, "calls": 260.0, "own": 0.78, "passes": 2, "tokens": 2048,
            "expected": {"passes": 3, "tokens": 3072}, "late": True,
            "compiles": {"compiles": 1, "seconds": 1.5, "kernels": {}, "cache_loads": {}},
            "seconds": {"routed": {"mlp": 0.02}, "outside": {"outside": 0.004}}}
    clock = {"shapes": [[1, 1024]], "reps": 3, "left": ["dense"], "failed": [run.CONTROL],
             "arms": {run.ALWAYS: {"cells": [cell]}, run.CONTROL: {"error": "RuntimeError: no part clock"}}}
    text = "\n".join(run.clock_lines(clock))
    assert (f"| 1 x 1024 | {run.ALWAYS} | 50.0 | 40.00 | 30.00 | 1200.0 | 0.00 | 260 | 0.78 | 20.00 | 18.00 | 2.00 | "
            "44.00 | "
            "1.10 | 2 passes of 2048 "
            "tokens, 3 of 3072 expected; a reading served late; 1 Triton compilations inside |") in text
    assert "against" not in text
    assert f"Clock stage: {run.CONTROL} failed: RuntimeError: no part clock" in text
    assert "Clock stage left for the next run: dense" in text
    assert run.clock_parts(cell) == {"routed mlp": 10.0, "outside": 2.0}
    assert run.clock_lines(None) == [] and run.clock_doubts({**cell, "passes": 3, "tokens": 3072, "late": False,
                                                             "compiles": None}) == ""
    assert run.clock_doubts({**cell, "passes": 3, "tokens": 3072, "late": False, "compiles": None,
                             "thread_error": "OSError: gone"}) == "forward thread: OSError: gone"


def test_the_sequences_table_sets_rotated_passes_beside_those_in_a_row_and_a_reading_between_beside_rotated():
    """The shapes' cells weighted by their passes (a shape's passes in a row), against the rotated window, the
    window read between passes and the one after a decode burst, each over the one before: the ratios the table
    prints, a window whose device was not timed throughout shown without its device figure, a window missing
    shown as n/a, and an arm without sequences (an earlier run's) left out."""
    def window(model, device, passes=3, threads=(), allocator=None, cpu=None):
        return {"model": model, "device": device, "cpu": cpu, "passes": passes, "tokens": passes * 1024, "late": False,
                "expected": {"passes": passes, "tokens": passes * 1024}, "compiles": None,
                "answered_s_reps": [0.05] * passes, "threads": list(threads), "allocator": allocator}

    def trips(taken, given, retried, waits):
        return dict(zip(run.ALLOCATOR_COUNTERS, (taken, given, retried, waits), strict=True))

    main = {"tid": "1", "name": "MainThread", "cpu_s": 0.1, "waits": 40}
    writer = {"tid": "2", "name": "vskipper-state-writer", "cpu_s": 0.02, "waits": 7}
    twin = {"tid": "3", "name": "vskipper-state-writer", "cpu_s": 0.01, "waits": 1}  # named alike, apart

    cells = [window(40.0, 44.0, threads=[main, writer, twin], allocator=trips(2, 1, 0, 1), cpu=36.0),
             window(50.0, 60.0, passes=1, threads=[main], allocator=trips(1, 0, 0, 0), cpu=44.0)]
    assert run.in_a_row(cells) == {"model": 42.5, "device": 48.0, "cpu": 38.0}
    assert run.in_a_row([window(40.0, 44.0), window(50.0, None)])["device"] is None
    arms = {run.ALWAYS: {"parts": True, "cells": cells,
                         "sequences": {"rotated": window(68.0, 70.0, passes=4, cpu=40.0),
                                       "rotated, read between": {**window(71.4, None, passes=4), "late": True},
                                       "after a decode burst": window(80.0, 81.0, passes=4, cpu=41.5)}},
            "dense": {"cells": cells}}
    text = "\n".join(run.sequence_lines(arms, 3))
    # rotated, the forward's thread computed 40 of the host's 68 ms a pass: it waited the rest
    assert (f"| {run.ALWAYS} | yes | 42.50 | 68.00 | 1.60 | 71.40 | 1.05 | 80.00 | 1.12 | 38.00 | 40.00 | n/a | "
            "41.50 | 48.00 | 70.00 | n/a | 81.00 | rotated, read between: a reading served late |") in text
    # the cells' threads summed over their windows, each sequence's alone
    assert (f"| {run.ALWAYS} | in a row | 0.20 | 4 | MainThread 0.20 s, 80 waits, vskipper-state-writer 0.02 s, "
            "7 waits, vskipper-state-writer 0.01 s, 1 waits | 3 / 1 / 0 / 1 |") in text  # the cells' trips summed
    assert f"| {run.ALWAYS} | rotated | 0.20 | 4 | not attested | n/a |" in text  # no allocator off CUDA
    arms[run.ALWAYS]["sequences"]["rotated"]["allocator"] = {"num_device_alloc": 4}  # a torch counting one alone
    assert f"| {run.ALWAYS} | rotated | 0.20 | 4 | not attested | 4 / n/a / n/a / n/a |" \
        in "\n".join(run.sequence_lines(arms, 3))
    assert "What the whole machine did" not in text  # no window read the machine (a run from before)
    # what the machine did: the cells' windows weighted by their wall time, each window's forward CPU in turn
    near = {"cpu": 3, "busy": 1.0, "others": 0.5, "stolen": 0.0, "siblings": [{"cpu": 11, "busy": 0.9}]}
    ahead = {"tid": 5, "run_s": 0.5, "runnable_s": 0.004, "involuntary": 2, "cpu_before": 3, "cpu": 3, "moved": False}
    cells[0]["machine"] = {"wall_s": 1.0, "cpus": 16, "busy_cpus": 2.0, "stolen_cpus": 0.5, "core": near,
                           "forward": ahead, "canary_us": [1100.0, 1650.4],
                           "processes": [{"pid": 7, "name": "sglang::scheduler", "cpu_s": 1.0},
                                         {"pid": 9, "name": "python3", "cpu_s": 0.2, "client": True}]}
    cells[1]["machine"] = {"wall_s": 3.0, "cpus": 16, "busy_cpus": 4.0, "stolen_cpus": 0.1,
                           "forward": {**ahead, "runnable_s": 0.001, "cpu": 4, "moved": True},
                           "processes": [{"pid": 7, "name": "sglang::scheduler", "cpu_s": 2.5},
                                         {"pid": 8, "name": "sglang::scheduler", "cpu_s": 3.0}]}
    machine_text = "\n".join(run.sequence_lines(arms, 3))
    assert (f"| {run.ALWAYS} | in a row | 3.50 of 16 | 0.20 | 5.0 ms, 4 preempted; CPU 3, 3 -> 4 | 50% (11 90%), "
            "n/a | 1100 / 1650, n/a / n/a | sglang::scheduler 7 3.50 s, sglang::scheduler 8 3.00 s, python3 9 (client) "
            "0.20 s |") in machine_text
    assert f"| {run.ALWAYS} | rotated |" not in machine_text.split("What the whole machine did")[1]
    del arms[run.ALWAYS]["sequences"]["after a decode burst"]  # an arm stopped before its last window
    assert f"| {run.ALWAYS} | yes | 42.50 | 68.00 | 1.60 | 71.40 | 1.05 | n/a | n/a | 38.00 | 40.00 | n/a | n/a | " \
        "48.00 | 70.00 | n/a | n/a |" in "\n".join(run.sequence_lines(arms, 3))
    assert "| dense |" not in text and run.sequence_lines({"dense": {"cells": cells}}, 3) == []


def test_all_skips_what_is_done_and_writes_results_and_a_summary(dry_run):
    out, logs = dry_run
    for stage in run.STAGES:
        assert f"[{stage}] complete in an earlier run" in logs["all"]
    results = json.loads((out / "results.json").read_text())
    assert results["dry_run"] and all(results[stage] for stage in run.STAGES)
    summary = (out / "summary.md").read_text()
    assert "Dry run on CPU" in summary and "tau =" in summary
    assert "Where a prefill's time to its first token went" in summary and "## Check" in summary
    assert "Each pass as its server timed it" in summary
    assert "| host ms a pass | thread CPU ms | waits | device ms a pass |" in summary
    assert "hybrid-rule's passes against dense's as the servers timed them" in summary
    assert "## Tiles" in summary and "unused: the torch execution" in summary
    assert "| mlp_gate_up | 513-1024 |" in summary and "| mlp_gate_up | 2049- |" in summary  # prefill by its length
    table = results["tiles"]["table"]  # each shape's half-count timing beside the full one, and what it decides
    assert all(e["kernel_half_ms"] > 0 for entries in table["tiles"].values() for e in entries)
    # the prefill ranges' tiles chosen over both counts (a routed prefill layer serves about half its rows RUN)
    assert {e["chosen_by"] for entries in table["tiles"].values() for e in entries if e["rows"][0] >= 513} == {
        "full and half live"}
    assert "| interpreter, chosen over both counts |" in summary
    assert "Served in the gathered cuBLAS form (`TileTable.gathers`: " in summary
    assert f"at or below the ridge): {run.gathered_summary(table)}." in summary
    assert "The packed prefill read (64 tokens, 50% of them RUN)" in summary
    assert "for every row's read by SGLang's triton backend, which a routed prefill reads through" in summary
    assert "### The routed path's goals" in summary and "| decode s=0 / dense in every cell | 0.97 |" in summary
    q_star = results["ladder"]["q_star"]["q_star"]
    assert "## Headline A/B: GSM8K-shaped load, one server at a time" in summary
    assert f"Q* = {q_star} req/s" in summary and "13 on the A100, 14 on the H100" in summary
    assert "- hybrid-rule: enter 60 / exit 40 resident KV tokens served (attested source: flags; from dry-run (CPU))" \
        in summary
    assert "| hybrid-rule | mean E2E change at 0.95 Q* |" in summary and "| below -36.8% (the paper's) | -36.8 ± 2.0 |" \
        in summary
    assert "| always | mean E2E change at 0.95 Q* |" in summary and "| -46.5 (n = 1) |" in summary
    assert "### hybrid-rule (random-r1-d0.5-hybrid) against dense" in summary
    assert "| A100 | 0.95 Q* | 6 | -36.8 ± 2.0 |" in summary
    served = summary[summary.index("### The served layer alone"):]
    assert "decode with the triton execution, eager" in served and "| 4 | 16 |" in served and "| 32 |" in served


def test_device_plan_server_commands_parse_with_sglangs_own_flags(tmp_path):
    plan = run.Plan.gpu()
    model = run.write_model(plan, tmp_path)
    config = json.loads((model / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["routing_layers"]) == \
        (32, 4096, list(range(16, 32)))
    arms = run.write_arms(tmp_path)
    parser = sglang_parser()
    for arm in (["--arm", "dense"], ["--arm-file", str(arms[run.ALWAYS])],
                ["--arm-file", str(arms[run.HYBRID]), "--gpu", "H100-SXM"]):
        r = subprocess.run([sys.executable, "-m", "vskipper.cli", "serve", "--model", str(model), *arm,
                            "--platform", "gpu", "--dry-run", "--", *plan.sglang_flags, "--mem-fraction-static",
                            plan.solo_mem_fraction], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert r.returncode == 0, r.stderr
        shown = json.loads(r.stdout)
        args = parser.parse_args(shown["command"][3:])
        assert (args.load_format, args.attention_backend, args.skip_tokenizer_init) == ("dummy", "triton", True)
        assert args.cuda_graph_backend_decode == "full"  # routed arms replay their routed decode variant
        max_bs = int(plan.sglang_flags[plan.sglang_flags.index("--cuda-graph-max-bs-decode") + 1])
        assert args.cuda_graph_backend_prefill == "disabled" and args.cuda_graph_max_bs_decode == max_bs
    # the sweep's reference arm: breakable prefill graphs at the sweep's prompt lengths, after every other flag
    reference = parser.parse_args(["--model-path", str(model), *plan.sglang_flags, *plan.prefill_graph_flags()])
    assert reference.cuda_graph_backend_prefill == "breakable"
    assert reference.cuda_graph_bs_prefill == sorted(plan.prefill_lengths) and run.Plan.dry().prefill_graph_flags() == []
    # the sweep's servers capture decode graphs at its batches alone
    sweep = parser.parse_args(["--model-path", str(model), *run.graph_flags(plan.sglang_flags, plan.batches)])
    assert sweep.cuda_graph_bs_decode == list(plan.batches) and sweep.cuda_graph_max_bs_decode is None
    assert run.graph_flags(plan.sglang_flags, None) == list(plan.sglang_flags)


def test_a_reference_arm_that_fails_leaves_its_error_once_and_the_summary_says_so(tmp_path, monkeypatch):
    """The sweep's reference arm is served once per OUTDIR: a server that fails to start leaves its error in its
    place (the sweep's own arms stand) and a later call starts none. (No server: its start stood in for.)"""
    starts = []

    def failing(plan, stack, model, workdir, name, arm_files, *args, **kwargs):
        starts.append(name)
        raise RuntimeError("Capture cuda graph failed: operation not permitted when stream is capturing")

    monkeypatch.setattr(run, "server_for", failing)
    plan, stage = run.Plan.gpu(), run.Stage("sweep", tmp_path, 600)
    result = run.sweep_reference(plan, stage, tmp_path / "model", {}, 128256)
    assert starts == [run.PREFILL_GRAPHS] and result["flags"] == plan.prefill_graph_flags()
    assert result["error"] == "RuntimeError: Capture cuda graph failed: operation not permitted when stream is capturing"
    assert run.sweep_reference(plan, stage, tmp_path / "model", {}, 128256) == result and len(starts) == 1
    lines = run.prefill_graph_lines({"flags": result["flags"], "error": result["error"]})
    assert lines[0] == (f"Against dense with SGLang's prefill graphs ({run.PREFILL_GRAPHS}: "
                        "--cuda-graph-backend-prefill breakable --cuda-graph-bs-prefill 1024 1536 2048 4096; every "
                        "other arm prefills eagerly, since prefill graphs hold no routed variant): not served, "
                        f"{result['error']}.")
    stopped = run.Stage("sweep", tmp_path / "later", 0)  # no time left: not started, left for the next call
    assert run.sweep_reference(plan, stopped, tmp_path / "model", {}, 128256) is None
    assert stopped.left == [f"sweep of {run.PREFILL_GRAPHS}"] and len(starts) == 1

    def killed(*args, **kwargs):  # the stage's limit ends the call while the reference's server starts
        starts.append("killed")
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "server_for", killed)
    again = run.Stage("sweep", tmp_path / "killed", 600)
    with pytest.raises(KeyboardInterrupt):
        run.sweep_reference(plan, again, tmp_path / "model", {}, 128256)
    assert run.sweep_reference(plan, again, tmp_path / "model", {}, 128256)["error"] == (
        "the call serving it stopped before it finished (its stage's limit or budget)") and starts[-1] == "killed"
    assert starts.count("killed") == 1  # the next call starts no second server


def test_no_prefill_prompt_of_the_sweep_is_a_prefix_of_another():
    """SGLang's prefix cache would hold the shorter one's tokens and the longer would prefill only the rest."""
    plan = run.Plan.gpu()
    prompts = [run.prefill_prompt(n, r, 128256) for n in plan.prefill_lengths for r in range(plan.prefill_reps)]
    prompts += [p for n, t in plan.prefill_rounds for r in range(plan.prefill_reps)  # the rounds' prompts too
                for p in run.round_prompts(n, t, r, 128256)]
    assert not any(a[:16] == b[:16] for i, a in enumerate(prompts) for b in prompts[i + 1:])


def test_the_sweep_times_its_prefill_prompts_in_rounds_of_every_length(monkeypatch):
    """Each repetition serves one fresh prompt at every length before the next repetition, so a drift over an arm's
    prompts falls on every length alike; each length's figure is the median of its repetitions, its passes' spans
    too, read from the server's clock between one prompt and the next. (No server: the request and the server's
    clock, a GPU's, are stood in for.)"""
    import copy
    from types import SimpleNamespace

    plan = run.Plan.gpu()
    sent: list[int] = []
    clock = {"parts": False, "passes_total": {}, "tokens_total": {}, "seconds_total": {},
             "device_seconds_total": {}, "device_passes_total": {},
             "forward_thread": {"cpu_seconds_total": {}, "waits_total": {}, "preempted_total": {},
                                "gc_seconds_total": {}}}

    def add(field: str, value, into: dict | None = None) -> None:
        into = clock if into is None else into
        into[field]["prefill"] = into[field].get("prefill", 0) + value

    async def fake_burst(server, prompts, new_tokens):
        n = len(prompts[0])
        sent.append(n)
        ttft = n * 1e-5 * (1 + len(sent) / 100)
        parts = {"scheduled": 1e-3, "forward": ttft - 4e-3, "output": 1e-3, "http": 2e-3}
        add("cpu_seconds_total", n * 0.75e-6, clock["forward_thread"])  # 3/4 of its host time, and waits a
        add("waits_total", n // 64, clock["forward_thread"])  # 64 tokens; a collection in the 2,048-token ones
        add("gc_seconds_total", 2e-3 if n == 2048 else 0.0, clock["forward_thread"])
        add("passes_total", 1)
        add("tokens_total", n)
        add("device_passes_total", 1)
        add("device_seconds_total", n * 2e-6)  # the device's span of the prompt's pass, twice the host's
        outside = clock["seconds_total"].setdefault("prefill", {}).setdefault("outside", {})
        outside["outside"] = outside.get("outside", 0.0) + n * 1e-6
        return [SimpleNamespace(ttft_s=ttft, ttft_parts=lambda: parts if n > 1024 else None)]

    def fake_round(server, prompts):  # one pass of every prompt's tokens
        n = sum(len(p) for p in prompts)
        sent.append((len(prompts), n))
        add("passes_total", 1)
        add("tokens_total", n)
        add("device_passes_total", 1)
        add("device_seconds_total", n * 2e-6)
        return n * 1e-5

    tick, readings = os.sysconf("SC_CLK_TCK"), []

    def fake_reading(first, tid):  # a tenth of a second a reading: the forward's CPU 0 busy throughout, 0.03 s
        k = len(readings)  # of it the forward's own; its sibling 1 half busy; CPU 2 stolen; 2 ms runnable waiting
        readings.append(tid)
        return {"t": k * 0.1, "uptime": 1000.0 + k * 0.1,
                "cpus": {0: (k * tick // 10, 0), 1: (k * tick // 20, 0), 2: (0, k * tick // 10)},
                "forward": {"tid": tid, "run_s": k * 0.03, "runnable_s": k * 0.002, "involuntary": k, "cpu": 0},
                "canary_us": 1200.0 if first else 1800.0,
                "processes": {4: ("leftover", k * 0.1, 1), os.getpid(): ("pytest", k * 0.01, 2)}}

    monkeypatch.setattr(run, "burst", fake_burst)
    monkeypatch.setattr(run, "prefill_round", fake_round)
    monkeypatch.setattr(run.machine, "reading", fake_reading)
    monkeypatch.setattr(run.machine, "siblings", lambda cpu, cpus: [1] if cpu == 0 else [0])
    threads = {"7": {"name": "MainThread", "cpu_s": 1.0, "waits": 1, "cpu": 0}}
    server = SimpleNamespace(get_json=lambda path: {"part_clock": copy.deepcopy(clock), "threads": threads})
    cells, rounds = run.prefill_cells(plan, server, 128256)
    # every repetition: each length alone, then each round of several prompts
    each = [*plan.prefill_lengths, *((n, n * t) for n, t in plan.prefill_rounds)]
    assert sent == each * plan.prefill_reps and 1536 in plan.prefill_lengths
    assert [c["tokens"] for c in cells] == list(plan.prefill_lengths)
    assert [(c["prompts"], c["tokens"]) for c in rounds] == [(2, 1536), (2, 2048)]
    for cell in rounds:  # a round's pass alone between its readings: one pass of both prompts
        assert cell["pass_spans"]["passes"] == 1 and cell["pass_spans"]["device_ms"] == pytest.approx(
            cell["tokens"] * 2e-3)
        assert cell["ttft_s"] == pytest.approx(cell["tokens"] * 1e-5)
    for cell in cells:
        assert len(cell["ttft_s_reps"]) == plan.prefill_reps
        assert cell["ttft_s"] == sorted(cell["ttft_s_reps"])[plan.prefill_reps // 2]
        # the parts where the server stamped the requests (not at 1,024 here), each the median over the prompts
        assert ("ttft_parts_s" in cell) == (cell["tokens"] > 1024)
        if cell["tokens"] > 1024:
            forwards = sorted(p["forward"] for p in cell["ttft_parts_s_reps"])
            assert cell["ttft_parts_s"]["forward"] == forwards[plan.prefill_reps // 2]
    lines = "\n".join(run.ttft_parts_lines({"dense": {"prefill": cells}}))
    assert "| 1024 |" not in lines and f"| 1536 | dense | {cells[1]['ttft_s'] * 1e3:.1f} | 1.0 |" in lines
    for cell in cells:  # each prompt's pass alone, between the readings before and after it
        n = cell["tokens"]
        assert cell["pass_spans"]["passes"] == 1 and len(cell["pass_spans"]["reps"]) == plan.prefill_reps
        assert cell["pass_spans"]["host_ms"] == pytest.approx(n * 1e-3)
        assert cell["pass_spans"]["device_ms"] == pytest.approx(n * 2e-3)
    decode = {"batch": 32, "context": 1000, "step_s": 0.0105,
              "pass_spans": {"host_ms": 0.21, "device_ms": 9.87, "passes": 190, "device_passes": 190}}
    lines = run.pass_span_lines({"dense": {"prefill": cells, "decode": [decode]}, run.ALWAYS: {"decode": [decode]}})
    # each prompt's machine: 1.5 CPUs busy, 1 stolen, the forward 2 ms runnable and preempted once a prompt, its
    # CPU 0 busy 70% beside its own 30%, beside its sibling half busy
    assert f"| 1536 | dense | {cells[1]['ttft_s'] * 1e3:.1f} | {cells[1]['ttft_parts_s']['forward'] * 1e3:.1f} | " \
           f"1.5 | 1.2 | 24 | 0.0 | 3.1 | 2.00 | 1 | 1.50 of 3 | 1.00 | 2.0 | 1.0 | 70% (50%), 5 of 5 | 1500 |" \
           in lines
    assert f"| 1024 | dense | {cells[0]['ttft_s'] * 1e3:.1f} | n/a | 1.0 | 0.8 | 16 | 0.0 | 2.0 | 2.00 | 1 | " \
           "1.50 of 3 | 1.00 | 2.0 | 1.0 | 70% (50%), 5 of 5 | 1500 |" in lines
    assert f"| 2048 | dense | {cells[2]['ttft_s'] * 1e3:.1f} | {cells[2]['ttft_parts_s']['forward'] * 1e3:.1f} | " \
           f"2.0 | 1.5 | 32 | 2.0 | 4.1 | 2.00 | 1 | 1.50 of 3 | 1.00 | 2.0 | 1.0 | 70% (50%), 5 of 5 | 1500 |" \
           in lines
    assert cells[0]["machine"]["windows"] == plan.prefill_reps
    assert cells[0]["machine"]["forward_cpus"] == [0] * plan.prefill_reps
    assert set(readings) == {7}  # the server's main thread, read from outside
    # the processes beside each arm's prompts, over all its lengths: 0.1 s a prompt of the leftover one
    n = plan.prefill_reps * len(plan.prefill_lengths)
    assert f"- dense: leftover 4 {0.1 * n:.2f} s, pytest {os.getpid()} (client) {0.01 * n:.2f} s" in lines
    # a decode cell whose clock did not read the forward's thread (a server from before it): n/a
    assert lines.index("| 32 | 1000 | dense | 10.50 | 0.21 | n/a | n/a | 9.87 | 190 |") < \
        lines.index(f"| 32 | 1000 | {run.ALWAYS} | 10.50 | 0.21 | n/a | n/a | 9.87 | 190 |")
    assert run.pass_span_lines({"dense": {"prefill": [{"tokens": 1, "ttft_s": 1.0}]}}) == []
    after = copy.deepcopy(clock)
    after["passes_total"]["prefill"] += 1
    after["errors"] = {"device": "RuntimeError: lost"}
    assert headline.pass_spans(clock, after, "prefill")["device_error"] == "RuntimeError: lost"
    broken = dict(decode, pass_spans=dict(decode["pass_spans"], device_ms=None, device_error="RuntimeError: lost"))
    lines = run.pass_span_lines({"dense": {"decode": [decode, broken]}})
    assert "The device's spans of dense's passes stopped: RuntimeError: lost." in lines
    assert "| 32 | 1000 | dense | 10.50 | 0.21 | n/a | n/a | n/a | 190 |" in lines
    after["errors"] = {"thread": "OSError: gone"}
    assert headline.pass_spans(clock, after, "prefill")["thread_error"] == "OSError: gone"
    assert headline.pass_spans(clock, after, "prefill")["cpu_ms"] is None
    stopped = dict(decode, pass_spans=dict(decode["pass_spans"], thread_error="OSError: gone"))
    lines = run.pass_span_lines({run.ALWAYS: {"decode": [stopped]}})
    assert f"The reads of {run.ALWAYS}'s forward thread stopped: OSError: gone." in lines
    assert not any("device's spans" in line for line in lines)
    assert headline.pass_spans(None, clock, "prefill") is None and headline.pass_spans(clock, clock, "prefill") is None


def test_a_clock_reading_the_server_served_late_is_read_again_and_a_late_window_is_named(monkeypatch):
    """The sweep reads a server's clock between prompts: a document the server served late ("answered": false,
    its clock perhaps without the last pass) is read again, up to READ_ATTEMPTS reads; a window a late reading
    still bounds is marked, counted per length and named in the summary. (No server: its answers stood in for.)"""
    from types import SimpleNamespace

    from loadgen.attestation import READ_ATTEMPTS

    def clock(passes: int) -> dict:
        return {"parts": False, "passes_total": {"prefill": passes}, "tokens_total": {"prefill": 1024 * passes},
                "seconds_total": {"prefill": {"outside": {"outside": 0.002 * passes}}},
                "device_passes_total": {"prefill": passes}, "device_seconds_total": {"prefill": 0.003 * passes},
                "errors": {}}

    def server(*docs):
        answers = list(docs)
        return SimpleNamespace(get_json=lambda path: answers.pop(0), left=answers)

    late, fresh = {"part_clock": clock(1), "answered": False}, {"part_clock": clock(2), "answered": True}
    once = server(late, fresh)
    assert run.pass_clock(once) == clock(2) and once.left == []
    never = server(*[late] * (READ_ATTEMPTS + 1))
    assert run.pass_clock(never) == dict(clock(1), late=True) and len(never.left) == 1
    assert run.pass_clock(server({"passes_total": {}})) is None  # a server that times no pass
    spans = [headline.pass_spans(clock(0), dict(clock(1), late=True), "prefill"),
             headline.pass_spans(dict(clock(1), late=True), clock(3), "prefill"),
             headline.pass_spans(clock(3), clock(4), "prefill")]
    assert [s.get("late", False) for s in spans] == [True, True, False] and spans[1]["passes"] == 2
    cell = {"tokens": 1024, "ttft_s": 0.05, "pass_spans": run.median_spans(spans)}
    assert cell["pass_spans"]["late"] == 2 and cell["pass_spans"]["host_ms"] == pytest.approx(2.0)
    lines = run.pass_span_lines({"dense": {"prefill": [cell]}})
    assert f"Readings the server served late (its document older than the read, after {READ_ATTEMPTS} reads; a " \
           "pass of such a window may sit in the next): dense 2 windows." in lines


def test_the_sweep_names_the_kernels_an_arm_first_launched_while_serving_its_cells():
    quiet = {"compiles": 0, "seconds": 0.0, "kernels": {}, "cache_loads": {}}
    loud = {"compiles": 2, "seconds": 3.1, "kernels": {"cohort_maps_kernel": 2}, "cache_loads": {"_fwd_kernel": 1}}
    assert run.sweep_compile_lines({"dense": {"compiles": quiet}, run.ALWAYS: {"compiles": loud},
                                    run.CONTROL: {}}) == [
        "Triton kernels first launched while an arm served its cells, built there or loaded from Triton's cache "
        f"(built on a machine whose cache lacks them): {run.ALWAYS}: 2 built (3.10 s; cohort_maps_kernel x2), "
        "loaded from the cache: _fwd_kernel x1.", ""]
    assert run.sweep_compile_lines({"dense": {"compiles": quiet}}) == [
        "No Triton kernel first launched while dense served their cells.", ""]
    assert run.sweep_compile_lines({"dense": {}}) == []  # a sweep from before the count


def test_ratio_range_spans_every_pairing_of_the_arms_repetitions():
    assert run.ratio_range([2.0, 3.0], [1.0, 4.0]) == [0.5, 3.0]
    assert run.ratio_range([2.0], None) is None  # results of a sweep without repetitions


def _cells(key: str, values: list[tuple[float, list[float] | None]], **extra) -> list[dict]:
    return [{"batch": 32, "context": 1024 * (i + 1), key: v, "range": r, **extra} for i, (v, r) in enumerate(values)]


def test_sweep_goals_judge_every_cell_on_its_range_and_name_the_deciding_cell():
    comparison = {
        # the longest prompt met, the shortest within its spread
        "prefill_over_control": [{"tokens": 1024, "control_over_routed_time": 1.02, "range": [0.98, 1.05]},
                                 {"tokens": 4096, "control_over_routed_time": 1.31, "range": [1.25, 1.33]}],
        # one cell's whole range short of 0.97; a cell with a lower median straddles it and does not decide
        "control_over_dense_decode": _cells("control_over_dense_tok_s", [(0.99, [0.98, 1.0]), (0.95, [0.94, 0.96]),
                                                                          (0.93, [0.80, 0.99])]),
        # 1.08 of a limit of 1.2 is 90%: met only where the low end is too
        "decode_over_control": _cells("routed_over_control_tok_s", [(1.1, [1.09, 1.12]), (1.2, [1.15, 1.25])],
                                      bandwidth_limit=1.2),
        # no repetitions: judged on the ratio alone
        "control_over_dense_prefill": [{"tokens": 1024, "dense_over_control_time": 0.98, "range": None}],
    }
    goals = {g["goal"]: g for g in run.sweep_goals(comparison)}
    longest, shortest, prefill_dense, decode_dense, share = (goals[g[0]] for g in run.SWEEP_GOALS)
    assert (longest["verdict"], longest["cell"], longest["cells"]) == ("met", {"tokens": 4096}, 1)
    assert (shortest["verdict"], shortest["cell"]) == ("within spread", {"tokens": 1024})
    assert prefill_dense["verdict"] == "met" and prefill_dense["range"] == [0.98, 0.98]
    assert (decode_dense["verdict"], decode_dense["cell"], decode_dense["ratio"], decode_dense["cells"]) == \
        ("missed", {"batch": 32, "context": 2048}, 0.95, 3)
    assert share["verdict"] == "met" and share["ratio"] == pytest.approx(1.1 / 1.2)
    assert share["range"] == pytest.approx([1.09 / 1.2, 1.12 / 1.2])
    assert run.sweep_goals({})[0] == {"goal": run.SWEEP_GOALS[0][0], "verdict": "not measured"}


def test_summary_says_where_the_devices_triton_is_not_the_compile_checked_one():
    from benchmarks.gpu.bundle import device_pins

    checked = device_pins()["triton"]
    said = f"The kernels are compile-checked with the device image's triton {checked}"
    assert said in run.markdown({"dry_run": False, "environment": {"triton": "0.0.1"}})
    assert said not in run.markdown({"dry_run": False, "environment": {"triton": checked}})


def _record(first: float, step: float, tokens: int):
    from loadgen.records import RequestRecord

    r = RequestRecord(0, "r", 0.0, 8, tokens, True)
    r.token_times_s = [first + i * step for i in range(tokens)]
    r.first_token_s = first
    return r


def test_decode_step_reads_the_window_where_the_whole_batch_decodes():
    # two requests decoding together from t = 1.0 to t = 1.3 at 10 ms a step
    step_s, steps = run.decode_step([_record(0.8, 0.01, 51), _record(1.0, 0.01, 31)])
    assert steps == 31 and step_s == pytest.approx(0.01)


def test_taus_interval_resamples_the_repetitions_behind_both_lines():
    """`tau_interval`: with every repetition alike the interval is the point (the lines' intercepts' difference);
    with spread repetitions it holds the point and widens; fewer than two cells fit no line. Seeded: the same
    figures give the same interval. The landed H200 sweep's tau (-0.046 ms) is told from zero or not by it."""
    def cells(intercept, slope, noise):
        return [{"resident_tokens": v, "step_s": intercept + slope * v,
                 "step_s_reps": [intercept + slope * v + e for e in noise]} for v in (1000, 2000, 4000, 8000)]

    dense, routed = cells(0.010, 1e-6, (0.0, 0.0, 0.0)), cells(0.0105, 0.8e-6, (0.0, 0.0, 0.0))
    lo, hi = run.tau_interval(dense, routed, resamples=200)
    assert lo == pytest.approx(0.0005) and hi == pytest.approx(0.0005)
    noisy = cells(0.0105, 0.8e-6, (-0.0004, 0.0, 0.0004))
    lo, hi = run.tau_interval(dense, noisy, resamples=400)
    assert lo < 0.0005 < hi and hi - lo > 0.0002
    assert run.tau_interval(dense, noisy, resamples=400) == (lo, hi)
    assert run.tau_interval(dense[:1], routed[:1]) is None
    landed = json.loads((ROOT / "benchmarks/results/H200/host-lean-sweep/sweep.json").read_text())["arms"]
    lo, hi = run.tau_interval(landed["dense"]["decode"], landed[run.ALWAYS]["decode"])
    assert lo < -0.0000458 < hi


def test_an_earlier_sweep_without_taus_interval_is_given_it_and_the_measured_arm_its_upper_end_and_floor():
    """host-lean-sweep predates tau's interval: the headline resamples it from the sweep's repetitions and serves
    its upper end (0.214 ms: V* 31k, exit 30k / enter 40k on the H200) and the sweep's measured prefill floor
    (2,048 tokens); a sweep that holds an interval, or lacks either arm's cells, is left as it is."""
    sweep = json.loads((ROOT / "benchmarks/results/H200/host-lean-sweep/sweep.json").read_text())
    assert "tau_ms_interval" not in sweep["comparison"]
    run.resample_tau(sweep)
    lo, hi = sweep["comparison"]["tau_ms_interval"]
    assert lo < sweep["comparison"]["tau_ms"] < hi and hi == pytest.approx(0.214, abs=0.002)
    rule = json.loads((ROOT / "benchmarks/results/H200/lease-4/headline.json").read_text())["thresholds"]["rule"]
    th, _ = headline.thresholds_from_tau(rule, sweep, run.Plan.gpu().threshold_step)
    assert (th["exit_tokens"], th["enter_tokens"], th["prefill_floor_tokens"]) == (30_000, 40_000, 2048)
    given = {"comparison": {"tau_ms": 1.0, "tau_ms_interval": [0.5, 1.5]}, "arms": sweep["arms"]}
    run.resample_tau(given)
    assert given["comparison"]["tau_ms_interval"] == [0.5, 1.5]
    bare = {"comparison": {"tau_ms": 1.0}, "arms": {"dense": sweep["arms"]["dense"]}}
    run.resample_tau(bare)
    assert "tau_ms_interval" not in bare["comparison"]


def test_decode_step_falls_back_to_each_requests_own_pace_where_the_batch_barely_overlaps():
    # the first request ends before the second's second token (a fast host): no common window of two steps
    step_s, steps = run.decode_step([_record(0.0, 0.002, 32), _record(0.062, 0.004, 32)])
    assert steps == 32 and step_s == pytest.approx(0.003)


def test_decode_step_refuses_requests_that_never_decoded_two_tokens_apart():
    with pytest.raises(RuntimeError, match="no request decoded two tokens apart"):
        run.decode_step([_record(0.0, 0.0, 4), _record(1.0, 0.0, 4)])


def test_profile_summary_sums_kernels_ops_and_host_waits_and_counts_the_steps_its_trace_holds():
    from benchmarks.gpu.profile_routed import summarise

    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "gemm", "dur": 30.0},
        {"ph": "X", "cat": "kernel", "name": "gemm", "dur": 20.0},
        {"ph": "X", "cat": "kernel", "name": "Memcpy DtoH (Device -> Pinned)", "dur": 2.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::item", "dur": 5.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "dur": 7.0},
        {"ph": "X", "cat": "user_annotation", "name": "step[EXTEND bs=1 toks=8]", "dur": 60.0},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "step[EXTEND bs=1 toks=8]", "dur": 55.0},
        {"ph": "i", "cat": "kernel", "name": "instant", "dur": 99.0}]}
    s = summarise(trace, top=5)
    assert s["gpu_kernel_us_total"] == 52.0 and s["gpu_kernels_us"][0] == ("gemm", 50.0)
    assert s["cpu_ops_us"] == [("step[EXTEND bs=1 toks=8]", 60.0), ("aten::item", 5.0)]
    assert s["steps"] == 1  # the one pass the trace holds (its GPU-side annotation is not a second)
    assert dict((name, (us, n)) for name, us, n in s["host_waits_us"]) == {
        "cudaStreamSynchronize": (7.0, 1), "aten::item": (5.0, 1), "Memcpy DtoH (Device -> Pinned)": (2.0, 1)}


def test_profile_routed_with_the_part_clock_reads_the_bursts_passes_from_a_real_servers_clock(tmp_path, capsys):
    """`profile_routed.py --part-clock --dry-run`: the always-route arm's real SGLang server (CPU) started with
    its part clock on and no profiler; the burst's one prefill pass and its decode passes, each phase's host ms a
    pass by layer kind, and no device span on a CPU."""
    from benchmarks.gpu import profile_routed
    from vskipper.sglang.spec import ENV_PART_CLOCK

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with pytest.MonkeyPatch.context() as mp:
        for k in set(os.environ) - set(env):
            mp.delenv(k)
        mp.setenv(ENV_PART_CLOCK, "0")  # the tool turns it on for its servers: restored (unset) after
        assert profile_routed.main([str(tmp_path), "--dry-run", "--part-clock", "--arm", run.ALWAYS,
                                    "--prompt", "48", "--new-tokens", "4"]) == 0
    result = json.loads((tmp_path / f"clock-{run.ALWAYS}.json").read_text())
    prefill, decode = result["phases"]["prefill"], result["phases"]["decode"]
    assert (prefill["passes"], prefill["tokens"]) == (1, 48) and decode["passes"] >= 3
    for phase in (prefill, decode):
        assert phase["routed"] > 0 and phase["dense"] > 0 and phase["outside"] > 0
        assert phase["model"] == pytest.approx(phase["routed"] + phase["dense"] + phase["outside"])
        assert (phase["device"], phase["device_passes"]) == (None, 0)
    assert set(prefill["seconds"]["routed"]) >= {"read", "glue", "mlp", "projector"}
    out = capsys.readouterr().out
    assert "-- prefill: 1 passes, 48 tokens; host " in out and "no device span (a CPU's clock)" in out
    assert ENV_PART_CLOCK not in os.environ


def test_profile_report_of_a_clock_of_pass_spans_alone_says_the_forward_was_timed_whole(capsys):
    """A server whose clock times passes whole (`VSKIPPER_PASS_SPANS` alone, as the device run's) has no layer
    kinds to report: the report says so instead of 0 ms a kind."""
    from benchmarks.bench_cpu import run_clock
    from benchmarks.gpu.profile_routed import report_clock

    def clock(n: int) -> dict:
        return {"parts": False, "passes_total": {"prefill": n}, "tokens_total": {"prefill": 64 * n},
                "seconds_total": {"prefill": {"outside": {"outside": 0.004 * n}}},
                "device_passes_total": {"prefill": n}, "device_seconds_total": {"prefill": 0.005 * n}}

    report_clock({"arm": "dense", "batch": 1, "prompt_tokens": 64, "new_tokens": 1,
                  "phases": {"prefill": run_clock(clock(1), clock(3), "prefill")}})
    out = capsys.readouterr().out
    assert "-- prefill: 2 passes, 128 tokens; host 4.00 ms a pass (the forward whole: pass spans alone); device " \
           "span 5.00 ms a pass (2 passes)" in out


def test_profile_summary_puts_each_steps_host_span_beside_its_device_span_and_busy_time():
    """A step's device side may carry nested annotations (one span); its busy time is the union of the kernels
    inside that span, so overlapping kernels count once and a gap the device waited through not at all."""
    from benchmarks.gpu.profile_routed import summarise

    def x(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {"traceEvents": [
        x("user_annotation", "step[EXTEND bs=1 toks=8]", 0.0, 40.0),
        x("gpu_user_annotation", "step[EXTEND bs=1 toks=8]", 10.0, 100.0),
        x("gpu_user_annotation", "step[EXTEND bs=1 toks=8]", 12.0, 90.0),  # nested in the first
        x("kernel", "a", 10.0, 20.0), x("kernel", "b", 20.0, 20.0),  # overlapping: 10..40
        x("kernel", "c", 80.0, 40.0),  # runs past the span's end (110): 80..110 counts
        x("user_annotation", "step[DECODE bs=1]", 120.0, 5.0),
        x("gpu_user_annotation", "step[DECODE bs=1]", 130.0, 10.0),
        x("kernel", "d", 131.0, 8.0)]}
    s = summarise(trace, top=5)
    assert s["steps"] == 2
    assert s["step_clocks"] == [
        {"step": "step[EXTEND bs=1 toks=8]", "cpu_us": 40.0, "gpu_span_us": 100.0, "gpu_busy_us": 60.0},
        {"step": "step[DECODE bs=1]", "cpu_us": 5.0, "gpu_span_us": 10.0, "gpu_busy_us": 8.0}]
    one = summarise({"traceEvents": trace["traceEvents"][:2]}, top=5)  # no kernels: a span, nothing busy
    assert one["step_clocks"][0]["gpu_busy_us"] == 0.0


def test_summary_prints_the_served_layer_as_a_gpu_run_writes_it(tmp_path):
    """On CUDA the bench's served section has no dense prefill figure and reads prefill through SGLang's backend
    (Project-Only rows enter the read): the summary says so instead of failing on the missing column."""
    bench = tmp_path / "kernels" / run.BENCH_JSON
    bench.parent.mkdir()
    cell = {"rows": 32, "context": 512, "s=0_ms": 1.0, "s=0.5_ms": 0.9, "speedup": 1.11,
            "project_only_share": 0.5, "bandwidth_limit": 1.02}
    row = {"tokens": 1024, "s=0_ms": 3.0, "s=0.5_ms": 2.0, "speedup": 1.5, "project_only_share": 0.5,
           "flop_limit": 1.8, "project_only_rows_read": True}
    bench.write_text(json.dumps({"s": 0.5, "served": {"execution": {"decode": "triton"}, "decode_graphs": True,
                                                      "decode": {"cells": [cell]}, "prefill": [row]}}))
    text = "\n".join(run.served_layer_lines(bench))
    assert "decode with the triton execution, replayed from CUDA graphs" in text
    assert "| 32 | 512 | 1.000 | 0.900 | 1.110 | 0.50 | 1.020 |" in text
    assert "zero query" in text and "| 1024 | n/a | 3.00 | 2.00 | 1.500 | 0.500 | 1.800 |" in text
    assert run.served_layer_lines(tmp_path / "missing.json") == []
    assert not run.finished(bench)  # written after each section: whole only once marked complete
    bench.write_text(json.dumps({"served": {}, "complete": True}))
    assert run.finished(bench)


def test_a_step_that_fails_is_not_run_again_and_one_stopped_midway_is(tmp_path):
    """`run_steps`: a failure (a deterministic one would spend the session on three tries) is named as failed and
    the stage exits 1; a step stopped at the budget, or exiting with its output partial, is left for the next run
    (exit 4: run.sh runs it again)."""
    plan = run.Plan.dry()
    stage = run.Stage("kernels", tmp_path, budget_s=60)
    partial = stage.out / run.BENCH_JSON
    steps = (("fails", tmp_path / "never.json", [sys.executable, "-c", "raise SystemExit(3)"]),
             ("partial", partial, [sys.executable, "-c", f"open({str(partial)!r}, 'w').write('{{}}')"]),
             ("whole", tmp_path / "t.json", [sys.executable, "-c", f"open({str(tmp_path / 't.json')!r}, 'w')"]))
    runs = run.run_steps(plan, stage, steps)
    assert {k: v["exit"] for k, v in runs.items()} == {"fails": 3, "partial": 0, "whole": 0}
    assert stage.failed == ["fails"] and stage.left == ["partial"]


def test_the_tuner_may_run_on_past_the_tiles_stages_budget_into_its_limit(tmp_path, monkeypatch):
    """The tuner writes its table at its end, and some of what it runs is not bounded by its own budget: stopped
    at the stage's budget it would leave no table (and a lease's capped stage does not run again). Its step runs
    until the stage's limit (run.sh's `--limit-s`) less `TILES_END_S`; without a limit, until the budget."""
    waits = []

    def fake_run(cmd, **kwargs):
        waits.append(kwargs["timeout"])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(run.subprocess, "run", fake_run)
    run.stage_tiles(run.Plan.dry(), tmp_path / "a", budget_s=180, limit_s=260)
    run.stage_tiles(run.Plan.dry(), tmp_path / "b", budget_s=180)
    assert 260 - run.TILES_END_S - 5 < waits[0] <= 260 - run.TILES_END_S
    assert 175 < waits[1] <= 180


def test_a_check_the_stages_budget_stopped_runs_again_in_the_stages_next_run(tmp_path, monkeypatch):
    """A check of the served layer stopped by the stage's budget (not its own limit) ran short, not wrong: it is
    left for the stage's next run, which starts it again (one its own limit stopped is not: it would hang again)."""
    calls = []

    def budget_stop(plan, stage, steps, limit_s=None, need_s=None):
        calls.append(1)
        stage.left.append("check-served")
        return {"check-served": {"exit": 124, "output": str(steps[0][1])}}

    monkeypatch.setattr(run, "run_steps", budget_stop)
    run.check_served(run.Plan.dry(), tmp_path, run.Stage("sweep", tmp_path, 600))
    run.check_served(run.Plan.dry(), tmp_path, run.Stage("sweep", tmp_path, 600))
    assert len(calls) == 2 and not (tmp_path / "sweep" / "check-served.run.json").exists()


def test_the_tiles_stage_never_tunes_once_a_serving_stage_took_the_shipped_table(tmp_path):
    """Resuming a run whose servers started without a tuned table (an earlier failure or a run from before the
    stage): a table measured now would split dense's cells and the arms' (the headline's gate refuses such pairs),
    so the run keeps the shipped table and says so."""
    (tmp_path / "ladder").mkdir()
    result = run.stage_tiles(run.Plan.dry(), tmp_path, budget_s=60)
    assert result["runs"] == {} and result["left"] == [] and "ladder already served" in result["skipped"]
    assert run.tuned_table(run.Plan.dry(), tmp_path) is None
    assert "not tuned: ladder already served with the shipped table" in "\n".join(run.tiles_lines(result, None))


def test_the_tiles_summary_puts_the_ffn_pair_grouped_beside_apart_where_the_tuner_timed_it():
    """A tuned table's `ffn_pair` in the summary: each timed range's grouped and apart times and their ratio; a
    range the tuner did not time is left out. A tile's row names its K split where it splits."""
    from vskipper.mixed.tiles import default_tile_table

    table = default_tile_table(227 * 1024, "H100-SXM").as_dict()
    table["ffn_pair"] = [{"rows": [1, 16], "grouped_ms": 0.02, "apart_ms": 0.025},
                         {"rows": [17, 32], "apart_ms": 0.03, "grouped_error": "TunerError: its output strays 3"},
                         {"rows": [33, None]}]
    table["tiles"]["mlp_down"][3].update(split_k=4, kernel_ms=0.05, torch_ms=0.04, floor_ms=0.025, tried=9,
                                         refused=2)
    table["prefill_read"] = {"block_rows": 64, "block_n": 64, "num_warps": 4, "num_stages": 2, "kernel_ms": 0.1,
                             "causal_all_rows_ms": 0.08, "pairs_share": 0.49, "tokens": 2048, "run_share": 0.5,
                             "tried": 7, "refused": 1}
    # a tile that splits K says so in its row, and a shape beside its roofline floor where the tuner recorded it
    text = "\n".join(run.tiles_lines({"device": "H100-SXM", "runs": {}, "table": table}, None))
    pair = text[text.index("| rows | grouped ms"):]
    assert "| 1-16 | 0.0200 | 0.0250 | 0.800 |" in pair and "| 17-" not in pair and "| 33-" not in pair
    # where the grouped launch failed or strayed from the two apart, and the tiles and read launches refused
    assert "launch apart, at: 17-32 rows (TunerError: its output strays 3)." in text
    assert "| mlp_down | 65-128 | 64 x 128 x 64, K split 4 ways | 8 | 3 | 0.0500 |" in text
    assert "| 9 (2 refused) | eager | 0.0250 | 2.00 |" in text
    assert "(best of 7 launches, 1 refused: their output strayed from SDPA)" in text
    assert sum(line.endswith("| eager | n/a | n/a |") for line in text.splitlines()) == 47  # no floor recorded
    assert "| mlp_down | 33-64 | 64 x 128 x 64 | 4 | 3 |" in text


def test_the_summary_names_the_tiles_the_sweep_served_and_what_their_table_lacks_with_or_without_a_tiles_stage():
    """The sweep's servers attest their table, what of the tuner's measurements it lacks (`tiles_lack`) and their
    prefill read with what chose it (`prefill_read_why`): the summary lists them, under the tiles stage's table or, where no tiles stage ran in the folder (a sweep on an
    earlier run's table), on its own."""
    from vskipper.mixed.tiles import default_tile_table

    lack = ["half-count times: no GEMM serves in the gathered cuBLAS form where torch is faster"]
    why = "the table measured the packed read of half a prompt's rows at 0.1 ms, every row's read by ... at 0.2 ms"
    sweep = {"arms": {"dense": {"served": {"tiles": "t.json, sha256 ab", "routed_layers_backend": {
        "tiles_lack": lack, "prefill_read": "packed", "prefill_read_why": why,
        "split_k": {"attn_o": [[1, 64, 4], [65, 512, 2]], "mlp_down": [[17, 32, 2]]}}}},
        run.CONTROL: {"served": {"tiles": None}},
        # a server whose model never installed attests the runtime's default sentence there, not a record
        run.ALWAYS: {"served": {"tiles": None, "routed_layers_backend": "torch cohorts (the default)"}}}}
    alone = "\n".join(run.tiles_lines(None, sweep))
    assert alone.startswith("## Tiles the sweep served with")
    assert (f"- dense: t.json, sha256 ab; K split: attn_o at 1-64 slots 4 ways, 65-512 slots 2 ways; mlp_down at "
            f"17-32 slots 2 ways; the table lacks {lack[0]}; prefill read packed ({why})") in alone
    assert f"- {run.CONTROL}: none (no Triton GEMM in this arm)" in alone
    assert f"- {run.ALWAYS}: none (no Triton GEMM in this arm)" in alone
    table = default_tile_table(227 * 1024, "H100-SXM").as_dict()
    staged = "\n".join(run.tiles_lines({"device": "H100-SXM", "runs": {}, "table": table}, sweep))
    assert staged.startswith("## Tiles\n") and f"the table lacks {lack[0]}" in staged
    assert run.tiles_lines(None, None) == []


def test_a_stage_that_failed_runs_again_in_a_later_run_and_the_tiles_stage_then_keeps_the_shipped_table(tmp_path,
                                                                                                        capsys):
    """A stage whose JSON records a failure is not complete: a later `run.py` runs it again (here the tiles stage,
    which finds the ladder already served and keeps the shipped table, the earlier failure kept beside)."""
    (tmp_path / "tiles.json").write_text(json.dumps({"device": "CPU", "runs": {"tune-tiles": {"exit": 2}},
                                                      "left": [], "failed": ["tune-tiles"]}))
    (tmp_path / "ladder").mkdir()
    assert run.main(["tiles", str(tmp_path), "--dry-run"]) == 0
    result = json.loads((tmp_path / "tiles.json").read_text())
    assert "ladder already served" in result["skipped"] and result["earlier"]["failed"] == ["tune-tiles"]
    written = (tmp_path / "tiles.json").read_bytes()
    capsys.readouterr()
    assert run.main(["tiles", str(tmp_path), "--dry-run"]) == 0  # now complete: not run again
    assert "[tiles] complete in an earlier run" in capsys.readouterr().out
    assert (tmp_path / "tiles.json").read_bytes() == written



def test_a_lease_serves_its_arms_knee_first_and_packs_its_folder(dry_run):
    """lease-2: the ladder and dense's cells at every load, then the hybrid arm at the rule's thresholds alone,
    each arm's cells knee first; the folder packed whole after the summary."""
    out, logs = dry_run
    two = lease_out(out, "lease-2")
    ladder = json.loads((two / "ladder.json").read_text())
    assert ladder["loads"] == list(headline.LOADS) and ladder["q_star_from"] == "this run's ladder"
    result = json.loads((two / "headline.json").read_text())
    assert list(result["arms"]) == ["hybrid-rule"] and result["arms_requested"] == ["hybrid-rule"]
    assert result["arms"]["hybrid-rule"]["gates_passed"]
    text = logs["lease-2"]
    served = [text.index(f"[headline] hybrid-rule {load}-rep0") for load in headline.SERVE_ORDER]
    assert served == sorted(served) and "[run] lease-2 done in" in text
    with tarfile.open(f"{two}.tar.gz") as archive:
        names = set(archive.getnames())
    assert {f"{two.name}/{name}" for name in ("headline.json", "ladder.json", "summary.md", "env.json")} <= names


def test_a_later_lease_serves_dense_at_an_earlier_runs_q_star_and_only_where_its_arms_serve(dry_run):
    """lease-3 with lease-2's folder as --earlier: the same GPU (both dry runs name none), so dense does not climb
    the ladder again and serves the knee's cells alone, where always-route and the control serve theirs."""
    out, logs = dry_run
    two, three = lease_out(out, "lease-2"), lease_out(out, "lease-3")
    ladder = json.loads((three / "ladder.json").read_text())
    assert ladder["q_star"] == json.loads((two / "ladder.json").read_text())["q_star"]
    assert str(two) in ladder["q_star_from"] and not (three / "ladder" / "rates").exists()
    # the rates taken are kept: a later call on this folder serves at the same Q*, --earlier given or not
    assert json.loads((three / "ladder" / "earlier-q-star.json").read_text())["from"] == ladder["q_star_from"]
    assert ladder["loads"] == ["knee"] and not ladder["left"]
    assert {key for key, cell in ladder["dense"].items() if cell} == {f"knee-rep{r}" for r in range(run.Plan.dry().repetitions)}
    result = json.loads((three / "headline.json").read_text())
    assert list(result["arms"]) == ["always", "control"] and all(a["gates_passed"] for a in result["arms"].values())
    assert "not climbed again" in (three / "summary.md").read_text() and "ladder does not climb again" in \
        logs["lease-3"]
    # the hybrid arm needs dense's side at every load: this folder's ladder served the knee's alone, so the call
    # fails naming it (no server started) and keeps the arms served before
    copy = three.with_name(f"{three.name}-copy")
    shutil.copytree(three, copy)
    assert run.main(["headline", str(copy), "--dry-run", "--arms", "hybrid-rule"]) == 1
    again = json.loads((copy / "headline.json").read_text())
    assert again["failed"] == ["hybrid-rule"] and list(again["arms"]) == ["hybrid-rule", "always", "control"]
    assert again["arms"]["hybrid-rule"]["skipped"].startswith("dense has not served overload-rep0, below-rep0")
    assert again["arms"]["always"]["gates_passed"]


def test_within_starts_no_stage_that_cannot_finish_and_still_writes_the_summary(tmp_path):
    """--within: what is left of the call's seconds, less the summary's margin, under a stage's least: not
    started, the lease exits 4 (its stages left for a later call) and the summary is written."""
    r = subprocess.run([str(SCRIPT), "lease-1", str(tmp_path / "out"), "--dry-run", "--within", "40"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert r.returncode == 4, r.stdout + r.stderr
    assert "[tiles] not started: " in r.stdout and "[sweep] not started: " in r.stdout  # tiles is not needed
    assert (tmp_path / "out" / "summary.md").is_file() and not (tmp_path / "out" / "tiles.json").exists()
    bad = subprocess.run([str(SCRIPT), "lease-1", str(tmp_path / "out"), "--within", "soon"], capture_output=True,
                         text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "--within: a whole number of seconds" in bad.stderr


def test_a_lease_whose_tiles_stage_fails_goes_on_to_its_sweep(tmp_path):
    """The lease's later stages do not need the tiles stage's table (a server without it takes the one shipped for
    the device): a tuner that fails on the device (a kernel that faults, a budget overrun) leaves the sweep to run,
    and the lease's exit says the tiles stage failed. The tiles stage is told its limit beside its budget (the
    tuner may run on into it): the lease's cap of 180 s, and 80 s more."""
    stub, calls, args = tmp_path / "python", tmp_path / "calls", tmp_path / "args"
    stub.write_text(f"""#!/bin/sh
if [ "$1" = benchmarks/gpu/run.py ] && [ "$2" = tiles ]; then echo tiles >> {calls}; echo "$@" > {args}; exit 1; fi
if [ "$1" = benchmarks/gpu/run.py ] && [ "$2" = sweep ]; then echo sweep >> {calls}; exit 0; fi
exec {sys.executable} "$@"
""")
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([str(SCRIPT), "lease-1", str(tmp_path / "out"), "--dry-run"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120, env={**env, "PYTHON": str(stub)})
    assert r.returncode == 1, r.stdout + r.stderr
    assert calls.read_text().split() == ["tiles", "sweep"] and "[tiles] failed with exit 1" in r.stdout
    assert "--budget-s 180 --limit-s 260" in args.read_text()
    assert (tmp_path / "out" / "summary.md").is_file()


def _stopping_python(tmp_path, stops: int):
    """An interpreter for run.sh whose `run.py kernels` stops at its budget (exit 4) in its first `stops` runs and
    finishes after; everything else runs on this interpreter. It counts the stage's runs in a file beside it."""
    stub, runs = tmp_path / "python", tmp_path / "kernels-runs"
    stub.write_text(f"""#!/bin/sh
if [ "$1" = benchmarks/gpu/run.py ] && [ "$2" = kernels ]; then
    echo run >> {runs}
    [ "$(wc -l < {runs})" -gt {stops} ] || exit 4
    exit 0
fi
exec {sys.executable} "$@"
""")
    stub.chmod(0o755)
    return stub, runs


@pytest.mark.parametrize("stops, within, code, runs", [(1, True, 0, 2), (5, True, 4, 3), (1, False, 4, 1)])
def test_a_stage_named_alone_runs_again_when_its_budget_stopped_it(tmp_path, stops, within, code, runs):
    """A stage called on its own with --within that stops at its budget runs again while the call has time, as in a
    lease, up to three runs (one device call once swept two arms of three and left the third to a second call);
    without --within it runs once (three runs of a stage's limit would outlast a device call)."""
    stub, counted = _stopping_python(tmp_path, stops)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([str(SCRIPT), "kernels", str(tmp_path / "out"), "--dry-run",
                        *(["--within", "1000"] if within else [])],
                       capture_output=True, text=True, cwd=ROOT, timeout=120, env={**env, "PYTHON": str(stub)})
    assert r.returncode == code, r.stdout + r.stderr
    assert len(counted.read_text().split()) == runs
    assert r.stdout.count("[kernels] time budget reached") == min(stops, runs)


def test_a_stage_that_left_work_and_started_none_is_not_run_again_in_the_call(tmp_path, monkeypatch):
    """A headline run whose budget fit no arm's start (after the ladder and the check, 140-199 s of a call) leaves
    its arms and says so: run.py exits 5, and run.sh does not run the stage again in the call (its rerun would
    have less time still, and only recompute the predictions); the call exits 4, work left."""
    monkeypatch.setattr(run, "summary", lambda plan, out: None)
    monkeypatch.setattr(run, "stage_kernels", lambda plan, out, budget_s: {"left": ["hybrid-tau: 9 cells"],
                                                                           "idle": True})
    assert run.main(["kernels", str(tmp_path / "unit"), "--dry-run"]) == run.EXIT_IDLE
    monkeypatch.setattr(run, "stage_kernels", lambda plan, out, budget_s: {"left": ["x"], "idle": False})
    assert run.main(["kernels", str(tmp_path / "unit2"), "--dry-run"]) == 4
    # a stage that failed somewhere is not run again by the call, whatever it left (its failure would repeat)
    monkeypatch.setattr(run, "stage_kernels", lambda plan, out, budget_s: {"left": ["x"], "failed": ["y"]})
    assert run.main(["kernels", str(tmp_path / "unit3"), "--dry-run"]) == 1
    stub, runs = tmp_path / "python", tmp_path / "kernels-runs"
    stub.write_text(f"""#!/bin/sh
if [ "$1" = benchmarks/gpu/run.py ] && [ "$2" = kernels ]; then echo run >> {runs}; exit {run.EXIT_IDLE}; fi
exec {sys.executable} "$@"
""")
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([str(SCRIPT), "kernels", str(tmp_path / "out"), "--dry-run", "--within", "1000"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120, env={**env, "PYTHON": str(stub)})
    assert r.returncode == 4, r.stdout + r.stderr
    assert runs.read_text().split() == ["run"] and "[kernels] what is left does not fit this call's time" in r.stdout


def test_install_refuses_a_folder_that_holds_a_run_on_another_gpu(tmp_path):
    """A second call that lands on another machine kind must not pair its cells with the first's (nor hand the
    first's table to its servers): the folder's env.json says what it ran on."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "env.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "mode": "device"}))
    r = subprocess.run([str(SCRIPT), "install", str(out), "--dry-run"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert r.returncode == 2 and "holds a run on NVIDIA H100 80GB HBM3 (device, stand-in ops torch), this one is on " \
        "none (--dry-run, stand-in ops torch)" in r.stderr and "give this one as --earlier" in r.stderr
    assert json.loads((out / "env.json").read_text())["mode"] == "device"  # kept


def test_a_run_serves_every_server_on_one_kind_of_stand_in_ops_and_pairs_only_with_runs_on_the_same(tmp_path,
                                                                                                    monkeypatch):
    """`run.sh --stand-in-ops triton`: every server of the run, dense included, serves RMSNorm, SiLU-and-mul and RoPE on
    the Triton stand-ins (`vskipper serve --stand-in-ops`); its folder says so, and an earlier run's Q*, tau or table
    serves it only where that run measured on the same ops (the ops move dense's baseline). A CPU dry run, whose
    profile has no stand-ins, refuses them."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for args, message in ((["--dry-run", "--stand-in-ops", "triton"], "--stand-in-ops triton: the CUDA stand-ins', "
                                                                      "not a CPU dry run's"),
                          (["--stand-in-ops", "cuda"], "--stand-in-ops: torch or triton")):
        r = subprocess.run([str(SCRIPT), "install", str(tmp_path / "never"), *args], capture_output=True, text=True,
                           cwd=ROOT, timeout=60, env=env)
        assert r.returncode == 2 and message in r.stderr
    monkeypatch.setenv(run.ENV_STAND_IN_OPS_RUN, "triton")
    assert run.run_stand_in_ops(run.Plan.gpu()).stand_in_ops == "triton"
    with pytest.raises(SystemExit, match="which a CPU dry run does not serve"):
        run.run_stand_in_ops(run.Plan.dry())
    monkeypatch.setenv(run.ENV_STAND_IN_OPS_RUN, "cuda")
    with pytest.raises(SystemExit, match="one of torch, triton"):
        run.run_stand_in_ops(run.Plan.gpu())
    monkeypatch.delenv(run.ENV_STAND_IN_OPS_RUN)
    assert run.run_stand_in_ops(run.Plan.dry()).stand_in_ops == "torch"
    this, before = tmp_path / "this", tmp_path / "before"
    for folder, ops in ((this, "triton"), (before, None)):  # a run from before the option: SGLang's paths
        folder.mkdir()
        (folder / "env.json").write_text(json.dumps({"gpu": "NVIDIA H200", "mode": "device",
                                                     **({"stand_in_ops": ops} if ops else {})}))
        (folder / "x.json").write_text("{}")
    monkeypatch.setenv(run.ENV_EARLIER, str(before))
    found, why = run.earlier(this, "x.json", lambda p: True)
    assert found is None and why == f"{before} measured on NVIDIA H200 (device), this run on NVIDIA H200 (device, " \
        "stand-in ops triton)"
    (before / "env.json").write_text(json.dumps({"gpu": "NVIDIA H200", "mode": "device", "stand_in_ops": "triton"}))
    assert run.earlier(this, "x.json", lambda p: True)[0] == before / "x.json"
    from vskipper.sglang.launch import serve_command

    cmd = serve_command(tmp_path / "m", 31000, tmp_path / "s.json", arm="dense", platform="gpu",
                        stand_in_ops="triton")
    assert cmd[cmd.index("--stand-in-ops") + 1] == "triton" and cmd.index("--stand-in-ops") < cmd.index("--")
    assert "--stand-in-ops" not in serve_command(tmp_path / "m", 31000, tmp_path / "s.json", arm="dense")


def test_a_stage_covers_a_later_run_only_with_the_arms_and_loads_it_asks_for(tmp_path, monkeypatch):
    monkeypatch.delenv(run.ENV_EARLIER, raising=False)
    hybrid, knee_only, tau = ("hybrid-rule",), ("always", "control"), ("hybrid-tau",)
    assert run.arm_loads(knee_only) == ("knee",) and run.arm_loads(hybrid) == headline.LOADS
    ladder = {"loads": ["knee"], "left": []}
    assert run.covers("ladder", ladder, knee_only, tmp_path) and not run.covers("ladder", ladder, hybrid, tmp_path)
    done = {"arms_requested": ["hybrid-rule"], "left": []}
    assert run.covers("headline", done, hybrid, tmp_path) and not run.covers("headline", done, knee_only, tmp_path)
    assert not run.covers("headline", {**done, "left": ["always: 3 cells"]}, hybrid, tmp_path)
    assert not run.covers("headline", {**done, "failed": ["hybrid-rule"]}, hybrid, tmp_path)
    assert run.covers("headline", {"left": []}, knee_only, tmp_path)  # a run before leases served every arm
    # the tau arm, not served for want of a sweep, is done until a sweep comes (an earlier run's, or this run's)
    waiting = {"arms_requested": ["hybrid-tau"], "left": [], "arms": {"hybrid-tau": {"skipped": "no measured tau",
                                                                                    "wants_sweep": True}}}
    assert run.covers("headline", waiting, tau, tmp_path)
    (tmp_path / "sweep.json").write_text(json.dumps({"comparison": {"tau_ms": 2.0}}))
    assert not run.covers("headline", waiting, tau, tmp_path)
    with pytest.raises(SystemExit):
        run.main(["headline", "/nonexistent", "--dry-run", "--arms", "hybrid-rule,fastest"])
    assert {lease.name for lease in run.LEASES} == {f"lease-{n}" for n in range(1, 7)}
    for lease in run.LEASES:  # every stage and arm a lease names exists, in `run.sh all`'s order
        assert list(lease.stages) == [s for s in run.STAGES if s in lease.stages]
        assert set(lease.headline_arms) <= set(run.HEADLINE_ARMS) and set(dict(lease.caps)) <= set(lease.stages)
        assert lease.estimate_s <= 900 - 60  # a lease's device time, less the machine's start
    readme = (ROOT / "benchmarks" / "gpu" / "README.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in readme.splitlines() if line.startswith("| `lease-")}
    assert {name: row.rstrip(" |").endswith(f"| {lease.estimate_s} s") for name, row in rows.items()
            for lease in run.LEASES if lease.name == name} == {lease.name: True for lease in run.LEASES}


def test_the_headline_serves_its_arms_in_the_order_asked_then_those_an_earlier_run_asked_for():
    """A lease names its most important arm first (lease-5: the measured hybrid arm, then the knee's ablations), so
    that a budget spent leaves the others; an earlier run's arms in the same folder stay in the result."""
    (lease,) = [lease for lease in run.LEASES if lease.name == "lease-5"]
    assert run.headline_order(lease.headline_arms, ()) == ("hybrid-tau", "always", "control")
    assert run.headline_order(("control", "always"), ["hybrid-tau", "hybrid-rule"]) == \
        ("control", "always", "hybrid-rule", "hybrid-tau")
    assert run.headline_order(tuple(run.HEADLINE_ARMS), ["always"]) == tuple(run.HEADLINE_ARMS)


def test_an_earlier_runs_table_and_tau_serve_only_on_the_gpu_they_were_measured_on(tmp_path, monkeypatch):
    plan = run.Plan.dry()
    this, before = tmp_path / "this", tmp_path / "before"
    for folder, gpu in ((this, "NVIDIA H100 80GB HBM3"), (before, "NVIDIA H100 80GB HBM3")):
        folder.mkdir()
        (folder / "env.json").write_text(json.dumps({"gpu": gpu}))
    (before / "tiles").mkdir()
    table = before / "tiles" / run.TILES_JSON
    table.write_text(json.dumps({"device": run.DRY_TILES_DEVICE, "tiles": {}}))
    (before / "sweep.json").write_text(json.dumps({"comparison": {"tau_ms": 1.5}}))
    monkeypatch.delenv(run.ENV_EARLIER, raising=False)
    assert run.tuned_table(plan, this) is None and run.sweep_for_tau(this)[0] is None  # none given
    monkeypatch.setenv(run.ENV_EARLIER, str(before))
    assert run.tuned_table(plan, this) == table
    sweep, where = run.sweep_for_tau(this)
    assert sweep["comparison"]["tau_ms"] == 1.5 and str(before) in where
    table.write_text(json.dumps({"device": "H200", "tiles": {}}))  # measured for another device
    assert run.tuned_table(plan, this) is None
    (before / "env.json").write_text(json.dumps({"gpu": "NVIDIA H200"}))
    sweep, why = run.sweep_for_tau(this)
    assert sweep is None and "measured on NVIDIA H200 (None), this run on NVIDIA H100 80GB HBM3 (None)" in why
    # a dry run on the device names its GPU too: its mode keeps its figures out of a device run
    (before / "env.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "mode": "--dry-run"}))
    (this / "env.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "mode": "device"}))
    assert run.sweep_for_tau(this)[0] is None
    assert run.earlier(this, "sweep.json", lambda p: True)[0] is None
    (before / "env.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "mode": "device"}))
    assert run.earlier(this, "sweep.json", lambda p: True)[0] == before / "sweep.json"
    (this / "sweep.json").write_text(json.dumps({"comparison": {"tau_ms": 2.0}}))
    assert run.sweep_for_tau(this) == ({"comparison": {"tau_ms": 2.0}}, "this run's sweep")
    monkeypatch.setenv(run.ENV_EARLIER, str(tmp_path / "gone"))
    with pytest.raises(RuntimeError, match="gone: no such folder"):
        run.earlier_runs()


def test_the_device_tau_is_the_intercept_gap_of_the_device_spans_lines_and_none_without_them():
    """tau on the device alone (`device_tau_ms`): the routed arm's line of each decode cell's device ms a pass over
    the resident tokens, less dense's intercept; none where a cell has no device span (a CPU)."""
    def cells(intercept_ms: float, slope_ms: float) -> list[dict]:
        return [{"resident_tokens": v, "pass_spans": {"device_ms": intercept_ms + slope_ms * v}}
                for v in (32_000, 64_000, 128_000)]

    assert run.device_tau_ms(cells(10.0, 4e-5), cells(10.5, 3e-5)) == pytest.approx(0.5)
    cpu = [dict(c, pass_spans=dict(c["pass_spans"], device_ms=None)) for c in cells(10.0, 4e-5)]
    assert run.device_tau_ms(cpu, cells(10.5, 3e-5)) is None
    assert run.device_tau_ms([{"resident_tokens": 1}], cells(10.5, 3e-5)) is None  # no spans at all
    assert run.device_tau_ms(cells(10.0, 4e-5)[:1], cells(10.5, 3e-5)[:1]) is None  # one cell: no line
    clock = {"passes_total": {"decode": 10}, "device_passes_total": {"decode": 9}, "device_seconds_total":
             {"decode": 0.09}, "seconds_total": {"decode": {"outside": {"outside": 0.01}}}}
    empty = {"passes_total": {}, "device_passes_total": {}, "device_seconds_total": {}, "seconds_total": {}}
    assert headline.pass_spans(empty, clock, "decode")["device_ms"] is None  # a pass the device's clock missed


def test_the_samples_tables_set_the_sequences_frames_beside_their_share_in_a_row():
    """Each arm's most sampled frames of its sequences' windows, their share there beside their share in its cells'
    windows, each with the host ms a pass it stands for (the windows' host ms a pass weighted by their passes); an
    arm whose servers sampled nothing adds no table."""
    def window(total, innermost, ours, passes, model):
        return {"samples": {"total": total, "innermost": innermost, "vskipper": ours, "sglang": {}},
                "passes": passes, "model": model}

    # in a row: 3 passes of 40 ms and 1 of 20, 35 ms a pass; the sequences' one window 60 ms a pass
    cells = [window(40, {"jit.py:run:700": 10, "x.py:f:1": 30}, {"mixed/kernels.py:cohort_gemm:90": 20}, 3, 40.0),
             window(10, {"x.py:f:1": 10}, {}, 1, 20.0)]
    sequences = {"rotated": window(100, {"jit.py:run:700": 60, "x.py:f:1": 40},
                                   {"mixed/kernels.py:cohort_gemm:90": 70, "models/routed.py:read:600": 5}, 3, 60.0)}
    arms = {run.ALWAYS: {"cells": cells, "sequences": sequences}, "dense": {"cells": [{"samples": None}]}}
    assert run.sampled(cells) == (50, {"innermost": {"jit.py:run:700": 10, "x.py:f:1": 40},
                                       "vskipper": {"mixed/kernels.py:cohort_gemm:90": 20}})
    text = "\n".join(run.sample_lines(arms))
    # the windows attest no interval (a sampler from before it did): the sampler's own is named
    assert f"{run.ALWAYS}, the innermost frame of vSkipper's code (100 samples in the sequences, 50 in a row; " \
           f"every {INTERVAL_S * 1e3:g} ms):" in text
    assert "| `jit.py:run:700` | 60.0% (36.0 ms) | 20.0% (7.0 ms) |" in text
    assert "| `x.py:f:1` | 40.0% (24.0 ms) | 80.0% (28.0 ms) |" in text
    assert "| `mixed/kernels.py:cohort_gemm:90` | 70.0% (42.0 ms) | 40.0% (14.0 ms) |" in text
    assert "| `models/routed.py:read:600` | 5.0% (3.0 ms) | 0.0% (0.0 ms) |" in text
    # a window without its host time (a failed reading): the shares alone
    del sequences["rotated"]["model"]
    assert "| `jit.py:run:700` | 60.0% | 20.0% (7.0 ms) |" in run.sample_lines(arms)
    assert "dense," not in text and run.sample_lines({"dense": {"cells": [{"samples": None}]}}) == []


def _handed(tmp_path, flag: str, variable: str) -> list[str]:
    """What `run.sh install --dry-run` hands its Python in `variable`, with `flag` and then without it (run.sh's
    Python a script that records it)."""
    seen = tmp_path / "seen"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho \"${variable}\" >> {seen}\n")
    fake.chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHON": str(fake)}
    for args in ([flag], []):
        r = subprocess.run([str(SCRIPT), "install", str(tmp_path / "handed"), "--dry-run", *args], capture_output=True,
                           text=True, cwd=ROOT, timeout=60, env=env)
        assert r.returncode == 0, r.stderr
    return seen.read_text().split()


def test_the_sweeps_servers_sample_their_stacks_where_the_run_asks_and_the_summary_says_where_by_line(
        tmp_path, monkeypatch):
    """`run.sh --samples` reaches run.py (ENV_SAMPLES_RUN) and every sweep server samples its forward's stack; each
    length's cell sums its prompts' windows of samples, and the summary lists each arm's most sampled frames with
    their share at each length and the ms a pass that share is of the length's host time. (No server: its clock's
    readings are stood in for; run.sh's Python is a script that records what it was handed.)"""
    import copy
    from types import SimpleNamespace

    assert _handed(tmp_path, "--samples", "VSKIPPER_GPU_RUN_SAMPLES") == ["1", "0"]
    monkeypatch.setenv(run.ENV_SAMPLES_RUN, "1")
    plan = run.run_sweep_flags(run.Plan.gpu())
    assert plan.sweep_samples and not run.run_sweep_flags(run.Plan.gpu(), {}).sweep_samples
    with pytest.raises(SystemExit, match="0 or 1"):
        run.run_sweep_flags(plan, {run.ENV_SAMPLES_RUN: "yes"})

    plan = dataclasses.replace(plan, prefill_lengths=(1024, 2048), prefill_reps=3, prefill_rounds=())
    clock = {"parts": False, "passes_total": {}, "tokens_total": {}, "seconds_total": {}, "device_seconds_total": {},
             "device_passes_total": {}, "samples": {"interval_s": 0.002, "samples_total": {}, "seconds_total": {},
                                                    "innermost": {}, "vskipper": {}, "sglang": {}}}

    def count(field: dict, key: str, n: int) -> None:
        into = field.setdefault("prefill", {})
        into[key] = into.get(key, 0) + n

    async def fake_burst(server, prompts, new_tokens):
        n = len(prompts[0])
        for field, value in (("passes_total", 1), ("tokens_total", n), ("device_passes_total", 1)):
            clock[field]["prefill"] = clock[field].get("prefill", 0) + value
        clock["device_seconds_total"]["prefill"] = clock["device_seconds_total"].get("prefill", 0) + 0.05
        outside = clock["seconds_total"].setdefault("prefill", {}).setdefault("outside", {})
        outside["outside"] = outside.get("outside", 0.0) + 0.04  # 40 ms of host a pass at every length
        samples = clock["samples"]
        samples["samples_total"]["prefill"] = samples["samples_total"].get("prefill", 0) + 20
        samples["seconds_total"]["prefill"] = samples["seconds_total"].get("prefill", 0.0) + 20 * 50e-6
        # 15 of a 1,024-token pass's 20 samples in the launcher, 5 of a 2,048-token one's
        launcher = 15 if n == 1024 else 5
        count(samples["innermost"], "triton/runtime/jit.py:run:700", launcher)
        count(samples["innermost"], "torch/nn/functional.py:linear:10", 20 - launcher)
        count(samples["vskipper"], "vskipper/mixed/kernels.py:cohort_gemm:120", 20)
        return [SimpleNamespace(ttft_s=0.05, ttft_parts=lambda: None)]

    monkeypatch.setattr(run, "burst", fake_burst)
    server = SimpleNamespace(get_json=lambda path: {"part_clock": copy.deepcopy(clock)})
    cells, _ = run.prefill_cells(plan, server, 128256)
    assert [c["samples"]["total"] for c in cells] == [60, 60]
    assert [c["samples"]["interval_s"] for c in cells] == [0.002, 0.002]
    assert [c["samples"]["seconds"] for c in cells] == [pytest.approx(60 * 50e-6)] * 2
    assert cells[0]["samples"]["innermost"] == {"triton/runtime/jit.py:run:700": 45,
                                                "torch/nn/functional.py:linear:10": 15}
    lines = run.sweep_sample_lines({"dense": {"prefill": [{"tokens": 1024, "ttft_s": 0.05}]},
                                    run.ALWAYS: {"prefill": cells}})
    # the interval the servers attest (an earlier run's 2 ms here) and the ms the samples held the lock
    assert f"{run.ALWAYS}, the innermost frame (where the thread is in C code, the line that called it) " \
           "(120 samples; every 2 ms, the samples taking 6.0 ms of the forward in all):" in lines
    assert not any(line.startswith("dense,") for line in lines)  # an arm that did not sample: no table
    # 45 of 60 at 1,024 tokens: 75% of the 40 ms a pass; 15 of 60 at 2,048: 25%, 10 ms; 60 of 120 in all
    assert "| `triton/runtime/jit.py:run:700` | 75.0% (30.0 ms) | 25.0% (10.0 ms) | 50.0% |" in lines
    assert "| `vskipper/mixed/kernels.py:cohort_gemm:120` | 100.0% (40.0 ms) | 100.0% (40.0 ms) | 100.0% |" in lines
    assert run.sweep_sample_lines({"dense": {"prefill": [{"tokens": 1024, "ttft_s": 0.05}]}}) == []
    # arms served with and without samples (an earlier call's kept): the summary says they do not compare alike
    mixed = run.sweep_sample_lines({"dense": {"prefill": [{"tokens": 1024, "ttft_s": 0.05}], "samples": False},
                                    run.ALWAYS: {"prefill": cells, "samples": True}})
    assert f"Not every arm of this sweep sampled its stack (dense: not sampled, {run.ALWAYS}: sampled): a " \
           "sampled arm's host times stand a few percent above what it would take unsampled, so its figures do " \
           "not compare alike with the others'." in mixed


def test_a_prefill_only_sweep_serves_no_decode_cell_and_its_summary_says_what_it_leaves_out(tmp_path, monkeypatch):
    """`run.sh --prefill-only` reaches run.py (ENV_PREFILL_ONLY_RUN); the sweep's servers then capture the decode
    graphs of `PREFILL_ONLY_GRAPHS` alone and serve no decode burst, only the prefill cells; the arms' results say
    so, and the summary prints the prefill tables (against dense and against the control) without the decode ones
    or a tau, and says where arms of one sweep served different work. (No server: each is stood in for, and the
    prefill cells are the stand-ins' figures; run.sh's Python is a script that records what it was handed.)"""
    from types import SimpleNamespace

    assert _handed(tmp_path, "--prefill-only", "VSKIPPER_GPU_RUN_PREFILL_ONLY") == ["1", "0"]
    plan = run.run_sweep_flags(run.Plan.dry(), {run.ENV_PREFILL_ONLY_RUN: "1"})
    assert not plan.sweep_decode and run.run_sweep_flags(run.Plan.dry(), {}).sweep_decode
    with pytest.raises(SystemExit, match="0 or 1"):
        run.run_sweep_flags(plan, {run.ENV_PREFILL_ONLY_RUN: "yes"})

    started, sent = [], []

    def fake_server(plan, stack, model, workdir, name, arm_files, mem=None, graph_batches=None, samples=False, **kw):
        started.append((name, graph_batches))
        return SimpleNamespace(name=name, get_json=lambda path: {"max_total_num_tokens": 4096},
                               wait_ready=lambda timeout: None)

    async def fake_burst(server, prompts, new_tokens):  # the warm-up's alone: no decode burst
        sent.append((server.name, len(prompts), len(prompts[0]), new_tokens))
        return []

    def fake_cells(plan, server, vocab):  # the routed arms 20% faster than dense at every length
        ttft = 0.1 if server.name == "dense" else 0.08
        return [{"tokens": n, "ttft_s": ttft, "ttft_reps": [ttft] * 3} for n in plan.prefill_lengths], []

    monkeypatch.setattr(run, "server_for", fake_server)
    monkeypatch.setattr(run, "burst", fake_burst)
    monkeypatch.setattr(run, "prefill_round", lambda server, prompts: sent.append((server.name, len(prompts),
                                                                                   len(prompts[0]), 1)))
    monkeypatch.setattr(run, "prefill_cells", fake_cells)
    monkeypatch.setattr(run, "ready", lambda plan, servers: None)
    monkeypatch.setattr(run, "triton_compiles", lambda server: None)
    monkeypatch.setattr(run, "served", lambda server: {"arm": server.name, "profile": {"decode_graphs": "disabled"}})
    monkeypatch.setattr(run, "check_served", lambda plan, out, stage: {"ok": True, "cases": []})
    out = tmp_path / "out"
    sweep = run.stage_sweep(plan, out, 300)
    served = ("dense", run.ALWAYS, run.CONTROL, run.PREFILL_GRAPHS)
    assert started == [(name, run.PREFILL_ONLY_GRAPHS) for name in served]
    # each server, the reference too, warmed by one untimed prompt of each length and one of each round
    assert sent == [(name, *shape, 1) for name in served
                    for shape in [(1, n) for n in plan.prefill_lengths] + list(plan.prefill_rounds)]
    for name, arm in sweep["arms"].items():
        assert arm["decode"] == [] and (name == run.PREFILL_GRAPHS or arm["decode_cells"] is False)
        assert name == run.PREFILL_GRAPHS or arm["line"] is None
    c = sweep["comparison"]
    assert c["decode_speedup"] == [] and "tau_ms" not in c
    assert [round(p["dense_over_routed_time"], 3) for p in c["prefill_speedup"]] == [1.25, 1.25]
    text = run.markdown({"dry_run": True, "sweep": sweep})
    assert "A prefill-only sweep (`run.sh --prefill-only`): its servers served the prefill lengths and rounds " \
           "alone, no decode cell, so it measures no tau, no V_x and no decode ratio" in text
    assert "tau =" not in text and "| batch | context |" not in text and "bursts a decode cell" not in text
    assert "| prefill tokens | dense / routed time | range |" in text
    assert "| prefill tokens | s=0 / s=0.5 time | range | FLOP limit | dense / s=0 time | range |" in text
    # a prefill-only sweep measures no tau: the headline takes an earlier run's instead of reporting none
    (out / "sweep.json").write_text(json.dumps(sweep))
    assert run.prefill_only(sweep) and run.sweep_for_tau(out)[1] != run.OWN_SWEEP
    # a folder holds one kind of sweep: a whole sweep refuses it (nor does a finished one count as done)
    whole = run.run_sweep_flags(run.Plan.dry(), {})
    assert "served dense, random-r0-always, random-r1-d0.5-always without decode cells (--prefill-only), and " \
           "this run serves the sweep's prefill with its decode cells" in run.sweep_mode_mismatch(whole, out)
    assert run.sweep_mode_mismatch(plan, out) is None
    assert not run.covers("sweep", sweep, (), out, whole) and run.covers("sweep", sweep, (), out, plan)
    with pytest.raises(SystemExit, match="a folder holds one kind of sweep"):
        run.stage_sweep(whole, out, 300)
    # an arm of an earlier call that decoded first, kept beside prefill-only ones: the summary says they differ
    sweep["arms"]["dense"]["decode_cells"] = True
    assert f"Not every arm of this sweep served the decode cells before its prefill ones (dense: decode and " \
           f"prefill, {run.ALWAYS}: prefill only, {run.CONTROL}: prefill only)" in run.markdown(
               {"dry_run": True, "sweep": sweep})


def test_a_sweep_whose_routed_arms_replay_their_prefill_layers_hands_them_the_counts_and_says_so(tmp_path,
                                                                                                 monkeypatch):
    """`run.sh --routed-prefill-graphs` (ENV_ROUTED_PREFILL_GRAPHS_RUN; refused on a dry run, whose servers capture
    no graph): the sweep's routed arms, and only they, are started with the counts every prefill pass it serves
    holds (each length, each round's tokens); the summary says what each attested it replayed; a folder holds
    one kind of sweep. (No server: each is stood in for, with the attestation a graphed one gives.)"""
    from types import SimpleNamespace

    r = subprocess.run([str(SCRIPT), "install", str(tmp_path / "x"), "--dry-run", "--routed-prefill-graphs"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "--routed-prefill-graphs: CUDA graphs, not a CPU dry run's" in r.stderr
    assert run.run_sweep_flags(run.Plan.gpu(), {run.ENV_ROUTED_PREFILL_GRAPHS_RUN: "1"}).routed_prefill_graphs
    assert not run.run_sweep_flags(run.Plan.gpu(), {}).routed_prefill_graphs
    with pytest.raises(SystemExit, match="CUDA graphs, which a CPU dry run"):
        run.run_sweep_flags(run.Plan.dry(), {run.ENV_ROUTED_PREFILL_GRAPHS_RUN: "1"})
    assert run.Plan.gpu().routed_graph_tokens == tuple(sorted({*run.Plan.gpu().prefill_lengths,
                                                                *(n * t for n, t in run.Plan.gpu().prefill_rounds)}))

    plan = dataclasses.replace(run.Plan.dry(), sweep_decode=False, routed_prefill_graphs=True,
                               prefill_lengths=(32, 64), prefill_rounds=((2, 16),))
    assert plan.routed_graph_tokens == (32, 64)
    started = {}

    def fake_server(plan, stack, model, workdir, name, arm_files, mem=None, graph_batches=None, samples=False,
                    prefill_graphs=(), **kw):
        started[name] = prefill_graphs
        return SimpleNamespace(name=name, get_json=lambda path: {"max_total_num_tokens": 4096},
                               wait_ready=lambda timeout: None)

    def fake_served(server):
        graphs = None if server.name in ("dense", run.PREFILL_GRAPHS) else {
            "tokens": [32, 64], "passes": {"by_tokens": {"64": 3, "32": 4},
                                           "eager": {"longer than every count": 1, "its count's capture failed or strayed": 0}},
            "segments": {"captured": 10, "replayed": 30},
            "capture_check": {"segments": 10, "worst_difference": 0.0039, "worst_segment": "(64, 3, 'out')",
                              "rechecked": 10, "worst_recheck": 0.0078 if server.name == run.ALWAYS else 0.5,
                              "worst_recheck_segment": "(32, 2, 'in')", "empty": ["(32, 'state')"],
                              "not_finite": []},
            "memory": {"reserved_bytes": 3 * 2**30}, "failed": {"32": None, "64": None},
            "captured_at_boot_s": {"32": 1.234, "64": 2.5}, "read": "backend"}
        if server.name == run.CONTROL:  # its prefill chunk of 24 tokens left 64 out
            graphs |= {"reach": {"asked": "counts", "prefill_chunk": 24, "left_out": [64]},
                       "captured_at_boot_s": {"32": 1.234, "64": None}}
        return {"arm": server.name, "profile": {"decode_graphs": "disabled"}, "prefill_graphs": graphs}

    monkeypatch.setattr(run, "server_for", fake_server)
    warmed = []
    monkeypatch.setattr(run, "prefill_warm_up", lambda plan, server, vocab: warmed.append(server.name))
    monkeypatch.setattr(run, "prefill_cells", lambda plan, server, vocab: (
        [{"tokens": n, "ttft_s": 0.1, "ttft_reps": [0.1] * 3} for n in plan.prefill_lengths], []))
    monkeypatch.setattr(run, "ready", lambda plan, servers: None)
    monkeypatch.setattr(run, "triton_compiles", lambda server: None)
    monkeypatch.setattr(run, "served", fake_served)
    monkeypatch.setattr(run, "check_served", lambda plan, out, stage: {"ok": True, "cases": []})
    out = tmp_path / "out"
    sweep = run.stage_sweep(plan, out, 300)
    assert started == {"dense": (), run.ALWAYS: (32, 64), run.CONTROL: (32, 64), run.PREFILL_GRAPHS: ()}
    # every arm warms once: the graphed servers captured and checked each count before they reported ready
    assert warmed == ["dense", run.ALWAYS, run.CONTROL, run.PREFILL_GRAPHS]
    text = run.markdown({"dry_run": True, "sweep": sweep})
    assert "Routed prefill layers replayed from CUDA graphs (`VSKIPPER_PREFILL_GRAPHS`" in text
    assert f"- {run.ALWAYS}: captured at 32, 64 tokens with the backend read (before it served: 1.2 s at 32, " \
           "2.5 s at 64); " \
           "passes replayed 4 at 32, 3 at 64; eager 1 longer than " \
           "every count; segments captured 10, replayed 30; each capture's replay against its eager run: worst " \
           "difference 0.0039 of the largest value over 10 segments ((64, 3, 'out')); each segment's first later " \
           "replay against its eager run after it: worst difference 0.0078 of the largest value over 10 segments " \
           "((32, 2, 'in')); the captures reserved 3.00 GiB" in text
    assert f"- {run.CONTROL}: captured at 32 tokens with the backend read (before it served: 1.2 s at 32; 64 left " \
           "out, above the least count that holds its prefill chunk of 24 tokens); passes" in text
    assert f"**{run.CONTROL}'s replays strayed from its eager runs by 0.5 of the largest value: its routed " \
           "prefill figures above are in doubt.**" in text and f"**{run.ALWAYS}'s replays" not in text
    assert "Segments whose capture recorded no kernel (a trained gate's state is a view of its inputs and " \
           "launches none; any other is suspect): (32, 'state')." in text
    assert run.Plan.gpu().sweep_arm_s + run.GRAPHED_ARM_EXTRA_S == dataclasses.replace(
        run.Plan.gpu(), routed_prefill_graphs=True).sweep_arm_s
    sweep["arms"][run.ALWAYS]["served"]["prefill_graphs"]["capture_check"]["not_finite"] = ["(64, 3, 'out')"]
    assert f"**{run.ALWAYS}'s replays strayed from its eager runs by NaN or infinite values where the eager " \
           "run's were not ((64, 3, 'out')): its routed prefill figures above are in doubt.**" in run.markdown(
               {"dry_run": True, "sweep": sweep})
    assert "- dense:" not in text.split("Routed prefill layers replayed")[1].split("\n\n")[1]
    eager = dataclasses.replace(plan, routed_prefill_graphs=False)
    assert "with its routed prefill layers from graphs (--routed-prefill-graphs), and this run serves them " \
           "eagerly: a folder holds one kind of sweep" in run.sweep_mode_mismatch(eager, out)
    assert run.sweep_mode_mismatch(plan, out) is None


def test_a_headline_whose_routed_arms_replay_their_prefill_layers_asks_auto_and_keeps_each_arm_one_way(
        dry_run, tmp_path, monkeypatch):
    """`--routed-prefill-graphs` and `--routed-prefill-read` reach the headline's routed arms too: each is started
    asking for the counts "auto" asks (`VSKIPPER_PREFILL_GRAPHS=auto`, those its prefill chunk reaches) and the read.
    An arm's headline cells serve one way: on a copy of the dry run, whose arms prefilled eagerly with the table's
    read, a run asking for graphs (or for a read) is refused by name, and `covers` does not take the headline as
    done; a hybrid arm's folder served at other thresholds than this run's would be set aside, and is no obstacle.
    The summary names the headline's graphed arms. (The dry run's servers capture no CUDA graph: the first
    server start is stood in for, and stops the stage.)"""
    out, _ = dry_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("servers", "server", "kernels"))
    graphed = dataclasses.replace(run.Plan.dry(), routed_prefill_graphs=True, routed_prefill_read="packed")
    done = json.loads((copy / "headline.json").read_text())
    arms = tuple(done["arms_requested"])
    assert run.headline_mode_mismatch(run.Plan.dry(), copy) is None and run.covers("headline", done, arms, copy,
                                                                                   run.Plan.dry())
    first = next(key for key in run.HEADLINE_ARMS if (copy / "headline" / key / "served.json").is_file())
    with pytest.raises(SystemExit, match=f"served {first} with its routed prefill layers eagerly, and this run "
                                         "serves them from graphs: an arm's headline cells serve one way"):
        run.stage_headline(graphed, copy, 300)
    assert not run.covers("headline", done, arms, copy, graphed)
    with pytest.raises(SystemExit, match=f"served {first} with the table's prefill read, and this run serves it "
                                         r"with the packed read \(--routed-prefill-read\)"):
        run.stage_headline(dataclasses.replace(graphed, routed_prefill_graphs=False), copy, 300)
    # An arm this run does not serve, or whose folder it sets aside (served at other thresholds, as a tau arm from
    # another sweep's tau), is no obstacle; without thresholds every served arm is one.
    hybrid = "hybrid-rule"  # served in every dry run (its tau arm may not be)
    served_at = done["arms"][hybrid]["thresholds"]
    assert run.served_elsewhere(copy / "headline" / hybrid, served_at) is None
    assert f"served {hybrid} with its routed prefill layers eagerly" in run.headline_mode_mismatch(
        graphed, copy, (hybrid,), {hybrid: served_at})
    moved = {**served_at, "enter_tokens": served_at["enter_tokens"] + 64}
    assert run.served_elsewhere(copy / "headline" / hybrid, moved)[:2] == [served_at["enter_tokens"],
                                                                        served_at["exit_tokens"]]
    assert run.headline_mode_mismatch(graphed, copy, (hybrid,), {hybrid: moved}) is None
    assert run.headline_mode_mismatch(graphed, copy, (hybrid,), {}) is None
    assert run.headline_mode_mismatch(graphed, copy, (hybrid,)) is not None
    # `covers` weighs the arms as stage_headline would serve them now: a tau arm this run cannot serve (no sweep, so
    # no tau) is no obstacle, whatever its folder holds; an arm whose folder served at other thresholds than this
    # run's would be set aside and served again, so the result does not cover it.
    tau_arm, sweep_json = "hybrid-tau", copy / "sweep.json"
    (copy / "headline" / tau_arm).mkdir(parents=True, exist_ok=True)
    shutil.copy(copy / "headline" / hybrid / "served.json", copy / "headline" / tau_arm / "served.json")
    kept = sweep_json.read_text()
    sweep_json.unlink()
    monkeypatch.delenv(run.ENV_EARLIER, raising=False)
    assert run.covers("headline", done, (tau_arm,), copy, graphed)
    assert not run.covers("headline", done, (hybrid, tau_arm), copy, graphed)
    sweep_json.write_text(kept)
    assert run.covers("headline", done, (hybrid,), copy, run.Plan.dry())
    hybrid_served = copy / "headline" / hybrid / "served.json"
    kept = hybrid_served.read_text()
    hybrid_served.write_text(json.dumps({**json.loads(kept), "thresholds": moved}))
    assert not run.covers("headline", done, (hybrid,), copy, run.Plan.dry())
    hybrid_served.write_text(kept)

    text = run.markdown({"dry_run": True, "headline": {**done, "arms": {first: {**done["arms"][first], "served": {
        **done["arms"][first]["served"], "prefill_graphs": {"tokens": [16, 20, 24, 28], "read": "packed",
                                                           "reach": {"prefill_chunk": 24, "left_out": [28]}}}}}}})
    assert "the read eager; the headline's routed arms above; dense prefilled eagerly):" in text
    assert f"- {first}: captured at 16, 20, 24 tokens with the packed read (28 left out, above the least count " \
           "that holds its prefill chunk of 24 tokens)" in text
    ladder = {"tokens": list(AUTO_PREFILL_GRAPHS), "read": "packed",  # "auto" under a chunk of 100 tokens
              "captured_at_boot_s": {str(n): 0.5 if n < 112 else 1.5 if n == 112 else None
                                     for n in AUTO_PREFILL_GRAPHS},
              "reach": {"prefill_chunk": 100, "left_out": [n for n in AUTO_PREFILL_GRAPHS if n > 112]}}
    text = run.markdown({"dry_run": True, "headline": {**done, "arms": {first: {
        **done["arms"][first], "served": {**done["arms"][first]["served"], "prefill_graphs": ladder}}}}})
    assert f"- {first}: captured at {', '.join(str(n) for n in AUTO_PREFILL_GRAPHS if n <= 112)} tokens with the " \
           "packed read (before it served: 7.0 s over 12 counts, the longest 1.5 s at 112; 17 counts from 128 " \
           "left out, above the least count that holds its prefill chunk of 100 tokens)" in text

    assert done["arms"][first].get("model")  # the queueing model's prediction, which a note may follow
    noted = {**done, "arms": {first: {**done["arms"][first], "model_note": "The model's routed prefill passes are"}}}
    ladder = json.loads((copy / "ladder.json").read_text())
    assert "The model's routed prefill passes are" in run.markdown({"dry_run": True, "ladder": ladder,
                                                                    "headline": noted})
    assert run.Plan.gpu().headline_start_s + len(AUTO_PREFILL_GRAPHS) * run.GRAPHED_COUNT_S == dataclasses.replace(
        run.Plan.gpu(), routed_prefill_graphs=True).headline_start_s

    shutil.rmtree(copy / "headline")  # a headline served anew: its first routed arm starts asking for both
    started = []

    class Started(Exception):
        pass

    def fake_launched(model, workdir, env=None, **kw):
        started.append((workdir.parent.name, env[run.ENV_PREFILL_GRAPHS], env[run.ENV_PREFILL_READ]))
        raise Started

    monkeypatch.setattr(run, "launched", fake_launched)
    with pytest.raises(Started):
        run.stage_headline(graphed, copy, 300)
    assert started == [(first, "auto", "packed")]


def test_a_headline_arm_prefilling_another_way_than_the_sweep_says_its_model_reads_the_sweeps_way():
    """The queueing model reads the sweep's routed prefill passes (always-route's, the control's for the control):
    where those ran their routed layers one way and the headline arm's the other, the note says so."""
    graphed = {"prefill_graphs": {"tokens": [16, 20]}}
    swept = {run.ALWAYS: {"served": {"arm": run.ALWAYS}}, run.CONTROL: {"served": graphed}}
    assert run.prefill_mode_note("hybrid-rule", graphed, swept, run.HYBRID) == (
        f"The model's routed prefill passes are the sweep's {run.ALWAYS} arm's, which ran their routed layers "
        "eagerly, while hybrid-rule's replayed their routed layers from graphs: its prefill predictions describe "
        "the sweep's way, not the arm's.")
    assert "which replayed their routed layers from graphs, while control's ran their routed layers eagerly" in \
        run.prefill_mode_note("control", {"arm": run.CONTROL}, swept, run.CONTROL)
    assert run.prefill_mode_note("control", graphed, swept, run.CONTROL) is None
    assert run.prefill_mode_note("always", {"arm": run.ALWAYS}, swept, run.ALWAYS) is None
    assert run.prefill_mode_note("hybrid-rule", graphed, {}, run.HYBRID) is None  # no sweep: no model either
    assert run.graphed_start_s(4) == run.GRAPHED_ARM_EXTRA_S < run.graphed_start_s(29) == 29 * run.GRAPHED_COUNT_S


def test_a_sweep_whose_routed_arms_are_asked_for_a_prefill_read_hands_it_to_them_alone(tmp_path, monkeypatch):
    """`run.sh --routed-prefill-read packed|backend` (ENV_ROUTED_PREFILL_READ_RUN; refused on a dry run, whose
    servers run the torch execution): the sweep's routed arms, and only they, are started asking for that read
    (`VSKIPPER_PREFILL_READ`, set empty for every other server so none inherits the caller's); a folder holds one
    kind of sweep. (No server: each is stood in for, attesting the read it was asked for.)"""
    from types import SimpleNamespace

    r = subprocess.run([str(SCRIPT), "install", str(tmp_path / "x"), "--dry-run", "--routed-prefill-read", "packed"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "--routed-prefill-read: the triton execution's, not a CPU dry run's" in r.stderr
    r = subprocess.run([str(SCRIPT), "install", str(tmp_path / "x"), "--routed-prefill-read", "rows"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "--routed-prefill-read: packed or backend" in r.stderr
    assert run.run_sweep_flags(run.Plan.gpu(), {run.ENV_ROUTED_PREFILL_READ_RUN: "packed"}).routed_prefill_read \
        == "packed"
    assert run.run_sweep_flags(run.Plan.gpu(), {run.ENV_ROUTED_PREFILL_READ_RUN: ""}).routed_prefill_read is None
    with pytest.raises(SystemExit, match="one of packed, backend"):
        run.run_sweep_flags(run.Plan.gpu(), {run.ENV_ROUTED_PREFILL_READ_RUN: "rows"})
    with pytest.raises(SystemExit, match="the triton execution's, which a CPU dry run"):
        run.run_sweep_flags(run.Plan.dry(), {run.ENV_ROUTED_PREFILL_READ_RUN: "backend"})

    envs = {}

    def fake_launched(model, workdir, env=None, **kw):
        envs[workdir.name] = env
        return nullcontext(SimpleNamespace(name=workdir.name, get_json=lambda path: {"max_total_num_tokens": 4096},
                                           wait_ready=lambda timeout: None))

    def fake_served(server):
        why = {} if server.name in ("dense", run.PREFILL_GRAPHS) else {
            "prefill_read_why": "VSKIPPER_PREFILL_READ=packed, in place of the execution's choice: backend"}
        return {"arm": server.name, "profile": {"decode_graphs": "disabled"},
                "routed_layers_backend": {"prefill_read": "packed" if why else "backend", **why}}

    monkeypatch.setattr(run, "launched", fake_launched)
    monkeypatch.setattr(run, "tuned_table", lambda plan, folder: None)
    monkeypatch.setattr(run, "prefill_warm_up", lambda plan, server, vocab: None)
    monkeypatch.setattr(run, "prefill_cells", lambda plan, server, vocab: (
        [{"tokens": n, "ttft_s": 0.1, "ttft_reps": [0.1] * 3} for n in plan.prefill_lengths], []))
    monkeypatch.setattr(run, "triton_compiles", lambda server: None)
    monkeypatch.setattr(run, "served", fake_served)
    monkeypatch.setattr(run, "check_served", lambda plan, out, stage: {"ok": True, "cases": []})
    plan = dataclasses.replace(run.Plan.dry(), sweep_decode=False, routed_prefill_read="packed",
                               prefill_lengths=(32, 64), prefill_rounds=())
    out = tmp_path / "out"
    run.stage_sweep(plan, out, 300)
    assert {name: env[run.ENV_PREFILL_READ] for name, env in envs.items()} == {
        "dense": "", run.ALWAYS: "packed", run.CONTROL: "packed", run.PREFILL_GRAPHS: ""}
    assert run.sweep_mode_mismatch(plan, out) is None
    assert f"served {', '.join(sorted((run.ALWAYS, run.CONTROL)))} with the packed read (--routed-prefill-read), " \
           "and this run serves them " \
           "with the table's prefill read: a folder holds one kind of sweep" in run.sweep_mode_mismatch(
               dataclasses.replace(plan, routed_prefill_read=None), out)


def test_a_sweep_starts_an_arm_that_ends_before_its_limit_keeps_a_failed_arms_error_and_what_a_stop_served(
        tmp_path, monkeypatch):
    """On a device a sweep arm starts where what it takes (`Plan.sweep_arm_s`: a whole sweep's 150 s, a
    prefill-only one's 75 s, from the H200's logs) ends before the stage's limit less its end (`Stage.fits`), not
    where 30% of the budget is left; the check starts with its own 60 s. An arm whose server fails is named with its
    error and the others serve (but the control, with routed prefill graphs, after always-route failed with them);
    a stage stopped at its limit (run.sh's TERM) keeps the arms it served, its comparison and summary written, the
    arm it was serving left for the next call. (No server: each arm is stood in for, on a clock that each arm
    advances by a minute.)"""
    gpu = run.Plan.gpu()
    prefill_only = dataclasses.replace(gpu, sweep_decode=False)
    assert (gpu.sweep_arm_s, prefill_only.sweep_arm_s, run.Plan.dry().sweep_arm_s) == (150.0, 75.0, 1.0)
    # the reference serves prefill alone in either kind of sweep: a server's start at least (100 s), not a whole arm
    assert (gpu.reference_arm_s, prefill_only.reference_arm_s, run.Plan.dry().reference_arm_s) == (100.0, 100.0, 1.0)

    clock = [1000.0]
    monkeypatch.setattr(run.time, "monotonic", lambda: clock[0])
    stage = run.Stage("gates", tmp_path, budget_s=20, limit_s=100)  # its end: 100 - STAGE_END_S = 75 s away
    assert stage.fits(75, "one") and not stage.has_time(75, "two") and not stage.fits(76, "three")
    assert stage.left == ["two", "three"] and run.Stage("x", tmp_path, 20).fits(20, "y")  # no limit: the budget

    served, checks = [], []

    def fake_arm(plan, stage, model, arm_files, name, vocab):
        served.append(name)
        clock[0] += 60
        if name == run.ALWAYS:
            raise RuntimeError("the server exited with code 1 before it was ready")
        return {"prefill": [], "decode": [], "line": None, "served": {}, "decode_cells": False}

    monkeypatch.setattr(run, "sweep_arm", fake_arm)
    monkeypatch.setattr(run, "check_served", lambda plan, out, stage: checks.append(1) or {"runs": {}})
    out = tmp_path / "out"
    # limit 200 s: its end at 175 s. dense (75) at 0, always-route at 60 (fails), the control at 120 (needs 75: 195
    # is past 175, left) and the reference (100 s at least) left
    sweep = run.stage_sweep(prefill_only, out, 120, limit_s=200)
    assert served == ["dense", run.ALWAYS] and checks == [1]
    assert list(sweep["arms"]) == ["dense"] and sweep["failed"] == [run.ALWAYS]
    assert sweep["errors"] == {run.ALWAYS: "RuntimeError: the server exited with code 1 before it was ready"}
    assert sweep["left"] == [f"sweep of {run.CONTROL}", f"sweep of {run.PREFILL_GRAPHS}"]
    assert sweep["comparison"] is None and not run.covers("sweep", sweep, (), out, prefill_only)
    text = run.markdown({"dry_run": False, "sweep": sweep})
    assert "## Decode sweep and prefill\n\nThe sweep did not serve everything:\n\n" \
           f"- {run.ALWAYS} failed: RuntimeError: the server exited with code 1 before it was ready\n" \
           f"- left for the next run: sweep of {run.CONTROL}, sweep of {run.PREFILL_GRAPHS}\n" in text
    assert (out / "sweep" / "dense.result.json").is_file()
    assert not (out / "sweep" / f"{run.ALWAYS}.result.json").exists()  # a later call serves it again

    # stopped at its limit while serving the control: always-route and dense kept (dense from the call before)
    def stopped_arm(plan, stage, model, arm_files, name, vocab):
        served.append(name)
        if name == run.CONTROL:
            raise SystemExit(run.TERM_EXIT)
        return {"prefill": [], "decode": [], "line": None, "served": {}, "decode_cells": False}

    monkeypatch.setattr(run, "sweep_arm", stopped_arm)
    monkeypatch.setattr(run, "compare_sweep", lambda plan, model, arms: {"arms": sorted(arms)})
    served.clear()
    sweep = run.stage_sweep(prefill_only, out, 120, limit_s=1000)
    assert served == [run.ALWAYS, run.CONTROL] and sweep["stopped"] == f"sweep of {run.CONTROL}"
    assert sweep["left"] == [f"sweep of {run.CONTROL}"] and sweep["comparison"] == {"arms": ["dense", run.ALWAYS]}
    assert "- stopped at its limit while serving sweep of " + run.CONTROL in "\n".join(run.sweep_state_lines(sweep))
    # stopped while serving the reference: its place was taken as it started (its error says so), so it is not left
    def stopped_reference(plan, stage, model, arms, vocab):
        placeholder = {"flags": [], "error": "the call serving it stopped before it finished"}
        (stage.out / f"{run.PREFILL_GRAPHS}.result.json").write_text(json.dumps(placeholder))
        raise SystemExit(run.TERM_EXIT)

    monkeypatch.setattr(run, "sweep_arm", lambda *args: {"prefill": [], "decode": [], "line": None, "served": {},
                                                         "decode_cells": False})
    monkeypatch.setattr(run, "sweep_reference", stopped_reference)
    sweep = run.stage_sweep(prefill_only, tmp_path / "reference", 120, limit_s=1000)
    assert sweep["stopped"] == f"sweep of {run.PREFILL_GRAPHS}" and sweep["left"] == []
    assert sweep["arms"][run.PREFILL_GRAPHS]["error"] == "the call serving it stopped before it finished"
    # any other exit (a refusal of its own) is not a stop at the limit: it propagates
    monkeypatch.setattr(run, "sweep_arm", lambda *args: (_ for _ in ()).throw(SystemExit("refused")))
    with pytest.raises(SystemExit, match="refused"):
        run.stage_sweep(prefill_only, out, 120, limit_s=1000)
    # with routed prefill graphs, the control is not started after always-route failed: it serves the same graphs
    monkeypatch.setattr(run, "sweep_arm", fake_arm)
    monkeypatch.setattr(run, "sweep_reference", lambda *args: {"flags": []})
    served.clear()
    graphed = dataclasses.replace(prefill_only, routed_prefill_graphs=True)
    sweep = run.stage_sweep(graphed, tmp_path / "graphed", 120, limit_s=10_000)
    assert served == ["dense", run.ALWAYS] and sweep["failed"] == [run.ALWAYS, run.CONTROL]
    assert sweep["errors"][run.CONTROL] == f"not served: {run.ALWAYS}, which replays the same routed prefill " \
                                           "graphs, failed (RuntimeError: the server exited with code 1 before " \
                                           "it was ready)"
    served.clear()  # without them, it is
    run.stage_sweep(prefill_only, tmp_path / "eager", 120, limit_s=10_000)
    assert served == ["dense", run.ALWAYS, run.CONTROL]


def test_run_sh_packs_what_a_stage_wrote_while_it_runs_and_holds_nothing_open_after(tmp_path):
    """`--pack`: every `VSKIPPER_PACK_EVERY_S` while the stages run, what they wrote so far goes into the archive
    (a call cut short from outside keeps it), each pack whole or not at all, a file that grows while tar reads it
    (a server's log) taken as tar found it; at the end the folder is packed whole, no part file is left, and
    nothing of the packer holds the call's output open after it (a device call returns when its output closes),
    nor outlives a run.sh killed outright. (run.sh's Python is a script that writes one file, waits while another
    grows, keeps a copy of the archive as the packer left it, then writes a third.)"""
    import contextlib
    import signal

    out, archive, midway = tmp_path / "out", tmp_path / "run.tar.gz", tmp_path / "midway.tar.gz"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/sh
[ "$1" = benchmarks/gpu/run.py ] || exit 0
echo first > "$3/first.txt"
writer=
[ -n "$GROW" ] && {{ ( while :; do echo line >> "$3/server.log"; done ) & writer=$!; }}
sleep "$STAGE_S"
t=0  # a loaded machine's packer (nice 19) may take seconds: its first archive awaited, up to a minute
while [ -n "$AWAIT_PACK" ] && [ ! -e "{archive}" ] && [ $t -lt 600 ]; do sleep 0.1; t=$((t+1)); done
[ -z "$writer" ] || kill $writer
cp "{archive}" "{midway}" 2>/dev/null
echo second > "$3/second.txt"
""")
    fake.chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHON": str(fake)}
    command = [str(SCRIPT), "sweep", str(out), "--dry-run", "--pack", str(archive)]

    def call(every: int, stage_s: float, await_pack: bool = False) -> float:
        t0 = time.monotonic()
        r = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120,
                           env={**env, "VSKIPPER_PACK_EVERY_S": str(every), "STAGE_S": str(stage_s), "GROW": "1",
                                **({"AWAIT_PACK": "1"} if await_pack else {})})
        assert r.returncode == 0, r.stdout + r.stderr
        return time.monotonic() - t0

    call(1, 3, await_pack=True)
    with tarfile.open(midway) as early:
        assert {"out/first.txt", "out/server.log"} <= set(early.getnames()) and "out/second.txt" not in early.getnames()
    with tarfile.open(archive) as final:
        assert {"out/first.txt", "out/second.txt"} <= set(final.getnames())
    assert [p.name for p in tmp_path.iterdir() if ".part." in p.name] == []
    # a packer asleep for an hour when the stages end: stopped with its sleep, the call returns (a packer left
    # asleep would outlast the call's timeout)
    assert call(3600, 0) < 100
    bad = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={**env, "VSKIPPER_PACK_EVERY_S": "0"})
    assert bad.returncode == 2 and "VSKIPPER_PACK_EVERY_S: a whole number of seconds, 1 or more" in bad.stderr
    # run.sh killed outright (no EXIT trap runs): its packer stops by itself within an interval
    archive.unlink()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                            start_new_session=True, env={**env, "VSKIPPER_PACK_EVERY_S": "1", "STAGE_S": "40"})
    try:
        deadline = time.monotonic() + 35  # the stage outlasts the wait: run.sh is killed while its packer runs
        while not archive.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert archive.exists()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        # the packer (run.sh's process group; the stage runs in timeout's own) ends by itself, a pack under way at
        # the kill first (nice 19 on a loaded machine: seconds); after it the archive stays as it is
        deadline, gone = time.monotonic() + 60, False
        while not gone and time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
                time.sleep(0.2)
            except ProcessLookupError:
                gone = True
        assert gone, "the packer outlived run.sh"
        packed = archive.stat().st_mtime_ns
        time.sleep(3)
        assert archive.stat().st_mtime_ns == packed
    finally:  # what is left of the call (its stage runs in a group of timeout's own and ends by itself)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_graph_lines_give_the_kv_write_check_and_flag_a_write_that_strayed():
    """With the backend read an arm's graph lines give how far the K/V its replays left in the pool strayed from
    what they computed, flag the arm where that passes the doubt's bound as the replays' own checks do, and say
    where the writes were not compared."""
    kv = {"compared": 4, "worst_difference": 0.0, "worst_at": "layer 2 at 16 tokens", "not_compared": None}
    doc = {"tokens": [16], "read": "backend", "passes": {"by_tokens": {"16": 2}},
           "segments": {"captured": 9, "replayed": 27}, "capture_check": {"segments": 9, "worst_difference": 0.0},
           "kv_write_check": kv}

    def text() -> str:
        return "\n".join(run.routed_prefill_graph_lines({"a": {"served": {"prefill_graphs": doc}}}))

    assert "; the K/V each routed layer's replay left in the pool against what it computed: worst difference 0 " \
           "of the largest value over 4 layers (layer 2 at 16 tokens)" in text() and "in doubt" not in text()
    kv["worst_difference"] = 0.5
    assert "**a's replays strayed from its eager runs by 0.5 of the largest value" in text()
    doc["kv_write_check"] = {"compared": 0, "worst_difference": None, "worst_at": None,
                             "not_compared": "the KV pool stores torch.float8_e4m3fn, the segments compute "
                                             "torch.bfloat16"}
    assert "; its K/V writes not compared (the KV pool stores torch.float8_e4m3fn" in text()
    doc["read"], doc["kv_write_check"] = "packed", {"compared": 0, "not_compared": "the packed read reads its K/V "
                                                                                   "inside the segment"}
    assert "K/V" not in text()  # the packed read's replay reads the K/V it wrote: its own checks see them
    doc["memory"] = {"reserved_bytes": 3 * 2**29, "free_after_boot_bytes": 5 * 2**29}
    assert "; the captures reserved 1.50 GiB, 2.5 GiB of the device free after them" in text()
    doc["memory"] = {"reserved_bytes": 0, "free_after_boot_bytes": 5 * 2**29}
    assert "; 2.5 GiB of the device free after the captures" in text()


def test_the_graph_lines_say_where_the_checks_at_start_compared_no_project_only_row():
    """A routed arm whose boot rows all ran (a trained gate on the boot's token ids) has its projector's replay
    unchecked, which its lines say; the s = 0 control runs every row by design and is not flagged."""
    unchecked = "no row of the checks at start took Project-Only, so no replay of the projector's path was compared"
    doc = {"tokens": [16], "read": "packed", "passes": {"by_tokens": {"16": 2}},
           "segments": {"captured": 3, "replayed": 9}, "capture_check": {"segments": 3, "worst_difference": 0.0},
           "boot_rows": {"run": 64, "project_only": 0, "unchecked": unchecked}}
    lines = run.routed_prefill_graph_lines({run.ALWAYS: {"served": {"prefill_graphs": doc}},
                                            run.CONTROL: {"served": {"prefill_graphs": doc}}})
    assert [line for line in lines if unchecked in line] == [f"  {run.ALWAYS}: {unchecked}."]
    doc["boot_rows"] = {"run": 40, "project_only": 24, "unchecked": None}
    assert not any("Project-Only" in line for line in run.routed_prefill_graph_lines(
        {run.ALWAYS: {"served": {"prefill_graphs": doc}}}))
