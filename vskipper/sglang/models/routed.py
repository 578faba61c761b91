"""What the skipper model classes share: the per-pass step slot, the mixed-depth layer body, the model wrapper
that plans each pass, and the router/adapter weight loading.

A routed layer (x: the layer input, u = LN1 x, w: the tape's branch weight, as in `vskipper.mixed`) runs, on a
pass with routed rows:

  RUN row           h = x + Attn(u);  y = h + w * MLP(LN2 h)
  Project-Only row  y = x + w * Proj(LN2 x)

Every row's K/V is written to SGLang's KV pool through the attention backend (its `set_kv_buffer`), Project-Only
rows included (Invariant 1); the attention output of Project-Only rows is dropped with a select, so they read
nothing into their residual. The MLP and the adapter run over their cohorts with `vskipper.mixed`'s cohort FFN
(torch backend: this path serves CPU, with CUDA graphs off). Rows of dense-mode requests in a routed pass RUN
with unit weight (the tape's `dense_rows`), so they compute what the dense forward computes.

The model files add only how their upstream layer hands the residual across the layer boundary.

(No `EntryClass`: SGLang's registry imports this module and registers nothing from it.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from sglang.srt.distributed import tensor_model_parallel_all_reduce

from vskipper.mixed.backend import cohort_ffn
from vskipper.sglang.runtime import Step, get_runtime
from vskipper.skippers.modules import ProjectorAdapter, SkipRouter, router_sizes

ROUTER_MARKERS = (".router.", ".router_proj.")


class StepSlot:
    """The current forward pass's `Step`, set by the model around its forward and read by its routed layers."""

    def __init__(self) -> None:
        self.step: Step | None = None
        self.runtime = None


def _router_config(config) -> dict:
    return {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "router_reduction_factor": getattr(config, "router_reduction_factor", 16),
            "proj_reduction_factor": getattr(config, "proj_reduction_factor", 16)}


class MixedDepthLayer:
    """For a routed layer class placed before its upstream SGLang decoder layer: the checkpoint's `router` and
    `router_proj` modules, and the mixed-depth body over the layer's own norms, attention and MLP."""

    def __init__(self, config, layer_id: int, slot: StepSlot, **upstream) -> None:
        super().__init__(config=config, layer_id=layer_id, **upstream)
        r, m = router_sizes(_router_config(config))
        self.layer_id = layer_id
        self.router = SkipRouter(config.hidden_size, r, config.rms_norm_eps)
        self.router_proj = ProjectorAdapter(config.hidden_size, m)
        self._slot = slot

    def routed_step(self) -> Step | None:
        """This pass's step when it has routed rows; None: the upstream (dense) forward runs."""
        step = self._slot.step
        return step if step is not None and step.routed else None

    def mixed_depth(self, step: Step, positions: torch.Tensor, x: torch.Tensor, forward_batch) -> torch.Tensor:
        """The layer output y [rows, d] from its complete input x (the residual stream at the layer)."""
        u = self.input_layernorm(x)
        router = self.router if step.skipper.requires_router_weights else None
        step.tape.record(self.layer_id, step.skipper.route(self.layer_id, u, step.state, router), step.dense_rows)
        run, weights = step.tape.layer(self.layer_id, step.rows)
        self._slot.runtime.record_layer(step, self.layer_id, run)
        cohorts = step.builder.build(run)
        n_proj = int(cohorts.n_proj)  # host read: free on CPU, and this path runs eagerly
        attn = self.self_attn(positions=positions, hidden_states=u, forward_batch=forward_batch)
        if n_proj:
            attn = torch.where(run.view(-1, 1), attn, torch.zeros((), dtype=attn.dtype, device=attn.device))
        h = x + attn
        v = self.post_attention_layernorm(h)
        if n_proj == 0:  # all-RUN fast path: the branch weight still scales the MLP
            return h + weights.view(-1, 1).to(h.dtype) * self.mlp(v)
        # Under tensor parallelism this rank holds a slice of the MLP's intermediate width (column-parallel
        # gate/up, row-parallel down): its cohort output is a partial sum, reduced across the TP group as the
        # upstream MLP reduces its own. The adapter is replicated on every rank.
        gate_up = self.mlp.gate_up_proj.weight
        inter = gate_up.shape[0] // 2
        mlp_out = torch.zeros_like(h)
        cohort_ffn("torch", v, cohorts.run_idx, cohorts.n_run, weights, gate_up[:inter], gate_up[inter:],
                   self.mlp.down_proj.weight, mlp_out, op="mlp")
        y = h + tensor_model_parallel_all_reduce(mlp_out)  # Project-Only rows: h = x, so LN2 h = LN2 x
        p = self.router_proj
        cohort_ffn("torch", v, cohorts.proj_idx, cohorts.n_proj, weights, p.gate_proj.weight, p.down_proj.weight,
                   p.up_proj.weight, y, op="proj")
        return y


def is_router_tensor(name: str) -> bool:
    return any(m in name for m in ROUTER_MARKERS)


def split_router_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         loaded: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Load the router/adapter tensors by their checkpoint names; pass every other tensor through.

    Upstream loaders would mangle them (`router_proj.gate_proj` looks like a stacked MLP shard), so they never
    reach them."""
    params = dict(model.named_parameters())
    for name, tensor in weights:
        if not is_router_tensor(name):
            yield name, tensor
            continue
        param = params.get(name)
        if param is None:
            raise KeyError(f"checkpoint tensor {name!r} has no parameter: its layer is not in 'routing_layers'")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
        loaded.add(name)


def check_router_weights(model: torch.nn.Module, loaded: set[str]) -> None:
    missing = sorted(n for n, _ in model.named_parameters() if is_router_tensor(n) and n not in loaded)
    if missing:
        raise KeyError(f"checkpoint lacks router/adapter tensor {missing[0]!r} ({len(missing)} missing)")


class RouterWeightsMixin:
    """For a skipper model class placed before its SGLang base: the router/adapter tensors are taken out of
    the checkpoint stream by their real names (upstream's loader would read `router_proj.gate_proj` as an
    MLP shard), the rest goes to upstream's loader, and a missing router tensor is an error naming it."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        loaded: set[str] = set()
        result = super().load_weights(split_router_weights(self, weights, loaded))
        check_router_weights(self, loaded)
        return result


class SkipperCausalLM(RouterWeightsMixin):
    """For a skipper model class placed before its SGLang CausalLM base: the checkpoint's `routing_layers` are
    replaced by the class's routed layers (`routed_layer`), and every forward pass is planned by the runtime
    (the step its routed layers read) and counted after."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        self.slot = StepSlot()
        self.routed_layers = tuple(int(i) for i in (getattr(config, "routing_layers", None) or ()))
        for i in self.routed_layers:
            if self.model.start_layer <= i < self.model.end_layer:
                self.model.layers[i] = self.routed_layer(config, i, quant_config, prefix=f"model.layers.{i}")
        device = str(self.model.embed_tokens.weight.device)
        self.runtime = get_runtime(config.model_type, self.routed_layers, type(self).__name__, device)
        self.slot.runtime = self.runtime

    def routed_layer(self, config, layer_id: int, quant_config, prefix: str) -> torch.nn.Module:
        raise NotImplementedError(f"{type(self).__name__} must define routed_layer")

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, get_embedding=False,
                pp_proxy_tensors=None):
        if input_embeds is None:
            input_embeds = self.model.embed_tokens(input_ids)
        rids = forward_batch.rids or []
        step = None
        if len(rids) == forward_batch.batch_size:
            step = self.runtime.plan(forward_batch, input_embeds, positions)
        self.slot.step = step
        try:
            out = super().forward(input_ids, positions, forward_batch, input_embeds, get_embedding,
                                  pp_proxy_tensors)
        finally:
            self.slot.step = None
        if step is not None:
            self.runtime.finish(step)
        return out
