"""What a scheduler process serves: the skipper model (registered when it is built, read by the SGLang hooks
around `ModelRunner.forward` and the graph runners) and the vSkipper runtime (registered when the model builds
it, read by the scheduler hooks and the executed-configuration reader). A module of its own, importing nothing,
so that the hooks and the reader need import neither the model nor the runtime, which import them."""
from __future__ import annotations

_ACTIVE: list = []  # one per scheduler process; the last one built serves


def register(model) -> None:
    _ACTIVE.append(model)


def active_model():
    """The skipper model this process serves, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


_RUNTIME: list = []  # the process's vSkipper runtime (vskipper.sglang.runtime.Runtime), once built


def set_runtime(runtime) -> None:
    _RUNTIME[:] = [runtime]


def current_runtime():
    """The process's runtime once the model built it (None in processes without a vSkipper model)."""
    return _RUNTIME[0] if _RUNTIME else None
