"""`sgl_kernel.kvcacheio` of the GPU stand-in: SGLang's host KV pools import these on CUDA; hierarchical
caching (which calls them) is not served."""

from sgl_kernel._missing import define

IMPORT_ONLY = (
    "transfer_kv_all_layer", "transfer_kv_all_layer_direct_lf_pf", "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph", "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct", "transfer_kv_per_layer", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_per_layer_pf_lf", "transfer_kv_per_layer_ph_lf",
)
define(globals(), __name__, IMPORT_ONLY)
