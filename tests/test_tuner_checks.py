"""The tuner times only launches that compute what the served path computes: before a candidate tile is timed, its
output is checked against the gathered cuBLAS form's at the full and the half count (a tile that strays, or that
writes rows past the count, is refused and never timed, so it can never be the fastest); the grouped FFN launch
against the two launched apart (one that strays is not served: apart serves); a packed read launch against SDPA's
causal read of the RUN rows (and zeros past them). On the interpreter's real kernels, a fault injected into one
launch (a GPU-only fault, a race or a wrong bound, shows the same way on the device). (No GPU here: the timer is
stood in for; the kernels and the checks are real.)"""

from dataclasses import replace

import pytest
import torch

from vskipper.mixed import kernels, tuner
from vskipper.mixed.kernels import INTERPRETER_TILE
from vskipper.mixed.tiles import COUNT_RANGES, default_tile_table, parse_tile_table

BAD = replace(INTERPRETER_TILE, num_warps=8)  # the interpreter computes the same at any warps: only the fault differs
SCALE = 1.5  # the fault: an output off by half its value


def _faulty(monkeypatch, name: str, fault: str) -> None:
    """`kernels.<name>` with `fault` at the BAD tile alone: 'values' (its output off by SCALE) or 'past the count'
    (every slot of the map computed, the count ignored)."""
    real = getattr(kernels, name)

    def call(*args, tile=None, **kwargs):
        if tile != BAD:
            return real(*args, tile=tile, **kwargs)
        if fault == "past the count":
            args = (*args[:2], torch.tensor([args[1].shape[0]]), *args[3:])
        y = args[5] if name == "cohort_down_scatter" else args[4] if name == "cohort_scatter_add" else None
        before = None if y is None else y.clone()
        out = real(*args, tile=tile, **kwargs)
        if fault == "values":
            if y is None:
                return out * SCALE
            y.copy_(before + (y - before) * SCALE)
        return out

    monkeypatch.setattr(kernels, name, call)


def _timed_tiles(monkeypatch) -> list:
    """Stands in for the timer: a call carrying the BAD tile reports itself ten times faster; returns the tiles
    timed (None: the gathered form)."""
    timed: list = []

    def fake_time(fn, interpret, reps=20, graph=False):
        tile = (fn.__defaults__ or (None,))[0]  # a candidate's call carries its tile (`time_shapes`)
        timed.append(tile)
        return 0.1 if tile == BAD else 1.0

    monkeypatch.setattr(tuner, "time_call", fake_time)
    return timed


def _shape(op: str, rows: int = 16):
    g = torch.Generator().manual_seed(0)
    k_dim, n_dim = tuner.op_dims(op, 32, 64, 16)
    w1, w2 = tuner.op_weights(op, n_dim, k_dim, g, torch.device("cpu"), torch.float32)
    return tuner.ShapeCalls(f"{op} rows 1..16", *tuner.shape_calls(op, rows, w1, w2, g, torch.device("cpu"),
                                                                   torch.float32))


@pytest.mark.parametrize("op,kernel,fault", [
    ("mlp_gate_up", "cohort_gate_up", "values"),
    ("attn_q", "cohort_gemm", "values"),
    ("mlp_down", "cohort_down_scatter", "values"),
    ("mlp_down", "cohort_down_scatter", "past the count"),
    ("attn_o", "cohort_scatter_add", "past the count"),
])
def test_a_tile_whose_output_strays_is_refused_untimed_and_the_correct_one_kept(monkeypatch, op, kernel, fault):
    _faulty(monkeypatch, kernel, fault)
    timed = _timed_tiles(monkeypatch)
    lines: list[str] = []
    (entry,) = tuner.time_shapes([_shape(op)], [BAD, INTERPRETER_TILE], tuner.Clock(None, 1), interpret=True,
                                 graph=False, log=lines.append, by_half=True)
    assert BAD not in timed and INTERPRETER_TILE in timed
    assert (entry["num_warps"], entry["tried"], entry["refused"]) == (INTERPRETER_TILE.num_warps, 1, 1)
    assert any("refuse" in line and str(BAD) in line and "strays" in line for line in lines)


def test_the_correct_kernels_pass_their_checks_at_every_operation(monkeypatch):
    """Each operation's real kernel, at the full and the half count: within the tolerance, so nothing is
    refused."""
    _timed_tiles(monkeypatch)
    for op in ("mlp_gate_up", "proj_gate_up", "mlp_down", "proj_down", "attn_q", "attn_o"):
        shape = _shape(op)
        err, allowed = shape.check(INTERPRETER_TILE)
        assert err <= 1e-4 * allowed / tuner.CHECK_RTOL, op  # fp32 on the interpreter: far inside the bound
        (entry,) = tuner.time_shapes([shape], [INTERPRETER_TILE], tuner.Clock(None, 1), interpret=True,
                                     graph=False, log=lambda line: None)
        assert "refused" not in entry


def test_a_shape_whose_every_tile_strays_stops_the_tuner_naming_it(monkeypatch):
    _faulty(monkeypatch, "cohort_down_scatter", "values")
    _timed_tiles(monkeypatch)
    with pytest.raises(tuner.TunerError, match=r"mlp_down rows 1\.\.16: no candidate tile ran \(1 refused"):
        tuner.time_shapes([_shape("mlp_down")], [BAD], tuner.Clock(None, 1), interpret=True, graph=False,
                          log=lambda line: None)


def test_a_grouped_ffn_launch_that_strays_from_the_two_apart_is_not_served(monkeypatch):
    real = kernels.cohort_ffn_pair

    def grouped_wrong(x, weights, y, mlp, proj, grouped=True, **kwargs):
        real(x, weights, y, mlp, proj, grouped=grouped, **kwargs)
        if grouped:
            y.mul_(SCALE)

    monkeypatch.setattr(kernels, "cohort_ffn_pair", grouped_wrong)
    _timed_tiles(monkeypatch)
    monkeypatch.setattr(tuner, "COUNT_RANGES", COUNT_RANGES[:1])
    table = default_tile_table(227 * 1024, "H100-SXM", "float32")
    (entry,) = tuner.time_ffn_pairs(table, 32, 64, 16, torch.Generator().manual_seed(0), torch.device("cpu"),
                                    torch.float32, True, tuner.Clock(None, 1), log=lambda line: None)
    assert "grouped_ms" not in entry and "strays" in entry["grouped_error"] and entry["apart_ms"] == 1.0
    untimed = [{"rows": [lo, hi]} for lo, hi in COUNT_RANGES[1:]]  # the other ranges: grouped where they can
    parsed = parse_tile_table({**table.as_dict(), "ffn_pair": [entry, *untimed]}, 227 * 1024)
    assert not parsed.groups_ffn(16) and parsed.groups_ffn(17)
    monkeypatch.setattr(kernels, "cohort_ffn_pair", real)  # the real grouped launch passes its check
    (entry,) = tuner.time_ffn_pairs(table, 32, 64, 16, torch.Generator().manual_seed(0), torch.device("cpu"),
                                    torch.float32, True, tuner.Clock(None, 1), log=lambda line: None)
    assert entry == {"rows": [1, 16], "apart_ms": 1.0, "grouped_ms": 1.0}


@pytest.mark.parametrize("fault", ["values", "past the count"])
def test_a_packed_read_launch_that_strays_from_sdpas_read_is_refused(monkeypatch, fault):
    real = kernels.packed_prefill_attention

    def faulty(q, k_pool, v_pool, r2t, req, pos, reads, scale, **kwargs):
        out = real(q, k_pool, v_pool, r2t, req, pos, reads, scale, **kwargs)
        if fault == "values":
            return out * SCALE
        return torch.where(reads[:, None, None], out, torch.ones_like(out))  # slots past the RUN rows written

    monkeypatch.setattr(kernels, "packed_prefill_attention", faulty)
    lines: list[str] = []
    with pytest.raises(tuner.TunerError, match=r"prefill_read: no candidate launch ran \(1 refused"):
        tuner.tune_prefill_read(4, 2, 16, interpret=True, log=lines.append)
    assert any("refuse" in line and "SDPA" in line for line in lines)
    monkeypatch.setattr(kernels, "packed_prefill_attention", real)
    entry = tuner.tune_prefill_read(4, 2, 16, interpret=True, log=lines.append)
    assert entry["tried"] == 1 and "refused" not in entry


def test_a_shape_refusing_every_tile_spends_its_budget_as_one_that_times_them(monkeypatch):
    """Timed together (an operation's prefill lengths), a shape whose every tile strays counts its refusals as
    the tiles it took: once the budget is spent the others stop too, after the first candidate, and the tuner
    names the shape, instead of timing every candidate of the others until the stage's limit."""
    timed = _timed_tiles(monkeypatch)
    good = _shape("mlp_down")
    wrong = good._replace(name="mlp_down rows 1..16 (wrong)", check=lambda tile: (1.0, 0.02))
    spent = tuner.Clock(None, 1)
    spent.shape_deadline = 0.0  # the share long spent
    candidates = [INTERPRETER_TILE, replace(INTERPRETER_TILE, block_k=64), replace(INTERPRETER_TILE, block_n=64)]
    with pytest.raises(tuner.TunerError, match=r"\(wrong\): no candidate tile ran \(1 refused"):
        tuner.time_shapes([good, wrong], candidates, spent, interpret=True, graph=False, log=lambda line: None)
    assert {t for t in timed if t is not None} == {INTERPRETER_TILE}  # the good shape's first tile alone
