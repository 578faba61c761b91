"""Qwen3 skipper checkpoints in SGLang: upstream's Qwen3 model file, with the routed layers executing mixed depth.

The dense layers, the dense forward of a routed layer, attention (per-head q/k RMSNorm, then RoPE), the KV pool
and the logits are SGLang's own (`sglang.srt.models.qwen3`). On a pass with routed rows a routed layer runs the
mixed-depth body of `vskipper.sglang.models.routed` (RUN rows: attention and MLP; Project-Only rows: their K/V
written, the adapter only).

Upstream's Qwen3 layers keep the residual in the forward batch's residual stream (SGLang's layer-boundary
stages): a layer leaves its output pending there, and the next layer's input boundary (or the final norm) adds
it to the residual and normalizes. A routed layer folds the pending output into the residual, which gives its
input x (at the first layer, the embeddings), and hands on y as the written residual, with nothing pending: the
next layer's boundary reads LN1 y, the final norm reads norm(y). Where the fold formed x (a sum no one else
holds) or x is a routed layer's y, the layer forms y on x in place; the embeddings it leaves as they came.
"""

from __future__ import annotations

from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.models import qwen3
from sglang.srt.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM

from vskipper.sglang.models.routed import RoutedLayerMixin, SkipperCausalLM


class RoutedQwen3DecoderLayer(RoutedLayerMixin, Qwen3DecoderLayer):
    def forward(self, positions, hidden_states, forward_batch, post_residual_addition=None, capture_output=None):
        step = self.routed_step()
        if step is None:
            return super().forward(positions, hidden_states, forward_batch, post_residual_addition, capture_output)
        if post_residual_addition is not None or capture_output is not None:
            raise NotImplementedError(f"routed layer {self.layer_id}: post_residual_addition and capture_output "
                                      "(multimodal deepstack, speculative capture) are not served routed")
        # Past a first layer the stream holds a residual: the fold adds a dense layer's pending output onto it (a
        # sum formed afresh), or x is that residual, a routed layer's written y. The body and the hand-off update
        # either in place. A first layer's x is the embeddings, and a pending output with no residual the
        # producer's own (possibly borrowed) tensor: kept.
        x_owned = residual_batch.current(forward_batch).residual is not None
        x = residual_batch.fold(hidden_states, forward_batch)
        y = self.mixed_depth(step, positions, x, forward_batch, x_owned=x_owned).output(in_place=x_owned)
        return residual_batch.written(y, forward_batch)


class Qwen3SkipperForCausalLM(SkipperCausalLM, Qwen3ForCausalLM):
    upstream_layer = (qwen3, "Qwen3DecoderLayer")
    routed_layer_class = RoutedQwen3DecoderLayer


EntryClass = Qwen3SkipperForCausalLM
