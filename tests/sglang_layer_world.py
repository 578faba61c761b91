"""The served routed layer in this process (`vskipper.sglang.standalone`): SGLang's real decoder layers (Llama,
Qwen3) with vSkipper's routed body, SGLang's real KV pool, request-to-token pool and attention backend (torch-native
unless asked), on CPU; here with the tiny checkpoints' configs, the dense reference and the routed pass the tests
compare.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vskipper.sglang.standalone import TORCH_NATIVE, StandaloneLayer, device_process, init_sglang

device_process("cpu")  # before any test module of this process imports SGLang
__all__ = ["ARCHS", "LayerWorld", "init_sglang"]
ARCHS = ("flexidepth-llama", "qwen3-skipper")  # the two routed model families


class LayerWorld(StandaloneLayer):
    """One routed decoder layer (random weights) over a KV pool shared by `requests` request slots."""

    @classmethod
    def prefilled(cls, arch: str, tmp: Path, seed: int, prompts: dict[int, int]) -> LayerWorld:
        """A world whose requests' prompt K/V (request -> prompt tokens) is already written at this layer."""
        world = cls(arch, tmp, seed=seed)
        fb = world.batch(prompts)
        world.dense(fb, world.hidden(fb.positions.shape[0]))
        return world

    def __init__(self, arch: str, tmp: Path, seed: int = 0, layer_id: int = 2, requests: int = 4,
                 slots: int = 160, context: int = 32, attention_backend: str = TORCH_NATIVE) -> None:
        init_sglang()
        from transformers import AutoConfig

        from vskipper.checkpoint import make_tiny_model
        from vskipper.sglang.configs import register_configs

        register_configs()
        config = AutoConfig.from_pretrained(str(make_tiny_model(arch, tmp / arch)))
        super().__init__(config, layer_id=layer_id, requests=requests, slots=slots, context=context, seed=seed,
                         attention_backend=attention_backend)
        self.arch = arch

    def hidden(self, rows: int) -> torch.Tensor:
        return torch.randn(rows, self.config.hidden_size, generator=self.gen)

    def route(self, run: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """(run mask, weights): RUN rows with unit weight (so they compare with the dense layer), Project-Only rows
        with a random one."""
        run_t = torch.tensor(run)
        return run_t, torch.where(run_t, torch.ones(len(run)), torch.rand(len(run), generator=self.gen) * 0.8 + 0.1)

    def dense(self, fb, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        """The dense layer through SGLang's own modules: h = x + Attn(LN1 x); y = h + MLP(LN2 h), its attention
        through `backend` (by default the world's, which `batch` planned; another is planned here)."""
        layer = self.layer
        if backend is not None:
            self.plan(fb, backend)
        with self.context(backend), torch.no_grad():
            h = x + layer.self_attn(positions=fb.positions, hidden_states=layer.input_layernorm(x), forward_batch=fb)
            return h + layer.mlp(layer.post_attention_layernorm(h))

    def routed(self, fb, x: torch.Tensor, run: torch.Tensor, weights: torch.Tensor, watch=None,
               x_owned: bool = False, handoff: bool = False):
        """The routed layer's body on this pass, with the given route; `watch` (a context manager) wraps the
        layer's forward alone (the pass is planned outside it); `x_owned`: x handed over as the layers hand over a
        residual no one else holds (the body and the hand-off's sum update it in place); `handoff`: the body's
        `Handoff` rather than its sum."""
        from contextlib import nullcontext

        from mixed_world import TapeSkipper

        from vskipper.mixed.cohorts import CohortBuilder
        from vskipper.mixed.tape import RouteTape
        from vskipper.sglang.models.routed import plan_pass
        from vskipper.sglang.runtime import Step

        rows = x.shape[0]
        lid = self.layer.layer_id
        step = Step(fb.forward_mode.is_decode() and "decode" or "prefill", True, TapeSkipper({lid: (run, weights)}),
                    None, RouteTape(rows, (lid,)), CohortBuilder(rows), None, rows)
        self.slot.step, self.slot.plan = step, plan_pass(fb, rows)
        try:
            with self.context(), torch.no_grad(), watch or nullcontext():
                out = self.layer.mixed_depth(step, fb.positions, x, fb, x_owned=x_owned)
                return out if handoff else out.output(in_place=x_owned)
        finally:
            self.slot.step = self.slot.plan = None

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        lid = self.layer.layer_id
        return self.pool.get_key_buffer(lid).clone(), self.pool.get_value_buffer(lid).clone()

    def restore(self, kv: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> None:
        lid = self.layer.layer_id
        self.pool.get_key_buffer(lid).copy_(kv[0])
        self.pool.get_value_buffer(lid).copy_(kv[1])
        self.lengths = list(lengths)
