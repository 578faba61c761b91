"""Names SGLang imports from the kernel wheels on the CUDA path but never calls on the served path."""

from __future__ import annotations


def missing(package: str, name: str):
    """A function named `name` that raises NotImplementedError naming the stand-in when called."""

    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"{package}.{name} is a CUDA kernel the GPU stand-in (vskipper/sglang/shims_gpu) does not implement; "
            "serve on a machine with SGLang's kernel wheels for the code path that calls it")

    kernel.__name__ = name
    kernel.__qualname__ = name
    return kernel


def define(namespace: dict, package: str, names: tuple[str, ...]) -> None:
    for name in names:
        namespace[name] = missing(package, name)
