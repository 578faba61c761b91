"""FlexiDepth-Llama in SGLang: upstream's Llama model file, with the routed layers executing mixed depth.

The dense layers, the dense forward of a routed layer, attention, the KV pool and the logits are SGLang's own
(`sglang.srt.models.llama`). On a pass with routed rows a routed layer runs the mixed-depth body of
`vskipper.sglang.models.routed` (RUN rows: attention and MLP; Project-Only rows: their K/V written, the adapter
only).

Upstream's Llama layers hand on (delta, residual) and add them in the next layer's fused add-norm (or the final
norm's). A routed layer takes x = delta + residual as its input and hands on (y, 0).
"""

from __future__ import annotations

import torch
from sglang.srt.models.llama import LlamaDecoderLayer, LlamaForCausalLM

from vskipper.sglang.models.routed import RoutedLayerMixin, SkipperCausalLM


class RoutedLlamaDecoderLayer(RoutedLayerMixin, LlamaDecoderLayer):
    def forward(self, positions, hidden_states, forward_batch, residual):
        step = self.routed_step()
        if step is None:
            return super().forward(positions, hidden_states, forward_batch, residual)
        x = hidden_states if residual is None else hidden_states + residual
        y = self.mixed_depth(step, positions, x, forward_batch)
        return y, torch.zeros_like(y)


class DDLlamaForCausalLM(SkipperCausalLM, LlamaForCausalLM):
    def routed_layer(self, config, layer_id, quant_config, prefix):
        return RoutedLlamaDecoderLayer(config, layer_id, self.slot, quant_config=quant_config, prefix=prefix)


EntryClass = DDLlamaForCausalLM
