"""Stand-in for `flashinfer` on a GPU machine without it: SGLang imports it on the CUDA path even with
`SGLANG_IS_FLASHINFER_AVAILABLE=false`, the Triton attention backend and the torch sampling backend
(`srt/layers/sampler.py`, `srt/layers/quantization/fp8_utils.py`). Every name raises NotImplementedError when
called. Names SGLang imports inside try/except (fp4 GEMMs, MoE all-to-all, fused top-k) are left out on purpose:
their absence keeps those features marked unavailable."""

from flashinfer import comm, fused_moe, prefill, sampling  # noqa: F401
from sgl_kernel._missing import define

IMPORT_ONLY = ("bmm_fp8",)
define(globals(), __name__, IMPORT_ONLY)
