"""The served configuration of one vSkipper server, and how it travels to SGLang's processes (pure Python).

`vskipper serve` validates it (arm, thresholds, arm/model fit) before anything heavy is imported, then passes it
through the environment: SGLang's scheduler is a spawned process that rebuilds it with `ServeSpec.from_env`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from vskipper.arms import Arm
from vskipper.constants import CONSTANTS, SwitchConstants
from vskipper.serveargs import STAND_IN_OPS
from vskipper.switch import Policy

MODEL_PACKAGE = "vskipper.sglang.models"
SHIMS_DIR = Path(__file__).resolve().parent / "shims"  # the CPU stand-in for sgl_kernel
SHIMS_GPU_DIR = Path(__file__).resolve().parent / "shims_gpu"  # the CUDA stand-ins for sgl_kernel and flashinfer

ENV_ARM = "VSKIPPER_SERVED_ARM"  # the served arm as JSON (Arm fields); VSKIPPER_ARM is the image's arm *name*
ENV_ENTER = "VSKIPPER_SERVED_ENTER_TOKENS"  # as resolved (flags or the roofline rule)
ENV_EXIT = "VSKIPPER_SERVED_EXIT_TOKENS"
ENV_THRESHOLDS_SOURCE = "VSKIPPER_THRESHOLDS_SOURCE"  # flags | roofline:<device> | unused (...)
# The prefill switch's floor in prompt tokens a round (`--prefill-floor-tokens`); unset: vskipper.constants'
ENV_PREFILL_FLOOR = "VSKIPPER_SERVED_PREFILL_FLOOR_TOKENS"
ENV_STATE = "VSKIPPER_STATE_FILE"  # where the scheduler writes its attestation for the HTTP process
ENV_PROFILE = "VSKIPPER_PROFILE"  # the serving profile's attestation as JSON (ServeProfile.attestation)
ENV_PART_CLOCK = "VSKIPPER_PART_CLOCK"  # 1: time each part of each pass in the server (`vskipper.sglang.part_times`)
# 1: time each pass whole, its host's span and (on a GPU) the device's, and none of its parts: the part clock's
# spans alone, a measurement mode cheap enough to leave on beside the figures it explains (two timing events and two
# clock reads a pass, no wrapped call)
ENV_PASS_SPANS = "VSKIPPER_PASS_SPANS"
# 1: the forward's Python stack sampled while each pass runs (`vskipper.sglang.stack_samples`), counted per phase
# in the part clock's attestation: a measurement mode (the sampler takes the interpreter's lock for each sample)
ENV_STACK_SAMPLES = "VSKIPPER_STACK_SAMPLES"
# 1: a routed arm's decode passes, and apart from them its prefill passes, alternate between its routes and every
# row RUN through the routed layers (the s = 0 control); each control pass is a phase of its own in the part clock,
# and each decode pass is timed to the next (`vskipper.sglang.part_times.PassClock`): a measurement mode
ENV_INTERLEAVE_CONTROL = "VSKIPPER_INTERLEAVE_CONTROL"
# The routed layers' cohort execution (`vskipper.sglang.models.routed.cohort_execution`): auto (the default: triton
# on CUDA where every routed layer allows it, torch elsewhere), torch, or triton (off CUDA only under
# TRITON_INTERPRET=1, which the server's environment then keeps: tests). The same served semantics either way.
ENV_EXECUTION = "VSKIPPER_COHORT_EXECUTION"
EXECUTIONS = ("auto", "torch", "triton")
# The triton execution's prefill read (`PREFILL_READ_CHOICES`; the reads:
# `vskipper.sglang.models.routed.PREFILL_READS`): auto (the default: the tile table's choice,
# `TileTable.prefill_read`), packed or backend, in its place (attested with the table's choice in
# `prefill_read_why`): the table weighs the reads' device time alone, where routed prefill graphs change what each
# leaves the host (`ENV_PREFILL_GRAPHS`: the packed read replays inside each routed layer's one segment).
ENV_PREFILL_READ = "VSKIPPER_PREFILL_READ"
PREFILL_READ_CHOICES = ("auto", "packed", "backend")
# A tile table measured on the serving GPU (`vskipper serve --tile-table`), which the triton execution's GEMMs and
# packed prefill read take instead of the one shipped for it (`vskipper.mixed.tiles.given_tile_table`); unset: the
# shipped one. Only the flag sets it: `serve_environment` never passes one inherited from the caller.
ENV_TILE_TABLE = "VSKIPPER_TILE_TABLE"
# What the CUDA stand-in profile without JIT runs RMSNorm (with its residual add), SiLU-and-mul and RoPE with
# (`vskipper serve --stand-in-ops`): SGLang's torch paths, or vSkipper's one-launch Triton kernels in their place
# (`vskipper.sglang.stand_in_ops`); the profile sets it, never a caller's environment.
ENV_STAND_IN_OPS = "VSKIPPER_STAND_IN_OPS"
# The token counts a routed arm's prefill passes are captured at (comma-separated, e.g. "1024,2048,4096", or "auto":
# `AUTO_PREFILL_GRAPHS`), each captured and checked as the server starts: each routed layer's work replays from CUDA
# graphs (the read too with the packed read, `vskipper.sglang.prefill_graphs`), a pass padded to the least count
# that holds it; where the server chunks its prefill, a count no pass reaches (one above the least count that holds
# the chunk) is left out at start. Unset: every routed prefill pass eager. Off by default: an opt-in mode whose graphs
# have not yet served on a device.
ENV_PREFILL_GRAPHS = "VSKIPPER_PREFILL_GRAPHS"
PREFILL_GRAPHS_AUTO = "auto"
# What "auto" captures: four counts an octave from 16 to 2048 tokens (16, 20, 24, 28, 32, 40, ...), so that a pass
# pads by less than a quarter of its rows. Not above 2048: on the H200 a routed prefill pass's device waits on its
# host below about 2k tokens (`benchmarks/results/H200`), which is what the graphs take off, and above it a padded
# row costs device time the host no longer hides. Within the server's prefill chunk only (above).
AUTO_PREFILL_GRAPHS = tuple(m << k for k in range(2, 9) for m in (4, 5, 6, 7)) + (2048,)
# Tests: "rerun" has a CPU server's routed prefill graphs made by the stand-in that reruns each capture at every
# replay (`vskipper.mixed.segment_graphs.RerunGraph`), so that a real server's capture at start and its replayed
# passes run where no CUDA graph can be captured; honoured only under Triton's interpreter (TRITON_INTERPRET=1)
ENV_PREFILL_GRAPH_STAND_IN = "VSKIPPER_PREFILL_GRAPH_STAND_IN"

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
    profile: dict | None = None  # ServeProfile.attestation() of the profile that serves
    part_clock: bool = False  # time each part of each pass (a measurement mode; off when deployed)
    interleave_control: bool = False  # every other routed pass of each phase all-RUN (`ENV_INTERLEAVE_CONTROL`)
    execution: str = "auto"  # the routed layers' cohort execution asked for (`ENV_EXECUTION`)
    tile_table: Path | None = None  # a table measured on this GPU (`ENV_TILE_TABLE`); None: the shipped one
    pass_spans: bool = False  # time each pass whole (`ENV_PASS_SPANS`; the part clock times its spans too)
    prefill_floor_tokens: int | None = None  # the prefill switch's floor (`ENV_PREFILL_FLOOR`); None: the constant's
    stack_samples: bool = False  # sample the forward's stack in each pass (`ENV_STACK_SAMPLES`; with the clock's spans)
    # the routed prefill passes' captured token counts, or "auto" (`ENV_PREFILL_GRAPHS`; `prefill_graph_counts`)
    prefill_graphs: tuple[int, ...] | str = ()
    prefill_read: str = "auto"  # the triton execution's prefill read asked for (`ENV_PREFILL_READ`)

    def __post_init__(self) -> None:
        if self.execution not in EXECUTIONS:
            raise ServeConfigError(f"{ENV_EXECUTION} must be one of {', '.join(EXECUTIONS)}, got {self.execution!r}")
        if self.prefill_read not in PREFILL_READ_CHOICES:
            raise ServeConfigError(f"{ENV_PREFILL_READ} must be one of {', '.join(PREFILL_READ_CHOICES)}, got "
                                   f"{self.prefill_read!r}")
        sizes = self.prefill_graphs
        if isinstance(sizes, str):
            if sizes != PREFILL_GRAPHS_AUTO:
                raise ServeConfigError(f"{ENV_PREFILL_GRAPHS} must be {PREFILL_GRAPHS_AUTO!r} or list token counts, "
                                       f"got {sizes!r}")
        elif any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes) or list(sizes) != sorted(
                set(sizes)):
            raise ServeConfigError(f"{ENV_PREFILL_GRAPHS} must list positive token counts in increasing order, got "
                                   f"{sizes!r}")
        floor = self.prefill_floor_tokens
        if floor is not None:
            if isinstance(floor, bool) or not isinstance(floor, int) or floor < 1:
                raise ServeConfigError(f"--prefill-floor-tokens must be a positive integer, got {floor!r}")
            if self.arm.prefill is not Policy.HYBRID:
                raise ServeConfigError(
                    f"--prefill-floor-tokens: arm {self.arm.name!r} does not switch prefill (field 'prefill' is "
                    f"{self.arm.prefill.value!r}): the floor is the hybrid prefill rule's")

    def switch_constants(self) -> SwitchConstants:
        """The constants the served switch takes: vskipper.constants', the prefill floor replaced where it is
        given."""
        if self.prefill_floor_tokens is None:
            return CONSTANTS
        return replace(CONSTANTS, prefill_min_prompt_tokens=self.prefill_floor_tokens)

    def prefill_floor(self) -> dict:
        """The served prefill floor and where it comes from (beside the decode thresholds in the attestation)."""
        if self.arm.prefill is not Policy.HYBRID:
            return {"prefill_floor_tokens": None, "prefill_floor_source": "unused (prefill is not switched)"}
        source = "flags" if self.prefill_floor_tokens is not None else "vskipper.constants"
        return {"prefill_floor_tokens": self.switch_constants().prefill_min_prompt_tokens,
                "prefill_floor_source": source}

    def to_env(self) -> dict[str, str]:
        env = {ENV_ARM: json.dumps(self.arm.fields()), ENV_ENTER: str(self.enter_tokens), ENV_EXIT: str(self.exit_tokens),
               ENV_THRESHOLDS_SOURCE: self.thresholds_source}
        if self.state_file is not None:
            env[ENV_STATE] = str(self.state_file)
        if self.profile is not None:
            env[ENV_PROFILE] = json.dumps(self.profile)
        if self.part_clock:
            env[ENV_PART_CLOCK] = "1"
        if self.pass_spans:
            env[ENV_PASS_SPANS] = "1"
        if self.stack_samples:
            env[ENV_STACK_SAMPLES] = "1"
        if self.interleave_control:
            env[ENV_INTERLEAVE_CONTROL] = "1"
        if self.execution != "auto":
            env[ENV_EXECUTION] = self.execution
        if self.tile_table is not None:
            env[ENV_TILE_TABLE] = str(self.tile_table)
        if self.prefill_floor_tokens is not None:
            env[ENV_PREFILL_FLOOR] = str(self.prefill_floor_tokens)
        if self.prefill_graphs:
            env[ENV_PREFILL_GRAPHS] = self.prefill_graphs if isinstance(self.prefill_graphs, str) \
                else ",".join(map(str, self.prefill_graphs))
        if self.prefill_read != "auto":
            env[ENV_PREFILL_READ] = self.prefill_read
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
        floor = environ.get(ENV_PREFILL_FLOOR)
        try:
            floor = int(floor) if floor is not None else None
        except ValueError:
            raise ServeConfigError(f"{ENV_PREFILL_FLOOR} must be an integer, got {floor!r}") from None
        state = environ.get(ENV_STATE)
        try:
            profile = json.loads(environ[ENV_PROFILE]) if environ.get(ENV_PROFILE) else None
        except json.JSONDecodeError as exc:
            raise ServeConfigError(f"{ENV_PROFILE}: not JSON ({exc})") from None
        return cls(arm, thresholds[0], thresholds[1], Path(state) if state else None,
                   environ.get(ENV_THRESHOLDS_SOURCE, "flags"), profile, part_clock_from_env(environ),
                   switch_from_env(environ, ENV_INTERLEAVE_CONTROL), environ.get(ENV_EXECUTION, "auto"),
                   Path(environ[ENV_TILE_TABLE]) if environ.get(ENV_TILE_TABLE) else None,
                   switch_from_env(environ, ENV_PASS_SPANS), floor, switch_from_env(environ, ENV_STACK_SAMPLES),
                   prefill_graphs_from_env(environ), environ.get(ENV_PREFILL_READ) or "auto")

    def prefill_graph_counts(self) -> tuple[int, ...]:
        """The token counts the routed prefill graphs are asked at: the spec's, or `AUTO_PREFILL_GRAPHS` for "auto"
        (either way, those the server's prefill chunk reaches are captured, `PrefillGraphs.capture_all`)."""
        return AUTO_PREFILL_GRAPHS if self.prefill_graphs == PREFILL_GRAPHS_AUTO else tuple(self.prefill_graphs)


def prefill_graphs_from_env(environ) -> tuple[int, ...] | str:
    """The routed prefill passes' captured token counts the environment asks for, or "auto" (`ENV_PREFILL_GRAPHS`)."""
    text = environ.get(ENV_PREFILL_GRAPHS, "").strip()
    if not text:
        return ()
    if text == PREFILL_GRAPHS_AUTO:
        return text
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ServeConfigError(f"{ENV_PREFILL_GRAPHS} must list token counts separated by commas (e.g. "
                               f"'1024,2048') or {PREFILL_GRAPHS_AUTO!r}, got {text!r}") from None


def switch_from_env(environ, name: str) -> bool:
    """Whether the environment turns a measurement mode on (`name`: 0, the default, or 1)."""
    value = environ.get(name, "0")
    if value not in ("0", "1"):
        raise ServeConfigError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def part_clock_from_env(environ) -> bool:
    """Whether the environment asks for the part clock (`ENV_PART_CLOCK`)."""
    return switch_from_env(environ, ENV_PART_CLOCK)


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


# The phases whose CUDA graphs hold a routed variant: SGLang's decode graph runner captures a dense and a routed
# graph per batch size for an arm that routes decode (`vskipper.sglang.models.routed.SkipperGraphVariants`).
# An arm that routes any other phase serves it eagerly (its graphs would hold the dense model only).
ROUTED_GRAPH_PHASES = ("decode",)

# SGLang's CPU recipe: the CPU engine (environment), torch-native attention and sampling, no grammar backend,
# no CUDA graphs, a small KV pool, a fixed prefill chunk (left to SGLang, servers started on one machine in one run
# resolved 2048 and 4096 tokens, which the A/B's cross-arm identity gate refuses: SGLang 0.5.21 sizes a CPU's chunk
# by its NUMA node's MemTotal at boot, 2048 tokens under 20 GiB and 4096 up to 60, and a virtual machine's MemTotal
# can move while it runs). Flags after `--` are appended and override these (SGLang keeps the last).
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
             "--grammar-backend", "none", "--cuda-graph-backend-decode", "disabled",
             "--cuda-graph-backend-prefill", "disabled", "--mem-fraction-static", "0.1",
             "--max-total-tokens", "4096", "--chunked-prefill-size", "2048")
# SGLang on CUDA without its kernel wheels: the pure-Triton attention backend (else it picks fa3 on Hopper), torch
# sampling, no grammar backend, full decode graphs (torch.cuda.CUDAGraph only), no prefill graphs (SGLang's CUDA
# default is breakable prefill graphs, which the stand-in's weak_ref_tensor supports; off here so that every arm
# prefills alike: an arm routing prefill runs it eagerly, `ROUTED_GRAPH_PHASES`). Flags after `--` turn them on.
GPU_STAND_IN_FLAGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
                      "--cuda-graph-backend-decode", "full", "--cuda-graph-backend-prefill", "disabled")
GPU_STAND_IN_ENV = {
    "SGLANG_IS_FLASHINFER_AVAILABLE": "false",  # the flashinfer stand-in is importable, never usable
    "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",  # the stand-in has no wheel version
    "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python",  # no compiled radix tree core on the device
}
# Without JIT: SGLang's fused ops (rope, silu, KV store, q/k norm) take their torch paths and nothing compiles at
# warm-up (deterministic start-up on a fresh machine). With JIT they compile with nvcc and ninja.
GPU_NO_JIT_ENV = {"SGLANG_FORCE_FUSED_OP_BACKEND": "torch", "SGLANG_CRASH_ON_JIT_COMPILE": "1"}


@dataclass(frozen=True)
class ServeProfile:
    """How the server runs on its platform: what goes first on its PYTHONPATH, its environment, SGLang flags
    before the caller's (`flags`)."""

    name: str  # cpu | gpu-stand-in | gpu-kernels
    platform: str  # cpu | gpu
    kernels: str
    decode_graphs: str  # what the launch asks of decode passes: disabled | full | sglang-default | eager: why
    path: tuple[str, ...] = ()
    environment: tuple[tuple[str, str], ...] = ()
    flags: tuple[str, ...] = ()
    jit: str | None = None
    ops: str = "torch"  # the stand-in profile's RMSNorm, SiLU-and-mul and RoPE (`STAND_IN_OPS`)

    @property
    def attention_backend(self) -> str | None:
        """The attention backend its flags name (`--attention-backend`); None where SGLang picks one."""
        flags = list(self.flags)
        return flags[flags.index("--attention-backend") + 1] if "--attention-backend" in flags else None

    def attestation(self) -> dict:
        return {"name": self.name, "platform": self.platform, "kernels": self.kernels, "jit": self.jit,
                "decode_graphs": self.decode_graphs, "ops": OPS_ATTESTED[self.ops]}


OPS_ATTESTED = {"torch": "SGLang's own paths for RMSNorm, SiLU-and-mul and RoPE",
                "triton": "vSkipper's Triton RMSNorm, residual add with RMSNorm, SiLU-and-mul and RoPE "
                          "(vskipper.mixed.norms) in place of SGLang's torch paths"}


def serve_profile(platform: str, real_sgl_kernel: bool, jit: bool = False, ops: str = "torch") -> ServeProfile:
    """The serving profile for a resolved platform (`cpu` | `gpu`) and whether a real `sgl_kernel` is importable.

    cpu           the CPU recipe: the CPU stand-in for sgl_kernel, SGLang's CPU engine, CPU_FLAGS
    gpu-stand-in  a GPU without SGLang's kernel wheels: the CUDA stand-ins, GPU_STAND_IN_ENV, GPU_STAND_IN_FLAGS;
                  without JIT, `ops` 'triton' runs RMSNorm, SiLU-and-mul and RoPE on vSkipper's kernels
    gpu-kernels   a GPU with the real sgl_kernel (a CUDA runtime image): nothing added
    Decode graphs stay on for every arm: a routed arm's decode passes replay its routed graph variant."""
    if ops not in STAND_IN_OPS:
        raise ServeConfigError(f"--stand-in-ops must be one of {', '.join(STAND_IN_OPS)}, got {ops!r}")
    stand_in_no_jit = platform == "gpu" and not real_sgl_kernel and not jit
    if ops != "torch" and not stand_in_no_jit:
        where = ("the CPU profile" if platform == "cpu" else "SGLang's own kernels" if real_sgl_kernel
                 else "--gpu-jit (SGLang compiles its own)")
        raise ServeConfigError(f"--stand-in-ops {ops}: only the CUDA stand-in profile without --gpu-jit runs "
                               f"SGLang's torch paths it replaces, not {where}")
    if platform == "cpu":
        return ServeProfile("cpu", "cpu", "sgl_kernel CPU stand-in (vskipper/sglang/shims); SGLang's torch paths",
                            "disabled", path=(str(SHIMS_DIR),), environment=(("SGLANG_USE_CPU_ENGINE", "1"),),
                            flags=CPU_FLAGS)
    if platform != "gpu":
        raise ValueError(f"--platform must be cpu, gpu or auto, got {platform!r}")
    if real_sgl_kernel:
        return ServeProfile("gpu-kernels", "gpu", "SGLang's sgl_kernel and flashinfer (installed)", "sglang-default")
    env = dict(GPU_STAND_IN_ENV, **({} if jit else GPU_NO_JIT_ENV), **{ENV_STAND_IN_OPS: ops})
    return ServeProfile("gpu-stand-in", "gpu", "CUDA stand-in (vskipper/sglang/shims_gpu): sgl_kernel norms in "
                        "torch, flashinfer importable only; Triton attention, torch sampling",
                        "full", path=(str(SHIMS_GPU_DIR),), environment=tuple(sorted(env.items())),
                        flags=GPU_STAND_IN_FLAGS,
                        jit="SGLang JIT kernels (nvcc, ninja)" if jit else "off: SGLang's torch fused-op paths",
                        ops=ops)


def serve_environment(spec: ServeSpec, base: dict[str, str] | None = None,
                      profile: ServeProfile | None = None) -> dict[str, str]:
    """The server's environment: the profile's (on CPU, SGLang's CPU engine), the external model package, the
    profile's stand-ins first on this process tree's PYTHONPATH only, and the served configuration."""
    profile = profile or serve_profile("cpu", False)
    env = dict(os.environ if base is None else base)
    env.pop(ENV_TILE_TABLE, None)  # the spec's own (checked) or none
    env.pop(ENV_STAND_IN_OPS, None)  # the profile's own or none
    env.update(spec.to_env())
    env.update(profile.environment)
    env["SGLANG_EXTERNAL_MODEL_PACKAGE"] = MODEL_PACKAGE
    stand_ins = {str(SHIMS_DIR), str(SHIMS_GPU_DIR)}  # never inherit the other platform's stand-in
    paths = list(profile.path) + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in stand_ins]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env
