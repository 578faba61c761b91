"""`python -m vskipper.mixed.compile_check`: every Triton kernel (the cohort execution's, the fused routes', the fused
gate's and the stand-in ops') compiled ahead of time to a cubin for a Hopper and an Ampere part with 99 KiB of shared memory, at
the launch configurations a server uses there, with Triton's own compiler and ptxas (no GPU: what runs on the
device itself, registers and speed, is measured there)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import triton
from triton.runtime.interpreter import InterpretedFunction

from tests.sglang_world import ROOT
from vskipper.mixed import compile_check, kernels, norms, router, routes
from vskipper.mixed.tiles import Tile, tile_table_for
from vskipper.roofline import lookup_device

pytestmark = pytest.mark.server  # a heavy process: about 30 s of compiling


def test_every_kernel_compiles_for_hopper_and_a_99_kib_ampere_part_within_its_shared_memory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compiled here, not found in a cache
    out = tmp_path / "compiled.json"
    res = subprocess.run([sys.executable, "-m", "vskipper.mixed.compile_check", "--device", "H100-SXM",
                          "--device", "RTX-A6000", "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    reports = json.loads(out.read_text())
    # this process runs them in the interpreter (conftest.py), the check's as JIT functions; `_` marks a helper
    # the kernels inline
    jitted = {name for module in (kernels, norms, routes, router) for name, obj in inspect.getmembers(module)
              if isinstance(obj, (triton.runtime.JITFunction, InterpretedFunction)) and not name.startswith("_")
              and obj.fn.__module__ == module.__name__}
    for report, limit in zip(reports, (227 * 1024, 99 * 1024), strict=True):
        assert report["failed"] == []
        assert {r["kernel"] for r in report["launches"]} == jitted  # every kernel of the modules, none missed
        assert all(r["shared"] <= limit for r in report["launches"])
        # ptxas's own report of each launch (a spill is reported, not refused: the tuner times what it costs)
        assert all(0 < r["registers"] <= 255 and r["spill_bytes"] >= 0 for r in report["launches"])
    # every tile of each device's table is compiled (the H100's measured one, the 99 KiB part's default), no other
    for report, device in zip(reports, ("H100-SXM", "RTX-A6000"), strict=True):
        table = tile_table_for(device)
        tiles = {(t.block_m, t.block_n, t.block_k, t.num_warps, t.num_stages)
                 for entries in table.entries.values() for _lo, _hi, t in entries}
        compiled = {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], r["num_warps"], r["num_stages"])
                    for r in report["launches"] for c in [dict(r["constexprs"])] if "BLOCK_K" in c}
        assert compiled == tiles
    for r in reports[0]["launches"]:
        if "BLOCK_K" in dict(r["constexprs"]):  # the tile tables' shared-memory estimate bounds what compiled
            blocks = dict(r["constexprs"])
            op = "mlp_gate_up" if r["kernel"].endswith("gate_up_kernel") else "mlp_down"
            tile = Tile(blocks["BLOCK_M"], blocks["BLOCK_N"], blocks["BLOCK_K"], r["num_warps"], r["num_stages"])
            assert r["shared"] <= tile.shared_mem_bytes(op), r["launch"]


def test_launches_are_specialized_as_the_jit_specializes_the_served_arguments():
    """Unit strides folded into constants, 16-byte aligned pointers and multiples of 16 marked divisible, the
    req_to_token stride (the context length plus 4) not: what Triton's JIT compiles at the server's launch, which
    decides the vectorized loads, the pipelined shared memory and the registers."""
    launches = compile_check.launches_for(lookup_device("H100-SXM"))
    gemm = next(x for x in launches if x.kernel == "cohort_gemm_kernel")
    assert dict(gemm.specialized) == {"stride_xk": 1, "stride_wk": 1, "stride_on": 1}
    assert {"x_ptr", "w_ptr", "out_ptr", "N", "K", "stride_xm", "stride_wn", "stride_om"} <= set(gemm.divisible)
    # the projector's count is the second of the builder's two (8 bytes in): the one pointer left unaligned
    gate_ups = [x for x in launches if x.kernel == "cohort_gate_up_kernel"]
    assert {x.label().endswith("; unaligned count_ptr)") for x in gate_ups} == {True, False}
    down = next(x for x in launches if x.kernel == "cohort_down_scatter_kernel")
    assert dict(down.specialized) == {"stride_an": 1, "stride_wn": 1, "stride_yd": 1}
    prefill = next(x for x in launches if x.kernel == "packed_prefill_kernel")
    assert dict(prefill.signature)["read_ptr"] == "*u1" and "stride_r2t" not in prefill.divisible
    assert {"stride_ks", "stride_kh", "stride_qm"} <= set(prefill.divisible)
    # a pass's row count is not specialized (`do_not_specialize`): one kernel for every count
    maps = next(x for x in launches if x.kernel == "cohort_maps_kernel")
    assert dict(maps.signature)["rows"] == "i32" and not maps.divisible
    assert "slots_total" not in prefill.divisible


def test_one_compiled_cohort_maps_variant_serves_every_pass_size():
    """The maps' launch specializes as Triton's JIT would the same for a decode batch of 1 to 256 rows and a
    prefill pass of thousands (its block and warps fixed, its row count not specialized): what compiles while the
    server captures its decode graphs serves every prefill pass, where a block sized by the pass compiled a variant
    per power of two while serving (four on the H200, 1.3-1.7 s each)."""
    for dense in (False, True):
        launches = {compile_check.cohort_maps_launch(rows, dense)
                    for rows in (1, 7, 16, 256, 1000, 1024, 1536, 2500, 4096, 8192, 16384)}
        assert len(launches) == 1, sorted(x.label() for x in launches)
        # nor by a stride or a pointer's alignment: a skipper's route is a row of a [layers, rows] tensor
        (launch,) = launches
        assert launch.specialized == () and launch.divisible == ()


def test_a_table_that_splits_k_is_compiled_split_with_its_reduce_and_grouped_at_the_same_blocks(tmp_path):
    """A tile that splits K compiles its GEMM split (SPLIT_K) and the reduce at that split in every served form, the
    projector's at its unaligned count; the MLP's split down tile also in the grouped down launch, split as it."""
    from vskipper.mixed.tiles import COUNT_RANGES, OPERATIONS

    tile = {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3}
    split = {"block_m": 32, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4, "split_k": 8}
    path = tmp_path / "split.json"
    path.write_text(json.dumps({"device": "H100-SXM", "dtype": "bfloat16", "tiles": {
        op: [{"rows": [lo, hi], **(split if op == "mlp_down" and lo == 17 else tile)} for lo, hi in COUNT_RANGES]
        for op in OPERATIONS}}))
    launches = compile_check.launches_for(lookup_device("H100-SXM"), path)
    blocks = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128}
    downs = [x for x in launches if x.kernel == "cohort_down_scatter_kernel"
             and dict(x.constexprs).items() >= {**blocks, "SPLIT_K": 8}.items()]
    assert len(downs) == 2  # the FFN down stored and added
    assert any(x.kernel == "grouped_down_scatter_kernel"
               and dict(x.constexprs).items() >= {**blocks, "SPLIT_K": 8}.items() for x in launches)
    reduces = [x for x in launches if x.kernel == "split_k_reduce_kernel"]
    assert {dict(x.constexprs)["SPLIT_K"] for x in reduces} == {2, 4, 8}  # the table's split and the tuner's seeds
    assert {x.label().endswith("; unaligned count_ptr)") for x in reduces} == {True, False}


def test_a_launch_naming_other_arguments_than_its_kernels_is_refused():
    with pytest.raises(ValueError, match="cohort_maps_kernel: the launch names"):
        compile_check._launch("cohort_maps_kernel", {"rows": 8}, {"BLOCK": 8}, 4, 3)


def test_every_kernel_compiles_for_hopper_with_the_device_images_triton(tmp_path):
    """The GPU machines JIT-compile the kernels with the triton their image holds (`device-packages.txt` pins it),
    not the one installed here: that version, installed beside this environment (its wheel carries its own
    compiler and ptxas), compiles every launch for the H100."""
    from benchmarks.gpu.bundle import device_pins

    version = device_pins()["triton"]
    assert version, "device-packages.txt pins the device image's triton"
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                          f"triton=={version}"], capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    out = tmp_path / "compiled.json"
    res = subprocess.run([sys.executable, "-m", "vskipper.mixed.compile_check", "--device", "H100-SXM", "--json",
                          str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    (report,) = json.loads(out.read_text())
    assert report["triton"] == version and report["failed"] == []  # compiled by the device's version, not this one
    assert all(r["shared"] <= 227 * 1024 and 0 < r["registers"] <= 255 for r in report["launches"])


def test_the_check_refuses_the_interpreter_naming_it():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "vskipper.mixed.compile_check"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "TRITON_INTERPRET=1" in res.stderr


def test_a_table_measured_on_the_device_is_compiled_as_a_server_would_be_handed_it(tmp_path):
    """`--tile-table`: the GEMM tiles and the packed read's launch of a table `vskipper tune-tiles` wrote (what
    `vskipper serve --tile-table` serves), for the one device it names."""
    from vskipper.mixed.tiles import COUNT_RANGES, OPERATIONS

    tile = {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3}
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"device": "H100-SXM", "dtype": "bfloat16",
                                "tiles": {op: [{"rows": [lo, hi], **tile} for lo, hi in COUNT_RANGES]
                                          for op in OPERATIONS},
                                "prefill_read": {"block_rows": 128, "block_n": 32, "num_warps": 8, "num_stages": 3}}))
    launches = compile_check.launches_for(lookup_device("H100-SXM"), path)
    gemms = {(dict(x.constexprs)["BLOCK_M"], x.num_warps, x.num_stages) for x in launches
             if "BLOCK_K" in dict(x.constexprs)}
    assert gemms == {(64, 4, 3)}
    read = next(x for x in launches if x.kernel == "packed_prefill_kernel")
    assert (dict(read.constexprs)["BLOCK_M"], dict(read.constexprs)["BLOCK_N"], read.num_warps, read.num_stages) == \
        (128 // 4, 32, 8, 3)  # four query heads a KV head: 32 slots of 4 heads a program
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "vskipper.mixed.compile_check", "--tile-table", str(path)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "pass exactly one --device" in res.stderr
    res = subprocess.run([sys.executable, "-m", "vskipper.mixed.compile_check", "--device", "H200", "--tile-table",
                          str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "field 'device' is 'H100-SXM', but this GPU is H200" in res.stderr
