"""`sgl_kernel.utils` of the GPU stand-in: plain kernel launches (no programmatic dependent launch)."""

from __future__ import annotations


def is_arch_support_pdl() -> bool:
    return False
