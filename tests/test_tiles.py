"""Per-device tile tables: validation against the device's shared memory, the documented defaults, lookup."""

import hashlib
import json
import shutil

import pytest

from vskipper.mixed.tiles import (
    COUNT_RANGES,
    DEFAULT_READ_TILE,
    OPERATIONS,
    PAIR_FIELD,
    PREFILL_FROM,
    PREFILL_RANGES,
    READ_FIELD,
    ReadTile,
    Tile,
    TileTableError,
    Timing,
    default_tile_table,
    load_tile_table,
    parse_tile_table,
    tile_table_for,
)
from vskipper.roofline import DEVICES, lookup_device


def table(tile: dict, device="RTX-A6000") -> dict:
    return {"device": device, "dtype": "bfloat16",
            "tiles": {op: [{"rows": [lo, hi], **tile} for lo, hi in COUNT_RANGES] for op in OPERATIONS}}


def test_loader_rejects_tiles_over_the_devices_shared_memory_with_a_clear_message(tmp_path):
    big = {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 4}
    path = tmp_path / "a6000.json"
    path.write_text(json.dumps(table(big)))
    need = Tile(128, 128, 64, 8, 4).shared_mem_bytes("mlp_gate_up")
    limit = lookup_device("RTX-A6000").shared_mem_per_block
    with pytest.raises(TileTableError) as err:
        load_tile_table(path)
    msg = str(err.value)
    assert "tiles.mlp_gate_up[0]" in msg and f"needs {need} bytes" in msg and f"{limit} bytes per block" in msg
    # the same tile fits a 227 KiB part
    assert load_tile_table(path, lookup_device("H200")).lookup("mlp_down", 300).block_m == 128


@pytest.mark.parametrize("device", DEVICES, ids=lambda d: d.name)
def test_default_table_fits_every_catalogued_device_and_covers_all_thirty_shapes(device):
    t = default_tile_table(device.shared_mem_per_block, device.name)
    for op in OPERATIONS:
        for lo, hi in COUNT_RANGES:
            for rows in {lo, hi or 4096}:
                tile = t.lookup(op, rows)
                assert tile.shared_mem_bytes(op) <= device.shared_mem_per_block
    assert t.lookup("mlp_gate_up", 1).block_m == 16 and t.lookup("mlp_gate_up", 1024).block_m == 128


def test_smaller_shared_memory_gets_fewer_pipeline_stages():
    big, small = default_tile_table(227 * 1024), default_tile_table(99 * 1024)
    assert big.lookup("mlp_gate_up", 64).num_stages > small.lookup("mlp_gate_up", 64).num_stages
    tiny = default_tile_table(24 * 1024)  # forced down until it fits
    assert all(tiny.lookup(op, 512).shared_mem_bytes(op) <= 24 * 1024 for op in OPERATIONS)


def test_unmeasured_devices_fall_back_to_the_default_and_unknown_ones_need_a_limit():
    t = tile_table_for("NVIDIA-L40S")
    assert t.source.startswith("default") and t.device == "L40S"
    assert tile_table_for("Some Future GPU", 227 * 1024).device == "Some Future GPU"
    with pytest.raises(TileTableError, match="not catalogued"):
        tile_table_for("Some Future GPU")


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d["tiles"].pop("proj_down"), "'tiles.proj_down' is missing"),
    (lambda d: d["tiles"]["mlp_down"][1]["rows"].__setitem__(0, 18), "expected 17"),
    (lambda d: d["tiles"]["mlp_down"][-1]["rows"].__setitem__(1, 4096), "open-ended"),
    (lambda d: d["tiles"]["mlp_gate_up"][0].__setitem__("block_k", 48), "block_k must be a power of two"),
    (lambda d: d["tiles"].__setitem__("attention", []), "unknown operation"),
    (lambda d: d.__setitem__("dtype", "int8"), "field 'dtype'"),
    (lambda d: d.__setitem__("prefill_read", [64, 64]), "prefill_read: expected an object"),
    (lambda d: d.__setitem__("prefill_read", {"block_rows": 48, "block_n": 64}),
     r"prefill_read: block_rows must be a power of two in 16..256"),
    (lambda d: d.__setitem__("prefill_read", {"block_rows": 64, "block_n": 512}),
     r"prefill_read: block_n must be a power of two in 16..256, got 512"),
    (lambda d: d.__setitem__("prefill_read", {"block_rows": 64, "block_n": 64, "num_stages": 0}),
     "prefill_read: num_stages must be an integer in 1..8"),
    (lambda d: d["tiles"]["attn_q"][2].update(kernel_ms=0.1, torch_ms=-1),
     r"tiles.attn_q\[2\]: field 'torch_ms' must be a positive number of milliseconds, got -1"),
    (lambda d: d["tiles"]["attn_o"][0].update(kernel_half_ms=0.1),
     r"tiles.attn_o\[0\]: fields 'kernel_ms' and 'torch_ms' go together \(got only \['kernel_half_ms'\]\)"),
    (lambda d: d.__setitem__("ffn_pair", {}), "ffn_pair: expected a list"),
    (lambda d: d.__setitem__("ffn_pair", pair_entries()[:3]), "ffn_pair: must end with an open-ended range"),
    (lambda d: d.__setitem__("ffn_pair", pair_entries()[1:]), r"ffn_pair\[0\]: field 'rows' must be \[1, last\]"),
    (lambda d: d.__setitem__("ffn_pair", [*pair_entries()[:-1], {"rows": [2049, None], "grouped_ms": 1.0}]),
     r"ffn_pair\[7\]: fields 'grouped_ms' and 'apart_ms' go together"),
    (lambda d: d.__setitem__("ffn_pair", [{"rows": [1, None], "grouped_ms": 0, "apart_ms": 1.0}]),
     r"ffn_pair\[0\]: field 'grouped_ms' must be a positive number of milliseconds, got 0"),
    (lambda d: d.__setitem__("ffn_pair", [{"rows": [1, None], "grouped_error": "x", "grouped_ms": 1.0}]),
     r"ffn_pair\[0\]: field 'grouped_error' must be a non-empty string, without 'grouped_ms'"),
    (lambda d: d["tiles"]["mlp_down"][1].update(split_k=3),
     r"tiles.mlp_down\[1\]: split_k must be a power of two in 1..16, got 3"),
    (lambda d: d["tiles"]["mlp_gate_up"][0].update(split_k=2),
     r"tiles.mlp_gate_up\[0\]: field 'split_k' is 2, but the gate-up kernels never split K"),
    (lambda d: d["tiles"]["attn_q"][5].update(split_k=2),
     r"tiles.attn_q\[5\]: field 'split_k' is 2 in a range that serves prefill passes \(rows 513..1024: from 513 "),
    (lambda d: d["tiles"].__setitem__("attn_o", [*d["tiles"]["attn_o"][:4], {**d["tiles"]["attn_o"][4], "split_k": 4,
                                                                             "rows": [129, None]}]),
     r"tiles.attn_o\[4\]: field 'split_k' is 4 in a range that serves prefill passes \(rows 129..: from 513 "),
])
def test_malformed_tables_are_refused_naming_the_field(mutate, message):
    data = table({"block_m": 16, "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2})
    mutate(data)
    with pytest.raises(TileTableError, match=message):
        parse_tile_table(data, 99 * 1024)


def test_a_table_measured_before_the_attention_cohort_gemms_takes_their_default_tiles_and_says_so():
    data = table({"block_m": 16, "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2})
    data["source"] = "measured"
    for op in ("attn_q", "attn_o"):
        data["tiles"].pop(op)
    t = parse_tile_table(data, 227 * 1024)
    default = default_tile_table(227 * 1024)
    assert t.entries["attn_q"] == default.entries["attn_q"] and t.entries["attn_o"] == default.entries["attn_o"]
    assert t.lookup("mlp_down", 8) == Tile(16, 32, 32, 4, 2)  # the measured operations keep their tiles
    assert t.source == "measured; attn_q, attn_o: default tiles (not in the table)"
    assert list(t.entries) == list(OPERATIONS)
    data["tiles"]["attn_q"] = table({"block_m": 16, "block_n": 32, "block_k": 32})["tiles"]["attn_q"]
    with pytest.raises(TileTableError, match=r"'tiles.attn_o' is missing \(a table with any of"):
        parse_tile_table(data, 227 * 1024)  # half a tuning run is refused, not completed with defaults


def test_the_shipped_h100_table_loads_with_the_attention_tiles_defaulted():
    t = tile_table_for("NVIDIA H100 80GB HBM3")
    assert t.device == "H100-SXM" and t.source.startswith("vskipper tune-tiles")
    assert t.source.endswith("attn_q, attn_o: default tiles (not in the table)")
    assert t.lookup("attn_q", 16).shared_mem_bytes("attn_q") <= lookup_device("H100-SXM").shared_mem_per_block


def pair_entries(apart_faster: tuple[int, ...] = ()) -> list[dict]:
    """`ffn_pair` over the count ranges, timed: the two FFNs faster apart at the ranges numbered `apart_faster`."""
    return [{"rows": [lo, hi], "grouped_ms": 2.0 if n in apart_faster else 1.0, "apart_ms": 1.5}
            for n, (lo, hi) in enumerate(COUNT_RANGES)]


def test_the_ffn_pair_launches_grouped_unless_the_table_measured_it_faster_apart():
    data = table({"block_m": 16, "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2})
    assert all(parse_tile_table(data, 99 * 1024).groups_ffn(rows) for rows in (1, 64, 4096))  # not timed: grouped
    data["ffn_pair"] = pair_entries(apart_faster=(1, 5))  # 17-32 and a prefill of 513-1,024 tokens
    del data["ffn_pair"][2]["grouped_ms"], data["ffn_pair"][2]["apart_ms"]  # a range not timed
    data["ffn_pair"][3] = {"rows": [65, 128], "grouped_error": "OutOfResources: shared memory", "apart_ms": 1.0}
    t = parse_tile_table(data, 99 * 1024)
    assert [t.groups_ffn(rows) for rows in (16, 17, 32, 33, 64, 65, 128, 129, 512, 513, 1024, 1025, 8192)] == [
        True, False, False, True, True, False, False, True, True, False, False, True, True]
    assert t.apart_ranges() == [[17, 32], [65, 128], [513, 1024]]
    again = parse_tile_table(json.loads(json.dumps(t.as_dict())), 99 * 1024)
    assert again.ffn_pair == t.ffn_pair


def test_table_round_trips_through_its_json_form():
    t = default_tile_table(163 * 1024, "A100-SXM4-80GB")
    again = parse_tile_table(json.loads(json.dumps(t.as_dict())), 163 * 1024)
    assert again.entries == t.entries


def test_a_split_tile_serves_split_where_its_gemm_is_not_gathered_nor_grouped_and_old_tables_never_split():
    """`split_at` / `split_ranges` (attested as `split_k`): Q and o_proj split where their tile says, except where
    they serve gathered (below the ridge, where torch beat the tile); the FFNs' down GEMMs each as its own tile
    says where the two FFNs launch apart, both as the MLP's down tile says where they launch grouped (one launch at
    its tile). The shipped tables were tuned before split K: every tile unsplit, `split_k_tried` False, and
    written out again they still say so."""
    data = table({"block_m": 16, "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2, "split_k": 1},
                 device="H200")
    for op in ("attn_q", "attn_o", "mlp_down", "proj_down"):
        for n in range(5):  # every decode range
            data["tiles"][op][n]["split_k"] = 8 if op == "proj_down" else 2 if n < 4 else 4
    data["tiles"]["attn_o"][4].update(kernel_ms=1.0, kernel_half_ms=0.8, torch_ms=0.5)  # torch wins at 129..512
    data[PAIR_FIELD] = [{"rows": [lo, hi], "grouped_ms": 1.0, "apart_ms": 2.0 if lo == 1 else 0.5}
                        for lo, hi in COUNT_RANGES]  # grouped faster at 1..16 alone
    t = parse_tile_table(data, 227 * 1024)
    ridge = int(lookup_device("H200").ridge_rows)
    assert t.split_ranges() == {"mlp_down": [[1, 128, 2], [129, 512, 4]], "proj_down": [[1, 16, 2], [17, 512, 8]],
                                "attn_q": [[1, 128, 2], [129, 512, 4]], "attn_o": [[1, 128, 2], [ridge + 1, 512, 4]]}
    assert t.split_at("proj_down", 16) == 2 and t.lookup("proj_down", 16).split_k == 8  # grouped: the MLP's
    again = parse_tile_table(json.loads(json.dumps(t.as_dict())), 227 * 1024)
    assert again.split_ranges() == t.split_ranges() and again.split_k_tried
    for device in ("H200", "H100-SXM"):
        shipped = tile_table_for(device)
        assert not shipped.split_k_tried and shipped.split_ranges() == {}
        assert any(line.startswith("split-K tiles") for line in shipped.lacks())
        rewritten = parse_tile_table(json.loads(json.dumps(shipped.as_dict())), 227 * 1024)
        assert not rewritten.split_k_tried


def test_a_given_table_serves_the_gpu_it_names_and_its_source_names_the_file(tmp_path):
    """`vskipper serve --tile-table`: a table measured on this GPU replaces the shipped one; one measured on
    another GPU, a missing file or an uncatalogued GPU is refused, naming the field or the file."""
    tile = {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3}
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({**table(tile, device="H100-SXM"), "source": "vskipper tune-tiles: here"}))
    given = tile_table_for("NVIDIA H100 80GB HBM3", path=path)
    assert given.lookup("mlp_gate_up", 4096) == Tile(64, 64, 64, 4, 3)
    # named by file name and content, alike wherever the run's folder lies (the arms' attestations are compared)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    assert given.source == f"vskipper tune-tiles: here (tuned.json, sha256 {digest})"
    (tmp_path / "moved").mkdir()
    moved = shutil.copy(path, tmp_path / "moved" / "tuned.json")
    assert tile_table_for("NVIDIA H100 80GB HBM3", path=moved).source == given.source
    assert tile_table_for("NVIDIA H100 80GB HBM3").lookup("mlp_gate_up", 4096) == Tile(128, 64, 32, 8, 4)  # shipped
    with pytest.raises(TileTableError, match=r"field 'device' is 'H100-SXM', but this GPU is H200"):
        tile_table_for("NVIDIA H200", path=path)
    with pytest.raises(TileTableError, match="missing.json: no tile table can be read there"):
        tile_table_for("NVIDIA H100 80GB HBM3", path=tmp_path / "missing.json")
    with pytest.raises(TileTableError, match="'Some Future GPU' is not catalogued"):
        tile_table_for("Some Future GPU", 227 * 1024, path=path)


def test_the_packed_reads_tile_is_the_tables_when_measured_and_the_kernels_default_otherwise():
    data = table({"block_m": 16, "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}, device="H100-SXM")
    assert parse_tile_table(data, 227 * 1024).read is None
    assert parse_tile_table(data, 227 * 1024).read_tile == DEFAULT_READ_TILE
    assert tile_table_for("NVIDIA H100 80GB HBM3").read_tile == DEFAULT_READ_TILE  # shipped before the read was tuned
    data["prefill_read"] = {"block_rows": 128, "block_n": 32, "num_warps": 8, "num_stages": 3, "kernel_ms": 0.5}
    measured = parse_tile_table(data, 227 * 1024)
    assert measured.read == measured.read_tile == ReadTile(128, 32, 8, 3)
    again = parse_tile_table(json.loads(json.dumps(measured.as_dict())), 227 * 1024)
    assert again.read == measured.read and again.entries == measured.entries


def test_a_table_file_that_is_not_a_json_object_is_refused_naming_the_file(tmp_path):
    for name, content in (("list.json", b"[1, 2]"), ("binary.json", b"\xff\xfe\x00")):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(TileTableError, match=name):
            load_tile_table(path)


def timed(data: dict, op: str, n: int, kernel: float, torch_ms: float, half: float | None = None) -> None:
    data["tiles"][op][n].update(kernel_ms=kernel, torch_ms=torch_ms, ratio_vs_torch=round(kernel / torch_ms, 3),
                                **({} if half is None else {"kernel_half_ms": half}))


def test_an_operation_serves_gathered_where_torch_beat_its_tile_at_full_and_half_count_below_the_ridge():
    """`TileTable.gathers`: the measured torch form replaces the tile only where it was faster at the full count
    and at half of it (a table without the half-count timing keeps its tiles), and only while the capacity is at
    or below the device's ridge rows (H200: 989 TFLOP/s over 4.8 TB/s, 206 rows); a table without timings never
    gathers."""
    data = table({"block_m": 16, "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}, device="H200")
    assert not parse_tile_table(data, 227 * 1024).gathers("mlp_down", 100)  # no timings: the tiles serve
    timed(data, "mlp_down", 3, kernel=0.12, torch_ms=0.06, half=0.1)  # 65-128: torch faster at both counts
    timed(data, "mlp_gate_up", 3, kernel=0.12, torch_ms=0.06)  # no half-count timing (an older table): the tile
    timed(data, "attn_q", 3, kernel=0.03, torch_ms=0.02, half=0.015)  # torch loses once half the rows skip
    timed(data, "attn_o", 4, kernel=0.05, torch_ms=0.04, half=0.045)  # 129-512: torch faster at both counts
    timed(data, "mlp_gate_up", 5, kernel=0.9, torch_ms=0.7, half=0.8)  # prefill: torch faster, above the ridge
    timed(data, "proj_down", 3, kernel=0.01, torch_ms=0.02)  # the tile faster
    t = parse_tile_table(data, 227 * 1024)
    assert t.timing("mlp_down", 100) == Timing(0.12, 0.06, 0.1) and t.timing("mlp_down", 10) is None
    assert not t.gathers("mlp_gate_up", 100)
    ridge = int(lookup_device("H200").ridge_rows)
    assert ridge == 206
    assert t.gathers("mlp_down", 65) and t.gathers("mlp_down", 128) and not t.gathers("mlp_down", 129)
    assert not t.gathers("attn_q", 128)
    assert t.gathers("attn_o", 129) and t.gathers("attn_o", ridge) and not t.gathers("attn_o", ridge + 1)
    assert not t.gathers("mlp_gate_up", 2048) and not t.gathers("proj_down", 100)
    assert t.gathered_ranges() == {"mlp_down": [[65, 128]], "attn_o": [[129, ridge]]}
    again = parse_tile_table(json.loads(json.dumps(t.as_dict())), 227 * 1024)
    assert again.timings == t.timings and again.gathered_ranges() == t.gathered_ranges()
    data["device"] = "Some Future GPU"  # no ridge to hold the capacity against: the tiles serve
    assert parse_tile_table(data, 227 * 1024).gathered_ranges() == {}


def test_the_shipped_tables_tuned_before_the_half_count_timing_keep_their_tiles():
    """The H200 and H100 tables were tuned against an unmasked torch reference timed eagerly, with no half-count
    timing: they never gather (a retuned table decides)."""
    for product in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        t = tile_table_for(product)
        assert t.timing("mlp_down", 128) is not None and t.gathered_ranges() == {}, product


def test_the_prefill_read_is_the_backends_where_the_table_measured_the_packed_read_no_faster_than_its_read():
    """`TileTable.prefill_read`: the packed read of the RUN rows serves unless the tuner timed it (over half a
    prompt's rows) at or above the read that would replace it: the server's attention backend reading every row,
    where the table timed that backend, else SDPA's causal read of every row standing in (the shipped H200 table
    has SDPA's alone: 0.138 against 0.085 ms). A table without the read's times keeps the packed read. The times
    round-trip and are validated, the backend's named with it."""
    h200 = tile_table_for("NVIDIA H200")
    sdpa = ("the table measured the packed read of half a prompt's rows at 0.13791 ms, every row's causal read by "
            "SDPA ({}) at 0.08535 ms")
    assert h200.prefill_read() == ("backend", sdpa.format("the served backend not named"))
    assert h200.prefill_read("triton") == ("backend", sdpa.format("the triton backend's own read not timed"))
    assert tile_table_for("NVIDIA H100 80GB HBM3").prefill_read("triton") == ("packed", "")  # never timed
    data = table({"block_m": 16, "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}, device="H200")
    data["prefill_read"] = {"block_rows": 64, "block_n": 64, "kernel_ms": 0.138, "causal_all_rows_ms": 0.085,
                            "backend": "triton", "backend_all_rows_ms": 0.29}
    timed = parse_tile_table(data, 227 * 1024)
    # slower than SDPA, faster than the Triton extend kernel a server on that backend reads with instead
    assert timed.prefill_read("triton") == ("packed", "the table measured the packed read of half a prompt's rows "
                                            "at 0.138 ms, every row's read by the triton attention backend at 0.29 ms")
    assert timed.prefill_read("fa3")[0] == "backend" and "the fa3 backend's own read not timed" in \
        timed.prefill_read("fa3")[1]
    again = parse_tile_table(json.loads(json.dumps(timed.as_dict())), 227 * 1024)
    assert again.read_timing == timed.read_timing and again.read == timed.read
    data["prefill_read"]["backend_all_rows_ms"] = 0.1
    assert parse_tile_table(data, 227 * 1024).prefill_read("triton")[0] == "backend"
    del data["prefill_read"]["backend"]
    with pytest.raises(TileTableError, match="prefill_read: fields 'backend' .* and 'backend_all_rows_ms' go together"):
        parse_tile_table(data, 227 * 1024)
    del data["prefill_read"]["backend_all_rows_ms"]
    assert parse_tile_table(data, 227 * 1024).read_timing.backend_ms is None
    data["prefill_read"]["causal_all_rows_ms"] = 0
    with pytest.raises(TileTableError, match="prefill_read: field 'causal_all_rows_ms' must be a positive number"):
        parse_tile_table(data, 227 * 1024)


def test_a_table_says_which_of_the_tuners_measurements_it_was_tuned_without():
    """`TileTable.lacks`: a table the current tuner wrote lacks nothing; one an older tuner wrote (the shipped H200
    and H100 tables: no half-count times, no note of how each shape was timed or what chose its tile, no FFN pair)
    names each gap with what serving without it means; a table with no timings says that alone. A note the
    tuner does not write is refused, naming its field."""
    data = table({"block_m": 16, "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}, device="H200")
    assert parse_tile_table(data, 227 * 1024).lacks() == [
        "every timing: tiles neither measured against torch nor on this device's counts"]
    for op in OPERATIONS:
        for n in range(len(COUNT_RANGES)):
            timed(data, op, n, kernel=0.1, torch_ms=0.2)  # an older tuner's entry: two times and nothing else
    old = parse_tile_table(data, 227 * 1024).lacks()
    assert [line.split(":")[0] for line in old] == [
        "half-count times", "how each shape was timed", "prefill tiles chosen over the full and the half count",
        "split-K tiles", "FFN pair timings", "a packed prefill read timing"]
    for op in OPERATIONS:
        for n, (lo, _) in enumerate(COUNT_RANGES):
            prefill = lo >= PREFILL_FROM
            data["tiles"][op][n].update(kernel_half_ms=0.07, timed="eager" if prefill else "cuda graph",
                                        chosen_by="full and half live" if prefill else "full live", split_k=1)
    data[PAIR_FIELD] = [{"rows": [lo, hi], "grouped_ms": 0.1, "apart_ms": 0.2} for lo, hi in COUNT_RANGES]
    data[READ_FIELD] = {"block_rows": 64, "block_n": 64, "num_warps": 4, "num_stages": 2, "kernel_ms": 0.1,
                        "causal_all_rows_ms": 0.2}
    assert [line.split(":")[0] for line in parse_tile_table(data, 227 * 1024).lacks()] == [
        "the attention backend's own prefill read"]  # SDPA's read alone, as the tuner before the backend's timed
    data[READ_FIELD].update(backend="triton", backend_all_rows_ms=0.3)
    current = parse_tile_table(data, 227 * 1024)
    assert current.lacks() == [] and current.timing("mlp_down", 600).chosen_by == "full and half live"
    assert parse_tile_table(current.as_dict(), 227 * 1024).lacks() == []  # its notes survive a round trip
    # a table from before the prefill ranges were split by length: one tile, tuned at one length, for every prefill
    unsplit = json.loads(json.dumps(data))
    for op in OPERATIONS:
        unsplit["tiles"][op] = [*unsplit["tiles"][op][:len(COUNT_RANGES) - len(PREFILL_RANGES)],
                                {**unsplit["tiles"][op][-1], "rows": [PREFILL_FROM, None]}]
    unsplit[PAIR_FIELD] = [*data[PAIR_FIELD][:len(COUNT_RANGES) - len(PREFILL_RANGES)],
                           {"rows": [PREFILL_FROM, None], "grouped_ms": 0.1, "apart_ms": 0.2}]
    older = parse_tile_table(unsplit, 227 * 1024)
    assert [line.split(":")[0] for line in older.lacks()] == ["prefill tiles by length"]
    assert older.lookup("mlp_down", 1024) == older.lookup("mlp_down", 8192)  # and it still serves every length
    del data["tiles"]["attn_q"][1]["kernel_half_ms"]  # a decode shape whose gathered form could not be captured
    data["tiles"]["attn_q"][1]["timed"] = "eager"
    assert parse_tile_table(data, 227 * 1024).lacks() == []  # a choice the tuner made, not a gap
    data["tiles"]["attn_o"][2]["timed"] = "by hand"
    with pytest.raises(TileTableError, match=r"tiles.attn_o\[2\]: field 'timed' must be one of"):
        parse_tile_table(data, 227 * 1024)
