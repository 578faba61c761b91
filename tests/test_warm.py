"""The pass sizes a served routed layer's warm-up runs (`vskipper.mixed.warm`): one in every count range its
tiles distinguish, so that no range's GEMM variants first compile while serving. That the warm-up's launches are
the variants a served pass launches is checked on the served model (`test_sglang_model_replay.py`)."""

from __future__ import annotations

from mixed_world import gathering_table

from vskipper.mixed.tiles import COUNT_RANGES, tile_table_for
from vskipper.mixed.warm import warm_rows
from vskipper.roofline import find_device


def test_a_table_is_warmed_at_a_pass_in_every_count_range_and_the_interpreters_one_tile_at_one():
    table = tile_table_for("H200")
    rows = warm_rows(table, "cpu")
    ridge = find_device("H200").ridge_rows
    for lo, hi in COUNT_RANGES:  # each range (a tile and a form of its own in a table) holds a warmed pass
        inside = [n for n in rows if n >= lo and (hi is None or n <= hi)]
        # the range the ridge falls in twice: a capacity at the ridge serves the gathered form, one past it the tile
        assert inside == ([lo, int(ridge) + 1] if lo <= ridge < (hi or float("inf")) else [lo]), (lo, hi)
    timed = gathering_table()  # cuBLAS measured faster everywhere: gathered to the ridge, tiled above it
    assert warm_rows(timed, "cpu") == rows
    forms = {timed.gathers("mlp_down", n) for n in rows if 129 <= n <= 512}  # an eager pass's capacity: its rows
    assert forms == {True, False}  # the ridge's range warms both of its forms
    assert warm_rows(None, "cpu") == (1,)  # the interpreter's tile serves every count
