"""The tuner's candidate tiles, clock and timings: the shipped table's tile and, for a prefill range, large GEMM
tiles are tried before the sample, within the candidate limit and the device's shared memory; the budget is
shared out; decode shapes are timed as CUDA graph replays."""

from dataclasses import replace

import pytest

from vskipper.mixed.tiles import (
    COUNT_RANGES,
    OPERATIONS,
    PREFILL_RANGES,
    Tile,
    parse_tile_table,
    tile_table_for,
)
from vskipper.mixed.tuner import (
    PREFILL_SEED_TILES,
    candidate_tiles,
    current_table,
    representative_rows,
    seed_tiles,
    whole_rows_split_tile,
)
from vskipper.roofline import lookup_device

H100 = lookup_device("H100-SXM")


def test_the_shipped_tile_of_each_range_is_a_candidate_so_a_new_table_is_never_measured_worse():
    shipped = tile_table_for(H100.name)
    current = current_table(H100.name, H100.shared_mem_per_block, "bfloat16")
    for lo, hi in COUNT_RANGES:
        rows = representative_rows(lo, hi)
        seeds = seed_tiles("mlp_gate_up", lo, [rows], current)
        assert seeds[0] == shipped.lookup("mlp_gate_up", rows)
        tiles = candidate_tiles("mlp_gate_up", rows, H100.shared_mem_per_block, 2, 24, seeds)
        assert len(tiles) <= 24 and len(set(tiles)) == len(tiles)
        assert tiles[0] == seeds[0]


def test_each_prefill_length_is_tuned_at_its_own_tokens():
    """A prefill grid is sized by the pass's tokens: the ranges from 513 are timed at 1,024, 2,048 and 4,096 rows
    (under the interpreter at their first rows, the fewest it emulates), each decode range at its upper end."""
    assert [representative_rows(lo, hi) for lo, hi in PREFILL_RANGES] == [1024, 2048, 4096]
    assert [representative_rows(lo, hi, interpret=True) for lo, hi in PREFILL_RANGES] == [513, 1025, 2049]
    assert [representative_rows(lo, hi) for lo, hi in COUNT_RANGES[:-len(PREFILL_RANGES)]] == [16, 32, 64, 128, 512]


def test_a_prefill_range_tries_the_large_tiles_that_fit_and_a_decode_range_does_not():
    current = current_table(H100.name, H100.shared_mem_per_block, "bfloat16")
    prefill = seed_tiles("mlp_down", 1025, [2048], current)
    decode = seed_tiles("mlp_down", 1, [16], current)
    assert set(PREFILL_SEED_TILES) <= set(prefill) and not set(PREFILL_SEED_TILES) & set(decode)
    tiles = candidate_tiles("mlp_gate_up", 2048, H100.shared_mem_per_block, 2, 24, prefill)
    big = Tile(128, 256, 64, 8, 3)  # two weight tiles of 64 x 256 at 3 stages: 240 KiB, over the H100's 227
    assert big.shared_mem_bytes("mlp_gate_up") > H100.shared_mem_per_block and big not in tiles
    assert Tile(128, 128, 64, 8, 3) in tiles and len(tiles) == 24
    # the limit caps the seeds too: a smoke run's single candidate is the shipped tile
    assert candidate_tiles("mlp_down", 2048, H100.shared_mem_per_block, 2, 1, prefill) == prefill[:1]


def test_a_decode_range_of_an_operation_that_splits_k_tries_the_current_tile_split():
    """After the current table's tile, a decode shape of the down GEMMs, Q and o_proj tries that tile with K split
    2 and 4 ways (before the sample, within a smoke run's limit of one the tile alone); a gate-up or a prefill
    shape never splits, and a current tile that splits already is tried unsplit too."""
    current = current_table(H100.name, H100.shared_mem_per_block, "bfloat16")
    for op in ("mlp_down", "proj_down", "attn_q", "attn_o"):
        shipped = current.lookup(op, 128)
        seeds = seed_tiles(op, 65, [128], current)
        assert seeds == [shipped, replace(shipped, split_k=2), replace(shipped, split_k=4)], op
        assert candidate_tiles(op, 128, H100.shared_mem_per_block, 2, 24, seeds)[:3] == seeds
        assert candidate_tiles(op, 128, H100.shared_mem_per_block, 2, 1, seeds) == [shipped]
    assert all(t.split_k == 1 for t in seed_tiles("mlp_gate_up", 65, [128], current))
    assert all(t.split_k == 1 for t in seed_tiles("mlp_down", 1025, [2048], current))
    current.entries["attn_o"][0] = (1, 16, replace(current.lookup("attn_o", 16), split_k=2))
    assert [t.split_k for t in seed_tiles("attn_o", 1, [16], current)] == [2, 1, 4]
    # given the output width, also one row tile over every slot, K split until the grid holds a program an SM
    assert seed_tiles("mlp_down", 65, [128], current, 4096)[3:] == [Tile(128, 64, 64, 8, 4, 4)]  # 64 column tiles
    assert whole_rows_split_tile(16, 4096) == Tile(16, 64, 128, 4, 4, 4)
    assert whole_rows_split_tile(512, 4096) == Tile(128, 64, 64, 8, 4, 1)  # 4 x 64 programs: no split needed
    assert whole_rows_split_tile(1, 64) == Tile(16, 64, 128, 4, 4, 16)  # a tiny width: the most splits
    assert seed_tiles("mlp_gate_up", 65, [128], current, 14336) == [current.lookup("mlp_gate_up", 128)]
    # a seed whose buffers overflow the shared memory is dropped: at 64 rows, 128 KiB of a 99 KiB part's
    seed = whole_rows_split_tile(64, 4096)
    assert seed.shared_mem_bytes("mlp_down") == 128 * 1024
    assert seed in candidate_tiles("mlp_down", 64, H100.shared_mem_per_block, 2, 24, [seed])
    assert seed not in candidate_tiles("mlp_down", 64, 99 * 1024, 2, 24, [seed])


def test_every_candidate_fits_the_shared_memory_and_the_sample_still_spans_the_grid():
    a6000 = lookup_device("RTX-A6000")
    tiles = candidate_tiles("mlp_gate_up", 64, a6000.shared_mem_per_block, 2, None, ())
    assert all(t.shared_mem_bytes("mlp_gate_up") <= a6000.shared_mem_per_block for t in tiles)
    assert {t.block_m for t in tiles} == {16, 32, 64} and tiles[0] == Tile(16, 32, 32, 4, 2)


def test_a_device_without_a_loadable_table_seeds_only_the_large_prefill_tiles():
    assert current_table("Some Future GPU", None, "bfloat16") is None  # not catalogued, no limit: nothing loads
    assert seed_tiles("attn_q", 2049, [4096], None) == list(PREFILL_SEED_TILES)
    assert seed_tiles("attn_q", 129, [512], None) == []


def test_the_tuners_clock_shares_what_is_left_of_its_budget_and_never_stops_a_shape_before_its_first_tile(
        monkeypatch):
    """`tune-tiles --budget-s`: each shape gets an even share of what is left, so the table is always written
    (a slow device times fewer tiles on its later shapes, the seeds first); unbounded, nothing stops."""
    from vskipper.mixed import tuner

    now = [100.0]
    monkeypatch.setattr(tuner.time, "monotonic", lambda: now[0])
    clock = tuner.Clock(30.0, 3)
    clock.start_shape()  # 30 s left over 3 shapes: until 110
    assert not clock.spent(0) and not clock.spent(1)
    now[0] = 111.0
    assert clock.spent(1) and not clock.spent(0)  # over its share, but a shape always times one tile
    clock.start_shape()  # 19 s left over 2 shapes: until 120.5
    now[0] = 120.0
    assert not clock.spent(3)
    now[0] = 121.0
    assert clock.spent(3)
    unbounded = tuner.Clock(None, 2)
    unbounded.start_shape()
    now[0] = 1e9
    assert not unbounded.spent(24)
    now[0] = 0.0  # the packed read, timed last, has its share (6 of 42 s beside 36 GEMM shapes) set aside
    reserving = tuner.Clock(42.0, 36, tuner.READ_WEIGHT)
    reserving.start_shape()  # 36 s free over 36 shapes
    now[0] = 0.9
    assert not reserving.spent(1)
    now[0] = 1.1
    assert reserving.spent(1)
    now[0] = 40.0  # the GEMM shapes ran slow: each later one gets what is free, none of the reserve
    reserving.start_shape()
    now[0] = 40.01
    assert reserving.spent(1) and not reserving.spent(0)
    reserving.start_reserved()  # the read: everything left, until the budget's end
    now[0] = 41.9
    assert not reserving.spent(3)
    now[0] = 42.1
    assert reserving.spent(3)
    now[0] = 0.0  # a shape of a quarter's weight (the FFN pair) takes a quarter of a GEMM shape's share
    weighted = tuner.Clock(10.0, 2 + 2 * tuner.PAIR_WEIGHT)
    weighted.start_shape(tuner.PAIR_WEIGHT)  # 10 s over 2.5 weights: 1 s for this quarter
    now[0] = 0.9
    assert not weighted.spent(1)
    now[0] = 1.1
    assert weighted.spent(1)
    now[0] = 0.0
    weighted.start_shape()  # 10 s over the 2.25 left: 4.44 s
    now[0] = 4.4
    assert not weighted.spent(1)
    now[0] = 4.5
    assert weighted.spent(1)


def test_a_decode_shape_is_timed_as_cuda_graph_replays_and_a_prefill_shape_eagerly(monkeypatch):
    """`time_call(graph=True)` times the replay of a CUDA graph holding the calls (triton's do_bench_cudagraph), as
    a served decode pass replays them; otherwise do_bench. (No GPU here: triton's two timers are stood in for, to
    see which the tuner asks for; the GPU's tiles stage runs them.)"""
    import triton.testing

    from vskipper.mixed import tuner

    asked = []
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, rep: asked.append(("graph", rep)) or 0.5)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, warmup, rep: asked.append(("eager", rep)) or 0.7)
    assert tuner.time_call(lambda: None, interpret=False, graph=True) == 0.5
    assert tuner.time_call(lambda: None, interpret=False) == 0.7
    assert asked == [("graph", 20), ("eager", 100)]


def test_a_shape_whose_gathered_form_cannot_be_captured_is_timed_eagerly_and_never_gathers(monkeypatch):
    """`time_shape`: a decode shape is timed in CUDA graphs, tile and torch side alike; where the gathered form's
    capture fails, the whole shape is timed eagerly and its entry keeps no half-count time, so the table never
    serves that form there (a decode pass would capture it). (No GPU here: the timer is stood in for, the
    kernels and the forms are the tuner's own callables.)"""
    from vskipper.mixed import tuner

    def reference():
        return None

    def kernel(tile, count=None):
        return None

    asked = []

    def fake_time(fn, interpret, reps=20, graph=False):
        asked.append(graph)
        if graph and fn is reference and refuse:
            raise RuntimeError("operation not permitted when stream is capturing")
        return 0.05 if fn is reference else 0.1

    monkeypatch.setattr(tuner, "time_call", fake_time)
    candidates = [Tile(16, 32, 64, 4, 2), Tile(32, 64, 64, 4, 3)]
    rows = {}
    for refuse in (False, True):
        asked.clear()
        entry = tuner.time_shape("mlp_down rows 65..128", reference, kernel, None, candidates,
                                 tuner.Clock(None, 1), interpret=False, graph=True, log=lambda line: None)
        assert entry.pop("line").startswith("best Tile(block_m=16")
        rows[refuse] = entry
        # the reference, each candidate, then the best tile at half the count
        assert asked == ([True] * 4 if not refuse else [True, False, False, False, False])
    assert rows[False]["timed"] == "cuda graph" and rows[False]["kernel_half_ms"] == 0.1
    assert rows[True]["timed"] == "eager" and "kernel_half_ms" not in rows[True]
    for refuse, entry in rows.items():
        data = {"device": "H200", "dtype": "bfloat16", "tiles": {
            op: [{"rows": [lo, hi], **entry} for lo, hi in COUNT_RANGES] for op in OPERATIONS}}
        assert parse_tile_table(data, 227 * 1024).gathers("mlp_down", 100) is not refuse


def test_a_prefill_shape_takes_the_tile_fastest_over_the_full_and_half_count(monkeypatch):
    """`time_shape` with `by_half` (the prefill range): every candidate is timed with every slot live and with half
    of them, and the tile with the least sum wins, where the full count alone would pick one whose grid fills the
    device only when every slot is live (at half it runs half its programs, each as long). Without it (the decode
    ranges) the full count decides and only the winner is timed at half. (No GPU here: the timer is stood in for.)"""
    from vskipper.mixed import tuner

    wide, narrow = Tile(128, 256, 64, 8, 3), Tile(64, 128, 64, 4, 3)
    times = {(wide, "full"): 1.00, (wide, "half"): 0.96, (narrow, "full"): 1.05, (narrow, "half"): 0.55}
    asked = []

    def reference():
        return None

    def kernel(tile, count=None):
        return tile, "half" if count is not None else "full"

    def fake_time(fn, interpret, reps=20, graph=False):
        if fn is reference:
            return 2.0
        asked.append(fn())
        return times[fn()]

    monkeypatch.setattr(tuner, "time_call", fake_time)
    half = object()
    for by_half, chosen, timed in ((True, narrow, [(wide, "full"), (wide, "half"), (narrow, "full"),
                                                   (narrow, "half")]),
                                   (False, wide, [(wide, "full"), (narrow, "full"), (wide, "half")])):
        asked.clear()
        entry = tuner.time_shape("mlp_down rows 513..None", reference, kernel, half, [wide, narrow],
                                 tuner.Clock(None, 1), interpret=False, graph=False, log=lambda line: None,
                                 by_half=by_half)
        assert (entry["block_m"], entry["block_n"]) == (chosen.block_m, chosen.block_n) and asked == timed
        assert (entry["kernel_ms"], entry["kernel_half_ms"]) == (times[chosen, "full"], times[chosen, "half"])
        assert entry["chosen_by"] == ("full and half live" if by_half else "full live")
        assert ("over full and half live" in entry["line"]) is by_half


def test_a_range_whose_grouped_ffn_pair_fails_keeps_the_error_and_serves_the_two_apart(monkeypatch):
    """`time_ffn_pairs`: the pair is timed apart, then grouped; where the grouped launch fails (a compiler or a
    device that refuses it), the range keeps the error and the apart time, and the table launches the two apart
    there, while a range that timed both keeps the faster. (No GPU here: the timer is stood in for.)"""
    import torch

    from vskipper.mixed import tuner
    from vskipper.mixed.tiles import default_tile_table

    def grouped():
        return None

    def apart():
        return None

    def fake_time(fn, interpret, reps=20, graph=False):
        if fn is failing[0] and not failed:
            failed.append(fn)
            raise RuntimeError("out of resources: shared memory")
        return 0.5 if fn is grouped else 1.0

    failed: list = []
    failing = [grouped]
    monkeypatch.setattr(tuner, "time_call", fake_time)
    monkeypatch.setattr(tuner, "ffn_pair_calls", lambda *args: (grouped, apart, lambda: (0.0, 1.0)))
    table = default_tile_table(227 * 1024, "H100-SXM", "float32")
    entries = tuner.time_ffn_pairs(table, 32, 64, 16, torch.Generator().manual_seed(0), torch.device("cpu"),
                                   torch.float32, True, tuner.Clock(None, 6), log=lambda line: None)
    assert entries[0] == {"rows": [1, 16], "apart_ms": 1.0,
                          "grouped_error": "RuntimeError: out of resources: shared memory"}
    assert all(e["grouped_ms"] == 0.5 and e["apart_ms"] == 1.0 for e in entries[1:])
    parsed = parse_tile_table({**table.as_dict(), "ffn_pair": entries}, 227 * 1024)
    assert [parsed.groups_ffn(rows) for rows in (16, 17, 4096)] == [False, True, True]
    assert parsed.apart_ranges() == [[1, 16]]
    failing[0] = apart  # now the launches apart fail at the first range: it keeps no timing
    failed.clear()
    entries = tuner.time_ffn_pairs(table, 32, 64, 16, torch.Generator().manual_seed(0), torch.device("cpu"),
                                   torch.float32, True, tuner.Clock(None, 6), log=lambda line: None)
    assert entries[0] == {"rows": [1, 16]} and all("grouped_ms" in e for e in entries[1:])


def test_the_tuner_times_the_prefill_lengths_together_on_twice_a_decode_shapes_share_each(monkeypatch):
    """`tune` with a budget: an operation's decode ranges one by one in CUDA graphs, then its three prefill lengths
    eagerly as one group on the same candidates (each compiled once) chosen over both counts, the group's share of
    what is left `PREFILL_WEIGHT` times a decode shape's for each length (each candidate is timed at both counts,
    eagerly, over thousands of rows); the FFN pairs keep theirs. The prefill group's candidates start with the
    current table's tile at each length, all of them timed whatever the budget, then the large tiles. (No GPU here:
    CUDA, the operands and the timing stood in for; the clock read as each group starts.)"""
    import time
    from types import SimpleNamespace

    import torch

    from vskipper.mixed import tuner
    from vskipper.mixed.tiles import default_tile_table

    groups: list[tuple] = []

    def fake_shapes(shapes, candidates, clock, interpret, graph, log=print, by_half=False, keep=1):
        los = [int(shape.name.split("rows ")[1].split("..")[0]) for shape in shapes]
        groups.append((los, clock.shape_deadline - tuner.time.monotonic(), candidates, by_half, graph, keep))
        return [{"block_m": 16, "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2, "kernel_ms": 1.0,
                 "torch_ms": 1.0, "line": ""} for _ in shapes]

    own = [Tile(64, 128, 64, 4, 3), Tile(128, 128, 64, 8, 2), Tile(128, 64, 64, 8, 3)]  # one per prefill length
    data = default_tile_table(H100.shared_mem_per_block, "H100-SXM").as_dict()
    for entries in data["tiles"].values():
        for entry, tile in zip(entries[-len(PREFILL_RANGES):], own, strict=True):
            entry.update(block_m=tile.block_m, block_n=tile.block_n, block_k=tile.block_k,
                         num_warps=tile.num_warps, num_stages=tile.num_stages)
    current = parse_tile_table(data, H100.shared_mem_per_block)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # the tuner's clock stands still (its module's alone): nothing is spent
    monkeypatch.setattr(tuner, "time", SimpleNamespace(monotonic=lambda: 0.0, perf_counter=time.perf_counter))
    monkeypatch.setattr(tuner, "current_table", lambda *args: current)
    monkeypatch.setattr(tuner, "op_weights", lambda *args: (None, None))
    monkeypatch.setattr(tuner, "shape_calls", lambda *args: (None, None, None))
    monkeypatch.setattr(tuner, "time_shapes", fake_shapes)
    monkeypatch.setattr(tuner, "time_ffn_pairs", lambda *args: [{"rows": [lo, hi]} for lo, hi in COUNT_RANGES])
    tuner.tune("H100-SXM", H100.shared_mem_per_block, 4096, 14336, 896, max_candidates=24, log=lambda line: None,
               budget_s=1000.0)
    decode = [[lo] for lo, _ in COUNT_RANGES if lo < PREFILL_RANGES[0][0]]
    assert [los for los, *_ in groups] == (decode + [[lo for lo, _ in PREFILL_RANGES]]) * len(OPERATIONS)
    # nothing is spent, so each group takes its weights' part of the whole budget over the weights still left
    left = sum(len(OPERATIONS) * tuner.shape_weight(lo) + tuner.PAIR_WEIGHT for lo, _ in COUNT_RANGES)
    for los, share, candidates, by_half, graph, keep in groups:
        prefill = len(los) > 1
        weight = sum(tuner.shape_weight(lo) for lo in los)
        assert share == pytest.approx(1000.0 * weight / left)
        assert (by_half, graph, keep) == ((True, False, 3) if prefill else (False, True, 1))
        if prefill:
            assert candidates[:3] == own and set(PREFILL_SEED_TILES) & set(candidates[3:])
        left -= weight
    assert tuner.PREFILL_WEIGHT == 2 and sum(tuner.shape_weight(lo) for lo, _ in PREFILL_RANGES) == 6


def test_shapes_timed_together_take_each_candidate_in_turn_and_each_keeps_its_own_best(monkeypatch):
    """`time_shapes` over several shapes (an operation's prefill lengths): each candidate is timed at every shape
    before the next candidate, each shape's tile is its own fastest over both counts, and the budget stops the
    candidates only once every shape timed one. (No GPU here: the timer is stood in for.)"""
    from vskipper.mixed import tuner

    wide, narrow, third = Tile(128, 256, 64, 8, 3), Tile(64, 128, 64, 4, 3), Tile(128, 128, 64, 8, 3)
    # at 1,024 rows the narrow tile wins at half the count; at 4,096 the wide one fills the device either way
    times = {("short", wide): (1.0, 0.96), ("short", narrow): (1.05, 0.55),
             ("long", wide): (4.0, 2.0), ("long", narrow): (4.4, 2.2)}
    asked = []

    def fake_time(fn, interpret, reps=20, graph=False):
        name, tile, half = fn()
        if tile is None:
            return 1.0
        asked.append((name, tile, half))
        return times[name, tile][half]

    def shape(name):
        return tuner.ShapeCalls(f"mlp_down rows {name}", lambda: (name, None, 0),
                                lambda tile, count=None: (name, tile, int(count is not None)), object())

    monkeypatch.setattr(tuner, "time_call", fake_time)
    entries = tuner.time_shapes([shape("short"), shape("long")], [wide, narrow], tuner.Clock(None, 1),
                                interpret=False, graph=False, log=lambda line: None, by_half=True)
    assert [(e["block_m"], e["block_n"]) for e in entries] == [(64, 128), (128, 256)]
    assert [(e["kernel_ms"], e["kernel_half_ms"], e["tried"]) for e in entries] == [(1.05, 0.55, 2), (4.0, 2.0, 2)]
    assert asked == [(n, t, h) for t in (wide, narrow) for n in ("short", "long") for h in (0, 1)]
    spent = tuner.Clock(None, 1)
    spent.shape_deadline = 0.0  # the share long spent: one candidate, timed at every shape, then none
    for keep, timed in ((1, [wide]), (2, [wide, narrow])):  # unless told to keep more (the current table's)
        asked.clear()
        tuner.time_shapes([shape("short"), shape("long")], [wide, narrow, third], spent, interpret=False,
                          graph=False, log=lambda line: None, by_half=True, keep=keep)
        assert [t for _, t, _ in asked] == [t for t in timed for _ in range(4)]


def test_a_split_tile_timed_fastest_goes_in_the_table_and_its_pair_runs_split_grouped_and_apart(monkeypatch):
    """The tuner's path with split tiles, on the interpreter's real kernels (the timer stood in for: it runs each
    call and reports a split tile faster): a decode shape of the MLP's down keeps the split seed, the table written
    from it loads with that split, and `time_ffn_pairs` then times the two FFNs grouped (both down GEMMs split in
    one launch, then a reduce each) and apart (the MLP's down split with its reduce, the projector's unsplit)."""
    import torch
    from mixed_world import INTERPRETER_ENTRY, OwnLaunches

    from vskipper.mixed import tuner
    from vskipper.mixed.kernels import INTERPRETER_TILE

    def fake_time(fn, interpret, reps=20, graph=False):
        fn()  # the real launch, on the interpreter
        tile = (fn.__defaults__ or (None,))[0]  # a candidate's call carries its tile (`time_shapes`)
        return 0.5 if isinstance(tile, Tile) and tile.split_k > 1 else 1.0

    monkeypatch.setattr(tuner, "time_call", fake_time)
    g, cpu = torch.Generator().manual_seed(0), torch.device("cpu")
    w1, w2 = tuner.op_weights("mlp_down", 32, 64, g, cpu, torch.float32)  # hidden 32, intermediate 64
    shapes = [tuner.ShapeCalls("mlp_down rows 1..16", *tuner.shape_calls("mlp_down", 16, w1, w2, g, cpu,
                                                                         torch.float32))]
    split = replace(INTERPRETER_TILE, split_k=2)
    (entry,) = tuner.time_shapes(shapes, [INTERPRETER_TILE, split], tuner.Clock(None, 1), interpret=True,
                                 graph=False, log=lambda line: None)
    assert entry["split_k"] == 2 and entry["tried"] == 2 and (entry["kernel_ms"], entry["torch_ms"]) == (0.5, 1.0)
    entry.pop("line")
    tiles = {op: [{"rows": [lo, hi], **INTERPRETER_ENTRY, "split_k": 1} for lo, hi in COUNT_RANGES]
             for op in OPERATIONS}
    tiles["mlp_down"][0] = {"rows": [1, 16], **entry}
    table = parse_tile_table({"device": "H200", "dtype": "float32", "tiles": tiles}, 227 * 1024)
    assert table.lookup("mlp_down", 16) == split and table.split_k_tried
    monkeypatch.setattr(tuner, "COUNT_RANGES", COUNT_RANGES[:1])
    launches = OwnLaunches()
    with launches.triton():
        (pair,) = tuner.time_ffn_pairs(table, 32, 64, 16, g, cpu, torch.float32, True, tuner.Clock(None, 1),
                                       log=lambda line: None)
    assert pair == {"rows": [1, 16], "apart_ms": 1.0, "grouped_ms": 1.0}
    apart = ["cohort_gate_up_kernel", "cohort_down_scatter_kernel", "split_k_reduce_kernel",  # the MLP split
             "cohort_gate_up_kernel", "cohort_down_scatter_kernel"]  # and the projector unsplit
    grouped = ["grouped_gate_up_kernel", "grouped_down_scatter_kernel", "split_k_reduce_kernel",
               "split_k_reduce_kernel"]
    # the Triton launches: apart timed, the grouped launch checked against apart, then timed
    assert [name for name in launches.launches if name.endswith("_kernel")] == apart + grouped + apart + grouped
