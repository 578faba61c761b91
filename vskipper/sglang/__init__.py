"""vSkipper inside SGLang 0.5.21: model classes, the per-step runtime, the server launcher.

Thin glue, all in this package:
  configs.py     config classes for the skipper model types (`ddllama`, `qwen3_skipper`), registered with
                 transformers' AutoConfig in every server process
  models/        the external model package (`SGLANG_EXTERNAL_MODEL_PACKAGE=vskipper.sglang.models`): SGLang's
                 own Llama/Qwen3 model files, subclassed; routed layers run through `vskipper.mixed`
  runtime.py     the scheduler-side state of one server: the served arm, its skipper, the mode switch fed with
                 the running batch's resident tokens, and the counters (attestation, Prometheus)
  server.py      the launcher `vskipper serve` runs: registers the above, adds `/vskipper/attestation`, starts
                 SGLang's HTTP server
  launch.py      `vskipper serve` as a child process in its own session (the demo and the server tests)
  standalone.py  one served routed layer outside a server, on CPU or CUDA (the served layer's tests, the CPU
                 bench's decode profile, mixed_depth_bench's served-layer section)
  shims/         what the pinned release needs to run on CPU-only machines
"""

SGLANG_VERSION = "0.5.21"
