"""`flashinfer.comm` of the GPU stand-in: importable, never called (no fused all-reduce)."""

from flashinfer.comm import mapping, mnnvl  # noqa: F401
