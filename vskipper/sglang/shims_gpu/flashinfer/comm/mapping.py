"""`flashinfer.comm.mapping` of the GPU stand-in: importable, never called."""
