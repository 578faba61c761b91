"""RandomSkip: a seeded, batch-independent random policy for sweeping the skip ratio s = r * d.

A row (one token of one request) is selected with probability r, and a selected row projects at a fraction d of
the routed layers. Everything is a function of (seed, request key, token position) alone, so a request gets the
same routes whatever batch it lands in, in prefill and in decode alike:

  k   = mix(mix(seed) ^ fold(request_key))                        per-request phase in [0, 2^31)
  row selected      iff (k + position * PHI) mod 2^31 < r * 2^31  (PHI = golden ratio * 2^31)
  o   = mix(k ^ mix(position))                                    per-row layer offset
  layer j projects  iff selected and (o + j * 2^31 / L) mod 2^31 < d * 2^31

The position stride is a golden-ratio (Weyl) sequence, so the share of selected tokens in a request stays
within O(1/n) of r instead of drifting binomially; the L layer points are evenly spaced from a random offset,
so a selected row projects at floor(d L) or ceil(d L) layers, d L on average. Integer arithmetic stays below
2^62, so the torch version and the pure-Python `reference_routes` agree bit for bit on any device.

On CPU the same chain runs as numpy's ufuncs over the tensors' own memory (`prepare_batch`): each of its some
fifty operations costs the host a microsecond or two there, where torch's dispatch of a small tensor op costs
three to five, and a pass's routes came to about 150 us of a 16-token prompt's host time. The arithmetic is the
same functions over int64 arrays, so the two agree bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vskipper.skippers.base import BatchContext, LayerRoute, Skipper

MOD = 1 << 31
MASK = MOD - 1
PHI = 1327217884  # round(0.6180339887 * 2^31)
MIX = 0x45D9F3B


def _mix(x):
    """A 31-bit integer finalizer; works on Python ints and int64 tensors alike."""
    x = x & MASK
    x = x ^ (x >> 16)
    x = (x * MIX) & MASK
    x = x ^ (x >> 16)
    x = (x * MIX) & MASK
    return x ^ (x >> 16)


def _fold(key):
    """Fold a signed 64-bit request key to 31 bits (arithmetic shifts agree in Python and torch)."""
    return (key ^ (key >> 31) ^ (key >> 62)) & MASK


def _threshold(fraction: float) -> int:
    return min(MOD, int(fraction * MOD))


def _row_phase(seed, key):
    return _mix(_mix(seed) ^ _fold(key))


def reference_routes(seed: int, key: int, position: int, r: float, d: float, num_layers: int) -> list[bool]:
    """Pure-Python routes of one row: True where the row projects, per routed layer in order."""
    k = _row_phase(seed, key)
    if (k + position * PHI) % MOD >= _threshold(r):
        return [False] * num_layers
    o = _mix(k ^ _mix(position))
    return [(o + j * MOD // num_layers) % MOD < _threshold(d) for j in range(num_layers)]


class RandomSkip(Skipper):
    name = "random_skip"
    decision = "seeded_hash_of_request_and_position"

    def __init__(self, r: float, d: float, seed: int = 0) -> None:
        self.r, self.d, self.seed = r, d, seed

    def parameters(self) -> dict[str, Any]:
        return {"r": self.r, "d": self.d, "seed": self.seed, "skip_ratio": self.r * self.d}

    def prepare_batch(self, batch: BatchContext) -> dict[str, Any]:
        """Every routed layer's routes of the pass at once (one [L_r, rows] chain of tensor ops over the pass's
        rows, numpy's on CPU): `route` then hands a layer its row of them, with no work per layer."""
        if batch.request_keys is None or batch.positions is None:
            raise ValueError("random_skip needs per-row request_keys and positions in the batch context")
        keys = batch.request_keys.to(torch.int64).view(-1)
        pos = batch.positions.to(torch.int64).view(-1)
        valid = batch.valid_rows.view(-1)
        layers = len(batch.routed_layers)
        if keys.device.type == "cpu":  # numpy's ufuncs over the same memory: no copy, a fraction of the dispatch
            layer = np.arange(layers, dtype=np.int64)
            run = torch.from_numpy(self._run(keys.numpy(), pos.numpy(), valid.numpy(), layer))
        else:  # built on the device (a tensor literal would be a blocking host copy, illegal while a graph captures)
            layer = torch.arange(layers, dtype=torch.int64, device=keys.device)
            run = self._run(keys, pos, valid, layer)
        weights = torch.ones(run.shape[1], 1, dtype=batch.hidden_states.dtype, device=run.device)
        return {"run": run.unsqueeze(-1), "weights": weights,
                "index": {layer: j for j, layer in enumerate(batch.routed_layers)}}

    def _run(self, keys, pos, valid, layer):
        """The run mask [L_r, rows] of rows with request `keys`, positions `pos` and `valid` flags over the routed
        layers `layer` (0 .. L_r - 1), all int64 (`valid` bool) tensors or numpy arrays alike."""
        k = _row_phase(self.seed, keys)
        selected = (((k + pos * PHI) % MOD) < _threshold(self.r)) & valid
        offset = _mix(k ^ _mix(pos))
        strides = layer * MOD // len(layer)
        return ~(selected & (((offset + strides.reshape(-1, 1)) % MOD) < _threshold(self.d)))

    def route(self, layer_id: int, normed_hidden: torch.Tensor, state: dict[str, Any],
              router: torch.nn.Module | None = None) -> LayerRoute:
        return LayerRoute(state["run"][state["index"][layer_id]], state["weights"])
