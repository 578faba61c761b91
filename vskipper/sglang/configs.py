"""Config classes for the skipper checkpoints' model types, so transformers (and SGLang) load them as they are.

A FlexiDepth checkpoint says `model_type: ddllama`, a Qwen3 skipper `qwen3_skipper`; both are their base model's
config plus the skipper fields (`routing_layers`, `router_reduction_factor`, `proj_reduction_factor`), which
transformers keeps as attributes. Registering them with AutoConfig replaces the checkpoints' remote code.
"""

from __future__ import annotations

from transformers import AutoConfig, LlamaConfig, Qwen3Config


class DDLlamaConfig(LlamaConfig):
    model_type = "ddllama"


class Qwen3SkipperConfig(Qwen3Config):
    model_type = "qwen3_skipper"


CONFIGS = (DDLlamaConfig, Qwen3SkipperConfig)


def register_configs() -> None:
    """Register the config classes with AutoConfig (idempotent)."""
    for cls in CONFIGS:
        try:
            AutoConfig.register(cls.model_type, cls)
        except ValueError as exc:  # already registered in this process
            if "already" not in str(exc):
                raise
