"""The tuner weighs the packed prefill read against SGLang's own read of every row (`vskipper.sglang.backend_read`):
SGLang's real Triton extend kernel, run here on the Triton interpreter, reads a prompt as SDPA's causal read does,
and the tuner times a backend's read only once its output matches that (a read of the wrong rows is refused, a
kernel that fails is left out, each logged). (No GPU here: no time is a measurement; the device run's tiles stage
times it on the GPU.)"""

import json
import os
import subprocess
import sys

import pytest
import torch

from vskipper.mixed.tuner import CHECK_RTOL, BackendRead, read_calls, time_backend_read
from vskipper.sglang.backend_read import BACKEND_READS, TRITON

pytest.importorskip("sglang")


def prompt(tokens=48, heads=4, kv_heads=2, head_dim=16):
    return read_calls(tokens, heads, kv_heads, head_dim, torch.Generator().manual_seed(3), torch.device("cpu"),
                      torch.float32)


def test_sglangs_extend_kernel_reads_a_fresh_prompt_as_sdpas_causal_read_does():
    causal, _, _, (q, k, v, scale), _ = prompt()
    out = BACKEND_READS[TRITON].build(q, k, v, scale)()
    want = causal()[0].transpose(0, 1)
    assert out.shape == want.shape == q.shape
    assert (out - want).abs().max() < 1e-4


def test_the_backends_read_is_timed_only_where_it_matches_sdpas():
    causal, _, _, args, _ = prompt()
    lines: list[str] = []
    entry = time_backend_read(BACKEND_READS[TRITON], causal, args, interpret=True, log=lines.append)
    assert entry["backend"] == TRITON and entry["backend_all_rows_ms"] > 0 and lines == []

    def no_mask(q, k, v, scale):  # every row reads every key: not the causal read a prefill layer takes
        kk, vv = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1).transpose(0, 1) for t in (k, v))
        return lambda: torch.softmax(q.transpose(0, 1) @ kk.transpose(1, 2) * scale, -1).matmul(vv).transpose(0, 1)

    assert time_backend_read(BackendRead(TRITON, no_mask), causal, args, interpret=True, log=lines.append) == {}
    assert lines[-1].startswith("prefill_read: the triton backend's read not timed: its output strays ")
    assert lines[-1].endswith(f"from SDPA's causal read of the same prompt (at most "
                              f"{CHECK_RTOL * float(causal()[0].abs().max()):.3g})")

    def broken(q, k, v, scale):
        raise ImportError("no module named 'sglang.kernels'")

    assert time_backend_read(BackendRead(TRITON, broken), causal, args, interpret=True, log=lines.append) == {}
    assert lines[-1] == ("prefill_read: the triton backend's read not timed (ImportError: no module named "
                         "'sglang.kernels')")


def test_tune_tiles_times_by_default_the_backend_the_device_runs_serve_with():
    """`vskipper tune-tiles --attention-backend` offers each read this module can time (or none), and its default
    is the backend the GPU stand-in profile serves with, so the device run's tiles stage times the read its servers
    would fall back to."""
    from vskipper.cli import build_parser
    from vskipper.sglang.spec import GPU_STAND_IN_FLAGS

    action = next(a for a in build_parser()._subparsers._group_actions[0].choices["tune-tiles"]._actions
                  if a.dest == "attention_backend")
    assert set(action.choices) == {*BACKEND_READS, "none"}
    assert action.default == GPU_STAND_IN_FLAGS[GPU_STAND_IN_FLAGS.index("--attention-backend") + 1] == TRITON


def test_a_server_weighs_the_packed_read_against_the_prefill_backend_sglang_was_configured_with():
    """`served_prefill_backend` reads SGLang's published configuration as a server's model sees it at build time:
    `--prefill-attention-backend` over `--attention-backend`, None where neither was named (SGLang picks one as it
    builds: the table's SDPA time then stands in) or nothing is published. (A process of its own: SGLang's context
    is one per process.)"""
    import subprocess
    import sys

    code = """
from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
from sglang.srt.server_args import ServerArgs

from vskipper.sglang.models.routed import served_prefill_backend

print(served_prefill_backend())
for extra in ({}, {"attention_backend": "triton"},
              {"attention_backend": "triton", "prefill_attention_backend": "torch_native"}):
    reset_context()
    publish(ServerArgs(model_path="dummy", device="cpu", **extra), role="test", ranks=SpawnRanks(world_rank=0))
    print(served_prefill_backend())
"""
    # SGLang's settings of this process's other tests (the CPU engine's, which a bare process cannot import) stay out
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["None", "None", "triton", "torch_native"]


def test_the_interpreter_smoke_run_of_tune_tiles_times_sglangs_read_by_default(cli_env, tmp_path):
    """`vskipper tune-tiles` (its default `--attention-backend triton`) writes SGLang's read of every row beside
    SDPA's into the table's `prefill_read`; `none` leaves it out (the table then weighs the packed read against
    SDPA's alone, and says so)."""
    from vskipper.mixed.tiles import load_tile_table

    tables = {}
    for backend in ("triton", "none"):
        out = tmp_path / f"{backend}.json"
        res = subprocess.run([sys.executable, "-m", "vskipper.cli", "tune-tiles", "--interpret", "--device",
                              "RTX-A6000", "--out", str(out), "--attention-backend", backend], env=cli_env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        tables[backend] = load_tile_table(out)
    timed = tables["triton"].read_timing
    assert timed.backend == TRITON and timed.backend_ms > 0
    assert json.loads((tmp_path / "triton.json").read_text())["prefill_read"]["backend"] == TRITON
    assert tables["none"].read_timing.backend is None
    assert any(line.startswith("the attention backend's own prefill read") for line in tables["none"].lacks())
