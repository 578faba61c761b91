"""The prefill read benchmark's pipeline at a tiny size (its figures mean nothing here)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import prefill_read_bench  # noqa: E402


def test_the_read_benchmark_prints_each_read_and_the_ratios_beside_the_pairs_share(capsys):
    assert prefill_read_bench.main(["--tokens", "80", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 x 80 tokens, " in out and "of the causal pairs" in out
    for name in ("folded", "sdpa-gqa", "causal", "backend", "gather"):
        assert f"  {name}" in out
    assert "folded over causal " in out and "(limit: the pairs' share " in out and "folded over sdpa-gqa " in out
    assert "folded with its gather over backend " in out
    assert "  loop" not in out and "one-call over loop" not in out  # one request: no one call to compare
    # 80 x 81 / 2 pairs x 16 heads of 64: 3.3 M products, under the sized read's threshold
    assert "the sized read (a CPU server's) takes backend here: 3.32 M query-key products against its 4.19 M" in out


def test_with_several_requests_it_prints_the_one_call_beside_the_loop(capsys):
    """The tiny model's heads in float32; the reads' outputs are checked against each other before timing."""
    assert prefill_read_bench.main(["--requests", "3", "--tokens", "24", "--rounds", "1", "--heads", "4,2,16",
                                    "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "3 x 24 tokens, " in out and "heads 4/2 of 16, float32" in out
    for name in ("folded", "loop", "one-call", "sdpa-gqa", "causal", "backend", "gather"):
        assert f"  {name}" in out
    assert "; one-call over loop " in out
    assert "the sized read (a CPU server's) takes folded here: several requests" in out


def test_a_share_with_no_row_running_is_refused():
    with pytest.raises(SystemExit, match="--run in"):
        prefill_read_bench.main(["--run", "0"])


@pytest.mark.parametrize("heads", ["4,3,16", "4,2", "a,b,c", "0,1,16"])
def test_heads_that_do_not_group_are_refused_naming_the_flag(heads):
    with pytest.raises(SystemExit, match="--heads"):
        prefill_read_bench.main(["--heads", heads])
