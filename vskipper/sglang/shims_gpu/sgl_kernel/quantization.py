"""`sgl_kernel.quantization` of the GPU stand-in: SGLang's GGUF support imports these on CUDA; unquantized
checkpoints never call them."""

from sgl_kernel._missing import define

IMPORT_ONLY = (
    "ggml_dequantize", "ggml_moe_a8", "ggml_moe_a8_vec", "ggml_moe_get_block_size", "ggml_mul_mat_a8",
    "ggml_mul_mat_vec_a8",
)
define(globals(), __name__, IMPORT_ONLY)
