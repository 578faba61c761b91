"""`flashinfer.sampling` of the GPU stand-in: imported by SGLang's sampler on CUDA; `--sampling-backend pytorch`
never calls them."""

from sgl_kernel._missing import define

IMPORT_ONLY = ("min_p_sampling_from_probs", "top_k_top_p_sampling_from_probs", "top_k_renorm_probs",
               "top_p_renorm_probs")
define(globals(), __name__, IMPORT_ONLY)
