"""SGLang external model package: `SGLANG_EXTERNAL_MODEL_PACKAGE=vskipper.sglang.models`.

SGLang's registry imports every module here and registers each module's `EntryClass` under its class name,
which is the checkpoint's `architectures[0]`:

  ddllama.py        DDLlamaForCausalLM        (FlexiDepth-Llama; the tiny checkpoints use the same name)
  qwen3_skipper.py  Qwen3SkipperForCausalLM

Importing the package registers the skipper config classes with transformers as well (the scheduler process
imports it before it reads the model config).
"""

from vskipper.sglang.configs import register_configs

register_configs()

ARCHITECTURES = ("DDLlamaForCausalLM", "Qwen3SkipperForCausalLM")
