"""The skipper model a scheduler process serves: registered by the model when it is built, read by the SGLang
hooks around `ModelRunner.forward` and the graph runners. A module of its own so that the hooks need not import
the model (which imports the runtime, which the hooks already call)."""
from __future__ import annotations

_ACTIVE: list = []  # one per scheduler process; the last one built serves


def register(model) -> None:
    _ACTIVE.append(model)


def active_model():
    """The skipper model this process serves, or None."""
    return _ACTIVE[-1] if _ACTIVE else None
