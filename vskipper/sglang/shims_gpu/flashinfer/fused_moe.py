"""`flashinfer.fused_moe` of the GPU stand-in: importable, never called by the served configuration."""
