"""The pass sizes a served routed layer's warm-up runs (`vskipper.mixed.warm`): one in every count range its
tiles distinguish, so that no range's GEMM variants first compile while serving. That the warm-up's launches are
the variants a served pass launches is checked on the served model (`test_sglang_model_replay.py`)."""

from __future__ import annotations

from vskipper.mixed.tiles import COUNT_RANGES, tile_table_for
from vskipper.mixed.warm import warm_rows


def test_a_table_is_warmed_at_a_pass_in_every_count_range_and_the_interpreters_one_tile_at_one():
    rows = warm_rows(tile_table_for("H200"), "cpu")
    for lo, hi in COUNT_RANGES:  # each range (a tile and a form of its own in a table) holds one warmed pass
        assert sum(1 for n in rows if n >= lo and (hi is None or n <= hi)) == 1, (lo, hi)
    assert warm_rows(None, "cpu") == (1,)  # the interpreter's tile serves every count
