"""The served routed layer in this process: SGLang's real decoder layers (Llama, Qwen3) with vSkipper's routed
body, SGLang's real KV pool, request-to-token pool and torch-native attention backend, on CPU.

SGLang's layers need its runtime context and a model-parallel group even at TP = 1: `init_sglang` publishes a
one-process topology (gloo) once per test process, as SGLang's own layer tests do. The forward batch is a plain
object with the fields the layer, the backend and the routed body read.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
_READY = False
# SGLang decides its platform from the environment when its modules are first imported, and its CPU engine
# imports `sgl_kernel` (the server's stand-in in vskipper/sglang/shims): both are set before any is imported.
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
if str(ROOT / "vskipper" / "sglang" / "shims") not in sys.path:
    sys.path.insert(0, str(ROOT / "vskipper" / "sglang" / "shims"))


def init_sglang() -> None:
    """SGLang's runtime context and a one-process gloo model-parallel group (idempotent)."""
    global _READY
    if _READY:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=1, pp_size=1, device="cpu"), role="test",
            ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    parallel_state.initialize_model_parallel(backend="gloo")
    _READY = True


ARCHS = ("flexidepth-llama", "qwen3-skipper")  # the two routed model families


class LayerWorld:
    """One routed decoder layer (random weights) over a KV pool shared by `requests` request slots."""

    @classmethod
    def prefilled(cls, arch: str, tmp: Path, seed: int, prompts: dict[int, int]) -> LayerWorld:
        """A world whose requests' prompt K/V (request -> prompt tokens) is already written at this layer."""
        world = cls(arch, tmp, seed=seed)
        fb = world.batch(prompts)
        world.dense(fb, world.hidden(fb.positions.shape[0]))
        return world

    def __init__(self, arch: str, tmp: Path, seed: int = 0, layer_id: int = 2, requests: int = 4,
                 slots: int = 160, context: int = 32) -> None:
        init_sglang()
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from transformers import AutoConfig

        from vskipper.checkpoint import make_tiny_model
        from vskipper.sglang.configs import register_configs
        from vskipper.sglang.models.routed import StepSlot

        register_configs()
        path = make_tiny_model(arch, tmp / arch)
        self.config = config = AutoConfig.from_pretrained(str(path))
        self.slot = StepSlot()
        if arch == "flexidepth-llama":
            from vskipper.sglang.models.ddllama import RoutedLlamaDecoderLayer

            layer = RoutedLlamaDecoderLayer(config, layer_id, self.slot, quant_config=None,
                                            prefix=f"model.layers.{layer_id}")
        else:
            from vskipper.sglang.models.qwen3_skipper import RoutedQwen3DecoderLayer

            layer = RoutedQwen3DecoderLayer(config, layer_id, self.slot, start_layer=0, quant_config=None,
                                            prefix=f"model.layers.{layer_id}", alt_stream=None)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.1) + (p.dim() == 1))
        self.layer = layer.eval()
        self.gen = gen
        attn = layer.self_attn
        self.pool = MHATokenToKVPool(slots, 1, torch.float32, attn.num_kv_heads, attn.head_dim,
                                     config.num_hidden_layers, "cpu", False)
        self.req_pool = ReqToTokenPool(requests, context, "cpu", False)
        perm = torch.randperm(slots - 1, generator=gen)[: requests * context] + 1  # slot 0 stays free
        self.req_pool.req_to_token[:requests, :context] = perm.view(requests, context)
        self.backend = TorchNativeAttnBackend(SimpleNamespace(device="cpu", req_to_token_pool=self.req_pool,
                                                              token_to_kv_pool=self.pool))
        self.lengths = [0] * requests

    def context(self):
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        return forward_context(ForwardContext(attn_backend=self.backend))

    def batch(self, extend: dict[int, int]) -> SimpleNamespace:
        """A forward batch: `extend` maps request slot -> new tokens (all 1: a decode batch)."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        decode = all(n == 1 for n in extend.values()) and all(self.lengths[r] for r in extend)
        reqs = list(extend)
        prefix = [self.lengths[r] for r in reqs]
        seq = [self.lengths[r] + extend[r] for r in reqs]
        positions = torch.cat([torch.arange(p, s) for p, s in zip(prefix, seq, strict=True)])
        req_rows = torch.repeat_interleave(torch.tensor(reqs), torch.tensor([extend[r] for r in reqs]))
        out_loc = self.req_pool.req_to_token[req_rows, positions].to(torch.int64)
        for r in reqs:
            self.lengths[r] += extend[r]
        return SimpleNamespace(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND, positions=positions,
            out_cache_loc=out_loc, req_pool_indices=torch.tensor(reqs, dtype=torch.int64),
            seq_lens=torch.tensor(seq), seq_lens_cpu=torch.tensor(seq),
            extend_seq_lens=torch.tensor([extend[r] for r in reqs]), extend_seq_lens_cpu=[extend[r] for r in reqs],
            extend_prefix_lens=torch.tensor(prefix), encoder_lens=None, mha_return_lse=False)

    def hidden(self, rows: int) -> torch.Tensor:
        return torch.randn(rows, self.config.hidden_size, generator=self.gen)

    def dense(self, fb, x: torch.Tensor) -> torch.Tensor:
        """The dense layer through SGLang's own modules: h = x + Attn(LN1 x); y = h + MLP(LN2 h)."""
        layer = self.layer
        with self.context(), torch.no_grad():
            h = x + layer.self_attn(positions=fb.positions, hidden_states=layer.input_layernorm(x), forward_batch=fb)
            return h + layer.mlp(layer.post_attention_layernorm(h))

    def routed(self, fb, x: torch.Tensor, run: torch.Tensor, weights: torch.Tensor, watch=None) -> torch.Tensor:
        """The routed layer's body on this pass, with the given route; `watch` (a context manager) wraps the
        layer's forward alone (the pass is planned outside it)."""
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
                return self.layer.mixed_depth(step, fb.positions, x, fb).output()
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
