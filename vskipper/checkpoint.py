"""Skipper checkpoints on disk: tiny random ones for tests and the demo, and loading of the router/adapter tensors.

A tiny checkpoint has the real layout: a Hugging Face config.json with the skipper fields (`routing_layers`,
`router_reduction_factor`, `proj_reduction_factor`) and one `model.safetensors` whose tensor names are those of
the released FlexiDepth checkpoint (Llama) or the same layout on Qwen3 (with its per-head q/k norms), so the
loading code tests and serves exactly what it would read from a real checkpoint.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from vskipper.skippers.modules import ProjectorAdapter, SkipRouter, is_router_tensor, router_sizes

# Architecture names written into config.json; the SGLang integration registers model classes for them.
ARCHS = {
    "flexidepth-llama": {"architectures": ["DDLlamaForCausalLM"], "model_type": "ddllama"},
    "qwen3-skipper": {"architectures": ["Qwen3SkipperForCausalLM"], "model_type": "qwen3_skipper"},
}


@dataclass(frozen=True)
class TinySize:
    layers: int = 4
    hidden: int = 64
    intermediate: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    vocab: int = 512
    reduction: int = 16


def tiny_config(arch: str, size: TinySize = TinySize(), dtype: str = "float32") -> dict:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    if size.layers < 2:
        raise ValueError("a skipper checkpoint needs at least 2 layers (the deeper half is routed)")
    qwen = arch == "qwen3-skipper"
    config = {
        **ARCHS[arch],
        "vocab_size": size.vocab,
        "hidden_size": size.hidden,
        "intermediate_size": size.intermediate,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "head_dim": size.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6 if qwen else 1e-5,
        "rope_theta": 1000000.0 if qwen else 500000.0,
        "attention_bias": False,
        "tie_word_embeddings": qwen,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": dtype,
        "routing_layers": list(range(size.layers // 2, size.layers)),
        "router_reduction_factor": size.reduction,
        "proj_reduction_factor": size.reduction,
    }
    if not qwen:
        config["mlp_bias"] = False
    return config


def tiny_state_dict(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the real parameter names. Routers are scaled so that w spreads around 0.5."""
    g = torch.Generator().manual_seed(seed)
    d, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    r, m = router_sizes(config)
    qwen = config["model_type"] == "qwen3_skipper"

    def randn(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm(n: int) -> torch.Tensor:
        return 1.0 + randn(n, std=0.1)

    sd = {"model.embed_tokens.weight": randn(config["vocab_size"], d, std=1.0), "model.norm.weight": norm(d)}
    if not config["tie_word_embeddings"]:
        sd["lm_head.weight"] = randn(config["vocab_size"], d, std=1 / math.sqrt(d))
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd |= {
            p + "input_layernorm.weight": norm(d),
            p + "post_attention_layernorm.weight": norm(d),
            p + "self_attn.q_proj.weight": randn(heads * hd, d, std=1 / math.sqrt(d)),
            p + "self_attn.k_proj.weight": randn(kv * hd, d, std=1 / math.sqrt(d)),
            p + "self_attn.v_proj.weight": randn(kv * hd, d, std=1 / math.sqrt(d)),
            p + "self_attn.o_proj.weight": randn(d, heads * hd, std=1 / math.sqrt(heads * hd)),
            p + "mlp.gate_proj.weight": randn(inter, d, std=1 / math.sqrt(d)),
            p + "mlp.up_proj.weight": randn(inter, d, std=1 / math.sqrt(d)),
            p + "mlp.down_proj.weight": randn(d, inter, std=1 / math.sqrt(inter)),
        }
        if qwen:
            sd[p + "self_attn.q_norm.weight"] = norm(hd)
            sd[p + "self_attn.k_norm.weight"] = norm(hd)
        if i in config["routing_layers"]:
            sd |= {
                p + "router.router_enc.weight": randn(r, d, std=1 / math.sqrt(d)),
                p + "router.router_norm.weight": norm(r),
                p + "router.router_dec.weight": randn(d, r, std=1 / math.sqrt(r)),
                p + "router.router_head.weight": randn(1, d, std=1.5 / math.sqrt(d)),
                p + "router_proj.gate_proj.weight": randn(m, d, std=1 / math.sqrt(d)),
                p + "router_proj.down_proj.weight": randn(m, d, std=1 / math.sqrt(d)),
                p + "router_proj.up_proj.weight": randn(d, m, std=1 / math.sqrt(m)),
            }
    dtype = getattr(torch, config["torch_dtype"])
    return {k: v.to(dtype).contiguous() for k, v in sd.items()}


def make_tiny_model(arch: str, out: str | Path, size: TinySize = TinySize(), seed: int = 0,
                    dtype: str = "float32") -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, size, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, indent=2) + "\n")
    save_file(tiny_state_dict(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# A few sentences to train the tiny byte-level BPE tokenizer on (offline, deterministic).
_TOKENIZER_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Layer skipping lets easy tokens take a shallow path.",
    "Serving large language models: prefill, decode, paged KV cache, continuous batching, prefix reuse.",
    "What is two plus two? Two plus two is four. Count from one to ten: one two three four five six.",
    "A router decides per token and per layer whether to run the layer or to project the hidden state.",
    "Hello! How are you today? I am fine, thank you. Tell me a short story about a ship and a skipper.",
)
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: the tiny configs' bos 1 and eos 2
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_tiny_tokenizer(out: str | Path, vocab_size: int = 512) -> Path:
    """Train a byte-level BPE tokenizer of at most `vocab_size` tokens and save it (tokenizer.json and a
    tokenizer_config.json with a chat template) into a checkpoint directory, so servers can load it as is."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_TOKENIZER_CORPUS, trainer=trainer)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, more than vocab_size {vocab_size}")
    tokenizer.save(str(out / "tokenizer.json"))
    pad, bos, eos = SPECIAL_TOKENS
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "pad_token": pad, "model_max_length": 4096, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": bos, "eos_token": eos, "pad_token": pad}, indent=2) + "\n")
    return out


def _checkpoint_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    return files


def load_skipper_modules(path: str | Path, dtype: torch.dtype | None = None,
                         device: str | torch.device = "cpu") -> dict[int, tuple[SkipRouter, ProjectorAdapter]]:
    """Build each routed layer's router and adapter from a checkpoint directory, by the real tensor names.

    Reads only the router/adapter tensors (safetensors opens lazily, so a full 8B checkpoint costs little).
    A missing or misshapen tensor is an error that names it.
    """
    from safetensors import safe_open

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    layers = config.get("routing_layers")
    if not layers:
        raise ValueError(f"{path}/config.json: field 'routing_layers' is missing or empty; not a skipper checkpoint")
    r, m = router_sizes(config)
    d = config["hidden_size"]
    eps = config.get("rms_norm_eps", 1e-6)
    wanted: dict[str, torch.Tensor] = {}
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if is_router_tensor(key):
                    wanted[key] = f.get_tensor(key)
    modules = {}
    for layer in layers:
        router, adapter = SkipRouter(d, r, eps), ProjectorAdapter(d, m)
        for prefix, module in ((f"model.layers.{layer}.router.", router),
                               (f"model.layers.{layer}.router_proj.", adapter)):
            state = {}
            for name, param in module.state_dict().items():
                key = prefix + name
                if key not in wanted:
                    raise KeyError(f"{path}: tensor {key!r} is missing")
                if tuple(wanted[key].shape) != tuple(param.shape):
                    raise ValueError(f"{path}: tensor {key!r} has shape {tuple(wanted[key].shape)}, "
                                     f"expected {tuple(param.shape)}")
                state[name] = wanted[key]
            module.load_state_dict(state)
        target = dtype or getattr(torch, config.get("torch_dtype", "float32"))
        modules[layer] = (router.to(device=device, dtype=target), adapter.to(device=device, dtype=target))
    return modules
