"""The prefill read benchmark's pipeline at a tiny size (its figures mean nothing here)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import prefill_read_bench  # noqa: E402


def test_the_read_benchmark_prints_each_read_and_the_ratios_beside_the_pairs_share(capsys):
    assert prefill_read_bench.main(["--tokens", "80", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "80 tokens, " in out and "of the causal pairs" in out
    for name in ("folded", "sdpa-gqa", "causal"):
        assert f"  {name}" in out
    assert "folded over causal " in out and "(limit: the pairs' share " in out and "folded over sdpa-gqa " in out


def test_a_share_with_no_row_running_is_refused():
    with pytest.raises(SystemExit, match="--run in"):
        prefill_read_bench.main(["--run", "0"])
