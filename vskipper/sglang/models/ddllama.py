"""FlexiDepth-Llama in SGLang: upstream's Llama model file, with the routed layers executing mixed depth.

The dense layers, the dense forward of a routed layer, attention, the KV pool and the logits are SGLang's own
(`sglang.srt.models.llama`). A routed layer adds the checkpoint's `router` and `router_proj` (adapter) modules
and, on a pass with routed rows, runs (x: layer input, w: the tape's branch weight, as in `vskipper.mixed`):

  RUN row           h = x + Attn(LN1 x);  y = h + w * MLP(LN2 h)
  Project-Only row  y = x + w * Proj(LN2 x)

Every row's K/V is written to SGLang's KV pool through the attention backend (its `set_kv_buffer`), Project-Only
rows included (Invariant 1); the attention output of Project-Only rows is dropped with a select, so they read
nothing into their residual. The MLP and the adapter run over their cohorts with `vskipper.mixed`'s cohort FFN
(torch backend: this path serves CPU, with CUDA graphs off). Rows of dense-mode requests in a routed pass RUN
with unit weight (the tape's `dense_rows`), so they compute what the dense forward computes.
"""

from __future__ import annotations

import torch
from sglang.srt.models.llama import LlamaDecoderLayer, LlamaForCausalLM

from vskipper.mixed.backend import cohort_ffn
from vskipper.sglang.models.routed import RouterWeightsMixin, StepSlot
from vskipper.sglang.runtime import get_runtime
from vskipper.skippers.modules import ProjectorAdapter, SkipRouter, router_sizes


def _config_dict(config) -> dict:
    return {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "router_reduction_factor": getattr(config, "router_reduction_factor", 16),
            "proj_reduction_factor": getattr(config, "proj_reduction_factor", 16)}


class RoutedLlamaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_id: int, slot: StepSlot, quant_config=None, prefix: str = "") -> None:
        super().__init__(config=config, layer_id=layer_id, quant_config=quant_config, prefix=prefix)
        r, m = router_sizes(_config_dict(config))
        self.layer_id = layer_id
        self.router = SkipRouter(config.hidden_size, r, config.rms_norm_eps)
        self.router_proj = ProjectorAdapter(config.hidden_size, m)
        self._slot = slot

    def forward(self, positions, hidden_states, forward_batch, residual):
        step = self._slot.step
        if step is None or not step.routed:
            return super().forward(positions, hidden_states, forward_batch, residual)
        x = hidden_states if residual is None else hidden_states + residual
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
            y = h + weights.view(-1, 1).to(h.dtype) * self.mlp(v)
        else:
            y = h.clone()
            gate_up = self.mlp.gate_up_proj.weight
            inter = gate_up.shape[0] // 2
            cohort_ffn("torch", v, cohorts.run_idx, cohorts.n_run, weights, gate_up[:inter], gate_up[inter:],
                       self.mlp.down_proj.weight, y, op="mlp")
            p = self.router_proj
            cohort_ffn("torch", v, cohorts.proj_idx, cohorts.n_proj, weights, p.gate_proj.weight,
                       p.down_proj.weight, p.up_proj.weight, y, op="proj")
        # SGLang's layers pass (delta, residual); the next layer's fused norm adds them back.
        return y, torch.zeros_like(y)


class DDLlamaForCausalLM(RouterWeightsMixin, LlamaForCausalLM):
    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        self.slot = StepSlot()
        self.routed_layers = tuple(int(i) for i in (getattr(config, "routing_layers", None) or ()))
        for i in self.routed_layers:
            if self.model.start_layer <= i < self.model.end_layer:
                self.model.layers[i] = RoutedLlamaDecoderLayer(config, i, self.slot, quant_config,
                                                               prefix=f"model.layers.{i}")
        device = str(self.model.embed_tokens.weight.device)
        self.runtime = get_runtime(config.model_type, self.routed_layers, type(self).__name__, device)
        self.slot.runtime = self.runtime

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


EntryClass = DDLlamaForCausalLM
