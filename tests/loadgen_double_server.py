"""Test double: the stand-in streaming server the loadgen tests drive on loopback.

The end-to-end loadgen tests run against `loadgen.double_server.DoubleServer`, a toy continuous-batching engine
that speaks SGLang's `/generate` SSE format, `/v1/completions` and the attestation contract, so that they take
seconds and can inject failures; vSkipper's real servers are driven by the serve tests.
"""

from loadgen.double_server import DoubleConfig, DoubleServer, natural_length

__all__ = ["DoubleConfig", "DoubleServer", "natural_length"]
