"""Qwen3 skipper checkpoints in SGLang: upstream's Qwen3 model file, serving the dense arm.

The routed layers carry the checkpoint's `router` and `router_proj` modules (loaded by their real names, so a
skipper checkpoint loads as it is and is checked complete), and every pass is counted for the attestation.
Routed execution is not wired for Qwen3 yet: upstream's Qwen3 layers drive their residual through SGLang's
layer-boundary stages, which a routed layer must take over. A routed arm is refused at startup.
"""

from __future__ import annotations

import torch
from sglang.srt.models.qwen3 import Qwen3ForCausalLM

from vskipper.sglang.models.routed import RouterWeightsMixin
from vskipper.sglang.runtime import ServeConfigError, get_runtime
from vskipper.skippers.modules import ProjectorAdapter, SkipRouter, router_sizes


class Qwen3SkipperForCausalLM(RouterWeightsMixin, Qwen3ForCausalLM):
    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        self.routed_layers = tuple(int(i) for i in (getattr(config, "routing_layers", None) or ()))
        r, m = router_sizes({"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
                             "router_reduction_factor": getattr(config, "router_reduction_factor", 16),
                             "proj_reduction_factor": getattr(config, "proj_reduction_factor", 16)})
        for i in self.routed_layers:
            layer = self.model.layers[i]
            layer.router = SkipRouter(config.hidden_size, r, config.rms_norm_eps)
            layer.router_proj = ProjectorAdapter(config.hidden_size, m)
        device = str(self.model.embed_tokens.weight.device)
        self.runtime = get_runtime(config.model_type, self.routed_layers, type(self).__name__, device)
        if self.runtime.skipper is not None:
            raise ServeConfigError(
                f"arm {self.runtime.arm.name!r}: routed execution of Qwen3 skipper checkpoints is not available "
                "in this server yet; serve them with --arm dense")

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, get_embedding=False,
                pp_proxy_tensors=None):
        rids = forward_batch.rids or []
        step = None
        if len(rids) == forward_batch.batch_size:
            hidden = torch.empty(input_ids.shape[0], 0)
            step = self.runtime.plan(forward_batch, hidden, positions)
        out = super().forward(input_ids, positions, forward_batch, input_embeds, get_embedding, pp_proxy_tensors)
        if step is not None:
            self.runtime.finish(step)
        return out


EntryClass = Qwen3SkipperForCausalLM
