"""Shared set-ups for the mixed-depth tests: paged caches with shuffled pages, prompts, decode batches, a skipper
that replays a given tape, a tile table that serves chosen operations in the gathered form, and detectors of what a
pass makes the host do (reads; its waits: `vskipper.mixed.host_waits`) and what it launches."""

from __future__ import annotations

import copy
import random
import traceback
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from vskipper.mixed.bench_stack import BenchStack, ForwardBatch
from vskipper.mixed.host_waits import site
from vskipper.mixed.launches import NO_LAUNCH, interpreted_launches
from vskipper.mixed.tiles import COUNT_RANGES, OPERATIONS, TileTable, parse_tile_table
from vskipper.skippers.base import LayerRoute, Skipper

INTERPRETER_ENTRY = {"block_m": 16, "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 1}


def gathering_table(gathered: set[str] | frozenset[str] = frozenset(OPERATIONS), device: str = "H200") -> TileTable:
    """A tile table with the interpreter's small tile everywhere, timed so that the gathered cuBLAS form won (at
    the full and the half count) for the operations in `gathered` and lost for the others: with a catalogued
    `device`, those operations serve gathered at every capacity up to its ridge rows."""
    tiles = {op: [{"rows": [lo, hi], **INTERPRETER_ENTRY, "kernel_ms": 1.0, "kernel_half_ms": 0.8,
                   "torch_ms": 0.5 if op in gathered else 2.0} for lo, hi in COUNT_RANGES] for op in OPERATIONS}
    return parse_tile_table({"device": device, "dtype": "float32", "source": "test", "tiles": tiles}, 227 * 1024)


class TapeSkipper(Skipper):
    """Replays fixed routes: {layer: (run bool [rows], weights [rows])}."""

    name = "fixed_tape"
    decision = "given"

    def __init__(self, routes: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.routes = routes

    def prepare_batch(self, batch):
        return None

    def route(self, layer_id, normed_hidden, state, router=None):
        run, w = self.routes[layer_id]
        return LayerRoute(run.view(-1, 1), w.view(-1, 1).to(normed_hidden.dtype))


def random_routes(layers, rows, rng: random.Random, valid: torch.Tensor, mode: str = "random",
                  unit: bool = False) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """mode: random (ragged counts), all_run (n_proj = 0), all_project (n_run = padding rows only)."""
    routes = {}
    for layer in layers:
        if mode == "all_run":
            run = [True] * rows
        elif mode == "all_project":
            run = [False] * rows
        else:
            share = rng.random()
            run = [rng.random() > share for _ in range(rows)]
        run_t = torch.tensor(run, dtype=torch.bool) | ~valid  # padding rows always RUN
        w = torch.ones(rows) if unit else torch.tensor([rng.uniform(0.05, 0.95) for _ in range(rows)])
        routes[layer] = (run_t, torch.where(valid, w, torch.ones(rows)))
    return routes


class World:
    """A model, a paged cache with shuffled page ownership, and per-request prompt lengths."""

    def __init__(self, model: BenchStack, n_requests: int, seed: int, page_size: int = 4,
                 max_context: int = 24, spare_pages: int = 3) -> None:
        self.model = model
        self.rng = random.Random(seed)
        self.n_requests = n_requests
        pages_per_request = max_context // page_size
        num_pages = 1 + n_requests * pages_per_request + spare_pages
        self.kv = model.new_kv_cache(num_pages, page_size, n_requests, max_context)
        order = list(range(1, num_pages))
        self.rng.shuffle(order)
        self.pages = {r: order[r * pages_per_request : (r + 1) * pages_per_request] for r in range(n_requests)}
        for r, pages in self.pages.items():
            self.kv.assign_pages(r, pages)
        self.lengths = {r: 0 for r in range(n_requests)}
        self.vocab = model.config["vocab_size"]

    def owned_slots(self, requests) -> set[int]:
        return {int(self.kv.req_to_token[r, t]) for r in requests for t in range(self.lengths[r])}

    def prefill_batch(self, prompt: dict[int, int]) -> tuple[torch.Tensor, ForwardBatch]:
        """Packed prompt rows of the given requests ({request: new tokens}), interleaved in a random order."""
        rows = [(r, self.lengths[r] + t) for r, n in prompt.items() for t in range(n)]
        self.rng.shuffle(rows)
        for r, n in prompt.items():
            self.lengths[r] += n
        ids = torch.tensor([self.rng.randrange(self.vocab) for _ in rows])
        return ids, ForwardBatch(torch.tensor([p for _, p in rows]), torch.tensor([r for r, _ in rows]),
                                 torch.ones(len(rows), dtype=torch.bool), "prefill")

    def decode_batch(self, requests, padding: int = 0) -> tuple[torch.Tensor, ForwardBatch]:
        """One row per request (in the given order) plus `padding` padding rows (request 0, position 0)."""
        pos = []
        for r in requests:
            pos.append(self.lengths[r])
            self.lengths[r] += 1
        ids = torch.tensor([self.rng.randrange(self.vocab) for _ in range(len(requests) + padding)])
        valid = torch.tensor([True] * len(requests) + [False] * padding)
        return ids, ForwardBatch(torch.tensor(pos + [0] * padding), torch.tensor(list(requests) + [0] * padding),
                                 valid, "decode")

    def fork_cache(self):
        return copy.deepcopy(self.kv)


class HostReadDetector(TorchFunctionMode):
    """Records every tensor-to-host value read (.item(), int(), bool(), float(), tolist(), index use)."""

    READS = {torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__float__,
             torch.Tensor.tolist, torch.Tensor.__index__}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


class ScalarReadDetector(TorchDispatchMode):
    """Records every scalar read that reaches the dispatcher (`aten._local_scalar_dense`), including those an
    operator makes inside C++ (a host read a Python-level detector cannot see)."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


class OwnLaunches(TorchDispatchMode):
    """Records the device work vSkipper's own code launches in a pass: each operator called from a frame of
    `vskipper/` with no SGLang frame nearer (SGLang's modules launch what they launch in a dense pass too) that
    computes or copies data, and each Triton kernel launch (`triton()`, by kernel name). Views, metadata and
    uninitialized allocations launch nothing on a GPU and are not recorded (`vskipper.mixed.launches.NO_LAUNCH`)."""

    def __init__(self):
        super().__init__()
        self.launches: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_LAUNCH and self._own():
            self.launches.append(name)
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _own() -> bool:
        return site(traceback.extract_stack())[1]

    @contextmanager
    def triton(self):
        """Record the Triton kernels launched meanwhile (under the interpreter: what runs inside one is its own)."""
        with interpreted_launches(self.launches.append), self:
            yield self
