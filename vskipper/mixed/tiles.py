"""Per-device tile tables for the count-bounded cohort GEMMs and the packed prefill read.

A table is a JSON file per device, keyed by operation and by the captured batch size C (the static grid is
sized for C rows, so C picks the tile, never the device-side count):

  {"device": "H200", "dtype": "bfloat16", "source": "vskipper tune-tiles ...",
   "tiles": {"mlp_gate_up": [{"rows": [1, 16], "block_m": 16, "block_n": 64, "block_k": 64,
                               "num_warps": 4, "num_stages": 4, "split_k": 1, "ratio_vs_torch": 0.93}, ...],
             "mlp_down": [...], "proj_gate_up": [...], "proj_down": [...]},
   "prefill_read": {"block_rows": 64, "block_n": 64, "num_warps": 4, "num_stages": 2, "kernel_ms": ...},
   "ffn_pair": [{"rows": [1, 16], "grouped_ms": 0.021, "apart_ms": 0.034}, ...]}

`prefill_read` (optional: a table without it reads with `DEFAULT_READ_TILE`) is the packed prefill read's launch,
timed by the tuner on one prompt of 2,048 tokens with half of them RUN, beside every row's causal read by SDPA and,
where the tuner could run it, by the host engine's attention backend (`backend`, `backend_all_rows_ms`: SGLang's
Triton extend kernel, as `--attention-backend triton` serves): where the packed read of half the rows took at least
as long as the read that would replace it (the server's backend where the table timed it, else SDPA's), the triton
execution prefills through the host's attention backend instead (`TileTable.prefill_read`).

An entry's timings (`kernel_ms`, `torch_ms`, and `kernel_half_ms` in tables tuned since the half-count timing:
its tile with half the range's rows live) are kept (`Timing`): where the torch form beat the tile at the full and
at half the count (a table without the half-count timing never gathers) and the pass is memory-bound (its rows at
or below the device's ridge, `vskipper.roofline`), that operation serves in the gathered cuBLAS form
(`TileTable.gathers`, `vskipper.mixed.gathered`) instead of the tile.

`split_k` (absent: 1, as in every table tuned before the tuner split K; `lacks` names the gap) is how many ways
the tile's programs split K (`Tile`): only for the operations whose kernels split it (`SPLIT_OPERATIONS`: the
down GEMMs, Q and o_proj; a gate-up's activation needs its sums whole) and only in a decode range (a prefill
pass's grid fills the device unsplit, and its workspace would hold split_k fp32 copies of its output).

`rows` ranges must cover 1.. without gaps (the last one open: [2049, null]). The six operations are the gate-up (two
operands) and down GEMMs of the RUN cohort (the MLP) and of the Project-Only cohort (the projector), and the RUN
cohort's Q projection (`attn_q`, gathered) and o_proj (`attn_o`, scattered); with the eight count ranges of
`COUNT_RANGES` that is 48 shapes. The last three (`PREFILL_RANGES`, from 513 rows) are a prefill pass's, by its
tokens (a prefill's cohort maps hold the pass's rows): to 1,024, to 2,048, and above. A prefill grid is sized by the
pass's tokens, so no one tile fills the device at every length: at 1,024 tokens a tile of 128 x 256 rows x columns
makes 128 programs of a down GEMM on the H200's 132 SMs, and with half the rows RUN half of them run, each as long
(its routed down GEMMs took 0.96 of their all-RUN time there), where at 2,048 tokens the same tile fills the device
with half the rows. A routed layer launches its MLP and its projector together, one grid a stage
(`kernels.cohort_ffn_pair`), at the MLP's tiles (its down tile's K split included), unless
the table's `ffn_pair` (optional: a table without it groups them) measured the two launched apart faster at that
range; the projector's own tiles serve where each FFN launches alone (there, and where the table gathers one of the
four), and each down tile's split there. A table measured before the prefill ranges existed ends
at [129, null], which then serves prefill too, and one measured before they were split by length at [513, null]
(one tile for every prefill pass); both still load. Each entry may also note how it was timed (`timed`: 'cuda
graph', 'eager' or 'interpreter') and what chose its tile (`chosen_by`: 'full live', or 'full and half live' in the
prefill ranges). A table an older tuner wrote lacks some of these measurements and still loads; `TileTable.lacks`
names each gap with what serving without it means, and the serving execution attests that list (`tiles_lack`).
A table measured before the attention cohort GEMMs existed has no `attn_q` or `attn_o`: it takes their tiles from
`default_tile_table` for its shared-memory limit, and its `source` says so (a table with one of them and not the
other is refused). A table is validated against the device's shared memory per block (`vskipper.roofline.DEVICES`):
a tile whose pipelined operand buffers exceed it is refused with the operation, the range and both byte counts.

Tables ship only for devices where they were measured (`vskipper/mixed/tile_tables/<device>.json`). Any other
device gets `default_tile_table`: a conservative configuration chosen by its shared-memory limit (fewer
pipeline stages on the 99 KiB parts), checked against that limit like a measured table.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vskipper.modelspec import DTYPE_BYTES
from vskipper.roofline import Device, find_device

OPERATIONS = ("mlp_gate_up", "mlp_down", "proj_gate_up", "proj_down", "attn_q", "attn_o")
FFN_OPERATIONS = OPERATIONS[:4]  # a routed layer's two cohort FFNs: the MLP's and the projector's GEMMs
# the operations whose kernels split K (a gate-up's activation needs both sums whole: its tiles never split)
SPLIT_OPERATIONS = ("mlp_down", "proj_down", "attn_q", "attn_o")
MAX_SPLIT_K = 16
DEFAULTED_OPERATIONS = ("attn_q", "attn_o")  # a table without them takes the default's tiles
PREFILL_FROM = 513  # the count ranges from here on are a prefill pass's tokens (the decode ranges end at 512 rows)
COUNT_RANGES: tuple[tuple[int, int | None], ...] = ((1, 16), (17, 32), (33, 64), (65, 128), (129, 512),
                                                    (PREFILL_FROM, 1024), (1025, 2048), (2049, None))


def is_prefill(lo: int) -> bool:
    """A count range from `lo` rows holds a prefill pass's tokens (the tuner times it eagerly, as served, and
    chooses its tile over the full and the half count)."""
    return lo >= PREFILL_FROM


PREFILL_RANGES = tuple(r for r in COUNT_RANGES if is_prefill(r[0]))
TABLE_DIR = Path(__file__).with_name("tile_tables")
TABLE_DTYPES = ("float16", "bfloat16", "float32")  # the canonical names a table may be measured in


class TileTableError(ValueError):
    pass


@dataclass(frozen=True)
class Tile:
    """A cohort GEMM's launch: its block sizes, warps and pipeline stages, and `split_k`, the programs that share
    one output tile's K (each writes its fp32 partial sums, a second launch sums them and runs the epilogue: a grid
    of few output tiles, a decode pass's over few rows, then fills more of the device)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    split_k: int = 1

    def shared_mem_bytes(self, op: str, dtype_bytes: int = 2) -> int:
        """Shared memory of the pipelined operand tiles: the gathered rows plus one (down) or two (gate-up)
        weight tiles, per stage."""
        weights = 2 if op.endswith("gate_up") else 1
        return self.num_stages * (self.block_m * self.block_k + weights * self.block_k * self.block_n) * dtype_bytes


@dataclass(frozen=True)
class ReadTile:
    """A launch of the packed prefill read (`kernels.packed_prefill_attention`) on a GPU: `block_rows` query rows a
    program (its slots times the query heads that share a KV head, padded to a power of two), `block_n` keys a
    step, and the launch's warps and pipeline stages."""

    block_rows: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class Timing:
    """What the tuner measured for one operation at a range's representative rows: its tile with every row live
    (`kernel_ms`) and with half of them (`kernel_half_ms`; None in a table tuned before that timing), and the
    gathered cuBLAS form on the same rows (`torch_ms`), which costs the same whatever the count."""

    kernel_ms: float
    torch_ms: float
    kernel_half_ms: float | None = None
    timed: str | None = None  # how: 'cuda graph', 'eager' or 'interpreter' (None: a tuner from before the field)
    chosen_by: str | None = None  # 'full live' or 'full and half live' (None: a tuner from before the field)

    @property
    def torch_wins(self) -> bool:
        """The torch form is faster than the tile at the full count and at half of it. A table tuned before the
        half-count timing never says so: its torch side was another reference (no mask), timed eagerly, where a
        decode shape's times mostly measure the host's launches."""
        return self.kernel_half_ms is not None and self.torch_ms < min(self.kernel_ms, self.kernel_half_ms)


TIMING_FIELDS = ("kernel_ms", "torch_ms", "kernel_half_ms")
TIMED = ("cuda graph", "eager", "interpreter")  # how the tuner timed a shape (field 'timed')
CHOSEN_FULL, CHOSEN_BOTH = CHOSEN_BY = ("full live", "full and half live")  # what picked a tile (field 'chosen_by')


@dataclass(frozen=True)
class ReadTiming:
    """What the tuner measured for the packed prefill read: its best launch over the RUN half of one prompt
    (`kernel_ms`), every row's causal read of the same prompt by SDPA (`causal_ms`), and where the tuner could run
    it, by the host engine's own attention backend (`backend_ms`, the backend named `backend`, as SGLang's
    `--attention-backend` names it): the read a routed prefill layer takes instead of the packed one."""

    kernel_ms: float
    causal_ms: float
    backend_ms: float | None = None
    backend: str | None = None

    def rival(self, backend: str | None) -> tuple[float, str]:
        """The time the packed read is weighed against where a server reads through `backend` otherwise, and
        what it is: that backend's own read where the table timed it, else SDPA's causal read standing in for an
        untimed backend (which may be slower: SGLang's Triton extend kernel is)."""
        if backend is not None and backend == self.backend and self.backend_ms is not None:
            return self.backend_ms, f"every row's read by the {backend} attention backend"
        untimed = f"the {backend} backend's own read not timed" if backend else "the served backend not named"
        return self.causal_ms, f"every row's causal read by SDPA ({untimed})"


DEFAULT_READ_TILE = ReadTile(64, 64, 4, 2)  # a table without `prefill_read` (all before the read was tuned)
READ_FIELD = "prefill_read"
PAIR_FIELD = "ffn_pair"


@dataclass(frozen=True)
class PairTiming:
    """What the tuner measured for a routed layer's two cohort FFNs at a range's representative rows, half of them
    RUN, at the table's tiles: grouped, one grid a stage for both cohorts (`grouped_ms`), and each FFN launched on
    its own (`apart_ms`); or why the grouped launch did not run there (`grouped_error`: it is not served there)."""

    grouped_ms: float | None
    apart_ms: float | None
    grouped_error: str | None = None

    @property
    def grouped_wins(self) -> bool:
        return (self.grouped_error is None and self.grouped_ms is not None and self.apart_ms is not None
                and self.grouped_ms <= self.apart_ms)


@dataclass
class TileTable:
    device: str
    dtype: str
    entries: dict[str, list[tuple[int, int | None, Tile]]]
    source: str
    read: ReadTile | None = None  # the packed prefill read's tile; None: not in the table (`DEFAULT_READ_TILE`)
    # per operation, aligned with `entries`: what the tuner measured at each range (None: not timed)
    timings: dict[str, list[Timing | None]] = field(default_factory=dict)
    read_timing: ReadTiming | None = None  # the packed read against every row's causal read (None: not timed)
    # the two cohort FFNs grouped against apart, per count range (`rows` as the tiles'; a timing None: not timed)
    ffn_pair: list[tuple[int, int | None, PairTiming | None]] = field(default_factory=list)
    # whether each tile of the operations that split K says how many ways (False: a tuner from before split K)
    split_k_tried: bool = True

    def groups_ffn(self, capacity: int) -> bool:
        """Whether a routed layer's two cohort FFNs launch grouped at `capacity` slots (`kernels.cohort_ffn_pair`):
        unless the table measured them faster apart there, or the grouped launch failed there when tuned (a table
        without the timing groups them)."""
        for lo, hi, timing in self.ffn_pair:
            if capacity >= lo and (hi is None or capacity <= hi):
                return timing is None or timing.grouped_wins
        return True

    def apart_ranges(self) -> list[list[int | None]]:
        """The slot counts at which the two cohort FFNs launch apart as the table says (measured faster, or the
        grouped launch failed when tuned), as [first, last] ranges (last None: open); the attestation's record."""
        return [[lo, hi] for lo, hi, t in self.ffn_pair if t is not None and not t.grouped_wins]

    def prefill_read(self, backend: str | None = None) -> tuple[str, str]:
        """The prefill read the triton execution serves with on this table's device, where the server's prefill
        attention backend is `backend`, and why: the packed read of the RUN rows, unless the table measured it no
        faster than the read that would replace it (`ReadTiming.rival`: that backend's over every row where the
        table timed it, else SDPA's), where the backend reads instead. The why is empty where the read was never
        timed (the packed read serves)."""
        t = self.read_timing
        if t is None:
            return "packed", ""
        rival_ms, rival = t.rival(backend)
        why = (f"the table measured the packed read of half a prompt's rows at {t.kernel_ms:g} ms, {rival} at "
               f"{rival_ms:g} ms")
        return ("backend" if t.kernel_ms >= rival_ms else "packed"), why

    @property
    def read_tile(self) -> ReadTile:
        return self.read or DEFAULT_READ_TILE

    def _index(self, op: str, capacity: int) -> int:
        if op not in self.entries:
            raise KeyError(f"tile table for {self.device} has no operation {op!r}")
        for n, (lo, hi, _) in enumerate(self.entries[op]):
            if capacity >= lo and (hi is None or capacity <= hi):
                return n
        raise KeyError(f"tile table for {self.device}: no {op} tile for {capacity} rows")

    def lookup(self, op: str, capacity: int) -> Tile:
        return self.entries[op][self._index(op, capacity)][2]

    def timing(self, op: str, capacity: int) -> Timing | None:
        timings = self.timings.get(op)
        return timings[self._index(op, capacity)] if timings else None

    def gathers(self, op: str, capacity: int) -> bool:
        """Whether `op` over a cohort map of `capacity` slots serves in the gathered cuBLAS form instead of its
        tile: the table measured the torch form faster (`Timing.torch_wins`) and the pass is memory-bound on the
        table's device (capacity at or below its ridge rows), where the form, like the tile, reads each weight
        once however many slots are live. Above the ridge the tile's count bound saves compute the form spends
        on every slot. A table without timings, or for an uncatalogued device, never gathers."""
        timing = self.timing(op, capacity)
        if timing is None or not timing.torch_wins:
            return False
        device = find_device(self.device)
        return device is not None and capacity <= device.ridge_rows

    def gathered_ranges(self) -> dict[str, list[list[int]]]:
        """The slot counts each operation serves in the gathered form, as [first, last] ranges (the attestation's
        record of which GEMMs ran on cuBLAS)."""
        device = find_device(self.device)
        if device is None:
            return {}
        ridge = int(device.ridge_rows)
        out: dict[str, list[list[int]]] = {}
        for op, rows in self.entries.items():
            for (lo, hi, _), timing in zip(rows, self.timings.get(op, [None] * len(rows)), strict=True):
                last = ridge if hi is None else min(hi, ridge)
                if timing is not None and timing.torch_wins and lo <= last:
                    out.setdefault(op, []).append([lo, last])
        return out

    def split_at(self, op: str, capacity: int) -> int:
        """How many ways `op` splits K as served at `capacity` slots: its tile's `split_k`, but 1 where it serves
        in the gathered form; and a down GEMM of the two FFNs where they launch grouped (no FFN GEMM gathered and
        `groups_ffn`) splits as the MLP's down tile does (the grouped down launch runs both at its tile). A layer
        whose FFN weights one grid cannot read (`kernels._apart_because`: their dtypes, layouts or widths differ)
        launches them apart whatever the table, each down at its own tile: not a served model's layers."""
        if self.gathers(op, capacity):
            return 1
        if op.endswith("_down") and self.groups_ffn(capacity) and not any(
                self.gathers(other, capacity) for other in FFN_OPERATIONS):
            return self.lookup("mlp_down", capacity).split_k
        return self.lookup(op, capacity).split_k

    def split_ranges(self) -> dict[str, list[list[int]]]:
        """The slot counts at which each operation splits K as served (`split_at`), as [first, last, ways]: the
        attestation's record of which GEMMs launch a reduce after them (splits are a decode range's alone)."""
        out: dict[str, list[list[int]]] = {}
        for op in SPLIT_OPERATIONS:
            spans: list[list[int]] = []
            for capacity in range(1, PREFILL_FROM):
                split = self.split_at(op, capacity)
                if split == 1:
                    continue
                if spans and spans[-1][1] == capacity - 1 and spans[-1][2] == split:
                    spans[-1][1] = capacity
                else:
                    spans.append([capacity, capacity, split])
            if spans:
                out[op] = spans
        return out

    def lacks(self) -> list[str]:
        """What the tuner measures that this table holds no measurement of, each with what serving without it
        means: empty for a table the current tuner wrote, the older tuners' gaps for a table one of them wrote (a
        shipped table tuned before a measurement existed), one line for a table with no timings at all."""
        timed = [(hi, timing) for op, rows in self.entries.items()
                 for (_, hi, _), timing in zip(rows, self.timings.get(op) or [None] * len(rows), strict=True)]
        if all(timing is None for _, timing in timed):
            return ["every timing: tiles neither measured against torch nor on this device's counts"]
        out = []
        # (the current tuner leaves out a decode shape's half-count time where the gathered form's capture
        # failed, and notes that the shape was timed eagerly: a choice, not a gap)
        if any(timing is None or (timing.kernel_half_ms is None and timing.timed is None) for _, timing in timed):
            out.append("half-count times: no GEMM serves in the gathered cuBLAS form where torch is faster")
        if any(timing is None or timing.timed is None for _, timing in timed):
            out.append("how each shape was timed: a tuner from before decode shapes were timed as CUDA graph "
                       "replays timed them eagerly, mostly the host's launches")
        if any(timing is None or timing.chosen_by is None for hi, timing in timed
               if hi is None or hi >= PREFILL_FROM):  # the ranges that serve a prefill pass
            out.append("prefill tiles chosen over the full and the half count: chosen with every row live, they "
                       "may idle half the device when half the rows are RUN")
        if any([(lo, hi) for lo, hi, _ in rows if is_prefill(lo)] != list(PREFILL_RANGES)
               for rows in self.entries.values()):
            out.append("prefill tiles by length: one tile serves every prefill pass from the table's last range on, "
                       "tuned at one length: its grid may fill the device there alone")
        if not self.split_k_tried:
            out.append("split-K tiles: every decode GEMM's grid holds one program an output tile, which may fill a "
                       "fraction of the device at few rows (the H200's MLP down at 128 rows: 64 programs on 132 SMs)")
        if not any(t is not None for _, _, t in self.ffn_pair):
            out.append("FFN pair timings: every routed layer launches its two cohort FFNs grouped")
        if self.read_timing is None:
            out.append("a packed prefill read timing: the packed read serves, untimed against every row's causal "
                       "read")
        elif self.read_timing.backend_ms is None:
            out.append("the attention backend's own prefill read: the packed read was weighed against SDPA's "
                       "causal read, which may be faster than the backend that reads instead")
        return out

    def as_dict(self) -> dict:
        def entry(op: str, n: int, lo: int, hi: int | None, tile: Tile) -> dict:
            timing = self.timings[op][n] if self.timings.get(op) else None
            times = {k: v for k, v in asdict(timing).items() if v is not None} if timing is not None else {}
            fields = asdict(tile)
            if not self.split_k_tried and tile.split_k == 1:  # a table from before split K still says so
                del fields["split_k"]
            return {"rows": [lo, hi], **fields, **times}

        return {"device": self.device, "dtype": self.dtype, "source": self.source,
                "tiles": {op: [entry(op, n, lo, hi, t) for n, (lo, hi, t) in enumerate(rows)]
                          for op, rows in self.entries.items()},
                **({READ_FIELD: {**asdict(self.read), **self._read_times()}} if self.read is not None else {}),
                **({PAIR_FIELD: [{"rows": [lo, hi], **({k: v for k, v in asdict(t).items() if v is not None}
                                                        if t is not None else {})}
                                 for lo, hi, t in self.ffn_pair]} if self.ffn_pair else {})}

    def _read_times(self) -> dict:
        t = self.read_timing
        if t is None:
            return {}
        backend = {} if t.backend_ms is None else {"backend": t.backend, "backend_all_rows_ms": t.backend_ms}
        return {"kernel_ms": t.kernel_ms, "causal_all_rows_ms": t.causal_ms, **backend}


def _check_power_of_two(where: str, name: str, value: object, low: int, high: int | None = None) -> int:
    if not isinstance(value, int) or value < low or value & (value - 1) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in {low}..{high}"
        raise TileTableError(f"{where}: {name} must be a power of two {bounds}, got {value!r}")
    return value


def _check_stages(where: str, value: object) -> int:
    if not isinstance(value, int) or not 1 <= value <= 8:
        raise TileTableError(f"{where}: num_stages must be an integer in 1..8, got {value!r}")
    return value


def parse_tile_table(data: dict, shared_mem_per_block: int, where: str = "tile table") -> TileTable:
    """Validate a table dict against a shared-memory limit (bytes per block)."""
    if not isinstance(data, dict):
        raise TileTableError(f"{where}: expected a JSON object")
    dtype = data.get("dtype", "bfloat16")
    if dtype not in TABLE_DTYPES:
        raise TileTableError(f"{where}: field 'dtype' must be one of {sorted(TABLE_DTYPES)}, got {dtype!r}")
    tiles = data.get("tiles")
    if not isinstance(tiles, dict):
        raise TileTableError(f"{where}: field 'tiles' must be an object keyed by operation")
    unknown = sorted(set(tiles) - set(OPERATIONS))
    if unknown:
        raise TileTableError(f"{where}: unknown operation(s) {unknown}; operations are {list(OPERATIONS)}")
    entries: dict[str, list[tuple[int, int | None, Tile]]] = {}
    timings: dict[str, list[Timing | None]] = {}
    source = str(data.get("source", where))
    defaulted = [op for op in DEFAULTED_OPERATIONS if op not in tiles]
    if 0 < len(defaulted) < len(DEFAULTED_OPERATIONS):  # the tuner writes both or (before them) neither
        raise TileTableError(f"{where}: field 'tiles.{defaulted[0]}' is missing (a table with any of "
                             f"{list(DEFAULTED_OPERATIONS)} needs all of them)")
    if defaulted:
        fallback = default_tile_table(shared_mem_per_block, str(data.get("device", "unknown")), dtype)
        entries.update({op: fallback.entries[op] for op in defaulted})
        timings.update({op: [None] * len(fallback.entries[op]) for op in defaulted})
        source += f"; {', '.join(defaulted)}: default tiles (not in the table)"
    for op in OPERATIONS:
        if op in defaulted:
            continue
        if op not in tiles:
            raise TileTableError(f"{where}: field 'tiles.{op}' is missing")
        rows_out = []
        timings_out: list[Timing | None] = []
        expect = 1
        for n, entry in enumerate(tiles[op]):
            here = f"{where}: tiles.{op}[{n}]"
            rows = entry.get("rows")
            if not (isinstance(rows, list) and len(rows) == 2):
                raise TileTableError(f"{here}: field 'rows' must be [first, last] (last null for open-ended)")
            lo, hi = rows
            if lo != expect:
                raise TileTableError(f"{here}: rows start at {lo!r}, expected {expect} (ranges must be contiguous)")
            if hi is not None and (not isinstance(hi, int) or hi < lo):
                raise TileTableError(f"{here}: rows end {hi!r} must be null or an integer >= {lo}")
            tile = Tile(
                _check_power_of_two(here, "block_m", entry.get("block_m"), 16),
                _check_power_of_two(here, "block_n", entry.get("block_n"), 16),
                _check_power_of_two(here, "block_k", entry.get("block_k"), 16),
                _check_power_of_two(here, "num_warps", entry.get("num_warps", 4), 1),
                _check_stages(here, entry.get("num_stages", 2)),
                _check_power_of_two(here, "split_k", entry.get("split_k", 1), 1, MAX_SPLIT_K),
            )
            if tile.split_k > 1 and op not in SPLIT_OPERATIONS:
                raise TileTableError(f"{here}: field 'split_k' is {tile.split_k}, but the gate-up kernels never split "
                                     "K (the activation needs both sums whole): 1 or absent")
            if tile.split_k > 1 and (hi is None or hi >= PREFILL_FROM):
                raise TileTableError(f"{here}: field 'split_k' is {tile.split_k} in a range that serves prefill "
                                     f"passes (rows {lo}..{hi if hi is not None else ''}: from {PREFILL_FROM} rows "
                                     "on), whose grid fills the device unsplit and whose workspace would hold "
                                     "split_k fp32 copies of the pass's output: 1 or absent")
            need = tile.shared_mem_bytes(op, DTYPE_BYTES[dtype])
            if need > shared_mem_per_block:
                raise TileTableError(
                    f"{here} (rows {lo}..{hi if hi is not None else ''}): tile needs {need} bytes of shared "
                    f"memory, more than the device's {shared_mem_per_block} bytes per block; lower "
                    "num_stages or the block sizes")
            rows_out.append((lo, hi, tile))
            timings_out.append(_parse_timing(here, entry))
            if hi is None:
                if n != len(tiles[op]) - 1:
                    raise TileTableError(f"{here}: only the last range may be open-ended")
                break
            expect = hi + 1
        if not rows_out or rows_out[-1][1] is not None:
            raise TileTableError(f"{where}: tiles.{op} must end with an open-ended range [first, null]")
        entries[op] = rows_out
        timings[op] = timings_out
    entries = {op: entries[op] for op in OPERATIONS}
    read = _parse_read_tile(data[READ_FIELD], f"{where}: {READ_FIELD}") if READ_FIELD in data else None
    read_timing = _parse_read_timing(data[READ_FIELD], f"{where}: {READ_FIELD}") if READ_FIELD in data else None
    pair = _parse_pair(data[PAIR_FIELD], f"{where}: {PAIR_FIELD}") if PAIR_FIELD in data else []
    split_k_tried = all("split_k" in entry for op in SPLIT_OPERATIONS if op in tiles for entry in tiles[op])
    return TileTable(str(data.get("device", "unknown")), dtype, entries, source, read, timings, read_timing, pair,
                     split_k_tried)


def _parse_pair(entries: object, where: str) -> list[tuple[int, int | None, PairTiming | None]]:
    """The grouped-against-apart timings of the two cohort FFNs: count ranges as the tiles' (contiguous from 1, the
    last open), each with both times in milliseconds, or neither (not timed), or `grouped_error` (the grouped
    launch failed there: apart, its time where it ran)."""
    if not isinstance(entries, list) or not entries:
        raise TileTableError(f"{where}: expected a list of {{rows, grouped_ms, apart_ms}} entries")
    out: list[tuple[int, int | None, PairTiming | None]] = []
    expect = 1
    for n, entry in enumerate(entries):
        here = f"{where}[{n}]"
        rows = entry.get("rows") if isinstance(entry, dict) else None
        if not (isinstance(rows, list) and len(rows) == 2) or rows[0] != expect or not (
                rows[1] is None or (isinstance(rows[1], int) and rows[1] >= rows[0])):
            raise TileTableError(f"{here}: field 'rows' must be [{expect}, last] (last null for the open range, "
                                 "which ends the list)")
        times = {name: entry.get(name) for name in ("grouped_ms", "apart_ms")}
        for name, value in times.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not value > 0):
                raise TileTableError(f"{here}: field '{name}' must be a positive number of milliseconds, "
                                     f"got {value!r}")
        error = entry.get("grouped_error")
        if error is not None:
            if not isinstance(error, str) or not error or times["grouped_ms"] is not None:
                raise TileTableError(f"{here}: field 'grouped_error' must be a non-empty string, without "
                                     "'grouped_ms'")
        elif (times["grouped_ms"] is None) != (times["apart_ms"] is None):
            raise TileTableError(f"{here}: fields 'grouped_ms' and 'apart_ms' go together")
        timing = None if error is None and times["grouped_ms"] is None else PairTiming(
            *(None if times[k] is None else float(times[k]) for k in ("grouped_ms", "apart_ms")), error)
        out.append((rows[0], rows[1], timing))
        if rows[1] is None:
            if n != len(entries) - 1:
                raise TileTableError(f"{here}: only the last range may be open-ended")
            return out
        expect = rows[1] + 1
    raise TileTableError(f"{where}: must end with an open-ended range [first, null]")


def _parse_read_timing(entry: dict, where: str) -> ReadTiming | None:
    """The read's timings where the tuner recorded both (`kernel_ms`, `causal_all_rows_ms`), else None; with the
    host backend's own (`backend_all_rows_ms`, the backend named by `backend`) where it timed that too."""
    times = {name: entry.get(name) for name in ("kernel_ms", "causal_all_rows_ms", "backend_all_rows_ms")}
    for name, value in times.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise TileTableError(f"{where}: field '{name}' must be a positive number of milliseconds, got {value!r}")
    backend = entry.get("backend")
    if (backend is None) != (times["backend_all_rows_ms"] is None) or not (
            backend is None or (isinstance(backend, str) and backend)):
        raise TileTableError(f"{where}: fields 'backend' (the attention backend's name) and 'backend_all_rows_ms' "
                             "go together")
    if times["kernel_ms"] is None or times["causal_all_rows_ms"] is None:
        return None
    return ReadTiming(float(times["kernel_ms"]), float(times["causal_all_rows_ms"]),
                      None if backend is None else float(times["backend_all_rows_ms"]), backend)


def _parse_timing(where: str, entry: dict) -> Timing | None:
    """An entry's timings: None where the tuner recorded none (a hand-written or default table); every time
    given must be a positive number of milliseconds."""
    given = {name: entry[name] for name in TIMING_FIELDS if entry.get(name) is not None}
    for name, value in given.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise TileTableError(f"{where}: field '{name}' must be a positive number of milliseconds, got {value!r}")
    if "kernel_ms" not in given or "torch_ms" not in given:
        if given:
            raise TileTableError(f"{where}: fields 'kernel_ms' and 'torch_ms' go together (got only "
                                 f"{sorted(given)})")
        return None
    notes = {}
    for name, allowed in (("timed", TIMED), ("chosen_by", CHOSEN_BY)):
        value = entry.get(name)
        if value is not None and value not in allowed:
            raise TileTableError(f"{where}: field '{name}' must be one of {list(allowed)}, got {value!r}")
        notes[name] = value
    return Timing(float(given["kernel_ms"]), float(given["torch_ms"]),
                  None if "kernel_half_ms" not in given else float(given["kernel_half_ms"]), **notes)


def _parse_read_tile(entry: object, where: str) -> ReadTile:
    """The packed prefill read's tile, bounded as the tuner's launches are. Its shared memory depends on the
    model's head_dim, which a table does not know: the tuner ran it on the device, and `compile_check` compiles a
    table's read (shipped, or given with --tile-table) at Llama-3-8B's shapes."""
    if not isinstance(entry, dict):
        raise TileTableError(f"{where}: expected an object with block_rows, block_n, num_warps, num_stages")
    return ReadTile(_check_power_of_two(where, "block_rows", entry.get("block_rows"), 16, 256),
                    _check_power_of_two(where, "block_n", entry.get("block_n"), 16, 256),
                    _check_power_of_two(where, "num_warps", entry.get("num_warps", 4), 1, 16),
                    _check_stages(where, entry.get("num_stages", 2)))


def load_tile_table(path: str | Path, device: Device | None = None, shared_mem_per_block: int | None = None
                    ) -> TileTable:
    """Read and validate a table file. The limit comes from `device` (or the table's own 'device' field looked
    up in the catalogue) unless given explicitly."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TileTableError(f"{path}: not valid JSON ({exc})") from None
    except OSError as exc:
        raise TileTableError(f"{path}: no tile table can be read there ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise TileTableError(f"{path}: expected a JSON object")
    if shared_mem_per_block is None:
        if device is None:
            device = find_device(str(data.get("device", "")))
            if device is None:
                raise TileTableError(f"{path}: field 'device' {data.get('device')!r} is not a catalogued device; "
                                     "pass the shared-memory limit explicitly")
        shared_mem_per_block = device.shared_mem_per_block
    return parse_tile_table(data, shared_mem_per_block, where=str(path))


# Conservative defaults, by shared memory per block. Block sizes grow with the captured batch size so small
# batches do not waste the tensor cores' M dimension on empty rows; every config is re-checked by the parser.
_LARGE_SMEM = 160 * 1024  # A100 (163 KiB), H100/H200/B200 (227 KiB)


def default_tile_table(shared_mem_per_block: int, device: str = "unmeasured", dtype: str = "bfloat16"
                       ) -> TileTable:
    """The documented fallback for a device without a measured table.

    >= 160 KiB per block: block_m 16/32/64/64, then 128, over the count ranges, block_n 64 (gate-up) / 128 (down),
    block_k 64, 3 stages (4 warps; 8 from 65 rows). Below that (the 99 KiB Ampere/Ada parts): the same blocks
    with 2 stages. If a configuration still does not fit, stages and then block_n are lowered until it does.
    """
    stages = 3 if shared_mem_per_block >= _LARGE_SMEM else 2
    block_ms = (16, 32, 64, 64) + (128,) * (len(COUNT_RANGES) - 4)
    tiles: dict[str, list[dict]] = {}
    for op in OPERATIONS:
        rows = []
        for (lo, hi), bm in zip(COUNT_RANGES, block_ms, strict=True):
            tile = Tile(bm, 64 if op.endswith("gate_up") else 128, 64, 8 if lo > 64 else 4, stages)
            while tile.shared_mem_bytes(op, DTYPE_BYTES[dtype]) > shared_mem_per_block:
                if tile.num_stages > 1:
                    tile = Tile(tile.block_m, tile.block_n, tile.block_k, tile.num_warps, tile.num_stages - 1)
                elif tile.block_n > 16:
                    tile = Tile(tile.block_m, tile.block_n // 2, tile.block_k, tile.num_warps, 1)
                else:
                    raise TileTableError(f"no default tile fits {shared_mem_per_block} bytes of shared memory")
            rows.append({"rows": [lo, hi], **asdict(tile)})
        tiles[op] = rows
    data = {"device": device, "dtype": dtype, "source": f"default for {shared_mem_per_block} B shared memory",
            "tiles": tiles}
    return parse_tile_table(data, shared_mem_per_block, where=f"default tile table ({device})")


def table_path(device: Device) -> Path:
    return TABLE_DIR / f"{device.name}.json"


def tile_table_for(product: str, shared_mem_per_block: int | None = None, dtype: str = "bfloat16",
                   path: str | Path | None = None) -> TileTable:
    """The table to serve with on a device named `product` (catalogue name or GPU product string): the table at
    `path` when one is given (`given_tile_table`), else its measured table when one ships, otherwise the default
    for its shared-memory limit (catalogue value, or the one given for an unknown device)."""
    if path is not None:
        return given_tile_table(path, product)
    device = find_device(product)
    if device is not None and table_path(device).exists():
        return load_tile_table(table_path(device), device)
    limit = device.shared_mem_per_block if device is not None else shared_mem_per_block
    if limit is None:
        raise TileTableError(f"device {product!r} is not catalogued and no shared-memory limit was given")
    return default_tile_table(limit, device.name if device else product, dtype)


def table_label(path: str | Path) -> str:
    """A given table file as attested: its name and the start of its sha256, the same for each server handed
    the same table wherever the run's folder lies (the headline's cross-arm gate compares what arms attest)."""
    path = Path(path)
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError:
        return f"{path.name}, unreadable"
    return f"{path.name}, sha256 {digest}"


def given_tile_table(path: str | Path, product: str) -> TileTable:
    """A table measured on this device and handed to the server (`vskipper serve --tile-table`, e.g. one
    `vskipper tune-tiles` just wrote on it) instead of the one that ships: it must name the device it serves
    (field 'device') and fit that device's shared memory. Its source names the file (`table_label`)."""
    path = Path(path)
    device = find_device(product)
    if device is None:
        raise TileTableError(f"{path}: the GPU {product!r} is not catalogued (`vskipper devices`), so no measured "
                             "table can be checked against it")
    table = load_tile_table(path, device)
    named = find_device(table.device)
    if named is None or named.name != device.name:
        raise TileTableError(f"{path}: field 'device' is {table.device!r}, but this GPU is {device.name}: a tile "
                             "table serves the device it was measured on")
    table.source = f"{table.source} ({table_label(path)})"
    return table
