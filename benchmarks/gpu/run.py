"""The device run's stages (benchmarks/gpu/run.sh calls this): dense against routed, served by the real SGLang.

    python benchmarks/gpu/run.py tiles|sweep|ladder|headline|kernels|clock|summary OUTDIR [--dry-run]

Each stage writes `OUTDIR/<stage>.json` when it completes and skips work already there (a fresh machine reruns
only what is missing); a stage stops starting new work when its time budget (`--budget-s`, under nine minutes)
would be exceeded and says what it left for the next run. `--dry-run` runs every step on the CPU platform with a
tiny model and tiny sizes (the same code path; its numbers mean nothing).

Every stage serves a Llama-3-8B-shaped FlexiDepth configuration (32 layers, routed 16-31, random weights:
`--load-format dummy`), one server at a time with the device's memory to itself.

tiles     `vskipper tune-tiles` on the device: the routed layers' Triton GEMMs tiled for this device, every
          range (the prefill ones, by a pass's tokens from 513 up, included) and every operation measured here;
          each later stage's servers take the table (`vskipper serve --tile-table`), as each attests.
ladder    the headline A/B's dense half (`benchmarks/gpu/headline.py`): on GSM8K-shaped suites with forced output
          lengths, upstream's Q* ladder on dense (loadgen's Q* rule), then dense's side of every headline cell
          (0.75 / 0.95 / 1.25 x Q*, paired repetitions), on the same server.
sweep     fixed-batch decode (batch x context, each cell's prompts prefilled first so the timed burst decodes
          together; cells that do not fit the KV pool are skipped and named) and
          prefill at 1k/1.5k/2k/4k tokens (and rounds of two prompts of 768 and 1,024 tokens), dense,
          always-route r = 1 d = 0.5 and the control (always-route RandomSkip r = 0: nothing skipped), one server
          at a time in that order: step time, tokens/s, TPOT,
          the latency lines in V (tau, the measured crossover V_x beside the rule's V*), prefill ratios and the
          measured prefill floor.
headline  the routed half: the hybrid arm (RandomSkip r = 1 d = 0.5; thresholds from the roofline rule for the
          device, then from the upper end of the sweep's measured tau's 95% interval, with the sweep's measured
          prefill floor) on every cell, always-route and the s = 0
          control at the knee, each alone; then each arm against dense per load: loadgen's gates and paired 95%
          intervals, beside the paper's figures.
kernels   benchmarks/mixed_depth_bench.py with the tuned tiles.
clock     always-route, the s = 0 control and dense, each alone with its part clock on: a prefill pass's host time
          by layer kind and part (on a GPU its launches) beside the device's span, at 1k and 2k tokens and a round.
summary   results.json and summary.md from whatever the stages wrote.

A routed arm's decode passes replay the routed decode graph variant its model captured beside the dense one;
every figure is labelled with what ran (the attestation's `graph_passes_total`: passes replayed and eager).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu import headline, machine  # noqa: E402
from benchmarks.gpu.bundle import check_stamp, device_pins  # noqa: E402
from loadgen.attestation import READ_ATTEMPTS, read_answered  # noqa: E402
from vskipper.constants import CONSTANTS  # noqa: E402
from vskipper.modelspec import decode_bytes  # noqa: E402
from vskipper.sglang.launch import Server, http, launched  # noqa: E402
from vskipper.sglang.spec import (  # noqa: E402
    AUTO_PREFILL_GRAPHS,
    ENV_PART_CLOCK,
    ENV_PASS_SPANS,
    ENV_PREFILL_GRAPHS,
    ENV_PREFILL_READ,
    ENV_STACK_SAMPLES,
    PREFILL_GRAPHS_AUTO,
)
from vskipper.sglang.threads import ALLOCATOR_COUNTERS  # noqa: E402

# The order `run.sh all` runs them in (`run.py stages` prints it): the tiles first, since every routed server
# after them serves with the table they measure; then the sweep, which measures what the routed passes cost (and
# the tau the headline's second hybrid arm serves); the kernel benchmark, then the prefill's part clock last.
STAGES = ("tiles", "sweep", "ladder", "headline", "kernels", "clock")
SKIP_RATIO = 0.5  # RandomSkip r = 1, d = 0.5: half of the routed decisions project
ARM_FILES = {name: {"name": name, "skipper": "random_skip", "params": {"r": r, "d": 0.5}, "prefill": policy,
                    "decode": policy}
             for name, r, policy in (("random-r1-d0.5-always", 1.0, "routed"), ("random-r1-d0.5-hybrid", 1.0, "hybrid"),
                                     ("random-r0-always", 0.0, "routed"))}
# The control arm: the routed path with nothing skipped (every row RUN), the same kernels as ALWAYS.
ALWAYS, HYBRID, CONTROL = ARM_FILES
# The sweep's reference: dense as SGLang serves it on CUDA by default, its prefill passes replayed from breakable
# CUDA graphs captured at the sweep's prompt lengths (the stand-in's `weak_ref_tensor` makes them possible). The
# routed arms prefill eagerly (prefill graphs hold no routed variant, `vskipper.sglang.spec.ROUTED_GRAPH_PHASES`),
# and the sweep's dense arm likewise, so that the routed path's goals compare the same execution: this arm says
# what SGLang's prefill graphs would take off dense's TTFT. Prefill cells only; served last.
PREFILL_GRAPHS = "dense-prefill-graphs"
# The headline's routed arms in the order they are served (one server start each): key -> (arm, role, thresholds
# variant, loads). The hybrid arm runs every load twice over, with the rule's thresholds and, last, with the
# sweep's tau: what a session's device time leaves out first.
HEADLINE_ARMS = {"hybrid-rule": (HYBRID, "hybrid", "rule", headline.LOADS),
                 "always": (ALWAYS, "always", None, (headline.KNEE,)),
                 "control": (CONTROL, "control", None, (headline.KNEE,)),
                 "hybrid-tau": (HYBRID, "hybrid", "tau", headline.LOADS)}
# A JSON file {arm: URL} of servers already serving OUTDIR/model with `Plan` flags (`start`), used instead of
# starting them: the CI dry run starts each arm once for every stage (the hybrid arm at the thresholds of the
# sweep's tau would be `<arm>@tau`).
ENV_SERVERS = "VSKIPPER_GPU_RUN_SERVERS"
# Folders of earlier runs' results (`run.sh --earlier DIR`, os.pathsep between them): a lease that does not tune,
# sweep or climb the ladder itself takes the tile table, the tau and the Q* of the first one measured on this GPU.
ENV_EARLIER = "VSKIPPER_GPU_RUN_EARLIER"
# The CUDA stand-ins' RMSNorm, SiLU-and-mul and RoPE every server of the run serves with (`run.sh --stand-in-ops`,
# `vskipper serve --stand-in-ops`): torch (SGLang's paths, the default) or triton. A run's folder measures on one; an
# earlier run serves this one only where it measured on the same.
ENV_STAND_IN_OPS_RUN = "VSKIPPER_GPU_RUN_STAND_IN_OPS"
ENV_SAMPLES_RUN = "VSKIPPER_GPU_RUN_SAMPLES"  # run.sh --samples: the sweep's servers sample their forward's stack
# run.sh --prefill-only: the sweep's servers serve its prefill lengths and rounds alone, no decode cell (each
# server captures the one decode graph of a request): what a routed prefill pass costs, in less device time
ENV_PREFILL_ONLY_RUN = "VSKIPPER_GPU_RUN_PREFILL_ONLY"
# run.sh --routed-prefill-graphs: the sweep's routed arms replay their routed layers' prefill work from CUDA graphs
# captured at the sweep's prefill token counts (`vskipper.sglang.prefill_graphs`, `ENV_PREFILL_GRAPHS`); dense and
# the reference arm as ever. A device's option: a CPU server captures no graph.
ENV_ROUTED_PREFILL_GRAPHS_RUN = "VSKIPPER_GPU_RUN_ROUTED_PREFILL_GRAPHS"
# run.sh --routed-prefill-read: the sweep's routed arms prefill with this read (packed or backend) in place of the
# table's choice (`ENV_PREFILL_READ`; empty: the table's); the triton execution's, so a device's option.
ENV_ROUTED_PREFILL_READ_RUN = "VSKIPPER_GPU_RUN_ROUTED_PREFILL_READ"
ROUTED_PREFILL_READS = ("packed", "backend")
PREFILL_ONLY_GRAPHS = (1,)  # the decode graphs a prefill-only sweep server captures
# What one sweep arm takes on the H200, its server's start included (sweep-865480a's logs: a dense server ready 42 s
# after its launch, a routed one 59 s; a whole arm, its decode cells and prefill, 140-150 s; the prefill cells alone
# about 6 s): a sweep starts an arm only where this much is left before its limit (`Stage.fits`).
SWEEP_ARM_S = 150.0
PREFILL_ONLY_ARM_S = 75.0
# What a routed arm's start takes more where its routed prefill layers replay (`--routed-prefill-graphs`: the server
# captures each count's segments and checks them twice before it reports ready): at least GRAPHED_ARM_EXTRA_S, and
# GRAPHED_COUNT_S a count (`graphed_start_s`). Not yet timed on a device: each server attests its counts' seconds
# (`captured_at_boot_s`).
GRAPHED_ARM_EXTRA_S = 15.0
GRAPHED_COUNT_S = 1.0
STAGE_END_S = 25.0  # what a stage that runs to its limit keeps after its last step: its result and the summary
TERM_EXIT = 128 + signal.SIGTERM  # a stage's exit on run.sh's TERM at its limit (`main`)
STEP_NEED_S = 120.0  # what a stage's subprocess step needs left to start (`run_steps`), unless it says


@dataclass(frozen=True)
class Lease:
    """What one device lease measures: 15 minutes of device time, the machine's start (a minute or more) and the
    transfers included, so one call of at most ten minutes (`--within 560`); where its stages take longer, a second
    call on the same OUTDIR finishes them, at once on the machine still warm or later from the first call's archive
    (`--pack`). `run.sh lease-N OUTDIR --within S` runs its stages in order within S seconds; a stage's `caps` bound
    its budget, so that the stages after it keep their time."""

    name: str
    stages: tuple[str, ...]
    estimate_s: int  # device seconds its stages likely take, the starts of its servers included (not measured)
    caps: tuple[tuple[str, int], ...] = ()  # (stage, the most seconds of budget it takes in this lease)
    headline_arms: tuple[str, ...] = ()  # the headline's arms this lease serves (HEADLINE_ARMS keys)


# The device work in leases, what matters most first. A lease serves its own dense side: no arm is compared with a
# dense arm served on another machine. Not yet measured on a GPU; the estimates take a server ready in 45-90 s
# (measured on the H100 with every decode graph captured), a sweep arm about 80 s of cells, the ladder's climb
# about 150 s (warm-up, calibration, about 8 rates of 10 s) and a headline cell about 20 s (12 s of arrivals, the
# drain, the flush and attestations) and the check of the served layer before a lease's first routed server about
# 30 s: a lease's second call finishes what its first left.
LEASES = (  # what each measures: benchmarks/gpu/README.md's table
    Lease("lease-1", ("tiles", "sweep"), 690, caps=(("tiles", 180),)),  # items 1-2: the routed path's goals, tau
    Lease("lease-2", ("ladder", "headline"), 730, headline_arms=("hybrid-rule",)),  # item 3: Q*, the hybrid arm
    Lease("lease-3", ("ladder", "headline"), 520, headline_arms=("always", "control")),  # the knee's ablations
    Lease("lease-4", ("ladder", "headline", "kernels"), 670, headline_arms=("hybrid-tau",)),  # tau's hybrid arm
    # tau's hybrid arm first, then the knee's ablations, at an earlier run's Q* (`--earlier`): no climb
    Lease("lease-5", ("ladder", "headline"), 720, headline_arms=("hybrid-tau", "always", "control")),
    # where a prefill pass's host time goes, part by part, in always-route, the s = 0 control and dense, and what of
    # the sweep's way of serving makes a routed pass's launches take longer (always-route timed whole too)
    Lease("lease-6", ("clock",), 440),
)


# Every server serves with its metrics, as deployed: SGLang then stamps each request's way through it in its
# responses (`loadgen.records.SERVER_TIMES`), which place a prefill's TTFT (`prefill_cells`).
METRICS_FLAGS = ("--enable-metrics",)


@dataclass(frozen=True)
class Plan:
    """Sizes of one device run (`gpu`) or of its CPU dry run (`dry_run`)."""

    dry_run: bool
    platform: str
    dtype: str
    sglang_flags: tuple[str, ...]
    solo_mem_fraction: str | None  # one server alone on the device (every stage)
    tune_max_candidates: int | None  # tiles tried per shape by tune-tiles (None: all of them)
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    sweep_new_tokens: int
    decode_reps: int  # timed bursts of each decode cell (the median is the cell's figure, beside their spread)
    prefill_lengths: tuple[int, ...]
    prefill_reps: int
    startup_timeout_s: float
    # the headline A/B (ladder and headline stages)
    prompt_tokens: tuple[int, int]  # GSM8K-shaped prompt lengths, drawn uniformly (inclusive)
    output_tokens: tuple[int, int]  # forced output lengths, drawn uniformly (inclusive)
    warmup_requests: int  # a burst each server serves before its cells (compiles what they run)
    calibration_requests: int  # dense's closed burst whose request rate starts the ladder
    ladder_window_s: float  # declared duration of one ladder rate
    ladder_max_rates: int
    window_s: float  # declared duration of one headline cell
    min_requests: int
    repetitions: int
    start_estimate_s: float  # what one server start takes, to stop before the stage's budget
    cell_overhead_s: float  # flush, attestations and the client beside a cell's makespan
    # Whether a hybrid arm may run no routed pass in all its cells. Any one of its cells may run none (loadgen's
    # below-engagement): its thresholds and floor are meant to keep a light load dense. On a GPU it must route in one.
    engagement_optional: bool
    threshold_step: int  # the rounding of thresholds derived from a measured tau
    dry_thresholds: tuple[int, int] | None = None  # (enter, exit) on CPU, where no device has a roofline
    ladder_start_max: int | None = None  # the highest rate the ladder starts at, whatever the calibration says
    model_size: dict = field(default_factory=dict)
    # The sweep's prefill rounds of several prompts (prompts, tokens each), each sent in one request so that they form
    # one admission round, of a length a single prompt of `prefill_lengths` has: a served round's prefill floor
    # counts its prompts' tokens together, and a round of several prompts reads attention over each alone.
    prefill_rounds: tuple[tuple[int, int], ...] = ()
    stand_in_ops: str = "torch"  # every server's RMSNorm, SiLU-and-mul and RoPE (ENV_STAND_IN_OPS_RUN)
    # The sweep's servers sample their forward's Python stack in each pass (ENV_SAMPLES_RUN: a measurement that
    # costs each pass a few percent, so off unless asked for): where a slow pass's host time went, by line.
    sweep_samples: bool = False
    # The sweep's servers serve its decode cells before its prefill lengths (ENV_PREFILL_ONLY_RUN: not, where a run
    # asks for its prefill figures alone); a sweep without decode cells has no tau.
    sweep_decode: bool = True
    # The sweep's routed arms replay their routed prefill layers from graphs (ENV_ROUTED_PREFILL_GRAPHS_RUN) at
    # `routed_graph_tokens`, the headline's routed arms at the counts "auto" asks that their prefill chunk reaches.
    routed_prefill_graphs: bool = False
    # The sweep's and the headline's routed arms prefill with this read in place of the table's choice
    # (ENV_ROUTED_PREFILL_READ_RUN); None: the table's.
    routed_prefill_read: str | None = None

    @classmethod
    def gpu(cls) -> Plan:
        # GSM8K-shaped: prompts of 700-1,100 tokens (the paper gives none; see headline.py) and outputs of 58-174
        # tokens (mean 116, upstream's mean at the paper's knee). Cells of about 12 s of arrivals (the paper's hold
        # 3,600 requests, about 290 s at its knee), sized so that a lease's dense and routed sides fit its device
        # time (`LEASES`).
        return cls(False, "gpu", "bfloat16",
                   ("--load-format", "dummy", "--skip-tokenizer-init", "--context-length", "8192",
                    "--cuda-graph-max-bs-decode", "256", "--max-running-requests", "256", *METRICS_FLAGS),
                   "0.85", tune_max_candidates=24, batches=(32, 64, 128), contexts=(1024, 2048, 4096),
                   sweep_new_tokens=48, decode_reps=3, prefill_lengths=(1024, 1536, 2048, 4096), prefill_reps=5,
                   startup_timeout_s=300.0,
                   prompt_tokens=(700, 1100), output_tokens=(58, 174), warmup_requests=64, calibration_requests=128,
                   ladder_window_s=10.0, ladder_max_rates=14, window_s=12.0, min_requests=24, repetitions=3,
                   start_estimate_s=100.0, cell_overhead_s=3.0, engagement_optional=False,
                   threshold_step=CONSTANTS.threshold_rounding_tokens,
                   model_size={"layers": 32, "hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8,
                               "head_dim": 128, "vocab": 128256, "reduction": 16},
                   prefill_rounds=((2, 768), (2, 1024)))

    @classmethod
    def dry(cls) -> Plan:
        # On CPU an idle SGLang scheduler polls in a busy loop: the dry run's servers sleep while idle, so the
        # four of them and the kernels stage share the cores with the one being driven. The tiny prompts never
        # reach the prefill floor and a cell of a second and a half may keep the decode switch below its enter
        # threshold: the hybrid arm's cells may run no routed pass. A closed burst of four requests on the shared
        # cores measures anything from 2 to 110 req/s, and a ladder started far past the knee sees no output
        # within a one-second window: it starts at 3 req/s at most.
        return cls(True, "cpu", "float32", ("--load-format", "dummy", "--skip-tokenizer-init", "--sleep-on-idle",
                                            *METRICS_FLAGS),
                   None, None, batches=(2, 3), contexts=(16,), sweep_new_tokens=6, decode_reps=2,
                   prefill_lengths=(32, 64), prefill_reps=2, startup_timeout_s=240.0, prompt_tokens=(16, 32), output_tokens=(3, 9),
                   warmup_requests=2, calibration_requests=4, ladder_window_s=1.0, ladder_max_rates=3, window_s=1.5,
                   min_requests=4, repetitions=1, start_estimate_s=1.0, cell_overhead_s=0.5,
                   engagement_optional=True, threshold_step=10, dry_thresholds=(60, 40), model_size={"layers": 4},
                   ladder_start_max=3, prefill_rounds=((2, 32),))

    @property
    def sweep_arm_s(self) -> float:
        """What one sweep server's arm takes, its start included: a whole sweep's or a prefill-only one's, more
        where the routed arms capture their prefill graphs (on the dry run a second: every arm starts)."""
        if self.dry_run:
            return 1.0
        return (SWEEP_ARM_S if self.sweep_decode else PREFILL_ONLY_ARM_S) + \
            (graphed_start_s(len(self.routed_graph_tokens)) if self.routed_prefill_graphs else 0.0)

    @property
    def headline_start_s(self) -> float:
        """What a headline routed arm's start takes: a server's, more where it captures the counts "auto" asks (as
        many as its prefill chunk reaches, all of them under SGLang's GPU defaults)."""
        return self.start_estimate_s + (graphed_start_s(len(AUTO_PREFILL_GRAPHS)) if self.routed_prefill_graphs
                                        else 0.0)

    @property
    def reference_arm_s(self) -> float:
        """What the sweep's reference arm takes: a prefill-only arm whose server captures prefill graphs as it
        starts, so a server's start at least, in either kind of sweep."""
        return max(self.start_estimate_s, replace(self, sweep_decode=False).sweep_arm_s)

    @property
    def sweep_graph_batches(self) -> tuple[int, ...]:
        """The decode batch sizes a sweep server captures graphs of: the sweep's own, or one row where it serves
        its prefill alone (`sweep_decode`)."""
        return self.batches if self.sweep_decode else PREFILL_ONLY_GRAPHS

    def prefill_graph_flags(self) -> list[str]:
        """The reference arm's flags (`PREFILL_GRAPHS`): breakable prefill graphs captured at the sweep's prompt
        lengths (a graph of a pass's tokens or more replays it). None on CPU, which captures no graph."""
        if self.dry_run:
            return []
        return ["--cuda-graph-backend-prefill", "breakable", "--cuda-graph-bs-prefill",
                *(str(n) for n in sorted(self.prefill_lengths))]

    @property
    def routed_graph_tokens(self) -> tuple[int, ...]:
        """The token counts the routed arms' prefill graphs are captured at: every pass of the sweep's prefill
        cells, a prompt of each length alone and each round of several (a round's passes hold at most its
        tokens)."""
        return tuple(sorted({*self.prefill_lengths, *(n * length for n, length in self.prefill_rounds)}))

    def max_running(self) -> int | None:
        return headline.max_running(self.sglang_flags)


def graphed_start_s(counts: int) -> float:
    """What a server's start takes more to capture and check `counts` counts of routed prefill graphs."""
    return max(GRAPHED_ARM_EXTRA_S, GRAPHED_COUNT_S * counts)


class Stage:
    """One stage's output folder, its time budget (and limit, where it was given one) and what it left undone."""

    def __init__(self, name: str, out: Path, budget_s: float, limit_s: float | None = None) -> None:
        self.name, self.out = name, out / name
        self.out.mkdir(parents=True, exist_ok=True)
        now = time.monotonic()
        self.deadline = now + budget_s
        # the latest a step that knows what it takes may end (`fits`): the limit less the stage's end, else the budget
        self.end = now + limit_s - STAGE_END_S if limit_s is not None else self.deadline
        self.left: list[str] = []
        self.failed: list[str] = []  # steps that failed outright (`run_steps`)

    def has_time(self, needed_s: float, what: str) -> bool:
        """Whether `needed_s` from now is within the budget; else `what` is left for the next run."""
        return self._within(self.deadline, needed_s, what)

    def fits(self, needed_s: float, what: str) -> bool:
        """Whether a step that takes `needed_s` (an estimate of the whole step) ends before the stage's limit, less
        `STAGE_END_S`, where the stage was given its limit, else before its budget; else `what` is left."""
        return self._within(self.end, needed_s, what)

    def _within(self, deadline: float, needed_s: float, what: str) -> bool:
        if time.monotonic() + needed_s <= deadline:
            return True
        self.left.append(what)
        print(f"[{self.name}] left for the next run (time budget): {what}", flush=True)
        return False


def log(stage: str, text: str) -> None:
    print(f"[{stage}] {text}", flush=True)


# -- the model, the arms, the servers -------------------------------------------------------------------------------

def write_model(plan: Plan, out: Path) -> Path:
    """A FlexiDepth-Llama config.json (no weights: `--load-format dummy` draws them)."""
    from vskipper.checkpoint import TinySize, tiny_config

    path = out / "model"
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config("flexidepth-llama", TinySize(**plan.model_size), dtype=plan.dtype)
    if not plan.dry_run:
        config.update(max_position_embeddings=8192, bos_token_id=128000, eos_token_id=128001)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def write_arms(out: Path) -> dict[str, Path]:
    """The routed arms as files (OUTDIR/arms/NAME.json) for `vskipper serve --arm-file` and loadgen."""
    paths = {}
    (out / "arms").mkdir(parents=True, exist_ok=True)
    for name, arm in ARM_FILES.items():
        paths[name] = out / "arms" / f"{name}.json"
        paths[name].write_text(json.dumps(arm) + "\n")
    return paths


def device_name(plan: Plan) -> str | None:
    if plan.dry_run:
        return None
    from vskipper.roofline import lookup_device
    from vskipper.sglang.cli import detect_gpu_product

    product = detect_gpu_product()
    return lookup_device(product).name if product else None


def device_bandwidth(plan: Plan) -> float | None:
    """The detected device's memory bandwidth in GB/s (the roofline's catalogue), or None on the dry run's CPU."""
    from vskipper.roofline import lookup_device

    name = device_name(plan)
    return lookup_device(name).bandwidth_gbps if name else None


def rule(plan: Plan, model: Path) -> dict:
    """The roofline rule for the device (V*, enter, exit, tau), or the dry run's tiny thresholds."""
    if plan.dry_thresholds is not None:
        from vskipper.roofline import tau_seconds

        enter, exit_ = plan.dry_thresholds
        routed = len(json.loads((model / "config.json").read_text())["routing_layers"])
        return {"enter_tokens": enter, "exit_tokens": exit_, "v_star_tokens": exit_,
                "tau_ms": tau_seconds(routed) * 1e3, "source": "dry-run (CPU)"}
    from vskipper.modelspec import load_model_facts
    from vskipper.roofline import derive_thresholds, lookup_device

    device = lookup_device(device_name(plan))
    facts = load_model_facts(str(model))
    t = derive_thresholds(device.bandwidth_gbps, SKIP_RATIO, facts.num_routed_layers,
                          facts.kv_bytes_per_token_layer, device.dense_tflops)
    return {**t.as_dict(), "source": f"roofline:{device.name}"}


def earlier_runs() -> list[Path]:
    """The folders of earlier runs' results (ENV_EARLIER, `run.sh --earlier DIR`, each given once), in order."""
    given = [Path(p) for p in os.environ.get(ENV_EARLIER, "").split(os.pathsep) if p]
    for path in given:
        if not path.is_dir():
            raise RuntimeError(f"{ENV_EARLIER}: {path}: no such folder (an earlier run's results)")
    return given


def measured_on(folder: Path) -> str | None:
    """What a run measured on (its env.json): the GPU, the mode (a device run or a CPU dry run) and the stand-in ops
    where not SGLang's, or None where it names none. A run's folder measures on one GPU in one mode on one kind of
    ops: `run.sh install` refuses another."""
    env = folder / "env.json"
    if not env.is_file():
        return None
    doc = json.loads(env.read_text())
    ops = doc.get("stand_in_ops", "torch")
    return f"{doc.get('gpu')} ({doc.get('mode')}{'' if ops == 'torch' else f', stand-in ops {ops}'})"


def run_stand_in_ops(plan: Plan, environ=os.environ) -> Plan:
    """The plan with the run's stand-in ops (ENV_STAND_IN_OPS_RUN); the CPU dry run serves SGLang's own paths only."""
    from vskipper.serveargs import STAND_IN_OPS

    ops = environ.get(ENV_STAND_IN_OPS_RUN) or "torch"
    if ops not in STAND_IN_OPS:
        raise SystemExit(f"{ENV_STAND_IN_OPS_RUN}={ops!r}: one of {', '.join(STAND_IN_OPS)}")
    if ops != "torch" and plan.dry_run:
        raise SystemExit(f"--stand-in-ops {ops}: the CUDA stand-in profile's, which a CPU dry run does not serve")
    return replace(plan, stand_in_ops=ops)


def run_sweep_flags(plan: Plan, environ=os.environ) -> Plan:
    """The plan with the sweep's servers sampling their stacks where the run asks (ENV_SAMPLES_RUN, 0 or 1),
    serving its prefill cells alone where it asks (ENV_PREFILL_ONLY_RUN, 0 or 1), and its routed arms replaying
    their routed prefill layers from graphs where it asks (ENV_ROUTED_PREFILL_GRAPHS_RUN, 0 or 1; not on CPU)."""
    flags = {}
    for name in (ENV_SAMPLES_RUN, ENV_PREFILL_ONLY_RUN, ENV_ROUTED_PREFILL_GRAPHS_RUN):
        value = environ.get(name) or "0"
        if value not in ("0", "1"):
            raise SystemExit(f"{name}={value!r}: 0 or 1")
        flags[name] = value == "1"
    if flags[ENV_ROUTED_PREFILL_GRAPHS_RUN] and plan.dry_run:
        raise SystemExit("--routed-prefill-graphs: CUDA graphs, which a CPU dry run's servers do not capture")
    read = environ.get(ENV_ROUTED_PREFILL_READ_RUN) or None
    if read is not None and read not in ROUTED_PREFILL_READS:
        raise SystemExit(f"{ENV_ROUTED_PREFILL_READ_RUN}={read!r}: one of {', '.join(ROUTED_PREFILL_READS)}")
    if read is not None and plan.dry_run:
        raise SystemExit("--routed-prefill-read: the triton execution's, which a CPU dry run's servers do not run")
    return replace(plan, sweep_samples=flags[ENV_SAMPLES_RUN], sweep_decode=not flags[ENV_PREFILL_ONLY_RUN],
                   routed_prefill_graphs=flags[ENV_ROUTED_PREFILL_GRAPHS_RUN], routed_prefill_read=read)


def earlier(out: Path, name: str, usable) -> tuple[Path | None, str]:
    """The first earlier run (ENV_EARLIER) on this run's GPU whose file `name` is `usable`: (its path, where it comes
    from), or (None, why none is)."""
    runs = earlier_runs()
    if not runs:
        return None, "no earlier run was given (--earlier)"
    mine, why = measured_on(out), []
    for run in runs:
        path = run / name
        if not path.is_file() or not usable(path):
            why.append(f"{run} holds no whole {name}")
        elif mine is None or measured_on(run) != mine:
            why.append(f"{run} measured on {measured_on(run)}, this run on {mine}")
        else:
            return path, f"an earlier run on this GPU ({run})"
    return None, "; ".join(why)


def tuned_table(plan: Plan, out: Path) -> Path | None:
    """The tile table the tiles stage measured on this device, once written whole; else an earlier run's on this GPU
    (ENV_EARLIER; a table for another GPU would stop every server); else None: the servers take the one shipped for
    the device."""
    device = DRY_TILES_DEVICE if plan.dry_run else device_name(plan)

    def usable(path: Path) -> bool:
        return finished(path) and json.loads(path.read_text()).get("device") == device

    path = out / "tiles" / TILES_JSON
    if usable(path):
        return path
    return earlier(out, f"tiles/{TILES_JSON}", usable)[0]


OWN_SWEEP = "this run's sweep"


def sweep_for_tau(out: Path) -> tuple[dict | None, str]:
    """The sweep whose tau the headline's second hybrid arm serves: this run's, else an earlier run's on this GPU:
    (sweep, where it comes from: OWN_SWEEP for this run's), or (None, why there is none)."""
    if (out / "sweep.json").is_file():
        own = json.loads((out / "sweep.json").read_text())
        if not prefill_only(own):  # a prefill-only sweep measures no tau: an earlier run's serves instead
            return own, OWN_SWEEP
    path, where = earlier(out, "sweep.json", lambda p: (json.loads(p.read_text()).get("comparison") or {})
                          .get("tau_ms") is not None)
    return (json.loads(path.read_text()), f"the sweep of {where}") if path else (None, where)


def decode_cells(arms: dict) -> dict[str, bool]:
    """Whether each served arm of a sweep served its decode cells before its prefill ones (`Plan.sweep_decode`;
    an arm from before the flag did); the reference serves prefill alone in either kind of sweep, and is left out."""
    return {name: arm.get("decode_cells", True) for name, arm in arms.items()
            if "error" not in arm and name != PREFILL_GRAPHS}


def prefill_only(sweep: dict) -> bool:
    """Whether a sweep's arms served its prefill cells alone (`run.sh --prefill-only`, `Plan.sweep_decode`)."""
    served = decode_cells(sweep.get("arms") or {})
    return bool(served) and not any(served.values())


def asked_read(served: dict) -> str | None:
    """The prefill read a server's routed layers were asked to serve with (`ENV_PREFILL_READ`, as its execution
    attests it), or None where they took the table's choice."""
    backend = served.get("routed_layers_backend")
    if not isinstance(backend, dict) or not (backend.get("prefill_read_why") or "").startswith(f"{ENV_PREFILL_READ}="):
        return None
    return backend.get("prefill_read")


def read_words(asked: str | None) -> str:
    """The prefill read a run or a server was asked for, in a refusal's words."""
    return f"the {asked} read (--routed-prefill-read)" if asked else "the table's prefill read"


def sweep_mode_mismatch(plan: Plan, out: Path) -> str | None:
    """Why this run's sweep cannot continue or reuse what OUTDIR's sweep served: arms served with decode cells
    where this run serves its prefill alone, or the other way round (`run.sh --prefill-only`), routed arms asked for
    another prefill read than this run asks for, or none where it asks (`--routed-prefill-read`), or routed arms whose
    prefill layers replayed from graphs where this run's run eagerly, or the other way round
    (`--routed-prefill-graphs`); None where they agree or nothing was served yet. A folder holds one kind of sweep:
    its arms' prefill passes follow the same work."""
    folder = out / "sweep"
    docs = {p.name.removesuffix(".result.json"): json.loads(p.read_text())
            for p in folder.glob("*.result.json")} if folder.is_dir() else {}
    kept = decode_cells(docs)
    other = sorted(name for name, decoded in kept.items() if decoded != plan.sweep_decode)
    graphed = sorted(name for name in (ALWAYS, CONTROL) if (docs.get(name) or {}).get("served")
                     and bool(docs[name]["served"].get("prefill_graphs")) != plan.routed_prefill_graphs)
    reads = sorted(name for name in (ALWAYS, CONTROL) if (docs.get(name) or {}).get("served")
                   and asked_read(docs[name]["served"]) != plan.routed_prefill_read)
    if reads:
        return (f"{out}'s sweep served {', '.join(reads)} with {read_words(asked_read(docs[reads[0]]['served']))}, and this "
                f"run serves them with {read_words(plan.routed_prefill_read)}: a folder holds one kind of sweep; give this "
                "run a new OUTDIR (and the old one as --earlier)")
    if graphed:
        done = "eagerly" if plan.routed_prefill_graphs else "from graphs (--routed-prefill-graphs)"
        return (f"{out}'s sweep served {', '.join(graphed)} with its routed prefill layers {done}, and this run "
                f"serves them {'from graphs' if plan.routed_prefill_graphs else 'eagerly'}: a folder holds one kind "
                "of sweep; give this run a new OUTDIR (and the old one as --earlier)")
    if not other:
        return None
    done = "with its decode cells" if not plan.sweep_decode else "without decode cells (--prefill-only)"
    asked = "alone (--prefill-only)" if not plan.sweep_decode else "with its decode cells"
    return (f"{out}'s sweep served {', '.join(other)} {done}, and this run serves the sweep's prefill {asked}: a "
            "folder holds one kind of sweep; give this run a new OUTDIR (and the old one as --earlier)")


def headline_mode_mismatch(plan: Plan, out: Path, arms: tuple[str, ...] = tuple(HEADLINE_ARMS),
                           serving: dict[str, dict | None] | None = None) -> str | None:
    """Why this run's headline cannot continue what OUTDIR's headline served: a routed arm of `arms` whose cells
    served with its routed prefill layers from graphs where this run's run eagerly, or the other way round
    (`--routed-prefill-graphs`), or with another prefill read than this run asks for (`--routed-prefill-read`);
    None where they agree or nothing was served yet. A folder's headline cells of one arm serve one way. Where
    `serving` gives the thresholds this run serves each arm at (the arms it serves), an arm not among them and an
    arm whose folder is set aside, served at other thresholds (`served_elsewhere`), are no obstacle."""
    folder = out / "headline"
    for key in arms:
        path = folder / key / "served.json"
        if not path.is_file():
            continue
        if serving is not None and (key not in serving or served_elsewhere(folder / key, serving[key])):
            continue
        served_doc = json.loads(path.read_text())
        graphed = bool(served_doc.get("prefill_graphs"))
        if graphed != plan.routed_prefill_graphs:
            done = "from graphs (--routed-prefill-graphs)" if graphed else "eagerly"
            return (f"{out}'s headline served {key} with its routed prefill layers {done}, and this run serves them "
                    f"{'from graphs' if plan.routed_prefill_graphs else 'eagerly'}: an arm's headline cells serve one "
                    "way; give this run a new OUTDIR (and the old one as --earlier)")
        if asked_read(served_doc) != plan.routed_prefill_read:
            return (f"{out}'s headline served {key} with {read_words(asked_read(served_doc))}, and this run serves it with "
                    f"{read_words(plan.routed_prefill_read)}: an arm's headline cells serve one way; give this run a new "
                    "OUTDIR (and the old one as --earlier)")
    return None


def graph_flags(flags: tuple[str, ...], batches: tuple[int, ...] | None) -> list[str]:
    """The plan's SGLang flags, with the decode graphs captured at `batches` alone instead of every size up to the
    plan's largest (the sweep decodes at its own batches only: each size captured costs every start time, twice
    over for a routed arm's two variants)."""
    flags = list(flags)
    if batches and "--cuda-graph-max-bs-decode" in flags:
        i = flags.index("--cuda-graph-max-bs-decode")
        flags[i:i + 2] = ["--cuda-graph-bs-decode", *(str(b) for b in sorted(batches))]
    return flags


def start(plan: Plan, stack: ExitStack, model: Path, workdir: Path, arm: str | None = None,
          arm_file: Path | None = None, mem: str | None = None, thresholds: dict | None = None,
          graph_batches: tuple[int, ...] | None = None, flags: list[str] | None = None,
          part_clock: bool = False, samples: bool = False, prefill_graphs: tuple[int, ...] | str = (),
          prefill_read: str | None = None) -> Server:
    """`vskipper serve` with the plan's flags and the tiles stage's table where it wrote one (`model` is
    OUTDIR/model); `thresholds` as its --enter-tokens / --exit-tokens (else the arm's from the roofline rule for the
    detected GPU); `graph_batches`, the only decode batch sizes captured (`graph_flags`); `flags`, SGLang flags
    after all of those; `part_clock`, its part clock on (`ENV_PART_CLOCK`: every part of every layer timed);
    `samples`, the forward's stack sampled in each pass (`ENV_STACK_SAMPLES`); `prefill_graphs`, the token counts
    its routed prefill layers are captured at, or "auto" (`ENV_PREFILL_GRAPHS`; none: eager); `prefill_read`, the triton
    execution's prefill read in place of the table's choice (`ENV_PREFILL_READ`; None: the table's)."""
    extra = graph_flags(plan.sglang_flags, graph_batches) + (["--mem-fraction-static", mem] if mem else []) \
        + list(flags or [])
    kw = {}
    if thresholds is not None:
        kw = {"enter_tokens": thresholds["enter_tokens"], "exit_tokens": thresholds["exit_tokens"],
              "prefill_floor_tokens": thresholds.get("prefill_floor_tokens")}
    # Killed, not drained, when the stage is done with it: SGLang's graceful shutdown costs about 5 s a server.
    # Each times its passes' spans (`ENV_PASS_SPANS`: two timing events and two clock reads a pass, in every arm
    # alike), which the sweep reads beside its figures (`pass_spans`).
    return stack.enter_context(launched(model, workdir, arm=arm, arm_file=arm_file, dtype=plan.dtype,
                                        extra=extra, platform=plan.platform, graceful=False,
                                        tile_table=tuned_table(plan, model.parent),
                                        env={ENV_PASS_SPANS: "1", **({ENV_PART_CLOCK: "1"} if part_clock else {}),
                                             **({ENV_STACK_SAMPLES: "1"} if samples else {}),
                                             # set either way: never one inherited from the caller
                                             ENV_PREFILL_GRAPHS: prefill_graphs if isinstance(prefill_graphs, str)
                                             else ",".join(map(str, prefill_graphs)),
                                             ENV_PREFILL_READ: prefill_read or ""},
                                        stand_in_ops=None if plan.stand_in_ops == "torch" else plan.stand_in_ops,
                                        **kw))


class Attached:
    """A server started elsewhere (ENV_SERVERS): the calls the stages make of a `Server`."""

    def __init__(self, url: str) -> None:
        self.url = url

    def wait_ready(self, timeout: float) -> Attached:
        if http(self.url + "/health", timeout=min(timeout, 30))[0] != 200:
            raise RuntimeError(f"{self.url}/health does not answer 200")
        return self

    def get_json(self, path: str) -> dict:
        status, text = http(self.url + path)
        if status != 200:
            raise RuntimeError(f"GET {self.url}{path}: HTTP {status} {text[:300]}")
        return json.loads(text)


def server_for(plan: Plan, stack: ExitStack, model: Path, workdir: Path, name: str, arm_files: dict[str, Path],
               mem: str | None = None, thresholds: dict | None = None, key: str | None = None,
               graph_batches: tuple[int, ...] | None = None, part_clock: bool = False, samples: bool = False,
               prefill_graphs: tuple[int, ...] | str = (), prefill_read: str | None = None):
    """The arm's server: attached from ENV_SERVERS when it names `key` (default: the arm), else started (stopped
    with `stack`); `thresholds` go to the hybrid arm only; `part_clock`, `samples`, `prefill_graphs` and
    `prefill_read` as `start` takes them (dense's start takes neither of the last two)."""
    given = json.loads(Path(os.environ[ENV_SERVERS]).read_text()) if os.environ.get(ENV_SERVERS) else {}
    if (key or name) in given:
        return Attached(given[key or name])
    if name in ("dense", PREFILL_GRAPHS):
        return start(plan, stack, model, workdir, arm="dense", mem=mem, graph_batches=graph_batches,
                     flags=plan.prefill_graph_flags() if name == PREFILL_GRAPHS else None, part_clock=part_clock,
                     samples=samples)
    return start(plan, stack, model, workdir, arm_file=arm_files[name], mem=mem,
                 thresholds=thresholds if name == HYBRID else None, graph_batches=graph_batches,
                 part_clock=part_clock, samples=samples, prefill_graphs=prefill_graphs, prefill_read=prefill_read)


def ready(plan: Plan, servers: list[Server]) -> None:
    for server in servers:
        server.wait_ready(plan.startup_timeout_s)


def find_key(doc, key: str):
    if isinstance(doc, dict):
        if key in doc:
            return doc[key]
        doc = list(doc.values())
    if isinstance(doc, list):
        for item in doc:
            found = find_key(item, key)
            if found is not None:
                return found
    return None


def kv_capacity(server: Server) -> int:
    capacity = find_key(server.get_json("/server_info"), "max_total_num_tokens")
    if not capacity:
        raise RuntimeError(f"{server.url}/server_info names no max_total_num_tokens")
    return int(capacity)


def served(server: Server) -> dict:
    """What the server attests it ran: profile (decode graphs), passes, thresholds."""
    doc = server.get_json("/vskipper/attestation")
    return {"arm": doc["arm"]["name"], "profile": doc["execution"].get("profile"), "passes_total": doc["passes_total"],
            "graph_passes_total": doc.get("graph_passes_total"), "routed_graph_variants": doc.get("routed_graph_variants"),
            "cuda_graphs": doc["execution"].get("cuda_graphs"), "rows_total": doc.get("rows_total"),
            "routed_layers_backend": doc["execution"].get("routed_layers_backend"), "tiles": doc["execution"].get("tiles"),
            "thresholds": doc["thresholds"], "sglang_version": doc.get("sglang_version"),
            "prefill_graphs": doc.get("prefill_graphs")}


def triton_compiles(server: Server) -> dict | None:
    """The Triton compilations the server counts now (its attestation's `triton_compiles`)."""
    return server.get_json("/vskipper/attestation").get("triton_compiles")


def clock_reading(server: Server) -> tuple[dict | None, dict, dict | None, dict | None]:
    """`pass_clock` and, from the same document, each thread's CPU seconds so far (`threads`:
    `vskipper.sglang.threads.thread_cpu`; {} where the server attests none), its CUDA allocator's counters
    (`allocator`, `threads.allocator_counts`; None off CUDA) and its Triton compilations (`triton_compiles`)."""
    doc = read_answered(lambda: server.get_json("/vskipper/attestation")) or {}
    return (headline.attested_clock(doc), doc.get("threads") or {}, doc.get("allocator"),
            doc.get("triton_compiles"))


def pass_clock(server: Server) -> dict | None:
    """The server's part clock as its attestation holds it now, every pass timed so far read on the device too
    (the state writer waits for their end first). A document the server served late (`answered`: its clock may
    lack the last passes) is read again, up to `READ_ATTEMPTS` reads; the last is marked `late`
    (`headline.attested_clock`). None where the server times none (one started elsewhere without
    `ENV_PASS_SPANS`)."""
    return clock_reading(server)[0]


def execution_of(served_doc: dict) -> dict:
    """The routed layers' execution a served arm attests (`routed_layers_backend`): a dict where the skipper model
    installed, else {} (the runtime's default there is a sentence, not a record)."""
    backend = served_doc.get("routed_layers_backend")
    return backend if isinstance(backend, dict) else {}


def decode_graphs(served_doc: dict) -> str:
    """What a served arm's decode passes ran: its routed decode passes replayed / eager, else the profile's word."""
    passes = (served_doc.get("graph_passes_total") or {}).get("decode", {})
    routed, dense = passes.get("routed", {}), passes.get("dense", {})
    if routed.get("replayed") or routed.get("eager"):
        return f"routed passes {routed.get('replayed', 0)} replayed, {routed.get('eager', 0)} eager"
    if dense.get("replayed") or dense.get("eager"):
        return f"dense passes {dense.get('replayed', 0)} replayed, {dense.get('eager', 0)} eager"
    return str((served_doc.get("profile") or {}).get("decode_graphs"))


# -- bursts: a fixed batch, timed from the stream ---------------------------------------------------------------------

def prompt(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def prefill_prompt(length: int, repetition: int, vocab: int) -> list[int]:
    """The sweep's prefill prompt: seeded by its length and repetition, so that no prompt is a prefix of another
    (the same seed at two lengths draws the shorter prompt as the longer one's start, which SGLang's prefix cache
    would then hold) and none of it is in the cache."""
    return prompt(length, 1_000_003 * length + 99 + repetition, vocab)


async def burst(server: Server, prompts: list[list[int]], new_tokens: int):
    import aiohttp

    from loadgen.client import Endpoint, stream_request
    from loadgen.records import RequestRecord

    endpoint = Endpoint(server.url, attestation_path=None)
    records = [RequestRecord(i, f"b{i}", 0.0, len(p), new_tokens, True) for i, p in enumerate(prompts)]
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(stream_request(session, endpoint, r, p, time.perf_counter)
                               for r, p in zip(records, prompts, strict=True)))
    errors = [r.error for r in records if r.error]
    if errors:
        raise RuntimeError(f"burst against {server.url}: {len(errors)} requests failed, first: {errors[0]}")
    return records


def prefill_cells(plan: Plan, server: Server, vocab: int) -> tuple[list[dict], list[dict]]:
    """The sweep's prefill cells on one server: the TTFT of `prefill_reps` fresh prompts (one request each, one
    token out) at each of `prefill_lengths`, in rounds of every length, so that a drift of the device or the host
    over the arm's prompts falls on every length alike. Each length also keeps where its TTFT went by SGLang's own
    stamps (`RequestRecord.ttft_parts`: the hand-over to the scheduler, the forward to its result, the output, the
    HTTP rest), each part the median over the prompts, where the server reported them (--enable-metrics); and
    each prompt's prefill passes as the server's clock timed them (`headline.pass_spans`: the host's launches beside the
    device's span), where it times them, and their passes' stack samples where the server samples them
    (`Plan.sweep_samples`: `samples`, the prompts' windows together). In each repetition after the lengths, the
    rounds of several prompts (`Plan.prefill_rounds`, `prefill_round`): (the lengths' cells, the rounds' cells)."""
    records: dict[int, list] = {length: [] for length in plan.prefill_lengths}
    spans: dict[int, list] = {length: [] for length in plan.prefill_lengths}
    rounds: dict[tuple[int, int], list] = {shape: [] for shape in plan.prefill_rounds}
    round_spans: dict[tuple[int, int], list] = {shape: [] for shape in plan.prefill_rounds}
    samples: dict[int, list] = {length: [] for length in plan.prefill_lengths}
    machines: dict[int, list] = {length: [] for length in plan.prefill_lengths}
    clock, threads, _, _ = clock_reading(server)  # each prompt's reading after it is the next one's before
    for r in range(plan.prefill_reps):
        for length in plan.prefill_lengths:
            forward = forward_tid(threads)
            machine_before = machine.reading(True, forward)
            records[length].append(asyncio.run(burst(server, [prefill_prompt(length, r, vocab)], 1))[0])
            machine_after = machine.reading(False, forward)
            before, (clock, threads, _, _) = clock, clock_reading(server)
            machines[length].append(machine.window(machine_before, machine_after, client=os.getpid()))
            spans[length].append(headline.pass_spans(before, clock, "prefill"))
            if spans[length][-1] and not spans[length][-1].get("late"):  # a late window's may be another prompt's
                samples[length].append({"samples": window_samples(before, clock)})
        for n, length in plan.prefill_rounds:
            rounds[n, length].append(prefill_round(server, round_prompts(n, length, r, vocab)))
            before, clock = clock, pass_clock(server)
            round_spans[n, length].append(headline.pass_spans(before, clock, "prefill"))
    cells = []
    for length, recs in records.items():
        reps = [rec.ttft_s for rec in recs]
        parts = [rec.ttft_parts() for rec in recs]
        cell = {"tokens": length, "ttft_s": statistics.median(reps), "ttft_s_reps": reps,
                "prefill_tok_s": length / statistics.median(reps)}
        if all(parts):
            cell["ttft_parts_s"] = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
            cell["ttft_parts_s_reps"] = parts
        timed = [s for s in spans[length] if s]  # a window a late reading left without its pass adds none
        if timed:
            cell["pass_spans"] = median_spans(timed)
        merged = merge_samples(samples[length])  # the prompts' stack samples together, where the server samples
        if merged:
            cell["samples"] = merged
        read = [m for m in machines[length] if m]
        if read:
            cell["machine"] = machine_pooled(read)
        cells.append(cell)
    round_cells = []
    for (n, length), reps in rounds.items():
        cell = {"prompts": n, "tokens": n * length, "ttft_s": statistics.median(reps), "ttft_s_reps": reps}
        timed = [s for s in round_spans[n, length] if s]
        if timed:
            cell["pass_spans"] = median_spans(timed)
        round_cells.append(cell)
    return cells, round_cells


WARM_REPETITION = 10_000  # the prompts' repetition of `prefill_warm_up`: none of the timed cells' prompts


def prefill_warm_up(plan: Plan, server: Server, vocab: int) -> None:
    """One untimed prompt at each of the sweep's prefill lengths and one of each of its rounds, prompts no timed
    cell sends: what the cells' passes launch compiled and the allocator's blocks cached before they are timed, as
    the decode cells' prefilled bursts leave them in a whole sweep (a server whose routed prefill layers replay
    from graphs captured and checked them before it reported ready)."""
    for length in plan.prefill_lengths:
        asyncio.run(burst(server, [prefill_prompt(length, WARM_REPETITION, vocab)], 1))
    for n, length in plan.prefill_rounds:
        prefill_round(server, round_prompts(n, length, WARM_REPETITION, vocab))


def round_prompts(n: int, length: int, repetition: int, vocab: int) -> list[list[int]]:
    """The `n` prompts of `length` tokens of a round of the sweep's prefill, in its `repetition`: drawn as
    `prefill_prompt`s of repetitions past any single prompt's, so that none is another prompt's prefix."""
    return [prefill_prompt(length, 1000 + repetition * n + i, vocab) for i in range(n)]


def prefill_round(server: Server, prompts: list[list[int]]) -> float:
    """Seconds until one `/generate` request holding `prompts` (one token out each) answers: SGLang's tokenizer
    manager hands pre-tokenized prompts of one request to the scheduler in one message, so they are admitted in one
    round where its limits allow (the cell's `pass_spans` count the passes)."""
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}}
    t0 = time.perf_counter()
    status, text = http(server.url + "/generate", body)
    seconds = time.perf_counter() - t0
    if status != 200:
        raise RuntimeError(f"a prefill round of {len(prompts)} prompts against {server.url}: HTTP {status} {text[:300]}")
    return seconds


def median_spans(reps: list[dict]) -> dict:
    """One prefill length's pass spans (`pass_spans` of each prompt): the host's and the device's ms a pass, each
    the median over the prompts (the device's None where no prompt's pass reached its clock), the forward's
    thread's CPU ms and waits a pass (medians; None where a prompt's clock lacks them), the most passes a
    prompt's window held (one a prompt below the chunked-prefill size; more where a reading came late), the
    windows a late reading bounds (`late`), and every prompt's."""
    device = [r["device_ms"] for r in reps if r["device_ms"] is not None]
    thread = {k: statistics.median(r[k] for r in reps) if all(r.get(k) is not None for r in reps) else None
              for k in ("cpu_ms", "waits", "gc_ms")}  # the forward's thread a pass, where every prompt's clock read it
    return {"host_ms": statistics.median(r["host_ms"] for r in reps),
            "device_ms": statistics.median(device) if len(device) == len(reps) else None, **thread,
            "passes": max(r["passes"] for r in reps), "late": sum(1 for r in reps if r.get("late")), "reps": reps}


def decode_step(records) -> tuple[float, int]:
    """(seconds per decode step, steps) over the window where every request of the batch decodes. Where the batch
    did not decode together for two steps (its requests were admitted in rounds that barely overlap, as on a fast
    host with a tiny model), the median of the requests' own mean inter-token times, over their shortest decode."""
    t0 = max(r.first_token_s for r in records)
    t1 = min(r.token_times_s[-1] for r in records)
    steps = [sum(1 for t in r.token_times_s if t0 <= t <= t1) for r in records]
    n = min(steps)
    if n >= 2 and t1 > t0:
        return (t1 - t0) / (n - 1), n
    own = [((r.token_times_s[-1] - r.token_times_s[0]) / (len(r.token_times_s) - 1), len(r.token_times_s))
           for r in records if len(r.token_times_s) >= 2 and r.token_times_s[-1] > r.token_times_s[0]]
    if not own:
        raise RuntimeError("decode window too short: no request decoded two tokens apart; raise the new tokens")
    return statistics.median(s for s, _ in own), min(n for _, n in own)


def fit_line(points: list[tuple[float, float]]) -> dict | None:
    """Least squares step = a + b V."""
    if len(points) < 2:
        return None
    xs, ys = zip(*points, strict=True)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return {"intercept_s": my - b * mx, "slope_s_per_token": b, "points": len(points)}


TAU_RESAMPLES = 2000  # bootstrap resamples of the sweep's repetitions behind tau's interval


def tau_interval(dense: list[dict], routed: list[dict], resamples: int = TAU_RESAMPLES,
                 seed: int = 0) -> tuple[float, float] | None:
    """tau's 95% interval (seconds) over the repetitions behind it: each resample draws every cell's repetitions
    with replacement in both arms, takes their median as the cell's step, fits both latency lines again and keeps
    the intercepts' difference; the 2.5th and 97.5th percentiles of those (seeded: the same figures give the same
    interval). None where a line cannot be fitted (fewer than two cells with repetitions)."""
    cells = [(d["resident_tokens"], d.get("step_s_reps") or [d["step_s"]]) for d in dense]
    other = [(r["resident_tokens"], r.get("step_s_reps") or [r["step_s"]]) for r in routed]
    rng = random.Random(seed)
    taus = []
    for _ in range(resamples):
        lines = [fit_line([(v, statistics.median(rng.choices(reps, k=len(reps)))) for v, reps in arm])
                 for arm in (cells, other)]
        if lines[0] is None or lines[1] is None:
            return None
        taus.append(lines[1]["intercept_s"] - lines[0]["intercept_s"])
    taus.sort()
    return taus[int(0.025 * (len(taus) - 1))], taus[int(0.975 * (len(taus) - 1))]


# -- stages ------------------------------------------------------------------------------------------------------------

# -- the headline A/B: GSM8K-shaped cells, one server at a time --------------------------------------------------------

def flush(server: Server) -> None:
    """Empty the server's prefix cache, so that every cell starts cold on every arm (SGLang flushes only when idle:
    the requests of the cell before may take a moment to leave its batch)."""
    status, text = 0, ""
    for _ in range(40):
        status, text = http(server.url + "/flush_cache")
        if status == 200:
            return
        time.sleep(0.25)
    raise RuntimeError(f"{server.url}/flush_cache: HTTP {status} {text[:300]}")


def warm_up(plan: Plan, server: Server, vocab: int) -> None:
    """A burst of the longest prompts, so that what the cells run is compiled before they are timed."""
    asyncio.run(burst(server, [prompt(plan.prompt_tokens[1], 50_000 + i, vocab)
                               for i in range(plan.warmup_requests)], 8))
    flush(server)


def calibrate(plan: Plan, server: Server, vocab: int) -> dict:
    """A closed burst of GSM8K-shaped requests on dense: the request rate it sustained starts the ladder."""
    suite = headline.gsm8k_suite("calibration", plan.calibration_requests, 7, vocab, plan.prompt_tokens,
                                 plan.output_tokens)
    new_tokens = round(sum(plan.output_tokens) / 2)
    records = asyncio.run(burst(server, [list(r.input_ids) for r in suite.requests], new_tokens))
    flush(server)
    seconds = max(r.finish_s for r in records) - min(r.submit_s for r in records)
    rate = len(records) / seconds
    return {"requests": len(records), "new_tokens": new_tokens, "seconds": seconds, "req_s": rate,
            "ladder_start": headline.ladder_start(rate, plan.ladder_start_max),
            "ladder_start_max": plan.ladder_start_max}


def serve_cell(server: Server, suite, rate: float, seed: int, repetition: int, arm_name: str, path: Path):
    """One cell on a cold prefix cache: the suite at `rate` on the seeded schedule, every request's output length
    forced (loadgen's matched lane), attested before and after; written to `path` whole."""
    from loadgen.client import Endpoint
    from loadgen.driver import client_session, matched_plan, run_cell

    flush(server)
    plan = matched_plan(suite, rate, seed, headline.forced_lengths(suite), repetition=repetition)

    async def go():
        async with client_session() as session:
            return await run_cell(Endpoint(server.url), plan, arm_name, session=session)

    cell = asyncio.run(go())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cell.as_dict()) + "\n")
    return cell


def read_cell(path: Path):
    from loadgen.records import CellResult

    return CellResult.from_dict(json.loads(path.read_text()))


def cell_estimate(plan: Plan, dense_summary: dict | None, window_s: float) -> float:
    """What serving a cell takes: dense's makespan of the same cell where it ran, else twice its window."""
    makespan = (dense_summary or {}).get("makespan_s")
    return (1.2 * makespan if makespan else 2 * window_s) + plan.cell_overhead_s


def arm_loads(arms: tuple[str, ...]) -> tuple[str, ...]:
    """The loads the headline's `arms` serve (dense serves the same), in the order of `headline.LOADS`."""
    wanted = {load for key in arms for load in HEADLINE_ARMS[key][3]}
    return tuple(load for load in headline.LOADS if load in wanted)


def complete_ladder(path: Path) -> bool:
    doc = json.loads(path.read_text())
    return bool(doc.get("q_star")) and not doc.get("left") and not doc.get("failed")


def stage_ladder(plan: Plan, out: Path, budget_s: float, loads: tuple[str, ...] = headline.LOADS) -> dict:
    """Dense alone: upstream's Q* ladder (or the Q* an earlier run climbed to on this GPU, ENV_EARLIER), then
    dense's side of the headline cells at `loads` (those of the arms a lease serves), on one server start."""
    from loadgen.qstar import find_q_star

    stage = Stage("ladder", out, budget_s)
    model = write_model(plan, out)
    arm_files = write_arms(out)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    calibration_path, rates_dir = stage.out / "calibration.json", stage.out / "rates"
    tok = {int(p.stem[1:]): read_cell(p).summary["window_output_tok_s"] for p in sorted(rates_dir.glob("r*.json"))}
    calibration = json.loads(calibration_path.read_text()) if calibration_path.is_file() else None
    q_star_from = headline.OWN_LADDER
    pinned = stage.out / "earlier-q-star.json"  # an earlier run's climb, once taken: every later call keeps it
    if calibration is None and not tok and not pinned.is_file():
        path, where = earlier(out, "ladder.json", complete_ladder)
        if path is not None:  # the climb is the same on the same GPU: its rates, not climbed again
            doc = json.loads(path.read_text())
            pinned.write_text(json.dumps({"from": where, "calibration": doc["calibration"],
                                          "rates": doc["q_star"]["rates"], "tok_s": doc["q_star"]["tok_s"]}) + "\n")
    if pinned.is_file():
        doc = json.loads(pinned.read_text())
        calibration, q_star_from = doc["calibration"], doc["from"]
        tok = dict(zip(doc["rates"], doc["tok_s"], strict=True))
        log(stage.name, f"the rates of {q_star_from}: the ladder does not climb again")

    def next_rate() -> int | None:
        return headline.next_ladder_rate(tok, calibration["ladder_start"], plan.ladder_max_rates)

    def every_cell() -> list:
        return headline.schedule(find_q_star(tok).q_star, plan.window_s, plan.min_requests, plan.repetitions)

    def cells() -> list:  # those dense serves in this run
        return [c for c in every_cell() if c.load in loads]

    suites = {}

    def suite_for(load: str, requests: int):
        """The load's suite: its file where an earlier run wrote it, else drawn (from the load's seed) and written."""
        if load not in suites:
            path = out / suite_path(load)
            if path.is_file():
                suites[load] = load_headline_suite(path)
            else:
                suites[load] = headline.load_suite(load, requests, vocab, plan.prompt_tokens, plan.output_tokens)
                suites[load].save(path)
        return suites[load]

    ladder_done = calibration is not None and next_rate() is None
    todo = [c for c in cells() if not (stage.out / "dense" / f"{c.key}.json").is_file()] if ladder_done else None
    served_doc = json.loads((stage.out / "served.json").read_text()) if (stage.out / "served.json").is_file() else None
    if (not ladder_done or todo) and stage.has_time(plan.start_estimate_s, "dense (ladder and cells)"):
        with ExitStack() as stack:
            t0 = time.monotonic()
            dense = server_for(plan, stack, model, stage.out / "server", "dense", arm_files, plan.solo_mem_fraction)
            ready(plan, [dense])
            warm_up(plan, dense, vocab)
            log(stage.name, f"dense up and warm after {time.monotonic() - t0:.0f} s; KV pool {kv_capacity(dense)}")
            if calibration is None:
                calibration = calibrate(plan, dense, vocab)
                calibration_path.write_text(json.dumps(calibration, indent=1) + "\n")
                log(stage.name, f"calibration: {calibration['req_s']:.3g} req/s; the ladder starts at "
                                f"{calibration['ladder_start']} req/s")
            while (rate := next_rate()) is not None:
                if not stage.has_time(plan.ladder_window_s * 1.5 + plan.cell_overhead_s, f"ladder rate {rate}"):
                    break
                requests = headline.cell_requests(rate, plan.ladder_window_s, plan.min_requests)
                suite = headline.gsm8k_suite(f"ladder-r{rate}", requests, rate, vocab, plan.prompt_tokens,
                                             plan.output_tokens)
                cell = serve_cell(dense, suite, rate, rate, 0, "dense", rates_dir / f"r{rate}.json")
                tok[rate] = cell.summary["window_output_tok_s"]
                log(stage.name, f"ladder {rate} req/s: {tok[rate]:.4g} output tok/s in the window")
            if next_rate() is None:
                for c in cells():
                    path = stage.out / "dense" / f"{c.key}.json"
                    if path.is_file():
                        continue
                    if not stage.has_time(cell_estimate(plan, None, plan.window_s), f"dense {c.key}"):
                        break
                    cell = serve_cell(dense, suite_for(c.load, c.requests), c.rate, c.seed, c.repetition, "dense",
                                      path)
                    log(stage.name, f"dense {c.key} ({c.rate:g} req/s, {c.requests} requests): makespan "
                                    f"{cell.summary['makespan_s']:.1f} s")
            served_doc = served(dense)
            (stage.out / "served.json").write_text(json.dumps(served_doc, indent=1) + "\n")
    result = {"calibration": calibration, "served": served_doc, "left": stage.left, "loads": list(loads),
              "q_star_from": q_star_from}
    if calibration is None or next_rate() is not None:
        result["left"] = stage.left or ["the ladder"]
        return result
    q = find_q_star(tok)
    schedule = every_cell()  # the headline's cells, dense's side None at the loads it did not serve here
    for c in schedule:
        suite_for(c.load, c.requests)
    result.update(q_star=q.as_dict(), cells=[c.as_dict() for c in schedule],
                  suites={load: {"path": suite_path(load), **headline.suite_shape(s)} for load, s in suites.items()},
                  shape=headline.suite_shape(suites[headline.KNEE]),
                  dense={c.key: _summary(stage.out / "dense" / f"{c.key}.json") for c in schedule})
    missing = [c.key for c in cells() if result["dense"][c.key] is None]
    if missing and not stage.left:
        stage.left.append(f"dense cells {', '.join(missing)}")
    result["left"] = stage.left
    return result


def suite_path(load: str) -> str:
    """Where the ladder stage writes a load's suite, relative to OUTDIR (the folder may move between stages)."""
    return f"ladder/suites/{load}.jsonl"


def load_headline_suite(path: Path):
    from loadgen.suite import load_suite

    return load_suite(path, name=f"gsm8k-shaped-{path.stem}")


def _summary(path: Path) -> dict | None:
    """A cell's summary without its records (None where the cell has not run)."""
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    return {"rate": doc["rate"], "requests": doc["reported"], "seed": doc["seed"], "suite": doc["suite"],
            **{k: doc["summary"][k] for k in ("e2e", "ttft", "tpot", "makespan_s", "drain_s", "window_s",
                                              "window_req_s", "window_output_tok_s")}}


def headline_thresholds(plan: Plan, out: Path, model: Path) -> tuple[dict, dict | None, dict | None, str]:
    """The thresholds a headline in `out` serves its hybrid arms at: (the rule's, the measured tau's or None, the
    sweep that tau comes from or None, where the tau comes from or why there is none)."""
    th_rule = rule(plan, model)
    sweep, sweep_source = sweep_for_tau(out)
    resample_tau(sweep)
    th_tau, tau_source = headline.thresholds_from_tau(th_rule, sweep, plan.threshold_step)
    if sweep is None:
        tau_source = f"no measured tau: {sweep_source}"
    elif th_tau is not None and sweep_source != OWN_SWEEP:
        th_tau["source"] = tau_source = f"{th_tau['source']}, {sweep_source}"
    return th_rule, th_tau, sweep, tau_source


def headline_serving(arms: tuple[str, ...], th_rule: dict, th_tau: dict | None) -> dict[str, dict | None]:
    """The thresholds a headline serves each arm of `arms` at, for the arms it serves: a tau arm only where a
    measured tau gave thresholds (`th_tau`)."""
    means = {"rule": th_rule, "tau": th_tau}
    return {key: means.get(HEADLINE_ARMS[key][2]) for key in arms
            if not (HEADLINE_ARMS[key][2] == "tau" and th_tau is None)}


def stage_headline(plan: Plan, out: Path, budget_s: float, arms: tuple[str, ...] = tuple(HEADLINE_ARMS)) -> dict:
    """Each routed arm of `arms` (HEADLINE_ARMS keys) alone on the ladder's cells (one server start each), then
    every arm against dense."""
    ladder_path = out / "ladder.json"
    ladder = json.loads(ladder_path.read_text()) if ladder_path.is_file() else None
    if not ladder or ladder.get("left") or not ladder.get("cells"):
        raise RuntimeError(f"{ladder_path}: the ladder stage has not completed (Q* and dense's cells); run "
                           "`run.sh ladder OUTDIR` first")
    stage = Stage("headline", out, budget_s)
    model = write_model(plan, out)
    arm_files = write_arms(out)
    config = json.loads((model / "config.json").read_text())
    vocab = config["vocab_size"]
    cells = [headline.Cell.from_dict(c) for c in ladder["cells"]]
    suites = {}
    for load, doc in ladder["suites"].items():
        suites[load] = load_headline_suite(out / doc["path"])
        if suites[load].digest != doc["digest"]:
            raise RuntimeError(f"{doc['path']}: digest {suites[load].digest[:12]} is not the ladder's "
                               f"suites.{load}.digest {doc['digest'][:12]}")
    th_rule, th_tau, sweep, tau_source = headline_thresholds(plan, out, model)
    serving = headline_serving(arms, th_rule, th_tau)  # no entry: a tau arm without a tau, served nowhere
    mismatch = headline_mode_mismatch(plan, out, arms, serving)
    if mismatch:
        raise SystemExit(f"[headline] {mismatch}")
    bandwidth = device_bandwidth(plan)  # charges the adapter's read in the skip's limit (none on the dry run)
    result: dict = {"thresholds": {"rule": th_rule, "tau": th_tau or {"skipped": tau_source}}, "arms": {},
                    "arms_requested": list(arms), "check": check_served(plan, out, stage)}
    started = False
    for key in arms:  # in the order asked (`headline_order`)
        name, role, variant, loads = HEADLINE_ARMS[key]
        thresholds = serving.get(key)
        doc = {"arm": name, "role": role, "loads": {}, "thresholds": thresholds}
        result["arms"][key] = doc
        if variant == "tau" and th_tau is None:
            doc["skipped"] = tau_source
            doc["wants_sweep"] = sweep is None  # a later call given a sweep (--earlier) serves it
            log(stage.name, f"{key}: not served: {tau_source}")
            continue
        work = stage.out / key
        mine = [c for c in cells if c.load in loads]
        unpaired = [c.key for c in mine if ladder["dense"].get(c.key) is None]
        if unpaired:  # the ladder served dense for other arms' loads only: an error of the call, the others serve
            doc["skipped"] = (f"dense has not served {', '.join(unpaired)} in this run: run the ladder stage with "
                              f"--arms {key} first")
            stage.failed.append(key)
            log(stage.name, f"{key}: not served: {doc['skipped']}")
            continue
        set_aside_other_thresholds(stage, key, work, thresholds)
        todo = [c for c in mine if not (work / f"{c.key}.json").is_file()]
        estimates = {c.key: cell_estimate(plan, ladder["dense"][c.key], plan.window_s) for c in todo}
        if todo:
            # An arm starts where all its cells fit what is left of the budget; the first arm of a run where one
            # of them does (an arm longer than a whole budget goes on in the next run).
            needed = plan.headline_start_s + (sum(estimates.values()) if started else estimates[todo[0].key])
            if not stage.has_time(needed, f"{key}: {len(todo)} cells"):
                todo = []
        if todo:
            started = True
            # The rule's thresholds on a GPU are the ones `vskipper serve` derives for the detected device.
            flags = thresholds if variant == "tau" or plan.dry_run else None
            with ExitStack() as stack:
                t0 = time.monotonic()
                # ENV_SERVERS names a server by its arm; the hybrid arm at the tau's thresholds is another server.
                # its routed prefill layers from graphs where the run asks: the counts "auto" asks that the
                # server's prefill chunk reaches (headline prefill passes come in every size)
                server = server_for(plan, stack, model, work / "server", name, arm_files, plan.solo_mem_fraction,
                                    thresholds=flags, key=f"{name}@tau" if variant == "tau" else None,
                                    prefill_graphs=PREFILL_GRAPHS_AUTO if plan.routed_prefill_graphs else (),
                                    prefill_read=plan.routed_prefill_read)
                ready(plan, [server])
                warm_up(plan, server, vocab)
                log(stage.name, f"{key} up and warm after {time.monotonic() - t0:.0f} s")
                check_thresholds(key, served(server), thresholds)
                for c in todo:
                    if not stage.has_time(estimates[c.key], f"{key} {c.key}"):
                        break
                    cell = serve_cell(server, suites[c.load], c.rate, c.seed, c.repetition, name,
                                      work / f"{c.key}.json")
                    log(stage.name, f"{key} {c.key}: makespan {cell.summary['makespan_s']:.1f} s")
                served_doc = served(server)
                served_doc["kv_pool_tokens"] = kv_capacity(server)
                (work / "served.json").write_text(json.dumps(served_doc, indent=1) + "\n")
        doc.update(compare_arm(plan, out, key, name, role, mine, suites))
        predicted = arm_model(plan, sweep, name, thresholds, mine, suites, doc.get("kv_pool_tokens"), config,
                              bandwidth)
        if predicted:
            doc["model"] = predicted
            note = prefill_mode_note(key, doc.get("served"), (sweep or {}).get("arms") or {}, name)
            if note:
                doc["model_note"] = note
    swept = (sweep or {}).get("arms") or {}
    pool = headline.kv_pool_of(result)
    # one prefill source for the limit and its parts, so that the parts' "both at the limit" is the limit
    source = headline.prefill_source([swept[a] for a in ("dense", ALWAYS) if a in swept])
    limit = headline.skip_limit(swept.get("dense"), config, cells, suites, pool, plan.max_running(), SKIP_RATIO,
                                bandwidth, source)
    if limit:
        result["skip_limit"] = limit
    parts = headline.limit_parts(swept["dense"], swept[ALWAYS], config, cells, suites, pool, plan.max_running(),
                                 SKIP_RATIO, bandwidth, source) if "dense" in swept and ALWAYS in swept else None
    if parts:
        result["limit_parts"] = parts
    result["figures"] = headline.figure_rows(result)
    result["left"], result["failed"] = stage.left, stage.failed
    # Left work and started no server: a rerun, with less time than this run had, could not start one either.
    result["idle"] = bool(stage.left) and not started
    return result


def prefill_mode_note(key: str, served_doc: dict | None, swept: dict, name: str) -> str | None:
    """Where a headline arm's routed prefill layers ran one way (from graphs, or eagerly) and the sweep's arm whose
    lines the queueing model reads (`arm_model`) ran them the other: a sentence saying the model's routed prefill
    passes are not the arm's; else None."""
    routes = CONTROL if name == CONTROL else ALWAYS
    theirs_doc = (swept.get(routes) or {}).get("served")
    if served_doc is None or theirs_doc is None:
        return None
    mine, theirs = bool(served_doc.get("prefill_graphs")), bool(theirs_doc.get("prefill_graphs"))
    if mine == theirs:
        return None
    how = {True: "replayed their routed layers from graphs", False: "ran their routed layers eagerly"}
    return (f"The model's routed prefill passes are the sweep's {routes} arm's, which {how[theirs]}, while {key}'s "
            f"{how[mine]}: its prefill predictions describe the sweep's way, not the arm's.")


def arm_model(plan: Plan, sweep: dict | None, name: str, thresholds: dict | None, cells: list, suites: dict,
              kv_pool: int | None, config: dict, bandwidth_gbps: float | None) -> dict | None:
    """What the queueing model predicts for a routed arm on its cells, load by load, from the sweep's per-pass lines
    (`headline.model_prediction`): dense's and the routed arm's of the sweep with the same routes (always-route's
    for the hybrid arm, the control's for the control), the arm at the thresholds and floor it served (an arm that
    always routes has none to serve). Beside it (`at_limit`), where the arm skips, the same arm with its routed
    passes at the skip's physical limit (`headline.limit_lines`). None where the sweep lacks either arm's lines."""
    from vskipper.arms import Arm

    arms = (sweep or {}).get("arms") or {}
    routes = CONTROL if name == CONTROL else ALWAYS
    lines = headline.model_lines(arms["dense"], arms[routes]) if "dense" in arms and routes in arms else None
    if lines is None:
        return None
    arm = Arm.from_dict(ARM_FILES[name])
    skip = arm.declared_skip_ratio() or 0.0
    limit = headline.limit_lines(lines, config, skip, [p["tokens"] for p in arms["dense"]["prefill"]],
                                 bandwidth_gbps) if skip > 0 else None
    served = thresholds or {"enter_tokens": 0, "exit_tokens": 0}
    out = {}
    for load in headline.LOADS:
        mine = [c for c in cells if c.load == load]
        if not mine:
            continue
        out[load] = headline.model_prediction(lines, arm, served, suites[load], mine, kv_pool, plan.max_running())
        if limit is not None:
            out[load]["at_limit"] = headline.model_prediction(limit, arm, served, suites[load], mine, kv_pool,
                                                              plan.max_running())
    return out


def resample_tau(sweep: dict | None) -> None:
    """Give an earlier sweep's tau the 95% interval this code resamples from its repetitions, where the sweep
    predates it (the headline's measured arm serves its upper end); a sweep without the two arms' decode cells is
    left as it is."""
    comparison = (sweep or {}).get("comparison") or {}
    arms = (sweep or {}).get("arms") or {}
    if comparison.get("tau_ms") is None or "tau_ms_interval" in comparison or "dense" not in arms \
            or ALWAYS not in arms:
        return
    interval = tau_interval(arms["dense"]["decode"], arms[ALWAYS]["decode"])
    if interval is not None:
        comparison["tau_ms_interval"] = [round(s * 1e3, 4) for s in interval]


def served_elsewhere(work: Path, thresholds: dict | None) -> list | None:
    """The thresholds (enter, exit, prefill floor) an arm's folder `work` served at where they are not those this
    run means it to (a tau arm served from another sweep's tau, given since with --earlier); None where they are,
    where nothing served yet, or where the arm serves no thresholds of its own (`thresholds` None). A prefill floor
    left to the rule's constant matches any attested one (its place is None)."""
    served_path = work / "served.json"
    if thresholds is None or not served_path.is_file():
        return None
    was = json.loads(served_path.read_text()).get("thresholds") or {}
    fields = ("enter_tokens", "exit_tokens", "prefill_floor_tokens")
    served_as, means = [was.get(f) for f in fields], [thresholds.get(f) for f in fields]
    if means[2] is None:
        served_as[2] = None
    return None if served_as == means else served_as


def set_aside_other_thresholds(stage: Stage, key: str, work: Path, thresholds: dict | None) -> None:
    """An arm's cells served at other thresholds than this run means (`served_elsewhere`) are not this arm's: its
    folder is set aside beside it, named by the thresholds its server attested, and the arm serves again."""
    served_as = served_elsewhere(work, thresholds)
    if served_as is None:
        return
    means = [thresholds.get(f) for f in ("enter_tokens", "exit_tokens", "prefill_floor_tokens")]
    aside = work.with_name(f"{work.name}-enter{served_as[0]}-exit{served_as[1]}"
                           + (f"-floor{served_as[2]}" if served_as[2] is not None else ""))
    if aside.exists():
        shutil.rmtree(aside)
    work.rename(aside)

    def said(v: list) -> str:
        return f"enter {v[0]} / exit {v[1]}" + (f" / prefill floor {v[2]}" if v[2] is not None else "")

    log(stage.name, f"{key}: the cells served at {said(served_as)} set aside as {aside.name}: this run serves "
                    f"{said(means)} ({thresholds.get('source')})")


def check_thresholds(key: str, served_doc: dict, thresholds: dict | None) -> None:
    """The hybrid arm must serve the thresholds the stage means it to (attested, whichever way they were passed)."""
    if thresholds is None:
        return
    attested = served_doc["thresholds"]
    fields = ("enter_tokens", "exit_tokens", *(("prefill_floor_tokens",) if thresholds.get("prefill_floor_tokens")
                                               else ()))
    for field_name in fields:
        if attested.get(field_name) != thresholds[field_name]:
            raise RuntimeError(f"{key}: the server attests thresholds.{field_name} {attested.get(field_name)}, the "
                               f"stage means {thresholds[field_name]} ({thresholds['source']})")


def compare_arm(plan: Plan, out: Path, key: str, name: str, role: str, cells: list, suites: dict) -> dict:
    """The arm's cells against dense's, per load (from the cells' files): gates, paired intervals, routed shares."""
    from loadgen.report import markdown_table
    from vskipper.arms import Arm

    work = out / "headline" / key
    served_path = work / "served.json"
    served_doc = json.loads(served_path.read_text()) if served_path.is_file() else None
    arm = Arm.from_dict(ARM_FILES[name])
    results, loads, longest = [], {}, plan.prompt_tokens[1] + plan.output_tokens[1]
    for load in (load for load in headline.LOADS if any(c.load == load for c in cells)):
        pairs = [(c.repetition, read_cell(out / "ladder" / "dense" / f"{c.key}.json"),
                  read_cell(work / f"{c.key}.json")) for c in cells
                 if c.load == load and (work / f"{c.key}.json").is_file()]
        if not pairs:
            continue
        first = next(c for c in cells if c.load == load)
        ab = headline.pair_load(load, arm, key, suites[load], first.rate, pairs,
                                expect_engaged=role != "hybrid")
        results.append(ab)
        loads[load] = headline.load_doc(ab, first.requests)
    pool = (served_doc or {}).get("kv_pool_tokens")
    engaged = any(share for d in loads.values() for share in d["routed_share"].values())
    doc = {"served": served_doc, "kv_pool_tokens": pool,
           "resident_ceiling_tokens": headline.resident_ceiling(pool, plan.max_running(), longest) if pool else None,
           "loads": loads, "gates_passed": bool(loads) and all(g["passed"] for d in loads.values() for g in d["gates"]),
           "table": markdown_table(results, f"{key} ({name}) against dense") if results else None}
    if role == "hybrid" and loads and not engaged and not plan.engagement_optional:
        doc["gates_passed"] = False
        doc["not_engaged"] = (f"{key} ran no routed pass in any of its cells ({', '.join(loads)}): the switch never "
                              "engaged, so no cell measured routing")
    return doc


def stage_sweep(plan: Plan, out: Path, budget_s: float, limit_s: float | None = None) -> dict:
    """Dense, always-route and the control, each on its own server, then the reference arm: an arm starts where
    what it takes (`Plan.sweep_arm_s`) ends before the stage's limit (`Stage.fits`), each arm's result is written as
    it is served, and an arm whose server fails is named with its error (`failed`, `errors`) while the others
    serve. A stage stopped at its limit (run.sh's TERM) keeps what it served: its result and comparison are
    written, the arm it was serving left for the next run."""
    mismatch = sweep_mode_mismatch(plan, out)
    if mismatch:
        raise SystemExit(f"[sweep] {mismatch}")
    stage = Stage("sweep", out, budget_s, limit_s)
    model = write_model(plan, out)
    arms = write_arms(out)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    result: dict = {"arms": {}, "errors": {}}
    reference, serving = None, None
    try:
        # dense and always-route first, so that a sweep cut short still holds the two latency lines tau and V_x
        # come from (the headline's measured-tau arm needs them) and the skip against dense; the s = 0 control after
        for name in ("dense", ALWAYS, CONTROL):
            serving = None  # between steps
            if name != "dense" and "check" not in result:  # before the first routed server: dense needs none,
                serving = "check-served"  # and a check that hangs leaves dense measured
                result["check"] = check_served(plan, out, stage)
                serving = None
            done = stage.out / f"{name}.result.json"
            if done.is_file():
                result["arms"][name] = json.loads(done.read_text())
                continue
            if not stage.fits(plan.sweep_arm_s, f"sweep of {name}"):
                continue
            if name == CONTROL and plan.routed_prefill_graphs and ALWAYS in result["errors"]:
                # the control serves the same graphs over the same routed layers: its start would fail alike and
                # spend the device's minutes on it
                result["errors"][name] = f"not served: {ALWAYS}, which replays the same routed prefill graphs, " \
                                         f"failed ({result['errors'][ALWAYS][:200]})"
                stage.failed.append(name)
                log(stage.name, f"{name}: {result['errors'][name]}")
                continue
            serving = f"sweep of {name}"
            try:
                doc = sweep_arm(plan, stage, model, arms, name, vocab)
            except Exception as exc:  # noqa: BLE001 -- the other arms still serve; the error is kept
                result["errors"][name] = f"{type(exc).__name__}: {str(exc).strip()[:500]}"
                stage.failed.append(name)
                log(stage.name, f"{name} failed: {result['errors'][name]}")
                continue
            write_whole(done, json.dumps(doc, indent=1) + "\n")
            result["arms"][name] = doc
        serving = f"sweep of {PREFILL_GRAPHS}"
        reference = sweep_reference(plan, stage, model, arms, vocab)
    except SystemExit as stop:  # run.sh's TERM at the stage's limit: what was served stands
        if stop.code != TERM_EXIT:
            raise  # not the signal: a refusal or an exit of its own
        serving = serving or "the steps after the last it finished"  # stopped between two
        log(stage.name, f"stopped at its limit while serving {serving}: what it served is kept")
        result["stopped"] = serving
        placeholder = stage.out / f"{PREFILL_GRAPHS}.result.json"
        if serving == f"sweep of {PREFILL_GRAPHS}" and placeholder.is_file():
            reference = json.loads(placeholder.read_text())  # its place taken: not served again (its error says)
        else:
            stage.left.append(serving)
    if reference is not None:
        result["arms"][PREFILL_GRAPHS] = reference
    result["comparison"] = compare_sweep(plan, model, result["arms"])
    result["left"], result["failed"] = stage.left, stage.failed
    return result


def sweep_arm(plan: Plan, stage: Stage, model: Path, arm_files: dict[str, Path], name: str, vocab: int) -> dict:
    """One arm of the sweep on its own server: its decode cells (where the plan serves them) and its prefill
    cells."""
    with ExitStack() as stack:
        server = server_for(plan, stack, model, stage.out / name, name, arm_files, plan.solo_mem_fraction,
                            graph_batches=plan.sweep_graph_batches, samples=plan.sweep_samples,
                            prefill_graphs=plan.routed_graph_tokens
                            if plan.routed_prefill_graphs and name in (ALWAYS, CONTROL) else (),
                            prefill_read=plan.routed_prefill_read if name in (ALWAYS, CONTROL) else None)
        ready(plan, [server])
        capacity = kv_capacity(server)
        compiled = triton_compiles(server)  # what the arm compiles while it serves its cells: from here
        decode, skipped = [], []
        for batch in plan.batches if plan.sweep_decode else ():
            for ctx in plan.contexts:
                need = batch * (ctx + plan.sweep_new_tokens)
                if need > capacity:
                    skipped.append({"batch": batch, "context": ctx, "why": f"needs {need} KV tokens, "
                                    f"pool {capacity}"})
                    continue
                prompts = [prompt(ctx, 7 * batch + i, vocab) for i in range(batch)]
                # Prefilled once first (one token each): the timed burst finds the prompts in SGLang's prefix
                # cache, so its requests decode together instead of beside the chunks of each other's prefill
                # (whose cost differs per arm and would enter the decode figure).
                # Each repetition decodes the same prompts again (found in the cache again).
                asyncio.run(burst(server, prompts, 1))
                before = pass_clock(server)
                reps = [decode_step(asyncio.run(burst(server, prompts, plan.sweep_new_tokens)))
                        for _ in range(plan.decode_reps)]
                step_s, steps = statistics.median(s for s, _ in reps), min(n for _, n in reps)
                decode.append({"batch": batch, "context": ctx, "resident_tokens": batch * (ctx + steps // 2),
                               "step_s": step_s, "step_s_reps": [s for s, _ in reps], "tpot_s": step_s,
                               "decode_tok_s": batch / step_s,
                               "pass_spans": headline.pass_spans(before, pass_clock(server), "decode")})
        if not plan.sweep_decode:  # no decode burst prefilled first: the prefill path warmed on its own
            prefill_warm_up(plan, server, vocab)
        prefill, rounds = prefill_cells(plan, server, vocab)
        return {"kv_pool_tokens": capacity, "decode": decode, "prefill": prefill, "prefill_rounds": rounds,
                "skipped": skipped, "line": fit_line([(d["resident_tokens"], d["step_s"]) for d in decode]),
                "compiles": headline.compiles_between(compiled, triton_compiles(server)),
                "samples": plan.sweep_samples, "decode_cells": plan.sweep_decode, "served": served(server)}


REFERENCE_READY_S = 150.0  # the reference's server ready within this (a sweep server: about 30 s on the H200)


def sweep_reference(plan: Plan, stage: Stage, model: Path, arms: dict[str, Path], vocab: int) -> dict | None:
    """The reference arm's prefill cells (`PREFILL_GRAPHS`), once per OUTDIR whatever its outcome: a server that
    fails to start or to serve, or is not ready within `REFERENCE_READY_S`, leaves its error in its place (the
    sweep's own arms stand as they are), and so does a call stopped while it served (its place is taken before
    it starts): no second start in a later call. None where the stage's time ran out first."""
    done = stage.out / f"{PREFILL_GRAPHS}.result.json"
    if done.is_file():
        return json.loads(done.read_text())
    if not stage.fits(plan.reference_arm_s, f"sweep of {PREFILL_GRAPHS}"):
        return None
    flags = plan.prefill_graph_flags()
    done.write_text(json.dumps({"flags": flags, "error": "the call serving it stopped before it finished (its "
                                "stage's limit or budget)"}, indent=1) + "\n")
    try:
        with ExitStack() as stack:
            server = server_for(plan, stack, model, stage.out / PREFILL_GRAPHS, PREFILL_GRAPHS, arms,
                                plan.solo_mem_fraction, samples=plan.sweep_samples,
                                graph_batches=plan.sweep_graph_batches)
            server.wait_ready(min(plan.startup_timeout_s, REFERENCE_READY_S))
            prefill_warm_up(plan, server, vocab)  # it serves no decode cell first, in either kind of sweep
            prefill, rounds = prefill_cells(plan, server, vocab)
            result = {"flags": flags, "decode": [], "prefill": prefill, "prefill_rounds": rounds,
                      "samples": plan.sweep_samples, "served": served(server)}
    except Exception as exc:  # noqa: BLE001 (a reference only: whatever stopped it is its result)
        result = {"flags": flags, "error": f"{type(exc).__name__}: {str(exc).strip()[:500]}"}
        log("sweep", f"{PREFILL_GRAPHS} did not serve: {result['error']}")
    done.write_text(json.dumps(result, indent=1) + "\n")
    return result


def prefill_graph_passes(served_doc: dict) -> dict:
    """A served dense arm's prefill passes replayed from graphs and run eagerly (`graph_passes_total`)."""
    dense = ((served_doc.get("graph_passes_total") or {}).get("prefill") or {}).get("dense") or {}
    return {"replayed": dense.get("replayed", 0), "eager": dense.get("eager", 0)}


def device_tau_ms(dense: list[dict], routed: list[dict]) -> float | None:
    """tau on the device alone: the intercept of the routed arm's line of the device's ms a decode pass (its
    cells' `pass_spans`) over the resident tokens, less dense's. Beside tau (from the step the client sees) it
    tells the routed path's fixed cost on the device from the host's and the scheduler's share of a step, roughly:
    a cell's device mean covers every decode pass of its bursts, the batch's first and last steps too, its step
    only the window where the whole batch decodes. None where a cell has no device span (a CPU, a server whose
    events failed, a reading that missed passes) or a line cannot be fitted."""
    lines = []
    for cells in (dense, routed):
        points = [(c["resident_tokens"], (c.get("pass_spans") or {}).get("device_ms")) for c in cells]
        if any(ms is None for _, ms in points):
            return None
        lines.append(fit_line(points))
    if lines[0] is None or lines[1] is None:
        return None
    return lines[1]["intercept_s"] - lines[0]["intercept_s"]  # the points are ms: so is the intercept


def compare_sweep(plan: Plan, model: Path, arms: dict) -> dict | None:
    if "dense" not in arms or ALWAYS not in arms:
        return None
    dense, routed = arms["dense"], arms[ALWAYS]
    out: dict = {"routed_decode_graphs": decode_graphs(routed["served"]),
                 "dense_decode_graphs": decode_graphs(dense["served"])}
    ld, lr = dense["line"], routed["line"]
    if ld and lr:
        tau = lr["intercept_s"] - ld["intercept_s"]
        gap = ld["slope_s_per_token"] - lr["slope_s_per_token"]
        v_star = rule(plan, model)["v_star_tokens"]
        v_x = tau / gap if gap > 0 else None
        out.update(tau_ms=tau * 1e3, v_x_tokens=v_x, v_star_tokens=v_star,
                   v_x_over_v_star=(v_x / v_star) if v_x and v_star else None)
        interval = tau_interval(dense["decode"], routed["decode"])
        if interval is not None:
            out["tau_ms_interval"] = [round(s * 1e3, 4) for s in interval]
    device_tau = device_tau_ms(dense["decode"], routed["decode"])
    if device_tau is not None:
        out["device_tau_ms"] = device_tau
    config = json.loads((model / "config.json").read_text())
    out["decode_speedup"] = decode_ratios(config, routed["decode"], dense["decode"], "routed_over_dense_tok_s")
    out["prefill_speedup"] = prefill_ratios(config, routed["prefill"], dense["prefill"], "dense_over_routed_time")
    out["prefill_round_speedup"] = round_ratios(config, routed, dense)
    out["prefill_floor"] = headline.prefill_floor(out["prefill_speedup"] + out["prefill_round_speedup"])
    if CONTROL in arms:
        control = arms[CONTROL]
        out["control_decode_graphs"] = decode_graphs(control["served"])
        out["decode_over_control"] = decode_ratios(config, routed["decode"], control["decode"],
                                                   "routed_over_control_tok_s", limit=True)
        # Where the routed arm's prefill reads through SGLang's backend, Project-Only rows enter the read (attested).
        backend = execution_of(routed["served"])
        out["prefill_over_control"] = prefill_ratios(config, routed["prefill"], control["prefill"],
                                                     "control_over_routed_time", limit=True,
                                                     project_only_reads=backend.get("prefill_read") == "backend")
        out["control_over_dense_decode"] = decode_ratios(config, control["decode"], dense["decode"],
                                                         "control_over_dense_tok_s")
        out["control_over_dense_prefill"] = prefill_ratios(config, control["prefill"], dense["prefill"],
                                                           "dense_over_control_time")
        out["goals"] = sweep_goals(out)
    reference = arms.get(PREFILL_GRAPHS)
    if reference is not None:
        out["prefill_graphs"] = {"flags": reference.get("flags")}
        if reference.get("error"):
            out["prefill_graphs"]["error"] = reference["error"]
        else:
            out["prefill_graphs"].update(
                passes=prefill_graph_passes(reference["served"]),
                dense_over_graphs=prefill_ratios(config, reference["prefill"], dense["prefill"],
                                                 "dense_over_graphs_time"),
                routed_over_graphs=prefill_ratios(config, routed["prefill"], reference["prefill"],
                                                  "graphs_over_routed_time"))
    return out


# The routed path's goals on a GPU, each judged per cell on the ratio of medians and on its range over the
# repetitions: (name, comparison table, ratio key, cells, threshold; "limit" scales it by each cell's limit).
SWEEP_GOALS = (
    ("prefill s=0.5 / s=0 at the longest prompt", "prefill_over_control", "control_over_routed_time", "longest", 1.20),
    ("prefill s=0.5 / s=0 at the shortest prompt", "prefill_over_control", "control_over_routed_time", "shortest",
     1.0),
    ("prefill s=0 / dense at every length", "control_over_dense_prefill", "dense_over_control_time", "every", 0.97),
    ("decode s=0 / dense in every cell", "control_over_dense_decode", "control_over_dense_tok_s", "every", 0.97),
    ("decode s=0.5 / s=0 over the cell's bandwidth limit in every cell", "decode_over_control",
     "routed_over_control_tok_s", "limit", 0.90),
)


def sweep_goals(comparison: dict) -> list[dict]:
    """Each goal, with the cell that decides it: `met` where every cell's whole range over the repetitions
    reaches the threshold (the cell: the lowest low end), `missed` where some cell's whole range falls short (the
    cell: the lowest high end), `within spread` otherwise (the lowest low end). A cell without repetitions counts
    its ratio alone."""
    goals = []
    for name, table, key, cells, threshold in SWEEP_GOALS:
        rows = comparison.get(table) or []
        if cells in ("longest", "shortest") and rows:
            pick = max if cells == "longest" else min
            rows = [pick(rows, key=lambda r: r["tokens"])]
        if not rows:
            goals.append({"goal": name, "verdict": "not measured"})
            continue
        scale = (lambda r: r["bandwidth_limit"]) if cells == "limit" else (lambda r: 1.0)
        scored = [(r[key] / scale(r), [v / scale(r) for v in r["range"] or (r[key], r[key])], r) for r in rows]
        if any(r_hi < threshold for _, (_, r_hi), _ in scored):
            verdict, (value, (lo, hi), decider) = "missed", min(scored, key=lambda t: t[1][1])
        else:
            value, (lo, hi), decider = min(scored, key=lambda t: t[1][0])
            verdict = "met" if lo >= threshold else "within spread"
        goals.append({"goal": name, "threshold": threshold, "ratio": value, "range": [lo, hi],
                      "cell": {k: decider[k] for k in ("tokens", "batch", "context") if k in decider},
                      "cells": len(rows), "verdict": verdict})
    return goals


def ratio_range(numerators: list[float] | None, denominators: list[float] | None) -> list[float] | None:
    """The least and the greatest ratio of one arm's repetitions over the other's: the arms run one after the
    other, so no repetition of one pairs with a repetition of the other and every pairing is as likely. None
    where a side kept no repetitions (results of a sweep that ran one)."""
    if not numerators or not denominators:
        return None
    return [min(numerators) / max(denominators), max(numerators) / min(denominators)]


def decode_ratios(config: dict, treated: list, baseline: list, key: str, limit: bool = False) -> list[dict]:
    """Per (batch, context) cell: treated / baseline decode tok/s (of the medians of their repetitions), with the
    range over the repetitions; with `limit`, beside it the bandwidth limit of the skip (s = SKIP_RATIO over
    s = 0: bytes read per step at s = 0 over bytes at SKIP_RATIO)."""
    pairs = {(d["batch"], d["context"]): d for d in baseline}
    rows = []
    for r in treated:
        b = pairs.get((r["batch"], r["context"]))
        if b is None:
            continue
        row = {"batch": r["batch"], "context": r["context"], key: r["decode_tok_s"] / b["decode_tok_s"],
               "range": ratio_range(b.get("step_s_reps"), r.get("step_s_reps"))}
        if limit:
            v = r["resident_tokens"]
            row["bandwidth_limit"] = decode_bytes(config, v, 0.0) / decode_bytes(config, v, SKIP_RATIO)
        rows.append(row)
    return rows


def round_ratios(config: dict, routed: dict, dense: dict) -> list[dict]:
    """`prefill_ratios` of the two arms' rounds of several prompts (`prefill_cells`), each with its prompts and the
    most prefill passes a round of each arm took (one: the prompts were admitted in one round)."""
    rounds = {side: {c["tokens"]: c for c in arm.get("prefill_rounds") or []}
              for side, arm in (("routed", routed), ("dense", dense))}
    rows = prefill_ratios(config, list(rounds["routed"].values()), list(rounds["dense"].values()),
                          "dense_over_routed_time")
    for row in rows:
        cells = {side: rounds[side][row["tokens"]] for side in rounds}
        row["prompts"] = cells["routed"]["prompts"]
        row["passes"] = {side: (c.get("pass_spans") or {}).get("passes") for side, c in cells.items()}
    return rows


def prefill_ratios(config: dict, treated: list, baseline: list, key: str, limit: bool = False,
                   project_only_reads: bool = False) -> list[dict]:
    """Per prompt length: baseline / treated time to first token (of the medians of their repetitions), with the
    range over the repetitions; with `limit`, the FLOP limit of the skip (a Project-Only row pays its K/V and the
    projector, and with `project_only_reads` the attention read; `vskipper.modelspec.flop_limit`)."""
    from vskipper.modelspec import flop_limit

    base = {p["tokens"]: p for p in baseline}
    rows = []
    for p in treated:
        b = base.get(p["tokens"])
        if b is None:
            continue
        row = {"tokens": p["tokens"], key: b["ttft_s"] / p["ttft_s"],
               "range": ratio_range(b.get("ttft_s_reps"), p.get("ttft_s_reps"))}
        if limit:
            row["flop_limit"] = flop_limit(config, p["tokens"], 1, SKIP_RATIO, project_only_reads)
        rows.append(row)
    return rows


def bench_grid(plan: Plan) -> list[str]:
    """mixed_depth_bench's grid sized to the device: its default grid takes about 95 GB."""
    if plan.dry_run:
        return ["--smoke"]
    import torch

    memory_gib = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    return [] if memory_gib >= 120 else ["--rows", "32,64,128", "--contexts", "512,1024,2048", "--reps", "10"]


BENCH_JSON = "mixed_depth_bench.json"
CHECK_JSON = "check-served.json"  # the served routed layer against its torch execution, once per OUTDIR
TILES_JSON = "tile-table.json"  # the tiles stage's table (its field 'device' names the GPU it was measured on)
DRY_TILES_DEVICE = "H100-SXM"  # the device the dry run's interpreted table is shaped for (no measurement)


def finished(target: Path) -> bool:
    """Whether a step's output is whole: the tile table once written, the bench's JSON once its last section is in
    (it is written after each section)."""
    if not target.is_file():
        return False
    return target.name != BENCH_JSON or bool(json.loads(target.read_text()).get("complete"))


def run_steps(plan: Plan, stage: Stage, steps, limit_s: float | None = None, grace_s: float = 0.0,
              need_s: float = STEP_NEED_S) -> dict:
    """Each (name, output, command) step in a subprocess, started where `need_s` is left (`Stage.fits`), within the
    stage's budget, or its limit's end where the stage has one, and `grace_s` past it (and `limit_s` where given); a
    step whose output is whole from an earlier run is not run again. One stopped by the budget, or that exits
    without its whole output, is left for the next run (which starts it again); one that
    fails, or that its own limit stopped, is named in `stage.failed` and not run again by the same `run.sh all` (a
    failure that repeats would spend the session)."""
    runs = {}
    for name, target, cmd in steps:
        if finished(target):
            runs[name] = {"output": str(target), "exit": 0, "earlier_run": True}
            continue
        if not stage.fits(5 if plan.dry_run else need_s, name):  # what the step takes on a device
            continue
        env = dict(os.environ)
        if plan.dry_run:
            env["TRITON_INTERPRET"] = "1"
        remaining = max(30.0, stage.end - time.monotonic()) + grace_s  # the limit's end, where the stage has one
        limited = limit_s is not None and limit_s < remaining
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env,
                                  timeout=limit_s if limited else remaining)
            code, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            code, text = 124, (f"stopped at its {limit_s:g} s limit" if limited else
                               "stopped at the stage's time budget") + f"\n{out}"
        (stage.out / f"{name}.log").write_text(text)
        runs[name] = {"output": str(target), "exit": code, "seconds": round(time.monotonic() - t0, 1)}
        log(stage.name, f"{name}: exit {code}")
        if (code == 124 and not limited) or (code == 0 and not finished(target)):  # the next run starts it
            stage.left.append(name)
        elif code != 0:
            stage.failed.append(name)
    return runs


SERVING_STAGES = ("sweep", "ladder", "headline", "clock")
TILES_MARGIN_S = 60.0  # the stage's budget less the tuner's: its start (CUDA, triton) and the table's writing
TILES_END_S = 30.0  # what the stage keeps of its limit after the tuner: its result, the summary


def stage_tiles(plan: Plan, out: Path, budget_s: float, limit_s: float | None = None) -> dict:
    """`vskipper tune-tiles` for the device and the run's model into OUTDIR/tiles/, which every later server takes
    (`start`). Not once a serving stage has begun without it: its servers took the shipped table, and a table
    measured now would split the arms the headline compares (its cross-arm gate would refuse every pair).

    The tuner ends about when its own budget does, but what it runs once started is not bounded by it (CUDA's and
    Triton's start, a range's FFN pair, the prefill read's launches, the backend read's import and compilation),
    and it writes its table at its end: stopped at the stage's budget it would leave nothing of the stage. So it
    may run on into the stage's `limit_s` (run.sh's `timeout`), less `TILES_END_S`."""
    stage = Stage("tiles", out, budget_s)
    device = device_name(plan)
    table = stage.out / TILES_JSON
    served = [name for name in SERVING_STAGES if (out / name).is_dir()]
    if served and not finished(table):
        log(stage.name, f"not tuned: {', '.join(served)} already served with the shipped table")
        earlier = out / "tiles.json"  # what an earlier run of this stage did (a failure, a budget stop)
        return {"device": device or "CPU", "runs": {}, "left": [], "skipped": f"{', '.join(served)} already "
                "served with the shipped table: the run keeps it",
                **({"earlier": json.loads(earlier.read_text())} if earlier.is_file() else {})}
    model = write_model(plan, out)
    where = ["--interpret", "--device", DRY_TILES_DEVICE] if plan.dry_run else (["--device", device] if device else [])
    # the tuner's own budget within the stage's (the table is written at its end): a slow device times fewer tiles
    tune_budget = max(30.0, budget_s - TILES_MARGIN_S)
    cmd = [sys.executable, "-m", "vskipper.cli", "tune-tiles", "--out", str(table), "--model", str(model), *where,
           "--budget-s", f"{tune_budget:.0f}",
           *(["--max-candidates", str(plan.tune_max_candidates)] if plan.tune_max_candidates else [])]
    grace = max(0.0, limit_s - budget_s - TILES_END_S) if limit_s is not None else 0.0
    runs = run_steps(plan, stage, (("tune-tiles", table, cmd),), grace_s=grace)
    result = {"device": device or "CPU", "runs": runs, "left": stage.left, "failed": stage.failed}
    if finished(table):
        result["table"] = json.loads(table.read_text())
    return result


CHECK_LIMIT_S = 150.0  # the served-layer check's own limit (about 30-60 s on a device: two rigs, their compiles)
CHECK_NEED_S = 60.0  # what it takes on the H200: 31 s (sweep-865480a) and 51 s (lease-6), each with its compiles


def check_served(plan: Plan, out: Path, stage: Stage) -> dict:
    """The served routed layer's execution on this device against its torch execution (`check_served.py`), at the
    table this run's servers take, before the first routed server of the OUTDIR: {'runs', 'report'}. A report
    written whole is not run again, and a check that ran in this stage's folder is not run again by the stage (one
    that hung or crashed would take every run's time); a later stage's runs it again. At most `CHECK_LIMIT_S`. A
    case that strays is not fatal here: the summary says which, beside every routed figure it puts in doubt. An
    earlier run's check (ENV_EARLIER) on this GPU whose stamp is this run's (`bundle.check_stamp`: the same checked
    code, packages, SGLang variables, table and stand-in ops) is taken instead of a new one: a lease's second call on
    the same machine spends no minute on it."""
    target, ran = out / CHECK_JSON, stage.out / "check-served.run.json"
    table = tuned_table(plan, out)
    if not finished(target):
        stamp = check_stamp(table, plan.stand_in_ops)
        path, where = earlier(out, CHECK_JSON, lambda p: (json_or_none(p) or {}).get("stamp") == stamp)
        if path is not None:  # kept with where it comes from: a later stage of this run reads it so
            write_whole(target, json.dumps({**json.loads(path.read_text()), "taken_from": where}, indent=2) + "\n")
            log(stage.name, f"check-served: taken from {where}, checked at this run's code, packages, table and ops")
    taken = json_or_none(target) if finished(target) else None
    if taken is not None and taken.get("taken_from"):
        return {"runs": {"check-served": {"output": str(target), "exit": 0, "earlier_run": True}}, "report": taken}
    if not finished(target) and ran.is_file():
        return {"runs": json.loads(ran.read_text())}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu" / "check_served.py"), "--json", str(target),
           *(["--dry-run"] if plan.dry_run else []), *(["--tile-table", str(table)] if table else []),
           *(["--stand-in-ops", plan.stand_in_ops] if plan.stand_in_ops != "torch" else [])]
    runs = run_steps(plan, stage, (("check-served", target, cmd),), limit_s=CHECK_LIMIT_S, need_s=CHECK_NEED_S)
    # a check the stage's budget stopped ran short, not wrong: the stage's next run starts it again
    if "check-served" in runs and not runs["check-served"].get("earlier_run") and "check-served" not in stage.left:
        ran.write_text(json.dumps(runs) + "\n")
    if "check-served" in stage.failed:  # its verdict is the report's and the summary's: the stage goes on
        stage.failed.remove("check-served")
        log(stage.name, f"check-served: the served layer's execution STRAYS from its torch execution or could not "
                        f"be checked: {stage.out / 'check-served.log'}")
    return {"runs": runs, **({"report": json.loads(target.read_text())} if target.is_file() else {})}


def check_lines(results: dict) -> list[str]:
    """What the check of the served layer found (`check_served`), from whichever stage ran it."""
    checks = [doc["check"] for doc in (results.get(name) for name in ("sweep", "headline", "clock"))
              if isinstance(doc, dict) and doc.get("check")]
    check = next((c for c in checks if c.get("report")), None)
    if check is None:  # it ran and wrote nothing, or it did not run: the routed figures are unchecked
        if not checks:
            return []
        failed = next((c["runs"]["check-served"] for c in checks if "check-served" in c.get("runs", {})), None)
        why = ("did not run (the stage's time budget)" if failed is None else
               f"did not finish (exit {failed['exit']}; its log beside the stage's files)")
        return ["## Check", "", f"The check of the served routed layer against its torch execution {why}: **the "
                "routed figures below are unchecked**.", ""]
    report = check["report"]
    cases = report["cases"]
    bad = [c for c in cases if not c["ok"]]
    replayed = " and replayed from CUDA graphs" if any("CUDA graph" in c["case"] for c in cases) else ""
    ops = "; RandomSkip's fused routes against its own ops" if any(c["case"].startswith("fused routes")
                                                                     for c in cases) else ""
    ops += "; the trained gates' fused route against their own" if any(c["case"].startswith("fused gate")
                                                                      for c in cases) else ""
    ops += "; the stand-in ops against SGLang's torch path" if any(c["case"].startswith("stand-in ops")
                                                                   for c in cases) else ""
    backend = report.get("attention_backend")
    through = f", its backend read through SGLang's {backend} attention backend" if backend else ""
    head = (f"The served routed layer ({json.dumps(report['execution'])}{through}) against its torch execution on "
            f"{report['device']} (`check_served.py`: decode eager{replayed}, prefill with either read{ops}; each "
            f"row within {report['rtol']} of its largest value"
            + (f"; checked by {report['taken_from']} at this run's code, packages, table and ops"
               if report.get("taken_from") else "")
            + "): ")
    if not bad:
        worst = max(max(c["output_error"], c["kv_error"]) for c in cases)
        lines = ["## Check", "", head + f"all {len(cases)} cases agree (the worst row {worst:.3g}).", ""]
    else:
        lines = ["## Check", "", head + f"**{len(bad)} of {len(cases)} cases stray or could not run, and every "
                 "routed figure below measures that execution**:", ""] + [
            f"- {c['case']}: " + (f"not checked ({c['error']})" if "error" in c else
                                 f"output {c['output_error']:.3g}, K/V {c['kv_error']:.3g}") for c in bad] + [""]
    return lines + wait_lines(report) + issue_lines(report) + ops_timing_lines(report)


def ops_timing_lines(report: dict) -> list[str]:
    """What a call of each stand-in op costs on either path (`check_served.op_timing`), where the check timed them:
    the host's microseconds to its return (Triton's own launcher included on a GPU) and the device's span of it."""
    timed = [c for c in report.get("cases") or () if c.get("timing")]
    if not timed:
        return []

    def side(t: dict) -> str:
        return f"{t['host_us']:.1f} | {_f(t['device_us'], '.1f')}"

    return [("The stand-in ops' calls, warm (`check_served.op_timing`, the median of each side's calls taken in "
             "turns): the host's us from a call to its return, its launches issued, beside the device's span of "
             "them" + (", none on a CPU" if report.get("device") == "cpu" else "") + ". Where the host's figure is "
             "above the device's, a pass of such calls waits on its launches."), "",
            "| case | Triton host us | Triton device us | torch host us | torch device us |",
            "|---|---:|---:|---:|---:|"] + [
        f"| {c['case'].removeprefix('stand-in ops: ')} | {side(c['timing']['triton'])} | "
        f"{side(c['timing']['torch'])} |" for c in timed] + [""]


def issue_lines(report: dict) -> list[str]:
    """Whether the host or the device set each timed pass's time (`check_served.issue_timing`): the host's ms to
    issue one layer's warm eager pass beside the device's span of it, the served execution's and upstream's dense
    pass of the same rows, each with the waits the watch saw in it."""
    timed = report.get("host_issue") or ()
    passes, failed = [p for p in timed if "routed" in p], [p for p in timed if "routed" not in p]
    if not timed:
        return []
    rule = report.get("host_issue_rule") or {}
    share = rule.get("host_bound")
    head = (f"Host against device in one layer's warm eager pass (`check_served.issue_timing`, the median of "
            f"{rule.get('reps', 'n/a')} passes a side): the host's ms from the pass's start to its last launch "
            "beside the device's span of it, the routed execution's and upstream's dense pass of the same rows "
            "(through the servers' attention backend), each with the host waits the watch saw in it. "
            + ((f"Where the host took {share:.0%} of the span or more" if share else "Where the host took most of "
                "the span") + " in a pass that waits for nothing, the device waited on its launches "
               "(host-bound): fewer or cheaper launches, not faster kernels, would shorten that pass; a pass that "
               "waits gets no verdict (its host time holds the device's)."
               if report["device"] != "cpu" else "On CPU the device is the host: no span."))

    def side(t: dict) -> str:
        span = "n/a" if t["device_ms"] is None else f"{t['device_ms']:.3f}"
        verdict = " (host-bound)" if t["host_bound"] else ""
        return f"{t['host_ms']:.3f} | {span}{verdict} | {'n/a' if t.get('waits') is None else t['waits']}"

    lines = [head, ""]
    if passes:
        lines += ["| pass | routed host ms | routed device ms | routed waits | dense host ms | dense device ms | "
                  "dense waits |", "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {p['case']} | {side(p['routed'])} | {side(p['dense'])} |" for p in passes] + [""]
    lines += [f"- {p['case']}: not timed ({p.get('error', 'no figure')})" for p in failed]
    return lines + ([""] if failed else [])


def wait_lines(report: dict) -> list[str]:
    """What the check found of the served passes' host waits (`check_served.wait_verdict`), where it looked."""
    passes = report.get("host_waits")
    if not passes:
        return []
    how = ("torch's CUDA sync debug mode, each synchronizing call" if report["device"] != "cpu" else
           "the operators that would wait on a GPU")
    head = (f"Host waits of the served execution's eager passes ({how}; `check_served.py`: the largest decode "
            f"batch and each prefill with either read, both routes, each beside upstream's dense pass): ")
    if report.get("host_waits_watch"):
        return [head + f"**not checked: the watch saw no wait where one was made** ({report['host_waits_watch']}).",
                ""]
    waiting = [p for p in passes if not p["ok"]]
    engine = sum(1 for p in passes for w in p.get("waits", ()) if not w["own"])
    if not waiting:
        return [head + f"none in vSkipper's code in {len(passes)} passes"
                + (f" ({engine} elsewhere, none beyond the dense pass's)." if engine else "."), ""]
    return [head + f"**{len(waiting)} of {len(passes)} passes wait**:", ""] + [
        f"- {p['case']}: " + ("not checked (" + p["error"] + ")" if "error" in p else
                             "; ".join(f"{w['what']} at {w['where']}" for w in p["held"]))
        for p in waiting] + [""]


# The part clock's arms and shapes: always-route s = 0.5, the s = 0 control and dense, each alone with the whole
# device, one prompt at a time at the shortest and the third of the sweep's lengths and one round of several
# prompts (the sweep's first): where a prefill pass's host time goes, part by part. Second, right after the first,
# always-route on a server that times its passes whole and wraps no part (`ENV_PASS_SPANS` alone, as the sweep's
# and the headline's servers run, its stack sampled as every clock server's, where sweep-865480a's servers sampled
# none; a budget spent leaves the control and dense, whose prefill the sweep times too):
# on the H200 the sweep's routed prefill passes took 62-73 ms of the host's launches at 1-4k tokens (dense's 35-38
# up to 2k), where the part clock's took 41-45 ms at 1-2k (dense's 37-59, its parts timed). What differs is tried
# one factor at a time: the clock's parts (that arm), the shapes in a row against rotated as the sweep rotates
# them, and a reading of the clock between passes as the sweep reads it, and all of that after a burst of decoding
# as the sweep's prefill follows its decode cells (`CLOCK_SEQUENCES`, every arm).
CLOCK_SPANS = f"{ALWAYS}-spans"
CLOCK_SERVED = ((ALWAYS, ALWAYS, True), (CLOCK_SPANS, ALWAYS, False), (CONTROL, CONTROL, True),
                ("dense", "dense", True))  # (label, arm, parts timed), served in this order
CLOCK_SEQUENCES = ("rotated", "rotated, read between", "after a decode burst")
CLOCK_REPS = 3
CLOCK_ARM_S = 85.0  # one arm on a GPU: a server of the sweep's three decode graphs ready and warm, its passes


def clock_shapes(plan: Plan) -> list[tuple[int, int]]:
    """(prompts, tokens each) of the part clock's prefill passes: one prompt of the sweep's shortest length and
    of its third (2,048 on a GPU, where the routed prefill first gained), then its first round."""
    lengths = sorted(plan.prefill_lengths)
    return [(1, lengths[0]), (1, lengths[min(2, len(lengths) - 1)]), *plan.prefill_rounds[:1]]


def clock_cells(server: Server, shapes: list[tuple[int, int]], vocab: int, parts: bool = True) -> list[dict]:
    """Each shape's `CLOCK_REPS` timed prefill passes on one server, after an untimed one of the same shape (what
    a new shape compiles falls there), its part clock read right before and right after the timed ones
    (`bench_cpu.run_clock`: the host's ms a pass by layer kind and part, on a GPU its launches; the
    device's span of a pass, only where every pass of the window reached the device's clock), with the time each
    took to answer (one token out), the Triton compilations within the window and what the window should hold
    (`expected`: one pass a prompt or a round, its tokens) beside what it held. Prompts drawn apart from the
    sweep's and the warm-up's, none a prefix of another. `parts` False: a server whose clock times each pass whole
    (`ENV_PASS_SPANS` alone; its routed and dense layers' ms None)."""
    cells = []
    for i, (n, length) in enumerate(shapes):
        serve_prompts(server, round_prompts(n, length, 9_000 + i, vocab))  # untimed: a new shape's compilations
        cells.append(clock_window(server, [(n, round_prompts(n, length, 7_000 + r, vocab)) for r in range(CLOCK_REPS)],
                                  parts))
    return cells


def clock_sequences(plan: Plan, server: Server, shapes: list[tuple[int, int]], vocab: int,
                    parts: bool = True) -> dict:
    """`CLOCK_SEQUENCES` on one server after its `clock_cells` (every shape compiled): `CLOCK_REPS` rounds over the
    shapes, one pass of each in turn as the sweep's prefill serves its lengths, in one window of the clock
    (`rotated`); then the same with the clock read between one pass and the next, as the sweep reads it
    (`rotated, read between`); then once more so, after a burst that decodes together outside the window (the
    sweep's smallest batch at its longest context, its new tokens), as the sweep's prefill follows its decode
    cells (`after a decode burst`). Against the cells' passes of one shape after another, they tell whether the
    shape's change from one pass to the next, the reading between them or what decoding left behind costs the
    host. Fresh prompts throughout."""
    windows = {}
    # each window's seeds: prompts sharing no first token with any served before them in the dry run's vocabulary
    # of 512 (a shared first token is a cached one: the window would prefill fewer tokens than it sent, as its
    # doubts would then say)
    for name, seed in zip(CLOCK_SEQUENCES, (34_000, 35_000, 40_000), strict=True):
        if name == "after a decode burst":
            asyncio.run(burst(server, [prompt(plan.contexts[-1], 60_000 + i, vocab) for i in range(plan.batches[0])],
                              plan.sweep_new_tokens))
        windows[name] = clock_window(server, [(n, round_prompts(n, length, seed + 10 * r + i, vocab))
                                              for r in range(CLOCK_REPS) for i, (n, length) in enumerate(shapes)],
                                     parts, read_between=name != "rotated")
    return windows


def serve_prompts(server: Server, prompts: list[list[int]]) -> float:
    """Seconds until one prompt (one request) or a round of several (one request, `prefill_round`) answers its one
    token."""
    t0 = time.perf_counter()
    if len(prompts) == 1:
        asyncio.run(burst(server, prompts, 1))
    else:
        prefill_round(server, prompts)
    return time.perf_counter() - t0


def clock_window(server: Server, passes: list[tuple[int, list[list[int]]]], parts: bool,
                 read_between: bool = False) -> dict:
    """One window of the part clock over `passes` ((prompts, their token ids): one prefill pass each, served in
    order), the clock read right before and right after them (with `read_between`, also after each pass but the
    last): `bench_cpu.run_clock`'s host ms a pass by layer kind (the forward whole where the server times no
    parts) and the device's span of a pass, only where every pass of the window reached the device's clock; the
    time each took to answer, the Triton compilations within the window, what it should hold (`expected`), and
    the server's threads that used the most CPU in it (`threads`, `vskipper.sglang.threads.busiest`: beside the
    scheduler's, whose forward issues the passes, any that took the interpreter's lock from it), and what the
    whole machine did meanwhile, the forward's thread read from outside (`machine`, `forward_tid`)."""
    from benchmarks.bench_cpu import run_clock
    from vskipper.sglang.threads import busiest

    before, threads, allocator, compiles = clock_reading(server)
    if before is None or (parts and before.get("parts") is False):
        raise RuntimeError(f"{server.url}: its attestation holds no part clock{' by parts' if parts else ''} (was "
                           f"{ENV_PART_CLOCK if parts else ENV_PASS_SPANS} passed to it?)")
    seconds = []
    forward = forward_tid(threads)
    machine_before = machine.reading(True, forward)
    for j, (_, prompts) in enumerate(passes):
        seconds.append(serve_prompts(server, prompts))
        if read_between and j < len(passes) - 1:
            pass_clock(server)
    machine_after = machine.reading(False, forward)
    after, threads_after, allocator_after, compiles_after = clock_reading(server)
    if after is None:
        raise RuntimeError(f"{server.url}: its part clock went missing from its attestation")
    clock = run_clock(before, after, "prefill")
    if clock["device_passes"] != clock["passes"]:
        clock["device"] = None  # a window some passes of which the device's clock did not reach
    return {"prompts": passes[0][0], "samples": window_samples(before, after),
            "answered_s": statistics.median(seconds), "answered_s_reps": seconds,
            "threads": busiest(threads, threads_after),
            "machine": machine.window(machine_before, machine_after, client=os.getpid()),
            "allocator": None if allocator is None or allocator_after is None else
            {k: allocator_after[k] - allocator[k] for k in allocator_after if k in allocator},
            "expected": {"passes": len(passes), "tokens": sum(len(p) for _, prompts in passes for p in prompts)},
            "late": bool(before.get("late") or after.get("late")),
            "compiles": headline.compiles_between(compiles, compiles_after),
            "device_error": (after.get("errors") or {}).get("device"),
            "thread_error": (after.get("errors") or {}).get("thread"), **clock}


def machine_pooled(windows: list[dict]) -> dict:
    """Several windows' `machine` (a prefill length's prompts', one pass each) pooled: the CPUs busy and stolen,
    and how busy the forward's CPU was beside it (its busy seconds less the forward's own, summed over the windows
    where the forward stayed on one CPU, `weighed` of them) and its busiest sibling, each as their seconds over
    the windows' wall seconds (the kernel counts in ticks of a few ms: a window's own figure is coarse); the
    forward's thread's ms runnable waiting for a CPU and its preemptions, a window (where every window read it);
    the CPUs it ran on; the canary's median microseconds over both ends of every window (`machine.canary`: the
    machine's speed for one thread); every process's CPU seconds summed, the busiest first."""
    wall = sum(w["wall_s"] for w in windows)
    forwards = [w["forward"] for w in windows if w.get("forward")]
    steady = [w for w in windows if w.get("core") and not w["forward"]["moved"]]  # the forward on one CPU
    steady_wall = sum(w["wall_s"] for w in steady)
    paired = [w for w in steady if w["core"]["siblings"]]  # a core without hyperthreads has no sibling to be busy
    whole = len(forwards) == len(windows)
    canaries = [us for w in windows for us in w.get("canary_us") or () if us is not None]
    return {"windows": len(windows), "cpus": windows[0]["cpus"],
            "canary_us": statistics.median(canaries) if canaries else None,
            "busy_cpus": sum(w["busy_cpus"] * w["wall_s"] for w in windows) / wall,
            "stolen_cpus": sum(w["stolen_cpus"] * w["wall_s"] for w in windows) / wall,
            "runnable_ms": sum(f["runnable_s"] for f in forwards) / len(forwards) * 1e3 if whole else None,
            "involuntary": sum(f["involuntary"] for f in forwards) / len(forwards) if whole else None,
            "forward_cpus": [f["cpu"] for f in forwards], "moved": sum(1 for f in forwards if f["moved"]),
            "core_others": max(0.0, sum(w["core"]["busy"] * w["wall_s"] - w["forward"]["run_s"] for w in steady))
            / steady_wall if steady else None, "weighed": len(steady),
            "sibling_busy": sum(max(s["busy"] for s in w["core"]["siblings"]) * w["wall_s"] for w in paired)
            / sum(w["wall_s"] for w in paired) if paired else None,
            "processes": summed_processes(windows)}


def forward_tid(threads: dict) -> int | None:
    """The thread id of the server's forward (its scheduler process's main thread) in its threads table
    (`vskipper.sglang.threads.thread_cpu`, read from the server's own /proc/self/task: thread ids are the
    machine's, so the client reads the thread too), or None where the table names no one main thread (none
    attested; several replicas)."""
    tids = [int(tid) for tid, t in threads.items() if t.get("name") == "MainThread"]
    return tids[0] if len(tids) == 1 else None


def window_samples(before: dict, after: dict) -> dict | None:
    """The forward's stack samples of a window's prefill passes (`vskipper.sglang.stack_samples`): how many, each
    counted frame's samples of each kind, the sampler's interval and the seconds its samples held the interpreter's
    lock; None where the server samples none."""
    from vskipper.sglang.stack_samples import KINDS, window

    if "samples" not in after:
        return None
    by_kind = {kind: window(before.get("samples"), after["samples"], "prefill", kind) for kind in KINDS}
    seconds = [(doc or {}).get("seconds_total", {}).get("prefill")
               for doc in (before.get("samples"), after["samples"])]
    return {"total": by_kind[KINDS[0]][0], **{kind: counts for kind, (_, counts) in by_kind.items()},
            "interval_s": after["samples"].get("interval_s"),
            # what the samples held the interpreter's lock (a sampler from before it counted that: None)
            "seconds": None if seconds[1] is None else seconds[1] - (seconds[0] or 0.0)}


def stage_clock(plan: Plan, out: Path, budget_s: float) -> dict:
    """`CLOCK_SERVED` one at a time, each on its own server (its own start, the sweep's decode graphs only) with its
    part clock on, but for `CLOCK_SPANS`, always-route timing its passes whole as the other stages' servers do
    (every one of them sampling its stack):
    after the warm-up, `clock_cells` at `clock_shapes`, then `clock_sequences`.
    Where the routed prefill's host time goes that the control's and dense's does not, part by part (the summary's
    tables): what the H200's sweep could not tell (a 1,024-token routed prefill 10% slower than the control's
    while its kernels summed 7% less). Before its first routed server, the check of the served layer
    (`check_served`, once per OUTDIR), whose host-against-device table times each layer's pass apart. An arm that
    fails is named in `failed` and the others serve; an arm an earlier call served is kept."""
    stage = Stage("clock", out, budget_s)
    model = write_model(plan, out)
    arm_files = write_arms(out)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    shapes = clock_shapes(plan)
    result: dict = {"shapes": [list(s) for s in shapes], "reps": CLOCK_REPS, "arms": {}}
    need = min(CLOCK_ARM_S, plan.start_estimate_s + 20)
    for name, arm, parts in CLOCK_SERVED:
        if arm != "dense" and "check" not in result:  # before the first routed server, as the sweep's: its host
            result["check"] = check_served(plan, out, stage)  # against device table times each layer's pass
        done = stage.out / f"{name}.json"
        if done.is_file():
            result["arms"][name] = json.loads(done.read_text())
            continue
        if stage.left:  # an arm left for the next run leaves those after it too
            stage.left.append(name)
            continue
        if not stage.has_time(need, name):  # names it in `left`
            continue
        try:
            with ExitStack() as stack:
                t0 = time.monotonic()
                server = server_for(plan, stack, model, stage.out / "servers" / name, arm, arm_files,
                                    plan.solo_mem_fraction, key=f"{name}@clock", graph_batches=plan.batches,
                                    part_clock=parts, samples=True)
                ready(plan, [server])
                warm_up(plan, server, vocab)
                log(stage.name, f"{name} up and warm after {time.monotonic() - t0:.0f} s")
                doc = {"parts": parts, "cells": clock_cells(server, shapes, vocab, parts),
                       "sequences": clock_sequences(plan, server, shapes, vocab, parts), "served": served(server)}
        except Exception as e:  # noqa: BLE001 -- the other arms still serve; the error is kept
            log(stage.name, f"{name} failed: {type(e).__name__}: {e}")
            stage.failed.append(name)
            result["arms"][name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        done.write_text(json.dumps(doc, indent=1) + "\n")
        result["arms"][name] = doc
    result["left"], result["failed"] = stage.left, stage.failed
    return result


def clock_parts(cell: dict) -> dict[str, float]:
    """A clock cell's host ms a pass by layer kind and part ("routed mlp": the MLP of the layers the model routes,
    which a dense arm serves densely; "outside": the pass outside the layers): the parts compare across arms."""
    return {(where if part == where else f"{where} {part}"): seconds / max(1, cell["passes"]) * 1e3
            for where, by_part in cell["seconds"].items() for part, seconds in by_part.items()}


CLOCK_PAIRS = ((ALWAYS, CONTROL), (ALWAYS, "dense"), (CONTROL, "dense"))  # (arm, against) in the summary


def clock_lines(clock: dict | None) -> list[str]:
    """The summary's section of the clock stage: each arm's prefill pass per shape (host ms by layer kind, the
    device's span, and whatever makes a window doubtful), then the shapes served otherwise (`sequence_lines`),
    then always-route's host time by part beside the control's and dense's, and the control's beside dense's,
    the largest differences first."""
    if not clock:
        return []
    arms = {name: doc for name, doc in (clock.get("arms") or {}).items() if doc.get("cells")}
    lines = ["## Where a prefill pass's host time goes (the part clock)", ""]
    if arms:
        lines += ["Each arm alone with its part clock on (`vskipper.sglang.part_times`: every part of every layer "
                  "timed on the host; on a GPU that is its launches, which the device runs behind, and the device's "
                  f"span of a pass beside it), {clock['reps']} passes a shape after an untimed one, medians of the "
                  "time each took to answer. A device span about as long as the host's marks a host-bound pass; the "
                  "clock's own calls add to the host's time, more where more of SGLang's modules run. The routed "
                  "layers are those the model routes (dense serves them densely); `-spans`: a server that times each "
                  "pass whole, without the parts (its forward is `outside`). Thread CPU: the CPU ms a pass of the "
                  "thread that ran the forward, and its waits a pass (`forward_thread`): host time beyond its CPU "
                  "time is time it waited; gc: the interpreter's garbage collector's ms a pass, which holds every "
                  "thread for most of its run. Clock: the clock's wrapped calls a pass, and the host ms a pass they "
                  "cost by the server's own measure of one call (`PartClock.calibrate`, in a quiet loop: a floor, "
                  "which the clock's code run cold in a pass exceeds by a few microseconds a call); what timing "
                  "the parts adds to an arm's host time many times beyond it is not the clock's code.", "",
                  "| prefill | arm | answered ms | host ms a pass | thread CPU ms | waits | gc ms | clock calls | "
                  "clock's own ms | routed layers | dense layers | outside | device ms a pass | device / host | "
                  "doubts |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for i, (n, length) in enumerate(clock["shapes"]):
            for name, doc in arms.items():
                c = doc["cells"][i]
                lines.append(f"| {n} x {length} | {name} | {c['answered_s'] * 1e3:.1f} | {c['model']:.2f} | "
                             f"{_f(c.get('cpu'), '.2f')} | {_f(c.get('waits'), '.1f')} | {_f(c.get('gc'), '.2f')} | "
                             f"{_f(c.get('calls'), '.0f')} | {_f(c.get('own'), '.2f')} | "
                             f"{_f(c['routed'], '.2f')} | {_f(c['dense'], '.2f')} | {c['outside']:.2f} | "
                             f"{_f(c['device'], '.2f')} | {_f(_over(c['device'], c['model']), '.2f')} | "
                             f"{clock_doubts(c) or '-'} |")
        lines.append("")
    lines += sequence_lines(arms, clock["reps"])
    lines += sample_lines(arms)
    for name, against in CLOCK_PAIRS:
        if name not in arms or against not in arms:
            continue
        for i, (n, length) in enumerate(clock["shapes"]):
            mine, base = clock_parts(arms[name]["cells"][i]), clock_parts(arms[against]["cells"][i])
            rows = sorted(set(mine) | set(base), key=lambda k: -abs(mine.get(k, 0.0) - base.get(k, 0.0)))[:8]
            lines += [f"{name} against {against} at {n} x {length}: host ms a pass by layer kind and part, the "
                      "largest differences first:", "", f"| part | {against} | {name} | difference |",
                      "|---|---:|---:|---:|",
                      *(f"| {k} | {base.get(k, 0.0):.3f} | {mine.get(k, 0.0):.3f} | "
                        f"{mine.get(k, 0.0) - base.get(k, 0.0):+.3f} |" for k in rows), ""]
    failed = {name: doc["error"] for name, doc in (clock.get("arms") or {}).items() if doc.get("error")}
    lines += [f"Clock stage: {name} failed: {error}" for name, error in failed.items()]
    if clock.get("left"):
        lines.append(f"Clock stage left for the next run: {', '.join(clock['left'])}")
    return lines + ([""] if failed or clock.get("left") else [])


def in_a_row(cells: list[dict]) -> dict[str, float | None]:
    """The host's and the device's ms a pass over an arm's shape cells together (each shape's passes in a row),
    and the forward's thread's CPU ms a pass (`cpu`), weighted by their passes: what `CLOCK_SEQUENCES` serve
    rotated. Each None where a cell lacks it."""
    passes = sum(c.get("passes") or 0 for c in cells)

    def mean(key: str) -> float | None:
        return None if not passes or any(c.get(key) is None or c.get("passes") is None for c in cells) else \
            sum(c[key] * c["passes"] for c in cells) / passes

    return {"model": mean("model"), "device": mean("device"), "cpu": mean("cpu")}


def sequence_lines(arms: dict[str, dict], reps: int) -> list[str]:
    """The summary's tables of each arm's prefill passes in a row against rotated, rotated with the clock read
    between them and so after a decode burst (`clock_sequences`), each beside the one before: which of the sweep's
    ways of serving its prompts costs the host; then each window's busiest threads of the server."""
    arms = {name: doc for name, doc in arms.items() if doc.get("sequences")}
    if not arms:
        return []
    lines = [f"The same shapes served otherwise (`clock_sequences`, {reps} passes a shape each way, fresh prompts): "
             "each shape's passes in a row (the cells above, together), one pass of each shape in turn (rotated, "
             "as the sweep serves its lengths), and rotated with the clock read between passes (as the sweep reads "
             "it), and so again after a burst that decodes together (as the sweep's prefill follows its decode "
             "cells). Host ms a pass (the forward's launches; `-spans`: a server that times each pass whole, "
             "without the parts, as the sweep's and the headline's servers do, its stack sampled as every server "
             "here is, where sweep-865480a's were not), each beside the one before it, "
             "then the forward's thread's CPU ms a pass (what of the host's time it computed) and the device's ms "
             "a pass:", "",
             "| arm | parts timed | in a row | rotated | / in a row | read between | / rotated | after decoding "
             "| / read between | thread CPU: in a row | rotated | read between | after decoding "
             "| device: in a row | rotated | read between | after decoding | doubts |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, doc in arms.items():
        row, seq = in_a_row(doc["cells"]), doc["sequences"]
        hosts = [row["model"], *((seq.get(k) or {}).get("model") for k in CLOCK_SEQUENCES)]
        cpus = [row["cpu"], *((seq.get(k) or {}).get("cpu") for k in CLOCK_SEQUENCES)]
        devices = [row["device"], *((seq.get(k) or {}).get("device") for k in CLOCK_SEQUENCES)]
        cols = [_f(hosts[0], ".2f")] + [f"{_f(h, '.2f')} | {_f(_over(h, before), '.2f')}"
                                        for before, h in zip(hosts, hosts[1:], strict=False)]
        doubts = "; ".join(f"{k}: {d}" for k, c in seq.items() if (d := clock_doubts(c)))
        lines.append(f"| {name} | {'yes' if doc.get('parts', True) else 'no'} | {' | '.join(cols)} | "
                     f"{' | '.join(_f(c, '.2f') for c in cpus)} | "
                     f"{' | '.join(_f(d, '.2f') for d in devices)} | {doubts or '-'} |")
    lines += ["", "The server's threads that used the most CPU in each window, beside its time to answer (the sum "
              "of its passes' answers) and its passes; each thread's CPU seconds, then how often it gave up the "
              "processor to wait (`vskipper.sglang.threads`: a thread that runs while the scheduler's forward "
              "issues a pass takes the interpreter's lock whenever the forward lets it go, around each launch of "
              "torch's operators and of Triton's kernels, and the forward then waits for it; threads named alike "
              "are apart; in a row: each shape's window's busiest four, summed), and the CUDA allocator's trips "
              "to the driver in it (`allocator`: memory taken, given back (which waits for the device), requests "
              "retried after its cache was given back, waits on every stream; a pass whose temporaries fit the "
              "cached blocks makes none):", "",
              "| arm | window | answered s | passes | threads (CPU s, waits) | allocator (taken, given back, retried, "
              "stream waits) |", "|---|---|---:|---:|---|---|"]
    for name, doc in arms.items():
        windows = [("in a row", doc["cells"])] + [(k, [c]) for k, c in doc["sequences"].items()]
        for window, cells in windows:
            used: dict[tuple[str, str], list] = {}
            for c in cells:
                for t in c.get("threads") or ():
                    u = used.setdefault((t["name"], t.get("tid", t["name"])), [0.0, 0])
                    u[0] += t["cpu_s"]
                    u[1] += t.get("waits", 0)
            top = sorted(used.items(), key=lambda kv: -kv[1][0])[:4]
            trips = [c.get("allocator") for c in cells]
            alloc = "n/a" if any(t is None for t in trips) else " / ".join(  # a counter this torch lacks: n/a
                str(sum(t[k] for t in trips)) if all(k in t for t in trips) else "n/a" for k in ALLOCATOR_COUNTERS)
            lines.append(f"| {name} | {window} | {sum(sum(c['answered_s_reps']) for c in cells):.2f} | "
                         f"{sum(c['passes'] for c in cells)} | "
                         f"{', '.join(f'{t} {s:.2f} s, {w} waits' for (t, _), (s, w) in top) or 'not attested'} | "
                         f"{alloc} |")
    return lines + [""] + machine_lines(arms)


def machine_lines(arms: dict[str, dict]) -> list[str]:
    """The summary's table of what the whole machine did in each window of `sequence_lines`' arms (`machine` of
    each clock window, `benchmarks/gpu/machine.py`); nothing where no window read it (a run from before, a machine
    without /proc)."""
    rows = []
    for name, doc in arms.items():
        windows = [("in a row", doc["cells"])] + [(k, [c]) for k, c in doc["sequences"].items()]
        for window, cells in windows:
            read = [c["machine"] for c in cells if c.get("machine")]
            if read:
                rows.append(f"| {name} | {window} | {machine_row(read)} |")
    if not rows:
        return []
    return ["What the whole machine did in each window (`benchmarks/gpu/machine.py`, read by the client from "
            "Linux's /proc around the window; in a row: each shape's window together, the CPUs' means weighted "
            "by each window's time, the forward's ms and preemptions summed): the CPUs busy and stolen by the "
            "hypervisor on average; the scheduler's forward thread, read from outside: its ms runnable but "
            "waiting for a CPU another task held, how often the kernel preempted it and the CPU it ran on "
            "(a -> b: it moved, or moved and came back); how busy that CPU was beside the forward's own time and "
            "each hyperthread sibling of it; and the processes alive at its end that used the most CPU (CPU s; "
            "`client`: the reader's own). A pass whose thread waits runnable, or runs beside a busy sibling or a "
            "stolen CPU, is slowed by the machine, not its code; a process that should not run (a server that did "
            "not end) shows here. A virtual "
            "machine's siblings are its virtual topology: a neighbour on the physical core beyond what the "
            "hypervisor steals is not seen, but for the canary: a fixed loop of pure Python the reader times "
            "before and after each window (us, the least of three runs; `machine.canary`), which takes longer "
            "where the machine runs one thread slower:", "",
            "| arm | window | busy CPUs | stolen CPUs | forward: runnable ms, preempted, CPU | its CPU beside it "
            "(siblings) | canary us before / after | processes |", "|---|---|---:|---:|---|---|---|---|", *rows, ""]


def summed_processes(windows: list[dict]) -> list[dict]:
    """Every process's CPU seconds over `windows` (each window's `machine`), summed by process (its pid and start:
    a pid taken again is another), the busiest first."""
    used: dict[tuple[int, int | None], dict] = {}
    for w in windows:
        for p in w["processes"]:
            u = used.setdefault((p["pid"], p.get("start")), {**p, "cpu_s": 0.0})
            u["cpu_s"] += p["cpu_s"]
    return sorted(used.values(), key=lambda u: -u["cpu_s"])


def process_list(windows: list[dict]) -> str:
    """The processes that used the most CPU over `windows` (`summed_processes`), the busiest `machine.TOP`, the
    reader's own marked."""
    return ", ".join(f"{p['name']} {p['pid']}{' (client)' if p.get('client') else ''} {p['cpu_s']:.2f} s"
                     for p in summed_processes(windows)[:machine.TOP])


def machine_row(windows: list[dict]) -> str:
    """One row's cells of `machine_lines` over one or more windows' `machine`: the CPUs busy and stolen weighted by
    each window's wall time; the forward's runnable ms and preemptions summed, and each window's CPU in turn;
    each window's CPU's load beside the forward; the processes' CPU summed over the windows."""
    pooled = machine_pooled(windows)
    forwards = [w.get("forward") for w in windows]
    if all(forwards):
        where = ", ".join(f"{f['cpu_before']} -> {f['cpu']}" if f["moved"] else str(f["cpu"]) for f in forwards)
        forward = (f"{sum(f['runnable_s'] for f in forwards) * 1e3:.1f} ms, "
                   f"{sum(f['involuntary'] for f in forwards)} preempted; CPU {where}")
    else:
        forward = "n/a"
    beside = []
    for w in windows:
        core = w.get("core")
        if core is None or w["forward"]["moved"]:
            beside.append("n/a")
            continue
        near = ", ".join(f"{s['cpu']} {s['busy']:.0%}" for s in core["siblings"])
        beside.append(f"{core['others']:.0%} ({near})" if near else f"{core['others']:.0%}")
    procs = process_list(windows)
    canary = ", ".join(" / ".join(_f(us, ".0f") for us in w.get("canary_us") or (None, None)) for w in windows)
    return (f"{pooled['busy_cpus']:.2f} of {pooled['cpus']} | {pooled['stolen_cpus']:.2f} | {forward} | "
            f"{', '.join(beside)} | {canary} | "
            f"{procs or 'none'}")


SAMPLED_KINDS = {"innermost": "the innermost frame (where the thread is in C code, the line that called it)",
                 "vskipper": "the innermost frame of vSkipper's code"}


def sampled(windows: list[dict]) -> tuple[int, dict[str, dict[str, int]]]:
    """The stack samples of several clock windows together: how many, and each kind's counts summed."""
    total, counts = 0, {kind: {} for kind in SAMPLED_KINDS}
    for w in windows:
        samples = w.get("samples") or {}
        total += samples.get("total", 0)
        for kind in SAMPLED_KINDS:
            for key, n in (samples.get(kind) or {}).items():
                counts[kind][key] = counts[kind].get(key, 0) + n
    return total, counts


def merge_samples(windows: list[dict]) -> dict | None:
    """Several windows' stack samples as one window's (`window_samples`' fields: the counts summed, the interval
    of the first, the seconds summed where every window counts them); None where they hold none."""
    total, counts = sampled(windows)
    if not total:
        return None
    samples = [w["samples"] for w in windows if w.get("samples")]
    seconds = [s.get("seconds") for s in samples]
    return {"total": total, **counts, "interval_s": samples[0].get("interval_s"),
            "seconds": sum(seconds) if all(t is not None for t in seconds) else None}


def sampling(windows: list[dict]) -> str:
    """How the windows' servers sampled, for a summary: every how many ms (as their samplers attest: an earlier
    run's may differ from `INTERVAL_S`) and, where they count it, the ms their samples took in all (the forward's
    own time where it reads its stack at a signal; the interpreter's lock, which the forward waits for, where the
    sampler's thread reads it)."""
    from vskipper.sglang.stack_samples import INTERVAL_S

    samples = [w["samples"] for w in windows if w.get("samples")]
    intervals = sorted({s.get("interval_s") or INTERVAL_S for s in samples}) or [INTERVAL_S]
    text = "every " + " or ".join(f"{i * 1e3:g}" for i in intervals) + " ms"
    seconds = [s.get("seconds") for s in samples]
    if samples and all(t is not None for t in seconds):
        text += f", the samples taking {sum(seconds) * 1e3:.1f} ms of the forward in all"
    return text


def sample_lines(arms: dict[str, dict], shown: int = 6) -> list[str]:
    """Where each arm's prefill passes spent the host's time by the forward's stack samples
    (`vskipper.sglang.stack_samples`): per kind of frame, the most sampled frames of the three sequences' windows
    together beside their share in the windows of each shape's passes in a row, each with the host ms a pass that
    share stands for (a frame whose ms grow in the sequences is where their extra host time went)."""
    from vskipper.sglang.stack_samples import top

    lines = []
    for name, doc in arms.items():
        cells, sequences = doc.get("cells") or [], list((doc.get("sequences") or {}).values())
        row_total, row = sampled(cells)
        seq_total, seq = sampled(sequences)
        if not row_total and not seq_total:
            continue
        # the host's ms a pass over each group's windows, weighted by their passes (`in_a_row`)
        row_ms, seq_ms = (in_a_row(group)["model"] if group else None for group in (cells, sequences))
        if not lines:
            lines = ["Where the forward's host time went, by samples of its Python stack while a pass ran "
                     "(`VSKIPPER_STACK_SAMPLES`, on every server of this stage: one at each tick of a clock, where "
                     "the forward next runs Python, as it does after each launch (the scheduler's main thread "
                     "reads its own stack at the tick's signal); a stretch of pure Python is charged to the call "
                     "that ends it, and a frame's share of the samples is about its "
                     "share of the passes' host time): the most sampled frames of the three sequences' windows "
                     "together, beside their share in the windows of each shape's passes in a row, and in brackets "
                     "the host ms a pass that share stands for.", ""]
        for kind, what in SAMPLED_KINDS.items():
            keys = [k for k, _ in top(seq[kind] or row[kind], shown)]
            if not keys:
                continue
            lines += [f"{name}, {what} ({seq_total} samples in the sequences, {row_total} in a row; "
                      f"{sampling(cells + sequences)}):", "",
                      "| frame | sequences | in a row |", "|---|---:|---:|",
                      *(f"| `{k}` | {_share_ms(seq[kind].get(k, 0), seq_total, seq_ms)} | "
                        f"{_share_ms(row[kind].get(k, 0), row_total, row_ms)} |" for k in keys), ""]
    return lines


def _share(n: int, total: int) -> str:
    return "n/a" if not total else f"{100 * n / total:.1f}%"


def _share_ms(n: int, total: int, host_ms: float | None) -> str:
    """A frame's share of `total` samples, and in brackets the host ms a pass it stands for where `host_ms` (a
    pass's) is known."""
    return _share(n, total) + (f" ({host_ms * n / total:.1f} ms)" if host_ms is not None and total else "")


def clock_doubts(cell: dict) -> str:
    """What makes a clock window doubtful: passes or tokens other than expected, a late reading, a compilation
    inside it, the device's clock stopped, the reads of the forward's thread stopped."""
    doubts = []
    expected = cell.get("expected") or {}
    if expected and (cell["passes"], cell["tokens"]) != (expected["passes"], expected["tokens"]):
        doubts.append(f"{cell['passes']} passes of {cell['tokens']} tokens, {expected['passes']} of "
                      f"{expected['tokens']} expected")
    if cell.get("late"):
        doubts.append("a reading served late")
    if (cell.get("compiles") or {}).get("compiles"):
        doubts.append(f"{cell['compiles']['compiles']} Triton compilations inside")
    if cell.get("device_error"):
        doubts.append(f"device clock: {cell['device_error']}")
    if cell.get("thread_error"):
        doubts.append(f"forward thread: {cell['thread_error']}")
    return "; ".join(doubts)


def stage_kernels(plan: Plan, out: Path, budget_s: float) -> dict:
    stage = Stage("kernels", out, budget_s)
    device = device_name(plan) or "CPU"
    bench_json = stage.out / BENCH_JSON
    table = tuned_table(plan, out)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "mixed_depth_bench.py"), "--json", str(bench_json),
           *bench_grid(plan), *(["--tile-table", str(table)] if table else [])]
    runs = run_steps(plan, stage, (("mixed_depth_bench", bench_json, cmd),))
    return {"device": device, "runs": runs, "left": stage.left, "failed": stage.failed,
            "tile_table": str(table) if table else None}


def summary(plan: Plan, out: Path) -> dict:
    results = {"dry_run": plan.dry_run, "platform": plan.platform}
    env = out / "env.json"
    if env.is_file():
        results["environment"] = json.loads(env.read_text())
    for name in STAGES:
        path = out / f"{name}.json"
        results[name] = json.loads(path.read_text()) if path.is_file() else None
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "summary.md").write_text(markdown(results, out))
    return results


_f = headline.figure


def _over(value: float | None, limit: float | None) -> float | None:
    """value / limit, or None where either is missing."""
    return None if value is None or not limit else value / limit


def _interval(interval: list | None) -> str:
    """' [lo, hi] (95%, resampled repetitions)' after a figure, or nothing where none was computed."""
    return "" if not interval else f" [{interval[0]:.3g}, {interval[1]:.3g}] (95%, resampled repetitions)"


def _range(row: dict | None, key: str = "range") -> str:
    return "n/a" if not row or not row.get(key) else f"{row[key][0]:.3f}-{row[key][1]:.3f}"


def _reps(results: dict, key: str) -> str:
    return str(((results.get("sweep") or {}).get("plan") or {}).get(key, "?"))


def sweep_state_lines(sweep: dict | None) -> list[str]:
    """Which of the sweep's arms failed and why, where its limit stopped it, and what it left for the next run."""
    if not sweep:
        return []
    lines = [f"- {name} failed: {error}" for name, error in (sweep.get("errors") or {}).items()]
    if sweep.get("stopped"):
        lines.append(f"- stopped at its limit while serving {sweep['stopped']}: what it served before stands")
    if sweep.get("left"):
        lines.append(f"- left for the next run: {', '.join(sweep['left'])}")
    return ["The sweep did not serve everything:", "", *lines, ""] if lines else []


def markdown(results: dict, out: Path | None = None) -> str:
    """The run's summary; `out`, the run's folder, for what a stage left in files there."""
    env = results.get("environment") or {}
    lines = ["# vSkipper device run", "",
             f"Device: {env.get('gpu', 'none (CPU dry run: no figure here is a GPU measurement)')}; "
             f"torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, driver {env.get('driver', '?')}.", ""]
    checked = device_pins().get("triton")
    if env.get("triton") and checked and env["triton"] != checked:
        lines += [f"The kernels are compile-checked with the device image's triton {checked} "
                  f"(`device-packages.txt`), not with this machine's {env['triton']}.", ""]
    if results["dry_run"]:
        lines += ["**Dry run on CPU with a tiny model: the pipeline, not performance.**", ""]
    if env.get("stand_in_ops", "torch") != "torch":
        lines += [f"Every server, dense included, ran RMSNorm, SiLU-and-mul and RoPE on the stand-in ops "
                  f"`{env['stand_in_ops']}` (`vskipper serve --stand-in-ops`): compare with runs on the same ops.", ""]
    lines += check_lines(results)
    lines += tiles_lines(results.get("tiles"), results.get("sweep"))
    lines += headline.headline_lines(results.get("ladder"), results.get("headline"))
    lines += routed_prefill_graph_lines((results.get("headline") or {}).get("arms") or {},
                                        "the headline's routed arms above; dense prefilled eagerly")
    sweep = results.get("sweep")
    state = sweep_state_lines(sweep)
    if state and not sweep.get("comparison"):  # no arm pair to compare: what happened, alone
        lines += ["## Decode sweep and prefill", "", *state]
    if sweep and sweep.get("comparison"):
        c = sweep["comparison"]
        lines += ["## Decode sweep and prefill", ""] + sweep_decode_lines(sweep.get("arms") or {}) + [
                  f"Dense decode: {c['dense_decode_graphs']}; routed decode: {c['routed_decode_graphs']}.", ""]
        if c["decode_speedup"]:
            lines += [f"tau = {_f(c.get('tau_ms'))} ms{_interval(c.get('tau_ms_interval'))}"
                      + (f" (on the device alone, from each decode pass's span: {_f(c['device_tau_ms'])} ms)"
                         if c.get("device_tau_ms") is not None else "") + "; V_x = "
                      f"{_f(c.get('v_x_tokens'))} tokens; rule V* = "
                      f"{_f(c.get('v_star_tokens'))} tokens; V_x / V* = {_f(c.get('v_x_over_v_star'))}", ""]
        bursts = f"{_reps(results, 'decode_reps')} bursts a decode cell, " if c["decode_speedup"] else ""
        lines += ["Each figure is the ratio of the arms' medians over their repetitions (plan: "
                  f"{bursts}{_reps(results, 'prefill_reps')} prompts a prefill length), beside the range of the ratio "
                  "over every pairing of repetitions.", ""]
        if c["decode_speedup"]:
            lines += ["| batch | context | routed / dense decode tok/s | range |", "|---:|---:|---:|---|"]
            lines += [f"| {d['batch']} | {d['context']} | {d['routed_over_dense_tok_s']:.3f} | {_range(d)} |"
                      for d in c["decode_speedup"]]
            lines.append("")
        lines += ["| prefill tokens | dense / routed time | range |", "|---:|---:|---|"]
        lines += [f"| {p['tokens']} | {p['dense_over_routed_time']:.3f} | {_range(p)} |" for p in c["prefill_speedup"]]
        lines.append("")
        if c.get("prefill_round_speedup"):
            lines += ["Rounds of several prompts, sent in one request (one admission round where the pass spans count "
                      "one prefill pass), against one prompt of their length:", "",
                      "| prompts x tokens | dense / routed time | range | one prompt of that length | passes a round "
                      "(dense / routed) |", "|---|---:|---|---:|---|"]
            single = {p["tokens"]: p["dense_over_routed_time"] for p in c["prefill_speedup"]}
            lines += [f"| {p['prompts']} x {p['tokens'] // p['prompts']} | {p['dense_over_routed_time']:.3f} | "
                      f"{_range(p)} | {_f(single.get(p['tokens']), '.3f')} | {_f(p['passes']['dense'])} / "
                      f"{_f(p['passes']['routed'])} |" for p in c["prefill_round_speedup"]]
            lines.append("")
        if c.get("prefill_floor"):
            f = c["prefill_floor"]
            lines += [f"Measured prefill floor: {f['prefill_floor_tokens']} prompt tokens a round, "
                      f"{f['prefill_floor_source']} (vskipper.constants' floor: {CONSTANTS.prefill_min_prompt_tokens}; "
                      "the headline's measured arm serves it).", ""]
        if c.get("decode_over_control") or c.get("prefill_over_control"):
            dense_ratio = {(d["batch"], d["context"]): d for d in c["control_over_dense_decode"]}
            dense_prefill = {p["tokens"]: p for p in c.get("control_over_dense_prefill") or []}
            lines += [f"Against the control arm ({CONTROL}: the routed path, nothing skipped; decode "
                      f"{c['control_decode_graphs']}):", ""]
            if c.get("decode_over_control"):
                lines += ["| batch | context | s=0.5 / s=0 decode tok/s | range | bandwidth limit | share of the "
                          "limit | s=0 / dense decode tok/s | range |", "|---:|---:|---:|---|---:|---:|---:|---|"]
            for d in c["decode_over_control"]:
                to_dense = dense_ratio.get((d["batch"], d["context"]))
                lines.append(f"| {d['batch']} | {d['context']} | {d['routed_over_control_tok_s']:.3f} | {_range(d)} | "
                             f"{d['bandwidth_limit']:.3f} | {d['routed_over_control_tok_s'] / d['bandwidth_limit']:.0%} "
                             f"| {_f(to_dense and to_dense['control_over_dense_tok_s'], '.3f')} | {_range(to_dense)} |")
            lines += [*([""] if c.get("decode_over_control") else []),
                      "| prefill tokens | s=0 / s=0.5 time | range | FLOP limit | dense / s=0 time | range |",
                      "|---:|---:|---|---:|---:|---|"]
            for p in c["prefill_over_control"]:
                to_dense = dense_prefill.get(p["tokens"])
                lines.append(f"| {p['tokens']} | {p['control_over_routed_time']:.3f} | {_range(p)} | "
                             f"{p['flop_limit']:.3f} | {_f(to_dense and to_dense['dense_over_control_time'], '.3f')} "
                             f"| {_range(to_dense)} |")
            lines.append("")
        lines += prefill_graph_lines(c.get("prefill_graphs"))
        lines += routed_prefill_graph_lines(sweep.get("arms") or {})
        lines += ttft_parts_lines(sweep.get("arms") or {})
        lines += pass_span_lines(sweep.get("arms") or {})
        lines += sweep_sample_lines(sweep.get("arms") or {})
        lines += sweep_compile_lines(sweep.get("arms") or {})
        if c.get("goals"):
            lines += ["### The routed path's goals", "",
                      "| goal | threshold | deciding cell | its ratio | its range | cells | verdict |",
                      "|---|---:|---|---:|---|---:|---|"]
            for g in c["goals"]:
                if g["verdict"] == "not measured":
                    lines.append(f"| {g['goal']} | | | | | | not measured |")
                    continue
                cell = ", ".join(f"{k} {v}" for k, v in g["cell"].items())
                lines.append(f"| {g['goal']} | {g['threshold']:.2f} | {cell} | {g['ratio']:.3f} | {_range(g)} | "
                             f"{g['cells']} | {g['verdict']} |")
            lines.append("")
        lines += state
    kernels = results.get("kernels")
    if kernels:
        lines += ["## Kernels", ""] + [f"- {k}: exit {v['exit']}, {v['output']}" for k, v in kernels["runs"].items()]
        lines.append("")
        lines += served_layer_lines(out / "kernels" / BENCH_JSON if out else None)
    lines += clock_lines(results.get("clock"))
    return "\n".join(lines)


def sweep_compile_lines(arms: dict) -> list[str]:
    """The Triton kernels each sweep arm first launched while it served its cells (`compiles`: from ready to its
    last cell), built there or loaded from Triton's cache: a compilation holds the passes behind it, so a cell it
    fell in measures the compiler too."""
    found, counted = [], []
    for name, arm in arms.items():
        c = arm.get("compiles")
        if c is None:
            continue
        counted.append(name)
        if c["compiles"] or c.get("cache_loads"):
            found.append(f"{name}: {headline.compiles_text(c)}")
    if found:
        return ["Triton kernels first launched while an arm served its cells, built there or loaded from Triton's "
                "cache (built on a machine whose cache lacks them): " + "; ".join(found) + ".", ""]
    return [f"No Triton kernel first launched while {', '.join(counted)} served their cells.", ""] if counted else []


def prefill_graph_lines(reference: dict | None) -> list[str]:
    """Dense with SGLang's default prefill graphs (`PREFILL_GRAPHS`) beside dense and the routed arm, which prefill
    eagerly: what the graphs take off dense's TTFT, and the routed arm's prefill against that dense."""
    if not reference:
        return []
    flags = " ".join(reference["flags"]) or "none on CPU"
    head = (f"Against dense with SGLang's prefill graphs ({PREFILL_GRAPHS}: {flags}; every other arm prefills "
            "eagerly, since prefill graphs hold no routed variant)")
    if reference.get("error"):
        return [f"{head}: not served, {reference['error']}.", ""]
    passes = reference["passes"]
    lines = [f"{head}: {passes['replayed']} prefill passes replayed from graphs, {passes['eager']} eager.", "",
             "| prefill tokens | dense / dense with graphs time | range | s=0.5 / dense with graphs speed | range |",
             "|---:|---:|---|---:|---|"]
    routed = {p["tokens"]: p for p in reference["routed_over_graphs"]}
    for p in reference["dense_over_graphs"]:
        r = routed.get(p["tokens"])
        lines.append(f"| {p['tokens']} | {p['dense_over_graphs_time']:.3f} | {_range(p)} | "
                     f"{_f(r and r['graphs_over_routed_time'], '.3f')} | {_range(r)} |")
    return lines + [""]


# A replayed segment whose outputs stray further than this from its eager run's (of its largest value) puts its
# arm's figures in doubt: bfloat16 rounding and a reduction's order stay well under it.
GRAPH_CHECK_DOUBT = 0.05


BOOT_LISTED = 8  # a graphed arm's counts whose boot seconds the summary lists one by one; more are summed


def memory_words(reserved: int | None, free: int | None) -> str:
    """What an arm's prefill graphs took of the device's memory and what its start left free, for its graph line."""
    took = f"; the captures reserved {reserved / 2**30:.2f} GiB" if reserved else ""
    if free is None:
        return took
    return f"{took}, {free / 2**30:.1f} GiB of the device free after them" if took else \
        f"; {free / 2**30:.1f} GiB of the device free after the captures"


def routed_prefill_graph_lines(arms: dict, others: str = "dense and the reference arm as above") -> list[str]:
    """Which arms replayed their routed prefill layers from graphs (`vskipper.sglang.prefill_graphs`, their
    attestations): the counts captured, the passes each replayed at, those it ran eagerly and why, the segments
    captured and replayed, and how far a capture's first replay strayed from the eager run before it. Every figure
    above compares those arms' replayed passes with dense's eager ones (`others`: how the rest prefilled)."""
    graphed = [(name, arm["served"]["prefill_graphs"]) for name, arm in arms.items()
               if (arm.get("served") or {}).get("prefill_graphs")]
    if not graphed:
        return []
    lines = ["Routed prefill layers replayed from CUDA graphs (`VSKIPPER_PREFILL_GRAPHS`: with the packed read each "
             f"routed layer whole, with the backend read its work before and after the read, the read eager; "
             f"{others}):", ""]
    for name, doc in graphed:
        passes = doc.get("passes") or {}
        by = ", ".join(f"{n} at {tokens}" for tokens, n in sorted((passes.get("by_tokens") or {}).items(),
                                                                  key=lambda kv: int(kv[0])) if n)
        eager = ", ".join(f"{n} {why}" for why, n in (passes.get("eager") or {}).items() if n)
        segments, check = doc.get("segments") or {}, doc.get("capture_check") or {}
        checked = "".join(
            f"; {what}: worst difference {check[field]:.3g} of the largest value over {check.get(count, 0)} "
            f"segments ({check.get(where)})" for what, count, field, where in (
                ("each capture's replay against its eager run", "segments", "worst_difference", "worst_segment"),
                ("each segment's first later replay against its eager run after it", "rechecked", "worst_recheck",
                 "worst_recheck_segment")) if check.get(field) is not None)
        kv = doc.get("kv_write_check") or {}
        if kv.get("compared"):
            checked += (f"; the K/V each routed layer's replay left in the pool against what it computed: worst "
                        f"difference {kv['worst_difference']:.3g} of the largest value over {kv['compared']} layers "
                        f"({kv.get('worst_at')})")
        elif kv.get("not_compared") and doc.get("read") != "packed":
            checked += f"; its K/V writes not compared ({kv['not_compared']})"
        memory = (doc.get("memory") or {}).get("reserved_bytes")
        free = (doc.get("memory") or {}).get("free_after_boot_bytes")
        failed = "; ".join(f"at {tokens}: {why}" for tokens, why in (doc.get("failed") or {}).items() if why)
        boot = [(tokens, s) for tokens, s in (doc.get("captured_at_boot_s") or {}).items() if s is not None]
        reach = doc.get("reach") or {}
        left_out = reach.get("left_out") or []
        captured = [n for n in doc.get("tokens") or [] if n not in left_out]
        if len(boot) > BOOT_LISTED:  # a ladder ("auto"): the whole and the longest
            longest = max(boot, key=lambda found: found[1])
            notes = [f"before it served: {sum(s for _, s in boot):.1f} s over {len(boot)} counts, the longest "
                     f"{longest[1]:.1f} s at {longest[0]}"]
        else:
            notes = [f"before it served: {', '.join(f'{s:.1f} s at {tokens}' for tokens, s in boot)}"] if boot else []
        if left_out:
            shown = ", ".join(map(str, left_out)) if len(left_out) <= BOOT_LISTED else \
                f"{len(left_out)} counts from {left_out[0]}"
            notes.append(f"{shown} left out, above the least count that holds its prefill chunk of "
                         f"{reach.get('prefill_chunk')} tokens")
        booted = f" ({'; '.join(notes)})" if notes else ""
        read = f" with the {doc['read']} read" if doc.get("read") else ""
        lines.append(f"- {name}: captured at {', '.join(map(str, captured))} tokens{read}{booted}; "
                     f"passes "
                     f"replayed {by or 'none'}; eager {eager or 'none'}; segments captured "
                     f"{segments.get('captured', 0)}, replayed {segments.get('replayed', 0)}{checked}"
                     f"{memory_words(memory, free)}"
                     f"{f'; captures failed {failed}' if failed else ''}")
        if check.get("empty"):
            lines.append(f"  Segments whose capture recorded no kernel (a trained gate's state is a view of its "
                         f"inputs and launches none; any other is suspect): {', '.join(check['empty'])}.")
        worst = max(check.get("worst_difference") or 0.0, check.get("worst_recheck") or 0.0,
                    kv.get("worst_difference") or 0.0)
        if worst > GRAPH_CHECK_DOUBT or check.get("not_finite"):
            by = (f"NaN or infinite values where the eager run's were not ({', '.join(check['not_finite'])})"
                  if check.get("not_finite") else f"{worst:.3g} of the largest value")
            lines.append(f"  **{name}'s replays strayed from its eager runs by {by}: its routed prefill figures "
                         f"above are in doubt.**")
        unchecked = (doc.get("boot_rows") or {}).get("unchecked")
        if unchecked and name != CONTROL:  # the s = 0 control runs every row by design
            lines.append(f"  {name}: {unchecked}.")
    return lines + [""]


def ttft_parts_lines(arms: dict) -> list[str]:
    """Where each arm's prefill TTFT went (`prefill_cells`' parts by SGLang's stamps, medians in ms), at every
    length: the forward is the pass (its launches and the device) up to the scheduler's reading of its result;
    the rest is the same server code in every arm."""
    rows = [(name, cell) for name, arm in arms.items() for cell in arm.get("prefill") or []
            if cell.get("ttft_parts_s")]
    if not rows:
        return []
    lines = ["Where a prefill's time to its first token went (SGLang's stamps of each request, medians; "
             "scheduled: the tokenizer's receipt to the scheduler's first forward of the request; forward: from "
             "there to the scheduler's processing of the prefill's result; output: to the tokenizer's first "
             "token; HTTP: the rest of the client's TTFT; scheduled and output each span two processes' clocks, "
             "which SGLang calibrates once per process, and may each be off by that calibration, their sum not):",
             "", "| prefill tokens | arm | TTFT ms | scheduled ms | forward ms | output ms | HTTP ms |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for name, cell in sorted(rows, key=lambda r: (r[1]["tokens"], list(arms).index(r[0]))):
        parts = cell["ttft_parts_s"]
        lines.append(f"| {cell['tokens']} | {name} | {cell['ttft_s'] * 1e3:.1f} | " + " | ".join(
            f"{parts[k] * 1e3:.1f}" for k in ("scheduled", "forward", "output", "http")) + " |")
    return lines + [""]


def sweep_decode_lines(arms: dict) -> list[str]:
    """Where the sweep's arms served no decode cells (`run.sh --prefill-only`, `Plan.sweep_decode`), what that
    leaves out; where some did and some did not (arms of an earlier call kept), that their prefill cells came after
    different work."""
    served = decode_cells(arms)
    if all(served.values()):
        return []
    if not any(served.values()):
        return ["A prefill-only sweep (`run.sh --prefill-only`): its servers served the prefill lengths and rounds "
                "alone, no decode cell, so it measures no tau, no V_x and no decode ratio; each server captured "
                f"decode graphs of {' and '.join(map(str, PREFILL_ONLY_GRAPHS))} rows only.", ""]
    return ["Not every arm of this sweep served the decode cells before its prefill ones (" + ", ".join(
        f"{name}: {'decode and prefill' if cells else 'prefill only'}" for name, cells in served.items())
        + "): their prefill passes followed different work, and the decode figures hold only the arms that "
        "decoded.", ""]


def sweep_sample_lines(arms: dict, shown: int = 8) -> list[str]:
    """Where each sampling arm's prefill passes spent the host's time in the sweep (`Plan.sweep_samples`), by its
    forward's stack samples: per kind of frame, the most sampled frames over all its prefill lengths, each frame's
    share of the samples at each length and in all, and the ms a pass that share is of the length's host time a
    pass (`pass_spans`): a frame whose ms grow where the arm's passes are slow is where their time went."""
    from vskipper.sglang.stack_samples import top

    lines = []
    for name, arm in arms.items():
        cells = [c for c in arm.get("prefill") or [] if (c.get("samples") or {}).get("total")]
        if not cells:
            continue
        if not lines:
            lines = ["Where each arm's prefill passes spent the host's time, by samples of the forward's Python "
                     "stack (`run.sh --samples`: every sweep server samples at each tick of a clock while a pass "
                     "runs, where the forward next runs Python, as after each launch; a stretch of pure Python is "
                     "charged to the call that ends it). Each frame's share of a length's samples, "
                     "and in brackets that share of the length's host ms a pass:", ""]
        total, counts = sampled(cells)
        for kind, what in SAMPLED_KINDS.items():
            keys = [k for k, _ in top(counts[kind], shown)]
            if not keys:
                continue
            lines += [f"{name}, {what} ({total} samples; {sampling(cells)}):", "",
                      "| frame | " + " | ".join(f"{c['tokens']} tokens" for c in cells) + " | all |",
                      "|---|" + "---:|" * (len(cells) + 1)]
            for key in keys:
                shares = [_share_ms((c["samples"].get(kind) or {}).get(key, 0), c["samples"]["total"],
                                    (c.get("pass_spans") or {}).get("host_ms")) for c in cells]
                lines.append(f"| `{key}` | " + " | ".join(shares) + f" | {_share(counts[kind].get(key, 0), total)} |")
            lines.append("")
    alike = {bool(arm.get("samples")) for arm in arms.values() if "samples" in arm}
    if lines and len(alike) > 1:  # arms of an earlier call, served with another setting, kept
        lines += ["Not every arm of this sweep sampled its stack (" + ", ".join(
            f"{name}: {'sampled' if arm.get('samples') else 'not sampled'}" for name, arm in arms.items()
            if "samples" in arm) + "): a sampled arm's host times stand a few percent above what it would take "
            "unsampled, so its figures do not compare alike with the others'.", ""]
    return lines


def pass_span_lines(arms: dict) -> list[str]:
    """Each arm's passes as its server's clock timed them (`pass_spans`, ms a pass): at each prefill length and
    decode cell, the host's launches of a pass beside the device's span of it, and the figure they explain (TTFT,
    the decode step). A device span about as long as the host's marks a pass the host's launches held back; a
    step well beyond the device's span, time between passes on the host."""
    prefill = [(name, c) for name, arm in arms.items() for c in arm.get("prefill") or [] if c.get("pass_spans")]
    decode = [(name, c) for name, arm in arms.items() for c in arm.get("decode") or [] if c.get("pass_spans")]
    if not prefill and not decode:
        return []
    order = list(arms)
    lines = ["Each pass as its server timed it (ms a pass, medians; host: the forward's launches, which the device "
             "runs behind; device: from the pass's first kernel to its last, any wait for the launches "
             "included; none on a CPU). A device span about as long as the host's (device / host near 1) is a "
             "host-bound pass. Beside the host's time, the CPU time of the thread that ran the forward and how "
             "often it gave up the processor to wait (`forward_thread`, the kernel's account): a host time its "
             "CPU time fills was spent computing, the rest waiting (for the interpreter's lock another thread "
             "held, for the device, for a lock of the driver's); and the ms the interpreter's garbage collector "
             "ran in the pass (gc), which holds every thread for most of its run:", ""]
    if prefill:
        lines += ["| prefill tokens | arm | TTFT ms | forward ms (stamps) | host ms a pass | thread CPU ms | waits | "
                  "gc ms | device ms a pass | device / host | passes | busy CPUs | stolen CPUs | runnable ms | "
                  "preempted | its CPU beside it (busiest sibling), prompts weighed | canary us |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
        for name, cell in sorted(prefill, key=lambda r: (r[1]["tokens"], order.index(r[0]))):
            spans, forward = cell["pass_spans"], (cell.get("ttft_parts_s") or {}).get("forward")
            m = cell.get("machine") or {}
            core = "n/a" if m.get("core_others") is None else f"{m['core_others']:.0%} " + (
                "(no sibling)" if m["sibling_busy"] is None else f"({m['sibling_busy']:.0%})") + \
                f", {m['weighed']} of {m['windows']}"
            busy = "n/a" if m.get("busy_cpus") is None else f"{m['busy_cpus']:.2f} of {m['cpus']}"
            lines.append(f"| {cell['tokens']} | {name} | {cell['ttft_s'] * 1e3:.1f} | "
                         f"{_f(forward and forward * 1e3, '.1f')} | {spans['host_ms']:.1f} | "
                         f"{_f(spans.get('cpu_ms'), '.1f')} | {_f(spans.get('waits'), '.0f')} | "
                         f"{_f(spans.get('gc_ms'), '.1f')} | {_f(spans['device_ms'], '.1f')} | "
                         f"{_f(_over(spans['device_ms'], spans['host_ms']), '.2f')} "
                         f"| {spans['passes']} | {busy} | {_f(m.get('stolen_cpus'), '.2f')} "
                         f"| {_f(m.get('runnable_ms'), '.1f')} | {_f(m.get('involuntary'), '.1f')} | {core} "
                         f"| {_f(m.get('canary_us'), '.0f')} |")
        lines.append("")
        beside = prefill_processes(prefill)
        if beside:
            lines += ["What the whole machine did while each length's prompts were served (`benchmarks/gpu/"
                      "machine.py`, read by the client from /proc around each prompt, pooled over a length's): the "
                      "CPUs busy and stolen by the hypervisor on average; the forward's thread, read from outside, "
                      "its ms runnable but waiting for a CPU another task held and the kernel's preemptions of it, "
                      "a prompt (means over a length's prompts); how busy its CPU was beside it and that CPU's "
                      "busiest hyperthread sibling, over the prompts in which it stayed on one CPU (weighed; a "
                      "virtual machine's siblings are its virtual topology). A pass whose thread waits runnable or "
                      "runs beside a busy sibling is slowed by the machine, not its code; the canary (us, the "
                      "median over the prompts' readings before and after each) is a fixed loop of pure Python the "
                      "reader times, longer where the machine runs one thread slower, as a neighbour on the "
                      "physical core that a virtual machine does not publish makes it. The processes (alive at "
                      "each prompt's end) that used "
                      "the most CPU over each arm's prompts (CPU s, the reader's own marked `client`; a process "
                      "that should not run, such as a server that did not end, shows here):", "",
                      *beside, ""]
    for key, what in (("device_error", "The device's spans of {}'s passes"),
                      ("thread_error", "The reads of {}'s forward thread")):
        errors: dict[str, str] = {}  # where a server's reads failed (its later readings all say so)
        for name, cell in prefill + decode:
            for spans in [cell["pass_spans"], *cell["pass_spans"].get("reps", [])]:
                if spans.get(key):
                    errors.setdefault(name, spans[key])
        if errors:
            lines += [f"{what.format(name)} stopped: {error}." for name, error in errors.items()] + [""]
    late: dict[str, int] = {}  # windows a reading the server served late bounds (a pass may sit in the next one)
    for name, cell in prefill + decode:  # a prefill length's windows are its prompts', a decode cell's its own
        spans = cell["pass_spans"]
        late[name] = late.get(name, 0) + sum(1 for window in spans.get("reps", [spans]) if window.get("late"))
    if any(late.values()):
        lines += ["Readings the server served late (its document older than the read, after "
                  f"{READ_ATTEMPTS} reads; a pass of such a window may sit in the next): "
                  + ", ".join(f"{name} {n} windows" for name, n in late.items() if n) + ".", ""]
    if decode:
        lines += ["A decode cell's passes are every decode pass of its timed bursts (the batch's first and last "
                  "steps too), its step the window where the whole batch decodes:", "",
                  "| batch | context | arm | step ms | host ms a pass | thread CPU ms | waits | device ms a pass | "
                  "passes |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
        for name, cell in sorted(decode, key=lambda r: (r[1]["batch"], r[1]["context"], order.index(r[0]))):
            spans = cell["pass_spans"]
            lines.append(f"| {cell['batch']} | {cell['context']} | {name} | {cell['step_s'] * 1e3:.2f} | "
                         f"{spans['host_ms']:.2f} | {_f(spans.get('cpu_ms'), '.2f')} | {_f(spans.get('waits'), '.1f')} "
                         f"| {_f(spans['device_ms'], '.2f')} | {spans['passes']} |")
        lines.append("")
    return lines


def prefill_processes(prefill: list[tuple[str, dict]]) -> list[str]:
    """One line per arm of `pass_span_lines`' prefill cells: the processes that used the most CPU over all its
    lengths' prompts (each length's `machine`, `process_list`)."""
    arms: dict[str, list[dict]] = {}
    for name, cell in prefill:
        if cell.get("machine"):
            arms.setdefault(name, []).append(cell["machine"])
    return [f"- {name}: {process_list(windows)}" for name, windows in arms.items()]


def tiles_lines(tiles: dict | None, sweep: dict | None) -> list[str]:
    """The tiles stage's table (each shape's kernel against torch on the same packed rows) and the tiles each of
    the sweep's arms attests it served with, and what of the tuner's measurements that table lacks (the sweep's
    servers alone where the stage did not run in this folder: they took an earlier run's table or the shipped
    one)."""
    from vskipper.mixed.tiles import CHOSEN_BOTH

    if not tiles:
        return served_tiles_lines(sweep, "## Tiles the sweep served with")
    run = tiles["runs"].get("tune-tiles") or {}
    lines = ["## Tiles", "", f"`vskipper tune-tiles` on {tiles['device']}: exit {run.get('exit', 'not run')}"
             f"{', ' + str(run['seconds']) + ' s' if run.get('seconds') is not None else ''}"
             f"{' (an earlier run)' if run.get('earlier_run') else ''}"
             f"{'; not tuned: ' + tiles['skipped'] if tiles.get('skipped') else ''}"
             f"{'; failed (the servers took the shipped table): see tiles/tune-tiles.log' if tiles.get('failed') else ''}"
             f"{'; left by its budget (the servers took the shipped table)' if tiles.get('left') else ''}.",
             ""]
    table = tiles.get("table")
    if table:
        lines += [f"Source: {table['source']}.", "",
                  "| operation | rows | block m x n x k | warps | stages | kernel ms | kernel ms, half live | "
                  "gathered torch ms | kernel / torch | tiles timed | timed as | floor ms | kernel / floor |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
        for op, entries in table["tiles"].items():
            for e in entries:
                lo, hi = e["rows"]
                split = f", K split {e['split_k']} ways" if e.get("split_k", 1) > 1 else ""
                lines.append(f"| {op} | {lo}-{hi if hi is not None else ''} | {e['block_m']} x {e['block_n']} x "
                             f"{e['block_k']}{split} | {e['num_warps']} | {e['num_stages']} | "
                             f"{_f(e.get('kernel_ms'), '.4f')} | "
                             f"{_f(e.get('kernel_half_ms'), '.4f')} | "
                             f"{_f(e.get('torch_ms'), '.4f')} | {_f(e.get('ratio_vs_torch'), '.3f')} | "
                             f"{e.get('tried', '?')}{f' ({refused} refused)' if (refused := e.get('refused')) else ''} | "
                             f"{e.get('timed', 'eager')}"
                             f"{', chosen over both counts' if e.get('chosen_by') == CHOSEN_BOTH else ''} | "
                             f"{_f(e.get('floor_ms'), '.4f')} | {_f(_over(e.get('kernel_ms'), e.get('floor_ms')), '.2f')} |")
        lines += ["", f"Served in the gathered cuBLAS form (`TileTable.gathers`: torch faster than the tile at the full "
                      f"and the half count, at or below the ridge): {gathered_summary(table)}.", ""]
        pair = [e for e in table.get("ffn_pair") or [] if e.get("grouped_ms") is not None]
        if pair:  # what the served layer's launch of its two FFNs rests on
            lines += ["A routed layer's two cohort FFNs (half the rows RUN) grouped in one grid a stage against "
                      "launched apart (`kernels.cohort_ffn_pair`; the served layer groups them where grouped is "
                      "not slower):", "", "| rows | grouped ms | apart ms | grouped / apart |", "|---|---:|---:|---:|"]
            lines += [f"| {e['rows'][0]}-{e['rows'][1] if e['rows'][1] is not None else ''} | {e['grouped_ms']:.4f} | "
                      f"{e['apart_ms']:.4f} | {e['grouped_ms'] / e['apart_ms']:.3f} |" for e in pair]
            lines.append("")
        wrong = [e for e in table.get("ffn_pair") or [] if e.get("grouped_error")]
        if wrong:  # the ranges where the grouped launch is not served
            lines += ["The grouped launch of the two FFNs failed or strayed, so the two launch apart, at: "
                      + "; ".join(f"{e['rows'][0]}-{e['rows'][1] if e['rows'][1] is not None else ''} rows "
                                  f"({e['grouped_error']})" for e in wrong) + ".", ""]
        read = table.get("prefill_read")
        if read:
            lines += [f"The packed prefill read ({read['tokens']} tokens, {read['run_share']:.0%} of them RUN): "
                      f"{read['block_rows']} query rows x {read['block_n']} keys, {read['num_warps']} warps, "
                      f"{read['num_stages']} stages (best of {read.get('tried', '?')} launches"
                      f"{f', {refused} refused: their output strayed from SDPA' if (refused := read.get('refused')) else ''}), "
                      f"{read['kernel_ms']:.4f} ms (the default launch "
                      f"{_f(read.get('default_ms'), '.4f')} ms), against {read['causal_all_rows_ms']:.4f} ms for every row's "
                      f"causal read (SDPA): {read['kernel_ms'] / read['causal_all_rows_ms']:.3f}x"
                      + (f", and {read['backend_all_rows_ms']:.4f} ms for every row's read by SGLang's "
                         f"{read['backend']} backend, which a routed prefill reads through where the packed read is "
                         f"no faster: {read['kernel_ms'] / read['backend_all_rows_ms']:.3f}x"
                         if read.get("backend_all_rows_ms") else ", SGLang's backend not timed")
                      + f"; beside the RUN rows' share of the query-key pairs, {read['pairs_share']:.3f} (its "
                      "limit).", ""]
    return lines + served_tiles_lines(sweep)


def served_tiles_lines(sweep: dict | None, title: str | None = None) -> list[str]:
    """The tiles each of the sweep's arms attests it served with, where its GEMMs split K (`split_k`), what of the
    tuner's measurements its table lacks (`TileTable.lacks`: a table an older tuner wrote serves without them), and
    the read its routed prefill layers took (`PREFILL_READS`) with what the table weighed to choose it."""
    arms = ((sweep or {}).get("arms") or {}).items()
    served = {name: arm["served"] for name, arm in arms if arm.get("served")}  # a reference that failed: none
    if not served:
        return []
    lines = [title, ""] if title else []
    lines += ["Tiles each sweep arm served with, and its routed prefill's read (its attestation):", ""]
    for name, doc in served.items():
        execution = execution_of(doc)
        lack, read, why = (execution.get(k) for k in ("tiles_lack", "prefill_read", "prefill_read_why"))
        split = "; ".join(f"{op} at {', '.join(f'{lo}-{hi} slots {ways} ways' for lo, hi, ways in spans)}"
                          for op, spans in (execution.get("split_k") or {}).items())
        lines.append(f"- {name}: {doc.get('tiles') or 'none (no Triton GEMM in this arm)'}"
                     f"{'; K split: ' + split if split else ''}"
                     f"{'; the table lacks ' + '; '.join(lack) if lack else ''}"
                     f"{f'; prefill read {read}' + (f' ({why})' if why else '') if read else ''}")
    return lines + [""]


def gathered_summary(table: dict) -> str:
    """The slot counts each operation of a tuned table serves in the gathered form, in words."""
    from vskipper.mixed.tiles import TileTableError, parse_tile_table

    try:
        ranges = parse_tile_table(table, 1 << 30).gathered_ranges()  # its shared memory was checked when tuned
    except TileTableError as exc:
        return f"unknown ({exc})"
    return "; ".join(f"{op} at {', '.join(f'{lo}-{hi}' for lo, hi in spans)} slots"
                     for op, spans in ranges.items()) or "none"


def served_layer_lines(path: Path | None) -> list[str]:
    """The served layer alone (mixed_depth_bench's section 4), where the bench's JSON in the run's folder holds it."""
    bench = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    served, s = bench.get("served"), bench.get("s")
    if not served or "decode" not in served:
        return []
    execution = served["execution"]
    lines = [f"### The served layer alone (`mixed_depth_bench.py` section 4: one routed layer, the control s=0 "
             f"against s={s}; decode with the {execution['decode']} execution, "
             f"{'replayed from CUDA graphs' if served['decode_graphs'] else 'eager'})", "",
             f"| rows | context | s=0 ms | s={s} ms | s=0 / s={s} | Project-Only share | bandwidth limit |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {c['rows']} | {c['context']} | {c['s=0_ms']:.3f} | {c[f's={s}_ms']:.3f} | {c['speedup']:.3f} | "
              f"{c['project_only_share']:.2f} | {c['bandwidth_limit']:.3f} |" for c in served["decode"]["cells"]]
    prefill = served.get("prefill") or []
    if prefill:
        read = (" (Project-Only rows enter the attention read with a zero query: SGLang's backend read)"
                if prefill[0].get("project_only_rows_read") else "")
        lines += ["", f"Prefill, one prompt, eager{read}; dense where its attention backend here is the server's:", "",
                  f"| prefill tokens | dense ms | s=0 ms | s={s} ms | s=0 / s={s} | Project-Only share | FLOP limit |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {p['tokens']} | {_f(p.get('dense_ms'), '.2f')} | {p['s=0_ms']:.2f} | {p[f's={s}_ms']:.2f} | "
                  f"{p['speedup']:.3f} | {p['project_only_share']:.3f} | {p['flop_limit']:.3f} |" for p in prefill]
    return lines + [""]


EXIT_IDLE = 5  # a stage left work and started none of it: run.sh does not run it again in the same call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=[*STAGES, "summary", "stages", "leases"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="CPU platform, tiny model, tiny sizes")
    parser.add_argument("--budget-s", type=float, default=500.0, help="the stage's time budget")
    parser.add_argument("--limit-s", type=float, help="the stage's time limit, past its budget (run.sh's timeout): "
                                                      "tiles lets the tuner run on into it")
    parser.add_argument("--arms", type=_arms, default=tuple(HEADLINE_ARMS),
                        help="ladder, headline: the headline's arms to serve (and dense's cells for them), comma "
                             f"separated, of {', '.join(HEADLINE_ARMS)} (default: all)")
    args = parser.parse_args(argv)
    if args.stage == "stages":  # `run.sh all`'s order
        print(" ".join(STAGES))
        return 0
    if args.stage == "leases":  # `run.sh lease-N`: one line a stage, "LEASE STAGE BUDGET_CAP ARMS" (0: no cap)
        for lease in LEASES:
            caps = dict(lease.caps)
            for name in lease.stages:
                print(lease.name, name, caps.get(name, 0), ",".join(lease.headline_arms) or "-")
        return 0
    # A stage stopped at its time limit (SIGTERM) unwinds: its servers are stopped, never left holding the device.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(TERM_EXIT))
    plan = run_sweep_flags(run_stand_in_ops(Plan.dry() if args.dry_run else Plan.gpu()))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage == "summary":
        summary(plan, args.out)
        print(f"wrote {args.out / 'results.json'} and {args.out / 'summary.md'}")
        return 0
    path = args.out / f"{args.stage}.json"
    done = json.loads(path.read_text()) if path.is_file() else None
    if done is not None and covers(args.stage, done, args.arms, args.out, plan):
        print(f"[{args.stage}] complete in an earlier run: {path}")
        return 0
    stages = {"tiles": stage_tiles, "ladder": stage_ladder, "sweep": stage_sweep, "headline": stage_headline,
              "kernels": stage_kernels, "clock": stage_clock}
    kwargs = {}
    if args.stage in ("tiles", "sweep"):
        kwargs["limit_s"] = args.limit_s
    elif args.stage == "headline":  # the arms an earlier run served stay in the result
        kwargs["arms"] = headline_order(args.arms, (done or {}).get("arms_requested") or ())
    elif args.stage == "ladder":  # and the loads dense served for them
        wanted = set(arm_loads(args.arms)) | set((done or {}).get("loads") or ())
        kwargs["loads"] = tuple(load for load in headline.LOADS if load in wanted)
    result = stages[args.stage](plan, args.out, args.budget_s, **kwargs)
    result["plan"] = asdict(plan)
    write_whole(path, json.dumps(result, indent=1, default=str) + "\n")  # a KILL after a stop tears no result
    summary(plan, args.out)
    if args.stage in ("sweep", "headline"):  # what the next call turns on, in the call's own output
        others = {"sweep": "dense and the reference arm as in the summary",
                  "headline": "the headline's routed arms; dense prefilled eagerly"}[args.stage]
        print("\n".join(routed_prefill_graph_lines(result.get("arms") or {}, others)), end="")
    print(f"[{args.stage}] wrote {path}")
    if result.get("failed"):  # not run again by this call, whatever it left: a failure that repeats would spend it
        return 1
    if result.get("left"):
        # run.sh runs the stage again while its call has time; not after a run that could start nothing (5)
        return EXIT_IDLE if result.get("idle") else 4
    return 0


def json_or_none(path: Path) -> dict | None:
    """The JSON object in `path`, or None where the file holds none (a write cut short)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def write_whole(path: Path, text: str) -> None:
    """`text` into `path`, whole or not at all (a part file moved in place)."""
    part = path.with_name(f"{path.name}.part")
    part.write_text(text)
    os.replace(part, path)


def headline_order(asked: tuple[str, ...], earlier: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The headline's arms in the order they are served: those asked for in the order asked (a lease serves its
    most important arm first, so that a budget spent leaves the others), then those an earlier run of the stage in
    the same folder asked for, in `HEADLINE_ARMS`' order (their cells stay in the result)."""
    return tuple(dict.fromkeys([*asked, *(k for k in HEADLINE_ARMS if k in earlier)]))


def _arms(text: str) -> tuple[str, ...]:
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in keys if k not in HEADLINE_ARMS]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(f"--arms: {', '.join(unknown) or 'none given'}: not a headline arm (of "
                                         f"{', '.join(HEADLINE_ARMS)})")
    return keys


def covers(stage: str, done: dict, arms: tuple[str, ...], out: Path, plan: Plan | None = None) -> bool:
    """Whether a stage's earlier result in `out` holds all this run asks of it: nothing left or failed, for the
    ladder and the headline the loads and arms of `arms` (a lease serves some of them), and for the sweep the kind
    `plan` asks for (with decode cells or its prefill alone)."""
    if done.get("left") or done.get("failed"):
        return False
    if stage == "ladder":
        return set(arm_loads(arms)) <= set(done.get("loads") or headline.LOADS)
    if stage == "sweep" and plan is not None and sweep_mode_mismatch(plan, out) is not None:
        return False  # stage_sweep says why (a folder holds one kind of sweep)
    if stage == "headline":
        if not set(arms) <= set(done.get("arms_requested") or HEADLINE_ARMS):
            return False
        if plan is not None:
            # the arms this run serves, at the thresholds it serves them at, as stage_headline weighs them: one
            # whose folder served at others would be set aside and served again; one served another way (graphs,
            # read) stops the stage, which says why
            th_rule, th_tau, _, _ = headline_thresholds(plan, out, write_model(plan, out))
            serving = headline_serving(arms, th_rule, th_tau)
            if any(served_elsewhere(out / "headline" / key, th) is not None for key, th in serving.items()):
                return False
            if headline_mode_mismatch(plan, out, arms, serving) is not None:
                return False
        # an arm not served for want of a sweep (no tau) serves in a later call that has one (--earlier)
        waiting = [k for k in arms if ((done.get("arms") or {}).get(k) or {}).get("wants_sweep")]
        return not (waiting and sweep_for_tau(out)[0] is not None)
    return True


if __name__ == "__main__":
    sys.exit(main())
