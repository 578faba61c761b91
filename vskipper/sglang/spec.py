"""The served configuration of one vSkipper server, and how it travels to SGLang's processes (pure Python).

`vskipper serve` validates it (arm, thresholds, arm/model fit) before anything heavy is imported, then passes it
through the environment: SGLang's scheduler is a spawned process that rebuilds it with `ServeSpec.from_env`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from vskipper.arms import Arm

MODEL_PACKAGE = "vskipper.sglang.models"
SHIMS_DIR = Path(__file__).resolve().parent / "shims"

ENV_ARM = "VSKIPPER_ARM"  # the served arm as JSON (Arm fields)
ENV_ENTER = "VSKIPPER_ENTER_TOKENS"
ENV_EXIT = "VSKIPPER_EXIT_TOKENS"
ENV_THRESHOLDS_SOURCE = "VSKIPPER_THRESHOLDS_SOURCE"  # flags | roofline:<device> | unused (...)
ENV_STATE = "VSKIPPER_STATE_FILE"  # where the scheduler writes its attestation for the HTTP process

# Trained gates read routers trained for one model family; the others route any checkpoint.
GATE_MODEL_TYPES = {"flexidepth": ("ddllama",), "qwen3_hard_gate": ("qwen3_skipper",)}
# Model types whose routed layers execute in this server (the skipper checkpoints' model classes).
ROUTED_MODEL_TYPES = ("ddllama", "qwen3_skipper")


class ServeConfigError(ValueError):
    """A served configuration the runtime refuses at startup (the message names the field)."""


@dataclass(frozen=True)
class ServeSpec:
    arm: Arm
    enter_tokens: int
    exit_tokens: int
    state_file: Path | None = None
    thresholds_source: str = "flags"

    def to_env(self) -> dict[str, str]:
        arm = {k: v for k, v in self.arm.as_dict().items() if k in ("name", "skipper", "params", "phases",
                                                                     "mode_switch", "promotion")}
        env = {ENV_ARM: json.dumps(arm), ENV_ENTER: str(self.enter_tokens), ENV_EXIT: str(self.exit_tokens),
               ENV_THRESHOLDS_SOURCE: self.thresholds_source}
        if self.state_file is not None:
            env[ENV_STATE] = str(self.state_file)
        return env

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ServeSpec:
        environ = os.environ if environ is None else environ
        if ENV_ARM not in environ:
            raise ServeConfigError(f"{ENV_ARM} is not set: start the server with `vskipper serve --arm NAME`")
        try:
            arm = Arm.from_dict(json.loads(environ[ENV_ARM]))
        except json.JSONDecodeError as exc:
            raise ServeConfigError(f"{ENV_ARM}: not JSON ({exc})") from None
        thresholds = []
        for key in (ENV_ENTER, ENV_EXIT):
            try:
                thresholds.append(int(environ.get(key, "0")))
            except ValueError:
                raise ServeConfigError(f"{key} must be an integer, got {environ[key]!r}") from None
        state = environ.get(ENV_STATE)
        return cls(arm, thresholds[0], thresholds[1], Path(state) if state else None,
                   environ.get(ENV_THRESHOLDS_SOURCE, "flags"))


def check_arm_for_model(arm: Arm, model_type: str) -> None:
    """Refuse a trained gate on a checkpoint of another family (its routers would not exist or not match)."""
    families = GATE_MODEL_TYPES.get(arm.skipper or "")
    if families is not None and model_type not in families:
        raise ServeConfigError(
            f"arm {arm.name!r}: field 'skipper' is {arm.skipper!r}, which needs a checkpoint of model_type "
            f"{' or '.join(families)}; this checkpoint is {model_type!r}")
    if arm.skipper is not None and model_type not in ROUTED_MODEL_TYPES:
        raise ServeConfigError(
            f"arm {arm.name!r}: field 'skipper' is {arm.skipper!r}, but a checkpoint of model_type "
            f"{model_type!r} has no routed layers (routed: {', '.join(ROUTED_MODEL_TYPES)}); "
            "serve it with --arm dense")


def checkpoint_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ServeConfigError(f"--model {model_dir}: no config.json")
    return json.loads(path.read_text())


def serve_environment(spec: ServeSpec, base: dict[str, str] | None = None, cpu: bool = True) -> dict[str, str]:
    """The server's environment: SGLang's CPU engine (on CPU), the external model package, the sgl_kernel
    stand-in (on this process tree's PYTHONPATH only) and the served configuration."""
    env = dict(os.environ if base is None else base)
    env.update(spec.to_env())
    if cpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["SGLANG_EXTERNAL_MODEL_PACKAGE"] = MODEL_PACKAGE
    paths = [str(SHIMS_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env
