"""Test double: the stand-in streaming server the loadgen tests drive on loopback.

vSkipper's own server (the SGLang integration) does not exist yet, so the end-to-end tests run against
`loadgen.double_server.DoubleServer`, a toy continuous-batching engine that speaks SGLang's `/generate` SSE
format, `/v1/completions` and the attestation contract. Once the runtime lands, the same tests should also run
against it.
"""

from loadgen.double_server import DoubleConfig, DoubleServer, natural_length

__all__ = ["DoubleConfig", "DoubleServer", "natural_length"]
