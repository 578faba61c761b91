"""FlexiDepth-Llama in SGLang: upstream's Llama model file, with the routed layers executing mixed depth.

The dense layers, the dense forward of a routed layer, attention, the KV pool and the logits are SGLang's own
(`sglang.srt.models.llama`). On a pass with routed rows a routed layer runs the mixed-depth body of
`vskipper.sglang.models.routed` (RUN rows: attention and MLP; Project-Only rows: their K/V written, the adapter
only).

Upstream's Llama layers hand on (delta, residual) and add them in the next layer's fused add-norm (or the final
norm's). A routed layer does the same: its input x and u = LN1 x come from upstream's fused add-norm, and it
hands on the body's `Handoff` (delta, residual), whose sum the next fused add-norm forms.
"""

from __future__ import annotations

from sglang.srt.models import llama
from sglang.srt.models.llama import LlamaDecoderLayer, LlamaForCausalLM

from vskipper.sglang.models.routed import RoutedLayerMixin, SkipperCausalLM


class RoutedLlamaDecoderLayer(RoutedLayerMixin, LlamaDecoderLayer):
    def forward(self, positions, hidden_states, forward_batch, residual):
        step = self.routed_step()
        if step is None:
            return super().forward(positions, hidden_states, forward_batch, residual)
        if residual is None:  # the first layer: its input is the embeddings, left as they are
            x, u = hidden_states, self.input_layernorm(hidden_states)
        else:  # x is the residual buffer the add-norm formed (on CUDA, `residual` updated in place): the layer's own
            u, x = self.input_layernorm(hidden_states, residual)
        return tuple(self.mixed_depth(step, positions, x, forward_batch, u, x_owned=residual is not None))


class DDLlamaForCausalLM(SkipperCausalLM, LlamaForCausalLM):
    upstream_layer = (llama, "LlamaDecoderLayer")
    routed_layer_class = RoutedLlamaDecoderLayer


EntryClass = DDLlamaForCausalLM
