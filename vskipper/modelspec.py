"""Model facts the rule and the runtime need: depth, routed layers, KV geometry, the skipper modules' widths, the
bytes a decode step reads and the work a token's forward does (the physical limits of a skip).

`ModelFacts.from_config(dict)` reads a Hugging Face style config.json (already parsed: no I/O here);
`load_model_facts(name_or_path)` is the one function that touches the file system.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vskipper.roofline import kv_bytes_per_token_layer

DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1,
}


class ModelConfigError(ValueError):
    pass


def router_sizes(config: dict) -> tuple[int, int]:
    """(r, m): the router's and the Project-Only adapter's reduced widths from a skipper checkpoint's config."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    router_factor = config.get("router_reduction_factor", 16)
    proj_factor = config.get("proj_reduction_factor", 16)
    for field, factor, dim in (("router_reduction_factor", router_factor, hidden),
                               ("proj_reduction_factor", proj_factor, inter)):
        if not isinstance(factor, int) or factor <= 0 or dim % factor:
            raise ValueError(f"config field {field!r}={factor!r} must be a positive divisor of {dim}")
    return hidden // router_factor, inter // proj_factor


def decode_bytes(config: dict, resident: float, skip: float, dtype_bytes: int = 2) -> float:
    """Bytes one decode step of a skipper model (its config.json as a dict) reads: every weight once, the adapter's
    too at every routed layer where rows project (skip > 0), and the KV of the `resident` tokens at every layer,
    less the attention reads a Project-Only decision skips (share `skip` of the routed layers' rows). One routed
    layer alone: `num_hidden_layers` 1, one routed layer, `vocab_size` 0."""
    d, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or d // heads
    layers, routed = config["num_hidden_layers"], len(config["routing_layers"])
    per_layer = d * (heads + 2 * kv_heads) * hd + heads * hd * d + 3 * d * i
    adapter = 3 * d * router_sizes(config)[1] if skip > 0 else 0  # gate and down d -> m, up m -> d
    weights = (layers * per_layer + routed * adapter + 2 * v * d) * dtype_bytes
    return weights + resident * kv_bytes_per_token_layer(kv_heads, hd, dtype_bytes) * (layers - skip * routed)


def token_macs(config: dict, context: float, skip: float, lm_head_share: float,
               project_only_reads: bool = False) -> dict[str, float]:
    """Multiply-accumulates per token of one forward of a skipper model over every layer, at attention context
    `context`, when a share `skip` of the routed layers' rows is Project-Only (RandomSkip reads no router weights:
    no router), and the logits for a share `lm_head_share` of the tokens.

    RUN row: Q, K/V, the attention read (QK^T and PV over the context), o_proj, the MLP.
    Project-Only row: K/V and the projector (d -> m, d -> m, m -> d); with `project_only_reads`, the attention read
    too (a prefill read through SGLang's backend takes every row, Project-Only ones with a zero query)."""
    d, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or d // heads
    _, m = router_sizes(config)
    parts = {"q": d * heads * hd, "kv": 2 * d * kv * hd, "read": 2 * heads * hd * context, "o": heads * hd * d,
             "mlp": 3 * d * inter}
    run = sum(parts.values())
    project_only = parts["kv"] + 3 * d * m + (parts["read"] if project_only_reads else 0)
    layers, routed = config["num_hidden_layers"], len(config["routing_layers"])
    total = (layers - routed) * run + routed * ((1 - skip) * run + skip * project_only)
    return {"per_token": total + lm_head_share * d * config["vocab_size"], "run_row": run,
            "project_only_row": project_only, "skippable": run - parts["kv"]}


def flop_limit(config: dict, input_len: int, output_len: int, skip: float, project_only_reads: bool = False) -> float:
    """The work of s = 0 over the work at `skip`, per token of a request of `input_len` prompt and `output_len`
    output tokens: a prefill (`output_len` 1) takes the logits of the prompt's last token only and reads a mean
    context of half the prompt; decode reads the prompt and half the output. `project_only_reads`: see
    `token_macs`."""
    if output_len == 1:
        context, lm = (input_len + 1) / 2, 1 / input_len
    else:
        context, lm = input_len + output_len / 2, 1.0
    return (token_macs(config, context, 0.0, lm)["per_token"]
            / token_macs(config, context, skip, lm, project_only_reads)["per_token"])


@dataclass(frozen=True)
class ModelFacts:
    name: str
    num_layers: int
    routed_layers: tuple[int, ...]
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return kv_bytes_per_token_layer(self.num_kv_heads, self.head_dim, self.dtype_bytes)

    @property
    def num_routed_layers(self) -> int:
        return len(self.routed_layers)

    @classmethod
    def from_config(cls, config: dict, name: str = "config") -> ModelFacts:
        def need(field: str) -> int:
            value = config.get(field)
            if not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"{name}: field {field!r} must be a positive integer, got {value!r}")
            return value

        layers = need("num_hidden_layers")
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = config.get("num_key_value_heads", heads)
        if not isinstance(kv_heads, int) or kv_heads <= 0:
            raise ModelConfigError(f"{name}: field 'num_key_value_heads' must be a positive integer, got {kv_heads!r}")
        head_dim = config.get("head_dim") or hidden // heads
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").replace("torch.", "")
        if dtype not in DTYPE_BYTES:
            raise ModelConfigError(f"{name}: field 'torch_dtype' has unsupported value {dtype!r}")
        routed = config.get("routing_layers")
        if routed is None:
            # No declared routed set: route the deeper half, as both FlexiDepth (16..31 of 32) and the
            # Qwen3 skippers (18..35 of 36) do.
            routed = list(range(layers // 2, layers))
        if (not isinstance(routed, list) or not routed
                or any(not isinstance(i, int) or not 0 <= i < layers for i in routed)
                or len(set(routed)) != len(routed)):
            raise ModelConfigError(
                f"{name}: field 'routing_layers' must be a non-empty list of distinct layer indices in "
                f"[0, {layers}), got {routed!r}")
        return cls(
            name=name,
            num_layers=layers,
            routed_layers=tuple(sorted(routed)),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            dtype_bytes=DTYPE_BYTES[dtype],
        )


# The three models of the paper (shared reference: model facts), served in 16-bit.
PRESETS: dict[str, ModelFacts] = {
    "llama-3-8b": ModelFacts("llama-3-8b", 32, tuple(range(16, 32)), 4096, 14336, 32, 8, 128),
    "qwen3-4b": ModelFacts("qwen3-4b", 36, tuple(range(18, 36)), 2560, 9728, 32, 8, 128),
    "qwen3-8b": ModelFacts("qwen3-8b", 36, tuple(range(18, 36)), 4096, 12288, 32, 8, 128),
}


def load_model_facts(name_or_path: str) -> ModelFacts:
    """A preset name, a config.json path, or a checkpoint directory holding config.json."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelConfigError(
            f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json path")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path}: not valid JSON ({exc})") from exc
    return ModelFacts.from_config(config, name=str(path))
