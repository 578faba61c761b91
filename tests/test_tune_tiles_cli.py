"""`vskipper tune-tiles`: refuses without a GPU, and its interpreter smoke run writes a table that loads.
(The measured tuning itself needs a GPU; the smoke run exercises the same code path on the interpreter.)"""

import json
import subprocess
import sys

import pytest
import torch

from vskipper.mixed.tiles import COUNT_RANGES, FFN_OPERATIONS, OPERATIONS, PREFILL_FROM, load_tile_table
from vskipper.mixed.tuner import current_table, representative_rows
from vskipper.roofline import lookup_device


def run_cli(args, env):
    return subprocess.run([sys.executable, "-m", "vskipper.cli", "tune-tiles", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_tune_tiles_refuses_clearly_without_a_gpu(cli_env, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: tune-tiles tunes for real here")
    env = {k: v for k, v in cli_env.items() if k != "TRITON_INTERPRET"}
    res = run_cli(["--out", str(tmp_path / "t.json")], env)
    assert res.returncode == 2
    assert "none is visible" in res.stderr and "--interpret" in res.stderr
    assert not (tmp_path / "t.json").exists()


def test_interpreter_smoke_run_writes_a_loadable_table_for_all_forty_eight_shapes(cli_env, tmp_path):
    out = tmp_path / "smoke.json"
    res = run_cli(["--interpret", "--device", "RTX-A6000", "--out", str(out)], cli_env)
    assert res.returncode == 0, res.stderr
    table = load_tile_table(out)  # validated against the RTX A6000's 99 KiB
    assert table.device == "RTX-A6000" and "not a measurement" in table.source
    assert sum(len(table.entries[op]) for op in OPERATIONS) == len(OPERATIONS) * len(COUNT_RANGES) == 48
    assert "default tiles" not in table.source  # the tuner measured the attention cohort GEMMs too
    assert table.read is not None  # and the packed prefill read (on the interpreter: the default launch)
    # and the two cohort FFNs grouped against apart at every range where the new table gathers none of their GEMMs
    # (the interpreter's times are no measurement: which ranges gather varies)
    assert [(lo, hi) for lo, hi, _ in table.ffn_pair] == list(COUNT_RANGES)
    for lo, hi, timing in table.ffn_pair:
        gathers = any(table.gathers(op, representative_rows(lo, hi, interpret=True)) for op in FFN_OPERATIONS)
        assert (timing is None) == gathers, (lo, hi)
    assert any(timing is not None for *_, timing in table.ffn_pair)  # the open range never gathers
    raw = json.loads(out.read_text())
    assert {e["tried"] for entries in raw["tiles"].values() for e in entries} == {1} == {raw["prefill_read"]["tried"]}
    # each shape beside its roofline floor on the catalogued device (its timed rows, the smoke run's widths)
    assert all(e["floor_ms"] > 0 for entries in raw["tiles"].values() for e in entries)
    # each prefill length's tile chosen over the full and the half count, a decode range's over the full one
    assert {(e["rows"][0] >= PREFILL_FROM, e["chosen_by"]) for entries in raw["tiles"].values() for e in entries} == {
        (True, "full and half live"), (False, "full live")}
    # one candidate a shape under the interpreter: the seed, the tile the device's current table holds there
    a6000 = lookup_device("RTX-A6000")
    current = current_table(a6000.name, a6000.shared_mem_per_block, "float32")
    for op in OPERATIONS:
        for lo, hi, tile in table.entries[op]:
            assert tile == current.lookup(op, representative_rows(lo, hi, interpret=True)), (op, lo)
