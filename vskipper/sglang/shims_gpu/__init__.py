"""The CUDA profile's stand-ins for SGLang's kernel wheels, for a GPU machine without them (no package index there).

This directory (not the package) goes first on the server's PYTHONPATH under the `gpu-stand-in` profile
(`vskipper.sglang.spec.serve_profile`), so `import sgl_kernel` and `import flashinfer` resolve here inside the server
and nowhere else. With SGLang's Triton attention backend, its torch sampling backend and its own JIT (or torch)
fused ops, the Llama / Qwen3 path calls only three compiled-kernel entry points, which `sgl_kernel/` implements in
torch; every other name SGLang imports exists and raises NotImplementedError when called.

Never on the path: the CPU stand-in (`vskipper/sglang/shims`), `sgl_kernel.scalar_type` (SGLang's quantization
utilities then use their own fallbacks) and any `torch.ops.sgl_kernel` operator (SGLang probes that namespace).
"""
