"""The operator's settings, one object: each read from its environment variable, a command-line flag winning over
the variable, a bad value refused with a message naming the variable (pure Python)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

ENV_RESYNC_SECONDS = "VSKIPPER_OPERATOR_RESYNC_SECONDS"
ENV_API_BACKOFFS = "VSKIPPER_OPERATOR_API_BACKOFFS"
ENV_METRICS_PORT = "VSKIPPER_OPERATOR_METRICS_PORT"


class SettingsError(ValueError):
    pass


def _seconds(var: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{var}: {raw!r} is not a number of seconds") from None
    if not value > 0:
        raise SettingsError(f"{var}: {raw!r} must be a positive number of seconds")
    return value


def _backoffs(var: str, raw: str) -> tuple[float, ...]:
    return tuple(_seconds(var, part.strip()) for part in raw.split(","))


def _port(var: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{var}: {raw!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise SettingsError(f"{var}: {value} is not a port number (0: off)")
    return value


@dataclass(frozen=True)
class Settings:
    resync_seconds: float = 60.0  # drift correction: a quiet resource is re-planned this often
    api_backoffs: tuple[float, ...] = (0.1, 0.3, 1.0, 3.0)  # the operator's own API client retries
    metrics_port: int = 9090  # Prometheus metrics (0: off)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **flags: object) -> Settings:
        """Defaults, then the environment, then `flags` (a None flag was not given)."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for var, name, parse in ((ENV_RESYNC_SECONDS, "resync_seconds", _seconds),
                                 (ENV_API_BACKOFFS, "api_backoffs", _backoffs),
                                 (ENV_METRICS_PORT, "metrics_port", _port)):
            if environ.get(var, "") != "":
                values[name] = parse(var, environ[var])
        known = {f.name for f in fields(cls)}
        unknown = set(flags) - known
        if unknown:
            raise SettingsError(f"no operator setting named {sorted(unknown)}")
        values.update({k: v for k, v in flags.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]
