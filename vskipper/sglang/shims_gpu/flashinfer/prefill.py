"""`flashinfer.prefill` of the GPU stand-in: imported by SGLang's vision attention on CUDA; text models never call it."""

from sgl_kernel._missing import define

IMPORT_ONLY = ("cudnn_batch_prefill_with_kv_cache",)
define(globals(), __name__, IMPORT_ONLY)
