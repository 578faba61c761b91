"""Compatibility shims that let the pinned SGLang 0.5.21 run on CPU-only machines.

- `sgl_kernel/`: a stand-in for SGLang's CUDA kernel wheel. This directory (not the package) goes on the
  server's PYTHONPATH only, so `import sgl_kernel` resolves to it inside the server and nowhere else.
- `patch_torchvision`: makes the PyPI torchvision (a CUDA build whose ops cannot load beside the CPU torch)
  importable, which SGLang's config package needs. Applied once at install time; idempotent.
"""
