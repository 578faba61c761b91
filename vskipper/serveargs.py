"""`vskipper serve`'s flags, each declared once (pure Python, no I/O).

Every reader of a launch flag works from these declarations, on the pattern of SGLang's `ServerArgs`:

- `add_serve_arguments` builds `vskipper serve`'s own argparse parser (`vskipper.cli`);
- `serve_argv` writes a command line from values keyed by destination: the operator's planned container args
  (`vskipper_operator.plan.server_args`) and the test and demo launchers (`vskipper.sglang.launch`);
- `CONTAINER_ENV` is the runtime image entrypoint's map from flag to the variable it falls back to
  (images/runtime/entrypoint.py);
- `operator_owned_strings` is the CRD's list of flags `spec.serving.extraArgs` may not name (its CEL rule), and
  `SERVE_DESTS` / `SGLANG_OWNED_DESTS` the destinations the operator's extraArgs check refuses
  (`vskipper_operator.flags`).

Two kinds of flag meet on one command line. `SERVE_FLAGS` are `vskipper serve`'s own. `SGLANG_OPERATOR_FLAGS` are
SGLang 0.5.21's, which `vskipper serve` passes through unchanged: the operator sets some of them from the spec
(`spec_field` names which field), and `vskipper serve` sets SGLang's model path, host and port from its own flags.

The variables that carry the validated configuration from `vskipper serve` to SGLang's scheduler process are a
separate vocabulary (`vskipper.sglang.spec`, `VSKIPPER_SERVED_*`): a container variable names what a person
writes (an arm's name), a transport variable what the scheduler rebuilds (the arm as JSON).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

PLATFORMS = ("auto", "cpu", "gpu")
# the CUDA stand-in profile's RMSNorm, SiLU-and-mul and RoPE (`--stand-in-ops`): SGLang's torch paths or
# vSkipper's Triton
STAND_IN_OPS = ("torch", "triton")


@dataclass(frozen=True)
class ServeFlag:
    """One `vskipper serve` flag."""

    name: str  # the option string, e.g. "--enter-tokens"
    help: str
    type: Callable[[str], Any] | None = str  # None: a switch (store_true)
    default: Any = None
    required: bool = False
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()  # further option strings for the same destination
    dest: str = ""  # default: the name without dashes, `-` as `_`
    env: str | None = None  # the container variable the image entrypoint reads when the flag is absent
    operator_sets: bool = False  # planned by the operator on every server container

    @property
    def destination(self) -> str:
        return self.dest or self.name.lstrip("-").replace("-", "_")

    @property
    def strings(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


@dataclass(frozen=True)
class SGLangFlag:
    """One SGLang 0.5.21 flag the operator or `vskipper serve` sets, so that `spec.serving.extraArgs` may not."""

    dest: str  # SGLang's argparse destination
    strings: tuple[str, ...]  # every option string SGLang gives it (tests/test_operator_flags.py checks them)
    spec_field: str | None = None  # the spec field the operator writes it from
    type: Callable[[str], Any] | None = str  # None: a switch
    in_admission_rule: bool = True  # listed in the CRD's CEL rule (else refused by the operator's parser check)
    why: str = ""  # who sets it when no spec field does, or why it matters, for the error naming it

    @property
    def name(self) -> str:
        return self.strings[0]

    @property
    def set_by(self) -> str:
        return " ".join(p for p in (self.spec_field, self.why) if p)


SERVE_FLAGS: tuple[ServeFlag, ...] = (
    ServeFlag("--model", "checkpoint directory (config.json, *.safetensors, tokenizer)", required=True,
              env="VSKIPPER_MODEL", operator_sets=True),
    ServeFlag("--arm", "a named arm (see `vskipper arms`); with --arm-config, the name of that arm",
              env="VSKIPPER_ARM", operator_sets=True),
    ServeFlag("--arm-config", "the arm as a JSON file (Arm fields); takes precedence over the named arm's fields",
              aliases=("--arm-file",), dest="arm_file", operator_sets=True),
    ServeFlag("--exit-tokens", "decode switch: stop routing when V <= this", type=int, env="VSKIPPER_EXIT_TOKENS",
              operator_sets=True),
    ServeFlag("--enter-tokens", "decode switch: route when resident tokens V >= this", type=int,
              env="VSKIPPER_ENTER_TOKENS", operator_sets=True),
    ServeFlag("--prefill-floor-tokens", "prefill switch: route an admission round only from this many prompt tokens "
              "(a floor measured on this GPU; default: vskipper.constants' prefill_min_prompt_tokens); for an arm that "
              "switches prefill", type=int, operator_sets=True),
    ServeFlag("--gpu", "GPU product (catalogue name or GFD label) to derive the decode thresholds for when "
              "--enter/--exit-tokens are not given, and to check --tile-table against (default: the GPU nvidia-smi "
              "reports)"),
    ServeFlag("--host", "the address SGLang listens on", default="127.0.0.1", operator_sets=True),
    ServeFlag("--port", "the port SGLang listens on", type=int, default=30000, operator_sets=True),
    ServeFlag("--platform", "cpu: the CPU recipe; gpu: SGLang's kernels if installed, else the CUDA stand-ins with "
              "Triton attention and decode graphs; auto picks gpu when an NVIDIA device node exists",
              default="auto", choices=PLATFORMS),
    ServeFlag("--gpu-jit", "with the CUDA stand-ins: let SGLang JIT-compile its fused ops (nvcc, ninja) instead of "
              "their torch paths", type=None),
    ServeFlag("--stand-in-ops", "with the CUDA stand-ins and no --gpu-jit: torch runs RMSNorm, SiLU-and-mul and "
              "RoPE on SGLang's torch paths (a chain of kernels a call), triton on vSkipper's one-launch kernels in "
              "every arm (compare runs on the same ops)", default="torch", choices=STAND_IN_OPS),
    ServeFlag("--tile-table", "a tile table measured on this GPU (`vskipper tune-tiles --out FILE`) for the routed "
              "layers' Triton GEMMs and packed prefill read, instead of the one shipped for it; it must name this "
              "GPU"),
    ServeFlag("--state-file", "where the scheduler writes its attestation (default: a temp file)"),
    ServeFlag("--dry-run", "print the server command and environment, start nothing", type=None),
)

SGLANG_OPERATOR_FLAGS: tuple[SGLangFlag, ...] = (
    SGLangFlag("model_path", ("--model-path", "--model"), why="`vskipper serve --model`"),
    SGLangFlag("host", ("--host",), why="`vskipper serve --host`"),
    SGLangFlag("port", ("--port",), type=int, why="`vskipper serve --port`"),
    SGLangFlag("served_model_name", ("--served-model-name",), "spec.model.servedName"),
    SGLangFlag("tp_size", ("--tp-size", "--tensor-parallel-size"), "spec.resources.gpus", type=int),
    SGLangFlag("dtype", ("--dtype",), "spec.model.dtype", why="(it also feeds the decode thresholds)"),
    # Tunables with a spec field: set from the field when it is given, and only there (refused in extraArgs by the
    # operator's parser check, outside the CEL rule to keep its cost small).
    SGLangFlag("cuda_graph_max_bs_decode", ("--cuda-graph-max-bs-decode",), "spec.serving.cudaGraphMaxBatchSize",
               type=int, in_admission_rule=False),
    SGLangFlag("mem_fraction_static", ("--mem-fraction-static",), "spec.serving.memFractionStatic", type=float,
               in_admission_rule=False),
    SGLangFlag("attention_backend", ("--attention-backend",), "spec.serving.attentionBackend",
               in_admission_rule=False),
    SGLangFlag("disable_radix_cache", ("--disable-radix-cache",), "spec.serving.prefixCache", type=None,
               in_admission_rule=False),
    SGLangFlag("enable_metrics", ("--enable-metrics",), "spec.metrics.enabled", type=None, in_admission_rule=False),
    # The key travels in the environment (API_KEY_ENV, from the Secret), never on a command line or in the spec.
    SGLangFlag("api_key", ("--api-key",), "spec.serving.apiKeySecret", why="(never as text in the spec)"),
    # Not set, but a config file could set the others behind the operator's back.
    SGLangFlag("config", ("--config",), in_admission_rule=False,
               why="nobody: a config file would set the operator's flags behind its back"),
)

# The server's API key (SGLang's --api-key): `vskipper.sglang.server` hands it to SGLang inside its own process, so
# it is in no process's arguments (`ps`, a container's printed command), and its own log lines mask it.
API_KEY_ENV = "VSKIPPER_API_KEY"

SERVE_BY_DEST = {f.destination: f for f in SERVE_FLAGS}
SGLANG_BY_DEST = {f.dest: f for f in SGLANG_OPERATOR_FLAGS}
# Every `vskipper serve` flag is the operator's to set or leave: extraArgs are for SGLang (help would exit).
SERVE_DESTS = frozenset(SERVE_BY_DEST) | {"help"}
SGLANG_OWNED_DESTS = frozenset(SGLANG_BY_DEST) | {"help"}
CONTAINER_ENV = {f.name: f.env for f in SERVE_FLAGS if f.env}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare `vskipper serve`'s flags on `parser`."""
    for f in SERVE_FLAGS:
        kwargs: dict[str, Any] = {"dest": f.destination, "help": f.help}
        if f.type is None:
            kwargs["action"] = "store_true"
        else:
            kwargs.update(default=f.default, required=f.required)
            if f.type is not str:
                kwargs["type"] = f.type
            if f.choices:
                kwargs["choices"] = f.choices
        parser.add_argument(*f.strings, **kwargs)


def operator_owned_strings() -> tuple[str, ...]:
    """The option strings of what the operator sets on a server container, aliases included, for the CRD's
    admission rule (names first, then aliases)."""
    serve = [f for f in SERVE_FLAGS if f.operator_sets]
    sglang = [f for f in SGLANG_OPERATOR_FLAGS if f.in_admission_rule]
    names = [f.name for f in serve] + [f.name for f in sglang]
    aliases = [a for f in serve for a in f.aliases] + [a for f in sglang for a in f.strings[1:]]
    return tuple(dict.fromkeys(names + aliases))


def serve_argv(values: Mapping[str, Any]) -> list[str]:
    """A `vskipper serve` command line (without the command) from values keyed by destination, in declaration
    order: `vskipper serve`'s flags, then the SGLang flags it passes through. None leaves a flag out; a switch is
    written when its value is True."""
    unknown = set(values) - set(SERVE_BY_DEST) - set(SGLANG_BY_DEST)
    if unknown:
        raise ValueError(f"serve_argv: no serve or operator-set SGLang flag has the destination(s) {sorted(unknown)}")
    unset = set(values) & {d for d, f in SGLANG_BY_DEST.items() if f.spec_field is None and d not in SERVE_BY_DEST}
    if unset:
        raise ValueError(f"serve_argv: {sorted(unset)} come from `vskipper serve`'s own flags, not from values")
    argv: list[str] = []
    spec_set = [(d, f) for d, f in SGLANG_BY_DEST.items() if f.spec_field is not None]
    for dest, flag in [*SERVE_BY_DEST.items(), *spec_set]:
        value = values.get(dest)
        if value is None or value is False:
            continue
        if flag.type is None:
            argv.append(flag.name)
        else:
            argv += [flag.name, str(value)]
    return argv
