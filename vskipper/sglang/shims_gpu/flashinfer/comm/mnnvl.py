"""`flashinfer.comm.mnnvl` of the GPU stand-in: importable, never called."""
