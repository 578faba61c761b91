"""The engine-free bench/reference stack: a Llama-3 / Qwen3 skipper model with its own paged KV cache, no engine.

It runs the same routed-layer body the SGLang layer runs (`vskipper.mixed.routed_layer`), over its own
modules, so the kernels and the cohort logic can be measured (`benchmarks/mixed_depth_bench.py`) and checked
against the per-row oracle (`vskipper.mixed.reference`) without a server. Nothing serves with it.

Per layer, x = the layer input, LN1/LN2 its input/post-attention RMSNorms:

  dense                 h = x + Attn(LN1 x);  y = h + MLP(LN2 h)
  routed, RUN row       h = x + Attn(LN1 x);  y = h + w * MLP(LN2 h)
  routed, Project-Only  y = x + w * Proj(LN2 x)            (w: the tape's branch weight, 1 - router w for
                                                            FlexiDepth, 1 for the hard gate)

Every valid row computes its own K/V at every layer through the layer's own projections (Qwen3: per-head
q_norm/k_norm, then RoPE) and writes them to the paged cache (Invariant 1); a Project-Only row reads no KV and
its attention output is zero, so its h is x. A routed layer builds its cohort maps from the tape at every step
(Invariant 2).

Module and parameter names follow the checkpoints (`model.layers.{i}.self_attn.q_proj`, `mlp.gate_proj`,
`router`, `router_proj`, ...), so `BenchStack.from_pretrained` loads a skipper checkpoint as it is.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from vskipper.checkpoint import load_skipper_modules
from vskipper.mixed.attention import (
    PagedKVCache,
    apply_rope,
    paged_attention,
    prefill_attention,
    rope_cos_sin,
)
from vskipper.mixed.backend import select_backend, triton_available, triton_interpreted
from vskipper.mixed.cohorts import CohortBuilder, Cohorts
from vskipper.mixed.routed_layer import routed_layer
from vskipper.mixed.tape import RouteTape
from vskipper.skippers.base import BatchContext, Skipper
from vskipper.skippers.modules import ProjectorAdapter, RMSNorm, SkipRouter, is_router_tensor, router_sizes

QWEN3_TYPES = ("qwen3_skipper", "qwen3")
LLAMA_TYPES = ("ddllama", "llama")


@dataclass
class ForwardBatch:
    """The rows of one forward pass. Decode: one row per request; prefill: packed prompt tokens."""

    positions: torch.Tensor  # int64 [rows]: each row's position in its request
    req_indices: torch.Tensor  # int64 [rows]: each row's request slot in the cache's req_to_token
    valid: torch.Tensor  # bool [rows]: False for padding rows (they write the reserved slot, read nothing)
    phase: str = "decode"  # "decode" or "prefill"
    request_keys: torch.Tensor | None = None  # int64 [rows]: stable per-request keys (RandomSkip)
    dense_rows: torch.Tensor | None = None  # bool [rows]: rows of dense-mode requests in a routed batch (RUN)

    def __post_init__(self) -> None:
        if self.phase not in ("decode", "prefill"):
            raise ValueError(f"phase must be 'decode' or 'prefill', got {self.phase!r}")

    @property
    def rows(self) -> int:
        return self.positions.shape[0]


class Attention(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        d = config["hidden_size"]
        self.heads = config["num_attention_heads"]
        self.kv_heads = config["num_key_value_heads"]
        self.head_dim = config.get("head_dim", d // self.heads)
        self.theta = config.get("rope_theta", 10000.0)
        bias = config.get("attention_bias", False)
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)
        self.qk_norm = config["model_type"] in QWEN3_TYPES
        if self.qk_norm:
            eps = config.get("rms_norm_eps", 1e-6)
            self.q_norm = RMSNorm(self.head_dim, eps)
            self.k_norm = RMSNorm(self.head_dim, eps)

    def project_kv(self, u: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's own K (normed for Qwen3, then rotated) and V of rows u = LN1(x)."""
        k = self.k_proj(u).view(-1, self.kv_heads, self.head_dim)
        v = self.v_proj(u).view(-1, self.kv_heads, self.head_dim)
        if self.qk_norm:
            k = self.k_norm(k)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.theta, k.dtype)
        return apply_rope(k, cos, sin), v

    def project_q(self, u: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.rotate_q(self.q_proj(u), positions)

    def rotate_q(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """q_norm (Qwen3), then RoPE, of projected queries q [n, heads * hd]: [n, heads, hd]."""
        q = q.view(-1, self.heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.theta, q.dtype)
        return apply_rope(q, cos, sin)

    def forward(self, u: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache, layer_id: int,
                impl: str = "torch") -> torch.Tensor:
        """The dense attention: write every valid row's own K/V (Invariant 1), then every valid row reads.

        impl  'triton': the capture-safe decode read (`masked_decode_attention`, every row keeps its launch
              slot); 'torch': the reference reads (SDPA per request in prefill).
        """
        k, v = self.project_kv(u, batch.positions)
        kv.write(layer_id, kv.write_slots(batch.req_indices, batch.positions, batch.valid), k, v)
        q = self.project_q(u, batch.positions)
        out = self._read(q, kv, layer_id, batch.req_indices, batch.positions, batch.valid, batch.phase, impl)
        return self.o_proj(out.reshape(u.shape[0], -1))

    def _read(self, q: torch.Tensor, kv: PagedKVCache, layer_id: int, req: torch.Tensor, pos: torch.Tensor,
              reads: torch.Tensor, phase: str, impl: str) -> torch.Tensor:
        scale = 1.0 / math.sqrt(self.head_dim)
        if phase == "prefill":
            return prefill_attention(q, kv.k[layer_id], kv.v[layer_id], kv.req_to_token, req, pos, scale, reads)
        if impl == "triton":
            from vskipper.mixed.kernels import masked_decode_attention

            return masked_decode_attention(q, kv.k[layer_id], kv.v[layer_id], kv.req_to_token, req, pos, reads,
                                           scale)
        return paged_attention(q, kv.k[layer_id], kv.v[layer_id], kv.req_to_token, req, pos, scale, reads)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class LayerStats:
    """Host-side counters of what the routed layers executed (attested)."""

    routed_layer_passes: int = 0
    all_run_fast_path: int = 0
    cohort_passes: int = 0
    backends: dict = field(default_factory=dict)

    def note(self, path: str) -> None:
        """The body's report of the path a routed layer took ('all_run' or 'cohorts')."""
        if path == "all_run":
            self.all_run_fast_path += 1
        else:
            self.cohort_passes += 1


class DecoderLayer(nn.Module):
    def __init__(self, config: dict, layer_id: int, routed: bool) -> None:
        super().__init__()
        d, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.layer_id = layer_id
        self.self_attn = Attention(config)
        self.mlp = MLP(d, config["intermediate_size"])
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.routed = routed
        if routed:
            r, m = router_sizes(config)
            self.router = SkipRouter(d, r, eps)
            self.router_proj = ProjectorAdapter(d, m)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache, impl: str = "torch") -> torch.Tensor:
        """The dense layer (the unmodified model's computation)."""
        h = x + self.self_attn(self.input_layernorm(x), batch, kv, self.layer_id, impl=impl)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_routed(self, x: torch.Tensor, u: torch.Tensor, run: torch.Tensor, weights: torch.Tensor,
                       cohorts: Cohorts | None, batch: ForwardBatch, kv: PagedKVCache, backend: str,
                       stats: LayerStats, tiles: Any = None, x_owned: bool = False) -> torch.Tensor:
        """One routed layer over the tape's run mask `run` [rows] and branch weights `weights` [rows]: the
        shared routed-layer body over this stack's own modules (`x_owned`: it may update x in place)."""
        stats.routed_layer_passes += 1
        return routed_layer(StackLayerOps(self, batch, kv, backend), x, u, run, weights, backend, cohorts, tiles,
                            note=stats.note, x_owned=x_owned).output(in_place=x_owned)


class StackLayerOps:
    """The stack's `LayerOps`: its own projections, MLP and paged KV cache (`vskipper.mixed.routed_layer`)."""

    def __init__(self, layer: DecoderLayer, batch: ForwardBatch, kv: PagedKVCache, impl: str) -> None:
        self.layer, self.batch, self.cache, self.impl = layer, batch, kv, impl
        self.attn = layer.self_attn
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.projector = layer.router_proj
        self.reads_every_query = False  # the masked decode read (the stack prefills with torch)

    def _positions(self, rows: torch.Tensor | None) -> torch.Tensor:
        return self.batch.positions if rows is None else self.batch.positions.index_select(0, rows)

    def attention(self, u: torch.Tensor) -> torch.Tensor:
        return self.attn(u, self.batch, self.cache, self.layer.layer_id, impl=self.impl)

    def kv(self, u: torch.Tensor):
        k, v = self.attn.project_kv(u, self.batch.positions)
        return k.reshape(u.shape[0], -1), v.reshape(u.shape[0], -1)

    def q_kv(self, u: torch.Tensor, rows: torch.Tensor):
        q = self.attn.project_q(u.index_select(0, rows), self._positions(rows)).reshape(rows.shape[0], -1)
        return (q, *self.kv(u))

    def batch_q_kv(self, u: torch.Tensor, q: torch.Tensor):
        return (self.attn.rotate_q(q, self.batch.positions).reshape(q.shape[0], -1), *self.kv(u))

    def write_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        b, a = self.batch, self.attn
        self.cache.write(self.layer.layer_id, self.cache.write_slots(b.req_indices, b.positions, b.valid),
                      k.view(-1, a.kv_heads, a.head_dim), v.view(-1, a.kv_heads, a.head_dim))

    def read(self, q: torch.Tensor, rows: torch.Tensor | None, reads: torch.Tensor | None = None) -> torch.Tensor:
        b, a = self.batch, self.attn
        req = b.req_indices if rows is None else b.req_indices.index_select(0, rows)
        valid = b.valid if rows is None else b.valid.index_select(0, rows)
        out = a._read(q.view(q.shape[0], a.heads, a.head_dim), self.cache, self.layer.layer_id, req,
                      self._positions(rows), valid if reads is None else valid & reads, b.phase, self.impl)
        return out.reshape(q.shape[0], -1)

    def read_cohort(self, q: torch.Tensor, rows: torch.Tensor, reads: torch.Tensor) -> torch.Tensor:
        b, a = self.batch, self.attn
        if self.impl != "triton":  # the torch reads take their queries packed
            return self.read(q.index_select(0, rows), rows, reads)
        from vskipper.mixed.kernels import masked_decode_attention

        out = masked_decode_attention(q.view(q.shape[0], a.heads, a.head_dim), self.cache.k[self.layer.layer_id],
                                      self.cache.v[self.layer.layer_id], self.cache.req_to_token, b.req_indices,
                                      b.positions, reads & b.valid.index_select(0, rows),
                                      1.0 / math.sqrt(a.head_dim), idx=rows)
        return out.reshape(rows.shape[0], -1)

    def o_proj(self, a: torch.Tensor) -> torch.Tensor:
        return self.attn.o_proj(a)

    def mlp(self, v: torch.Tensor) -> torch.Tensor:
        return self.layer.mlp(v)

    def mlp_weights(self):
        m = self.layer.mlp
        return m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight

    def attention_weights(self):
        a = self.attn
        return a.q_proj.weight, a.q_proj.bias, a.o_proj.weight  # o_proj has no bias here

    def projector_weights(self):
        p = self.projector
        return p.gate_proj.weight, p.down_proj.weight, p.up_proj.weight


class Backbone(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        routed = set(config.get("routing_layers") or ())
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(config, i, i in routed)
                                    for i in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-6))


class BenchStack(nn.Module):
    """A Llama-3 / Qwen3 skipper model with a dense forward and a routed (mixed-depth) forward."""

    def __init__(self, config: dict, capacity: int = 64, backend: str = "auto", tiles: Any = None) -> None:
        super().__init__()
        model_type = config.get("model_type")
        if model_type not in QWEN3_TYPES + LLAMA_TYPES:
            raise ValueError(f"config field 'model_type' must be one of {QWEN3_TYPES + LLAMA_TYPES}, "
                             f"got {model_type!r}")
        self.config = config
        self.model = Backbone(config)
        self.tied = bool(config.get("tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        self.routed_layers = tuple(config.get("routing_layers") or ())
        self.capacity = capacity
        self.requested_backend = backend
        self.tiles = tiles
        self.stats = LayerStats()
        self._tape: RouteTape | None = None
        self._builder: CohortBuilder | None = None
        self.last_tape: RouteTape | None = None  # the tape of the latest routed forward (inspection)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu", **kwargs: Any) -> BenchStack:
        """Load a skipper checkpoint directory (config.json + *.safetensors) by its real tensor names."""
        from safetensors.torch import load_file

        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        model = cls(config, **kwargs)
        state: dict[str, torch.Tensor] = {}
        for file in sorted(path.glob("*.safetensors")):
            state |= {k: v for k, v in load_file(str(file)).items() if not is_router_tensor(k)}
        if not state:
            raise FileNotFoundError(f"{path}: no *.safetensors files")
        if model.tied:
            state.pop("lm_head.weight", None)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not is_router_tensor(k)]
        if missing or unexpected:
            raise KeyError(f"{path}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
        if model.routed_layers:
            for layer, (router, adapter) in load_skipper_modules(path).items():
                model.model.layers[layer].router.load_state_dict(router.state_dict())
                model.model.layers[layer].router_proj.load_state_dict(adapter.state_dict())
        target = dtype or getattr(torch, config.get("torch_dtype", "float32"))
        return model.to(device=device, dtype=target).eval()

    # -- execution state ------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def tape(self) -> RouteTape:
        """The model's route tape, allocated once (capacity x routed layers) and reused every step."""
        if self._tape is None or self._tape.run.device != self.device or self._tape.weights.dtype != self.dtype:
            self._tape = RouteTape(self.capacity, self.routed_layers, self.dtype, self.device)
            self._builder = CohortBuilder(self.capacity, self.device)
        return self._tape

    def backend_for(self, phase: str) -> str:
        backend = select_backend(self.requested_backend, self.device)
        return "torch" if phase == "prefill" else backend  # prefill: torch matmul over packed rows

    def new_kv_cache(self, num_pages: int, page_size: int, max_requests: int, max_context: int) -> PagedKVCache:
        c = self.config
        head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
        return PagedKVCache(c["num_hidden_layers"], num_pages, page_size, c["num_key_value_heads"], head_dim,
                            max_requests, max_context, self.dtype, self.device)

    # -- forward ----------------------------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache,
                skipper: Skipper | None = None, layer_inputs: list | None = None) -> torch.Tensor:
        """Final-normed hidden states [rows, d]. Dense when `skipper` is None; routed otherwise.

        `layer_inputs`, when given, receives every layer's input [rows, d] (for the Invariant 1 check).
        """
        x = self.embed(input_ids)
        impl = self.backend_for(batch.phase)  # dense layers read attention the same way as routed ones
        routed = skipper is not None and bool(self.routed_layers)
        if routed:
            tape, builder = self.tape(), self._builder
            if batch.rows > tape.capacity:
                if batch.phase == "decode":
                    raise ValueError(f"decode batch of {batch.rows} rows exceeds the routed capacity "
                                     f"{tape.capacity} (the captured graph's batch size)")
                # Prefill runs outside graph capture: a packed prompt larger than the capacity gets a tape of
                # its own size for this forward.
                tape = RouteTape(batch.rows, self.routed_layers, self.dtype, self.device)
                builder = CohortBuilder(batch.rows, self.device)
            self.last_tape = tape
            tape.pad(batch.rows)
            backend = self.backend_for(batch.phase)
            self.stats.backends[batch.phase] = backend
            context = BatchContext(x, batch.valid, self.routed_layers, batch.phase, batch.request_keys,
                                   batch.positions)
            state = None
            if backend == "triton":  # the skipper's routes in one launch where it has a fused form, as served
                from vskipper.mixed.routes import fused_state

                state = fused_state(skipper, context)
            if state is None:
                state = skipper.prepare_batch(context)
        owned = False  # x is a layer's output, which no one else reads (not the embeddings, nor a kept input)
        for layer in self.model.layers:
            if layer_inputs is not None:
                layer_inputs.append(x)
            if routed and layer.routed:
                u = layer.input_layernorm(x)
                router = layer.router if skipper.requires_router_weights else None
                route = skipper.route(layer.layer_id, u, state, router)
                cohorts = None  # the torch execution packs its cohorts itself
                if backend == "triton":  # the tape's record and the cohort maps in one launch
                    cohorts = builder.record_and_build(tape, layer.layer_id, route, batch.dense_rows)
                else:
                    tape.record(layer.layer_id, route, batch.dense_rows)
                run, weights = tape.layer(layer.layer_id, batch.rows)
                x = layer.forward_routed(x, u, run, weights, cohorts, batch, kv, backend, self.stats, self.tiles,
                                         x_owned=owned)
            else:
                x = layer(x, batch, kv, impl)
            owned = layer_inputs is None
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return hidden @ weight.t()

    def attestation(self) -> dict[str, Any]:
        """What executes, as a plain dict: backends per phase, counters, capacity, tile source."""
        return {
            "requested_backend": self.requested_backend,
            "decode_backend": self.backend_for("decode"),
            "prefill_backend": "torch",
            "device": str(self.device),
            "triton_installed": triton_available(),
            "triton_interpreted": triton_interpreted(),
            "capacity": self.capacity,
            "routed_layers": list(self.routed_layers),
            "routed_layer_passes": self.stats.routed_layer_passes,
            "all_run_fast_path": self.stats.all_run_fast_path,
            "cohort_passes": self.stats.cohort_passes,
            "cohort_counts": "device scalars" if self.backend_for("decode") == "triton" else "cohort shapes",
            "backends_used": dict(self.stats.backends),
            "tiles": self._tile_source(),
        }

    def _tile_source(self) -> str | None:
        if self.tiles is not None:
            return getattr(self.tiles, "source", "explicit tile")
        if self.backend_for("decode") != "triton":
            return None
        if self.device.type != "cuda":
            return "interpreter tile"
        from vskipper.mixed.kernels import device_tile_table

        return device_tile_table(self.device).source
