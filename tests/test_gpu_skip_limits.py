"""benchmarks/gpu/skip_limits.py on the landed H200 runs: the skip's limit on lease-4's cells for several d, from
host-lean-sweep's dense lines (a prediction from landed data; no server, no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.gpu import skip_limits

H200 = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "H200"


def test_the_skips_limit_per_d_on_lease_4s_cells_says_which_skip_reaches_the_papers_knee(tmp_path, capsys):
    out = tmp_path / "limits.json"
    code = skip_limits.main([str(H200 / "lease-4"), "--sweep", str(H200 / "host-lean-sweep"), "--d", "0.5,1",
                             "--json", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    # the headline's arms' pool, the plan's running cap, the catalogued bandwidth of the sweep's GPU (env.json)
    assert (doc["kv_pool_tokens"], doc["max_running"], doc["bandwidth_gbps"]) == (842_145, 256, 4800.0)
    half, whole = doc["limits"]
    assert (half["skip"], half["layers_skipped"], whole["skip"], whole["layers_skipped"]) == (0.5, 8, 1.0, 16)
    knee = {d["skip"]: d["loads"]["knee"]["e2e_mean"] for d in doc["limits"]}
    assert -28 < knee[0.5] < -22 and knee[1.0] < -36.8  # more skipped, more to give
    (parts,) = doc["parts"]  # the sweep served always-route at d = 0.5 only
    assert parts["arm"] == "random-r1-d0.5-always"
    text = capsys.readouterr().out
    assert "| random-r1-d0.5-always (s = 0.5) | 8 of 32 | 0.95 Q* | -25.9% |" in text
    assert "| -36.8 ± 2.0 | -39.4 ± 0.2 |" in text
    assert "the adapter's read at 4800 GB/s" in text
    assert "| prefill at the limit | -17.9% | -25.8% | -30.3% |" in text
    assert "knee: the paper's -36.8% lies within the limit of s = 1; s = 0.5 -25.9%, s = 1 -43.3%" in text
    assert skip_limits.main([str(H200 / "lease-4"), "--sweep", str(H200 / "host-lean-sweep"), "--d", "0.5",
                             "--bandwidth-gbps", "1e12"]) == 0  # (bandwidth without end: the adapter is free)
    assert "lies within the limit of none of these skips; s = 0.5 -26.2%" in capsys.readouterr().out


def test_skip_limits_refuses_a_bad_d_and_a_folder_without_the_stages_results(tmp_path, capsys):
    for bad in ("0", "1.5", "half", ""):
        with pytest.raises(SystemExit):
            skip_limits.main([str(H200 / "lease-4"), "--d", bad])
        assert "--d" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        skip_limits.main([str(H200 / "lease-4"), "--bandwidth-gbps", "0"])
    assert "--bandwidth-gbps must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        skip_limits.main([str(tmp_path)])
    assert "ladder.json: not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        skip_limits.main([str(H200 / "lease-4")])  # lease-4 took its sweep from host-lean-sweep
    assert "sweep.json: not found" in capsys.readouterr().err


def test_the_plans_running_cap_is_read_from_its_sglang_flags():
    from benchmarks.gpu import headline

    assert headline.max_running(["--max-running-requests", "128", "--enable-metrics"]) == 128
    assert headline.max_running(["--enable-metrics"]) is None and headline.max_running([]) is None
