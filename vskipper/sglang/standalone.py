"""One served routed decoder layer outside a server, in this process: SGLang's real decoder layer (Llama or Qwen3)
with vSkipper's routed body, SGLang's real KV pool, request-to-token pool and attention backend (its torch-native
one, or its Triton one, which the device runs' servers read through), on CPU or on a CUDA device. The served
layer's tests build on it (`tests/sglang_layer_world.py`), and so do the CPU bench's decode profile
(`benchmarks/bench_cpu.py`) and the served-layer section of `benchmarks/mixed_depth_bench.py`.

SGLang's layers need its runtime context and a model-parallel group even at TP = 1: `init_sglang` publishes a
one-process topology (gloo) once per process, as SGLang's own layer tests do. Before that, `device_process`
prepares the process as the server's profile for that platform (`platform_profile`) prepares the server: on CPU
SGLang's CPU engine and the CPU `sgl_kernel` stand-in, on a GPU without SGLang's kernel wheels the CUDA stand-ins.
SGLang decides its platform from the environment when its modules are first imported.
So this module imports no SGLang at import time, and a process that uses it imports SGLang only after
`device_process` (or `init_sglang`) has run. It sets RANK, WORLD_SIZE and MASTER_* in the environment: a process
that starts servers runs it in a child process.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from vskipper.sglang.backend_read import TRITON

_READY: str | None = None  # the device type SGLang's context was published for
PLATFORMS = {"cpu": "cpu", "cuda": "gpu"}  # device type -> the serving platform whose profile prepares it
# The attention backends a standalone layer builds (as `--attention-backend` names them): the torch-native one (the
# CPU servers') and the Triton one (the GPU stand-in servers'; on CPU its kernels run in the Triton interpreter).
TORCH_NATIVE = "torch_native"
ATTENTION_BACKENDS = (TORCH_NATIVE, TRITON)


def device_process(device: str = "cpu") -> None:
    """The environment and stand-ins (first on sys.path) of the server's profile for `device` ('cpu' or 'cuda') in
    this process; idempotent."""
    from vskipper.sglang.cli import platform_profile

    if device not in PLATFORMS:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    profile = platform_profile(PLATFORMS[device])
    os.environ.update(profile.environment)
    for path in reversed(profile.path):
        if path not in sys.path:
            sys.path.insert(0, path)


def init_sglang(device: str = "cpu") -> None:
    """SGLang's runtime context for `device` ('cpu' or 'cuda') and a one-process gloo model-parallel group
    (idempotent; one device type per process)."""
    global _READY
    if _READY is not None:
        if _READY != device:
            raise RuntimeError(f"SGLang's context in this process is published for {_READY}, not {device}")
        return
    device_process(device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=1, pp_size=1, device=device), role="test",
            ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    parallel_state.initialize_model_parallel(backend="gloo")
    _READY = device


def routed_decoder_layer(config, layer_id: int, slot):
    """The model family's routed decoder layer (`config.model_type`), built with upstream's arguments."""
    prefix = f"model.layers.{layer_id}"
    if config.model_type == "ddllama":
        from vskipper.sglang.models.ddllama import RoutedLlamaDecoderLayer

        return RoutedLlamaDecoderLayer(config, layer_id, slot, quant_config=None, prefix=prefix)
    if config.model_type == "qwen3_skipper":
        from vskipper.sglang.models.qwen3_skipper import RoutedQwen3DecoderLayer

        return RoutedQwen3DecoderLayer(config, layer_id, slot, start_layer=0, quant_config=None, prefix=prefix,
                                       alt_stream=None)
    raise ValueError(f"no routed decoder layer for model_type {config.model_type!r}")


class StandaloneLayer:
    """One routed decoder layer (random weights) of `config` over a KV pool of `slots` slots shared by `requests`
    requests of up to `context` tokens each. Request r lives at SGLang's request slot r + 1 (`request_slot`): as
    in SGLang's request pool, slot 0 is kept free for the padding rows of a replayed graph (`padded`), and its
    every position is KV slot 0, SGLang's padding slot. Request r's positions live at random distinct KV slots.
    `batch` tracks each request's length. Everything lives on `device` (the weights are drawn on the host, so a
    seed gives the same layer on every device). Its passes read through `attention_backend` (one of
    `ATTENTION_BACKENDS`); `attention_backend(name)` builds another over the same pools, `plan` plans one for a
    batch."""

    def __init__(self, config, *, layer_id: int, requests: int, slots: int, context: int,
                 dtype: torch.dtype = torch.float32, seed: int = 0, device: str | torch.device = "cpu",
                 attention_backend: str = TORCH_NATIVE) -> None:
        self.device = torch.device(device)
        init_sglang(self.device.type)
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        from vskipper.sglang.models.routed import StepSlot

        if requests * context > slots - 1:
            raise ValueError(f"slots ({slots}) must hold requests x context ({requests} x {context}) plus slot 0")
        self.config = config
        self.slot = StepSlot()
        layer = routed_decoder_layer(config, layer_id, self.slot)
        self.gen = gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.1) + (p.dim() == 1))
        self.layer = layer.to(dtype).to(self.device).eval()
        attn = layer.self_attn
        where = str(self.device)
        # The pool holds this layer alone (SGLang's pipeline-stage layer range), addressed by its layer id.
        self.pool = MHATokenToKVPool(slots, 1, dtype, attn.num_kv_heads, attn.head_dim, 1, where, False,
                                     start_layer=layer_id, end_layer=layer_id)
        self.req_pool = ReqToTokenPool(requests, context, where, False)  # slots 0 (free) to `requests`
        perm = torch.randperm(slots - 1, generator=gen)[: requests * context] + 1
        self.req_pool.req_to_token[1: requests + 1, :context] = perm.view(requests, context).to(self.device)
        self._backends: dict[str, object] = {}
        self.backend_name = attention_backend
        self.backend = self.attention_backend(attention_backend)
        self.lengths = [0] * requests

    @staticmethod
    def request_slot(request: int) -> int:
        """SGLang's request slot of request `request` (its row of the request pool's `req_to_token`)."""
        return request + 1

    def attention_backend(self, name: str):
        """SGLang's attention backend `name` (one of `ATTENTION_BACKENDS`) over this layer's pools, built once."""
        if name not in self._backends:
            where = str(self.device)
            if name == TORCH_NATIVE:
                from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

                backend = TorchNativeAttnBackend(SimpleNamespace(device=where, req_to_token_pool=self.req_pool,
                                                                 token_to_kv_pool=self.pool))
            elif name == TRITON:
                backend = self._triton_backend()
            else:
                raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
            self._backends[name] = backend
        return self._backends[name]

    def _triton_backend(self):
        """SGLang's Triton attention backend, built as a model runner builds it: its model config read from this
        layer's config as SGLang reads a checkpoint's, the runner's pools and KV index translator."""
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

        with tempfile.TemporaryDirectory(prefix="vskipper-layer-") as tmp:
            self.config.to_json_file(str(Path(tmp) / "config.json"))
            model_config = ModelConfig(tmp)
        where = str(self.device)
        translator = KVIndexTranslator(req_to_token=self.req_pool.req_to_token, token_to_kv_pool_allocator=None,
                                       token_to_kv_pool=self.pool, page_size=1, device=where)
        runner = SimpleNamespace(
            req_to_token_pool=self.req_pool, token_to_kv_pool=self.pool, token_to_kv_pool_allocator=None,
            kv_index_translator=translator, model_config=model_config, sliding_window_size=None, page_size=1,
            decode_num_tokens_per_req=lambda: 1, is_draft_worker=False, device=where,
            gpu_id=self.device.index or 0, kv_cache_dtype=self.pool.dtype)
        return TritonAttnBackend(runner)

    def plan(self, fb: SimpleNamespace, backend: str | None = None):
        """Attention backend `backend` (by default the layer's) with its metadata planned for batch `fb`, as a
        model runner plans it before a forward (the backend's passes over `fb` follow)."""
        chosen = self.backend if backend is None else self.attention_backend(backend)
        chosen.init_forward_metadata(fb)
        return chosen

    def context(self, backend: str | None = None):
        """SGLang's forward context of this layer's passes: their attention backend (`backend`, by default the
        layer's), hence its pools."""
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        chosen = self.backend if backend is None else self.attention_backend(backend)
        return forward_context(ForwardContext(attn_backend=chosen))

    def batch(self, extend: dict[int, int]) -> SimpleNamespace:
        """A forward batch: `extend` maps request -> new tokens (all 1: a decode batch). Its tensors live on the
        layer's device, `seq_lens_cpu` and `extend_seq_lens_cpu` on the host (as SGLang's batches). The layer's
        attention backend plans its metadata for it (`plan`: another backend's passes over it plan their own)."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        decode = all(n == 1 for n in extend.values()) and all(self.lengths[r] for r in extend)
        reqs = list(extend)
        slots = [self.request_slot(r) for r in reqs]
        prefix = [self.lengths[r] for r in reqs]
        seq = [self.lengths[r] + extend[r] for r in reqs]
        positions = torch.cat([torch.arange(p, s) for p, s in zip(prefix, seq, strict=True)])
        req_rows = torch.repeat_interleave(torch.tensor(slots), torch.tensor([extend[r] for r in reqs]))
        dev = self.device
        out_loc = self.req_pool.req_to_token[req_rows.to(dev), positions.to(dev)].to(torch.int64)
        for r in reqs:
            self.lengths[r] += extend[r]
        fb = SimpleNamespace(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND, positions=positions.to(dev),
            out_cache_loc=out_loc, req_pool_indices=torch.tensor(slots, dtype=torch.int64, device=dev),
            batch_size=len(reqs), seq_lens=torch.tensor(seq, device=dev), seq_lens_cpu=torch.tensor(seq),
            seq_lens_sum=sum(seq), extend_seq_lens=torch.tensor([extend[r] for r in reqs], device=dev),
            extend_seq_lens_cpu=[extend[r] for r in reqs], extend_prefix_lens=torch.tensor(prefix, device=dev),
            extend_prefix_lens_cpu=prefix, encoder_lens=None, spec_info=None, mha_return_lse=False,
            mha_one_shot=False, attn_attend_prefix_cache=False)
        self.plan(fb)
        return fb

    def padded(self, fb: SimpleNamespace, rows: int, backend: str = TRITON) -> SimpleNamespace:
        """Decode batch `fb` padded to `rows` rows as SGLang's decode graph runner pads a batch to the size of the
        graph it replays (`ForwardBatch`'s padding): every row past the batch's request slot 0, KV slot 0 and
        position 0, and as many tokens of context as attention `backend`, whose graph it replays, fills in (the
        Triton backend: one). The layer's attention backend plans its metadata for it."""
        if not fb.forward_mode.is_decode() or not fb.batch_size <= rows <= self.req_pool.size:
            raise ValueError(f"pads a decode batch to at least its {fb.batch_size} rows and at most the request "
                             f"pool's {self.req_pool.size}, got {rows}")
        tail = rows - fb.batch_size
        fill = self.attention_backend(backend).get_cuda_graph_seq_len_fill_value()

        def pad(t: torch.Tensor, value: int = 0) -> torch.Tensor:
            return torch.cat([t, t.new_full((tail,), value)])

        out = SimpleNamespace(**vars(fb))
        out.batch_size = rows
        out.req_pool_indices, out.out_cache_loc, out.positions = (pad(fb.req_pool_indices), pad(fb.out_cache_loc),
                                                                  pad(fb.positions))
        out.seq_lens, out.seq_lens_cpu = pad(fb.seq_lens, fill), pad(fb.seq_lens_cpu, fill)
        out.seq_lens_sum = fb.seq_lens_sum + fill * tail
        out.extend_seq_lens, out.extend_prefix_lens = pad(fb.extend_seq_lens, 1), pad(fb.extend_prefix_lens)
        out.extend_seq_lens_cpu, out.extend_prefix_lens_cpu = (fb.extend_seq_lens_cpu + [1] * tail,
                                                               fb.extend_prefix_lens_cpu + [0] * tail)
        self.plan(out)
        return out
