"""`make bench-cpu`: what routing saves when the real SGLang serves on CPU, beside what it could save.

1. Writes a mid-sized skipper checkpoint (16 layers, d = 1024, Llama-3 width ratios: GQA 16/4 heads of 64, MLP
   3584, bf16; layers 8-15 routed) with `vskipper.checkpoint`'s writers and a tiny tokenizer.
2. Serves it three times side by side with `vskipper serve` on CPU, `--enable-metrics` as deployed and
   `--sleep-on-idle` (so the idle arms leave the cores to the driven one):
     dense   the upstream-equivalent arm
     s=0     always-route RandomSkip r = 0: every row RUN (the routed path's own cost)
     s=0.5   always-route RandomSkip r = 1, d = 0.5 (half the routed layers' rows Project-Only)
   and drives each with the same client load, SGLang's own `sglang.bench_serving` (random-ids sent as token ids,
   ignore-eos, the prefix cache flushed after the warm-up; SGLang's token counters confirm each run's lengths):
     prefill 1024-token prompts, 1 output token, 4 concurrent     -> input tok/s
     decode  32-token prompts, 256 output tokens, 16 concurrent   -> output tok/s
   repeated in alternating arm order (ABC, CBA, ...) phase by phase, so drift on a shared machine lands on every
   arm alike and the runs a ratio pairs are back to back; a repetition whose arms computed different tokens (the
   servers' part clocks count them) is refused (`same_work`). Then the prefill load's prompts one at a time, the same
   ids to every arm in alternating order (`prefill_latency`): the prefill's latency without concurrency.
3. The FLOP limit of s = 0.5 over s = 0 from the model's shapes: a Project-Only row pays its K/V and the
   projector and skips Q, the attention read, o_proj and the MLP (`flop_limit`).
4. The limits from time (`served_layer_profile`, in a child process before the servers start): one served
   routed layer of the checkpoint's shape (SGLang's own decoder layer, KV pool and torch-native attention), at
   the decode load's batch and mean context and at one prefill prompt. What a Project-Only row skips (Q, the
   read, o_proj, the MLP) is timed over every row and over the RUN rows only: the saving is the difference, less
   the projector over the Project-Only rows, at each routed layer; the step is the model's layers, dense
   (embedding, logits and the scheduler left out, so the limit is an upper bound). On CPU at batch 16 a decode
   GEMM's time is its weight read, nearly flat in the rows, so the decode saving is mostly the attention read,
   not s x the skipped work; at prefill the parts' time shares differ from their FLOP shares (work a FLOP count
   barely sees, such as norms, RoPE and the K/V every row pays, takes time), so the time limit may lie on either
   side of the FLOP limit (below it at the full size: 1.260x against 1.298x). The routed-layer body itself is timed too, nothing skipped and at s: what the
   layer realises of its limit.
5. The limits from time measured in the servers themselves (`served_limit`): every server runs with its part
   clock on (`VSKIPPER_PART_CLOCK=1`, `vskipper.sglang.part_times`: each part of each layer timed in the served
   pass, about 0.3% of a pass), read before and after each run. Over each phase's own runs (`runs_clock`: the
   decode load's passes alone, not the prefill load's warm-up decode nor the servers' warm-up), what the skipped
   parts (Q, the read, o_proj, the MLP) of the routed layers took in the s=0 server, at every row, less what they
   took in the s=0.5 server, at its RUN rows, less the adapter there, against the s=0 server's model time (the
   scheduler's time outside the forward left out: an upper bound). Beside it, each part of the routed layers in both servers: what the routed body
   pays beyond the skipped work (packing the cohorts, the two projections, the second RoPE) shows as the parts
   that grow. This is the decode goal's limit: a layer alone in a quiet process times its parts otherwise than
   the served step does.
6. The host's drift between the two runs a ratio pairs (`drift_corrected`): each server's part clock is read
   before and after each run, so every run has its own time per layer kind (`run_clock`). The layers before the
   first routed one are dense in every arm and do the same work on the same load; their time over one whole run
   against the other is the host's speed between the runs. Each pair's ratio is printed again times that factor,
   beside the raw one, and so is the model time's ratio run by run. The correction takes the host's slowdown to
   scale the whole step alike (the scheduler's time outside the forward included): a control, not the goal's
   figure, which stays the raw ratio.

The last line: `prefill <x>x of limit <y>x; decode <x>x of limit <y>x; s=0 overhead <z>%` (s = 0.5 over s = 0,
the prefill limit from FLOPs, the decode limit from the servers' part clocks; every limit is printed above for
both phases; the overhead is the larger of the two phases' dense / s=0 - 1).

    python benchmarks/bench_cpu.py                 # the full size (tens of minutes on two cores)
    python benchmarks/bench_cpu.py --size demo     # 8 layers, s=0 and s=0.5 only (`make demo`'s routing section)
    python benchmarks/bench_cpu.py --quick         # a tiny model, the routed arms: checks the pipeline, figures mean nothing

CPU timings on a machine other processes share are noisy: the repetitions' spread is printed beside each ratio.
Each server (and each layer profile) runs on every core but one (`--server-threads`, OMP_NUM_THREADS), leaving one
to the client and SGLang's tokenizer and detokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from vskipper import modelspec  # noqa: E402
from vskipper.checkpoint import TinySize, make_tiny_model, tiny_config, write_tiny_tokenizer  # noqa: E402

ARCH = "flexidepth-llama"
SKIP = 0.5  # r * d of the routed arm: the Project-Only share of routed-layer rows
ARMS = {
    "dense": None,
    "s=0": {"skipper": "random_skip", "params": {"r": 0.0, "d": SKIP}, "prefill": "routed", "decode": "routed"},
    "s=0.5": {"skipper": "random_skip", "params": {"r": 1.0, "d": SKIP}, "prefill": "routed", "decode": "routed"},
}


WARMUP_OUTPUT_CAP = 32  # bench_serving's warm-up request generates at most this many tokens


@dataclass(frozen=True)
class Load:
    """One bench_serving run: prompt and output lengths, prompts, concurrency."""

    input_len: int
    output_len: int
    prompts: int
    concurrency: int

    def served_tokens(self) -> dict[str, int]:
        """The prompt and generated tokens the server takes for one run: the prompts as token ids (the lengths
        exact) and bench_serving's one warm-up request (the first prompt, its output capped)."""
        return {"prompt": (self.prompts + 1) * self.input_len,
                "generation": self.prompts * self.output_len + min(self.output_len, WARMUP_OUTPUT_CAP)}


@dataclass(frozen=True)
class Size:
    model: TinySize
    prefill: Load
    decode: Load
    repetitions: int
    max_total_tokens: int
    arms: tuple[str, ...] = tuple(ARMS)
    profile_rounds: int = 15
    latency_prompts: int = 12  # prefill prompts sent one at a time to each arm, alternating (`prefill_latency`)


WIDE = dict(hidden=1024, intermediate=3584, heads=16, kv_heads=4, head_dim=64, vocab=512)  # Llama-3 width ratios
SIZES = {
    "full": Size(TinySize(layers=16, **WIDE), prefill=Load(1024, 1, 8, 4), decode=Load(32, 256, 16, 16),
                 repetitions=7, max_total_tokens=16384),
    # `make demo`'s routing section: half the layers, the routed arms alone (the demo's A/B has the dense one),
    # about three minutes on two cores.
    "demo": Size(TinySize(layers=8, **WIDE), prefill=Load(1024, 1, 4, 2), decode=Load(32, 192, 16, 16),
                 repetitions=4, max_total_tokens=8192, arms=("s=0", "s=0.5"), profile_rounds=9, latency_prompts=6),
    # A tiny model and load, the routed arms: checks the pipeline (the demo's test runs it), its figures mean
    # nothing.
    "quick": Size(TinySize(layers=4, hidden=64, intermediate=224, heads=4, kv_heads=1, head_dim=16, vocab=512),
                  prefill=Load(32, 1, 4, 2), decode=Load(8, 8, 4, 4), repetitions=1, max_total_tokens=4096,
                  arms=("s=0", "s=0.5"), profile_rounds=3, latency_prompts=2),
}


# -- the limits ------------------------------------------------------------------------------------------------

def flop_limit(config: dict, phase: Load, skip: float, project_only_reads: bool = False) -> float:
    """`vskipper.modelspec.flop_limit` of one request of the load: s = 0's work over the work at `skip`."""
    return modelspec.flop_limit(config, phase.input_len, phase.output_len, skip, project_only_reads)


def default_threads() -> int:
    """The servers' torch threads: every core this process may use but one, which the client, SGLang's
    tokenizer and detokenizer processes share. A server whose threads fill every core stalls at each parallel
    region whenever one of them is preempted: on two cores, the full size's paired prefill ratios spread over
    0.23-0.28 (max - min of 7) with two threads, over 0.06 with one."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def threads_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads)}


def profile_layer(ckpt: Path, phase: str, load: Load, skip: float, rounds: int, threads: int) -> dict:
    """`served_layer_profile` of `phase` at the load's shape, in a child process (SGLang's one-process topology
    sets RANK, WORLD_SIZE and MASTER_* in its environment, which the servers started later must not inherit):
    decode at the load's concurrency and mean context, prefill one of its prompts."""
    shape = ({"rows": load.concurrency, "context": load.input_len + load.output_len // 2} if phase == "decode"
             else {"rows": load.input_len, "context": 0})
    cmd = [sys.executable, str(Path(__file__).resolve()), "--profile-layer", str(ckpt),
           json.dumps({"phase": phase, **shape, "skip": skip, "rounds": rounds})]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **threads_env(threads)})
    if proc.returncode != 0:
        raise RuntimeError(f"the {phase} profile failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def served_layer_profile(ckpt: Path, phase: str, rows: int, context: int, skip: float, rounds: int) -> dict:
    """Where a dense step of the served model goes, and what a Project-Only row can save in it, from one served
    routed layer of the checkpoint's shape (`vskipper.sglang.standalone`: SGLang's own decoder layer, KV pool and
    torch-native attention backend; random weights): decode, `rows` rows at `context` tokens; prefill, one prompt
    of `rows` tokens (the prefill load's prompt; a pass of several prompts costs about as much per token).

    Timed, each the median of `rounds` rounds that take every measurement once in turn:
      layer       the dense layer (upstream's forward) over all rows: the step is the model's layers times that
                  (embedding, logits and the scheduler left out: the limit is an upper bound);
      q, read, o, mlp   what a Project-Only row skips, over all rows and over the RUN rows only (rows - n_proj,
                  n_proj = round(skip x rows)): Q (the Q rows of the fused qkv_proj), the read the routed layer
                  takes (decode: SGLang's decode read over the RUN rows; prefill: the routed layer's own read, the
                  RUN rows' queries over every token's K/V), o_proj, LN2 + MLP. The saving is the difference, not
                  skip x the time: at decode on CPU a GEMM's time is the weight read, nearly flat in the row count,
                  while the read scales with the rows; at prefill each part's time share differs from its FLOP
                  share, which the FLOP limit does not see;
      projector   LN2 + the adapter over the n_proj rows;
      routed      the served routed-layer body over all rows with nothing skipped and with n_proj Project-Only
                  rows, with the execution the server picks on CPU (`cohort_execution`): what the layer realises.
    """
    import torch
    from torch.nn import functional as F

    from vskipper.sglang.standalone import StandaloneLayer, init_sglang

    init_sglang()
    from transformers import AutoConfig

    from vskipper.mixed.routed_layer import routed_layer
    from vskipper.sglang.configs import register_configs
    from vskipper.sglang.models.routed import SGLangLayerOps, cohort_execution, in_batch_slots, plan_pass

    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")
    register_configs()
    torch.set_grad_enabled(False)
    config = AutoConfig.from_pretrained(str(ckpt))
    routed_ids = list(config.routing_layers)
    decode = phase == "decode"
    # decode: `rows` requests of context + 1 tokens; prefill: one request of `rows` tokens
    requests, tokens = (rows, context + 1) if decode else (1, rows)
    world = StandaloneLayer(config, layer_id=routed_ids[0], requests=requests, slots=requests * tokens + 1,
                            context=tokens, dtype=torch.bfloat16)
    layer, attn = world.layer, world.layer.self_attn
    lid = attn.attn.layer_id
    world.pool.get_key_buffer(lid).normal_()
    world.pool.get_value_buffer(lid).normal_()
    n_proj = round(skip * rows)
    n_run = rows - n_proj
    gen = world.gen
    execution = cohort_execution([layer], torch.device("cpu"))
    run_half = torch.ones(rows, dtype=torch.bool)
    run_half[torch.randperm(rows, generator=gen)[:n_proj]] = False
    run_rows = torch.nonzero(run_half).view(-1)

    def make_batch(n: int):
        world.lengths = [context] * rows if decode else [0]
        return world.batch({r: 1 for r in range(n)} if decode else {0: rows})

    fb = make_batch(rows)
    x = torch.randn(rows, config.hidden_size, generator=gen).to(torch.bfloat16)
    q = torch.randn(rows, attn.q_size, generator=gen).to(torch.bfloat16)
    kv = torch.randn(rows, attn.num_kv_heads, attn.head_dim, generator=gen).to(torch.bfloat16)
    q_weight = attn.qkv_proj.weight[: attn.q_size]
    weights = torch.ones(rows)

    def ops():
        return SGLangLayerOps(layer, fb.positions, fb, plan_pass(fb, rows), prefill_read=execution.prefill_read,
                              decode_read=execution.decode_read)

    def routed(run: torch.Tensor):
        return routed_layer(ops(), x, layer.input_layernorm(x), run, weights)

    if decode:
        run_fb = make_batch(n_run)
        reads = {"all": lambda: world.backend.forward_decode(q, kv, kv, attn.attn, fb, save_kv_cache=False),
                 "run": lambda: world.backend.forward_decode(q[:n_run], kv[:n_run], kv[:n_run], attn.attn, run_fb,
                                                             save_kv_cache=False)}
    else:
        q_run = q.index_select(0, run_rows)
        q_slots = in_batch_slots(q_run, run_rows, rows)

        def read_ops():  # the pass's K/V as `write_kv` leaves them, which a read through SGLang's backend takes
            o = ops()
            o.written = (kv, kv)
            return o

        def read_run():  # the RUN rows' queries as `q_kv` hands them: in batch slots where the backend reads
            o = read_ops()
            if o.reads_through_backend():
                o.q_slotted = q_slots
                return o.read(q_slots, run_rows)
            return o.read(q_run, run_rows)

        reads = {"all": lambda: read_ops().read(q, None), "run": read_run}

    def parts(n: int, which: str) -> dict:
        return {"q": lambda: F.linear(x[:n], q_weight), "read": reads[which],
                "o": lambda: attn.o_proj(q[:n]),
                "mlp": lambda: layer.mlp(layer.post_attention_layernorm(x[:n]))}

    timed = {"layer": lambda: layer(fb.positions, x, fb, None),
             "projector": lambda: layer.router_proj(layer.post_attention_layernorm(x[:n_proj])),
             "routed s=0": lambda: routed(torch.ones(rows, dtype=torch.bool)),
             "routed s": lambda: routed(run_half)}
    timed.update({f"{k} @all": f for k, f in parts(rows, "all").items()})
    timed.update({f"{k} @run": f for k, f in parts(n_run, "run").items()})
    samples: dict[str, list[float]] = {k: [] for k in timed}
    with world.context():
        for f in timed.values():  # warm-up
            f()
        for _ in range(rounds):
            for name, f in timed.items():
                t0 = time.perf_counter()
                f()
                samples[name].append(time.perf_counter() - t0)
    ms = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    saving = {k: ms[f"{k} @all"] - ms[f"{k} @run"] for k in ("q", "read", "o", "mlp")}
    layer_saving = sum(saving.values()) - ms["projector"]
    step = config.num_hidden_layers * ms["layer"]
    saved = len(routed_ids) * layer_saving
    return {"phase": phase, "rows": rows, "context": context, "project_only_rows": n_proj,
            "torch_threads": torch.get_num_threads(),
            # the read the layer took: the decode read, or the prefill read (the sized read's choice at this prompt)
            "read": execution.decode_read if decode else "backend" if ops().reads_through_backend() else "rows",
            "layer_ms": ms["layer"], "step_ms": step, "parts_all_ms": {k: ms[f"{k} @all"] for k in saving},
            "parts_run_ms": {k: ms[f"{k} @run"] for k in saving}, "saving_ms": saving,
            "projector_ms": ms["projector"], "layer_saving_ms": layer_saving, "saved_ms": saved,
            "skippable_share": saved / step, "limit": step / (step - saved),
            "routed_ms": {"s=0": ms["routed s=0"], f"s={skip}": ms["routed s"]},
            "routed_saving_ms": ms["routed s=0"] - ms["routed s"]}


# -- the served arms -------------------------------------------------------------------------------------------

def write_model(out: Path, size: Size) -> Path:
    ckpt = make_tiny_model(ARCH, out / "model", size.model, dtype="bfloat16")
    write_tiny_tokenizer(ckpt, size.model.vocab)
    return ckpt


# SGLang's client (`sglang.bench_serving`), in one process for every run of the benchmark (importing it takes
# about 5 s): each line on its stdin is one run's arguments, and it answers with the run's exit status after
# DONE. Its dataset package imports Hugging Face `datasets` at the top for the MMMU loader alone; random-ids never
# calls it, so the client runs with a stand-in module that refuses.
DONE = "@@bench_serving-done@@ "
CLIENT = """
import json, sys, traceback, types
try:
    import datasets
except ImportError:
    datasets = types.ModuleType("datasets")
    def load_dataset(*args, **kwargs):
        raise NotImplementedError("Hugging Face datasets is not installed (random-ids needs none)")
    datasets.load_dataset = load_dataset
    sys.modules["datasets"] = datasets
from sglang.benchmark.serving import cli_main
done = sys.argv[1]
for line in sys.stdin:
    sys.argv = ["bench_serving", *json.loads(line)]
    try:
        cli_main()
        status = 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except Exception:
        traceback.print_exc()
        status = 1
    sys.stderr.flush()
    print(done + str(status), flush=True)
"""


class BenchServing:
    """SGLang's client, started once; `run` drives one load against one server and returns its JSONL record.

    The prompts go as token ids (`--tokenize-prompt`): as text, random ids decode to a string the server's
    tokenizer splits otherwise (the 1024-id prompts came to 1.5-1.6k tokens, the 32-id ones to about 50). The
    prefix cache is flushed after the warm-up (`--flush-cache`), which sends the first prompt, so the measured run
    prefills every prompt whole."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CLIENT, DONE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)

    def run(self, url: str, ckpt: Path, load: Load, out: Path, seed: int) -> dict:
        args = ["--backend", "sglang", "--base-url", url, "--tokenizer", str(ckpt), "--model", str(ckpt),
                "--dataset-name", "random-ids", "--random-input-len", str(load.input_len),
                "--random-output-len", str(load.output_len), "--random-range-ratio", "1",
                "--num-prompts", str(load.prompts), "--max-concurrency", str(load.concurrency),
                "--request-rate", "inf", "--seed", str(seed), "--warmup-requests", "1", "--disable-tqdm",
                "--tokenize-prompt", "--flush-cache", "--output-file", str(out)]
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        lines: list[str] = []
        for line in self.proc.stdout:
            if line.startswith(DONE):
                status = int(line[len(DONE):])
                break
            lines.append(line)
        else:
            status = self.proc.wait()
            lines.append(f"(the client exited with {status})\n")
            status = status or 1
        if status != 0 or not out.exists():
            raise RuntimeError(f"bench_serving failed ({status}):\n{''.join(lines)[-4000:]}")
        return json.loads(out.read_text().strip().splitlines()[-1])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


SERVED_COUNTERS = {"prompt": "sglang:prompt_tokens_total", "generation": "sglang:generation_tokens_total"}


def served_counts(server) -> dict[str, int]:
    """SGLang's own request-token counters (`--enable-metrics`), summed over their labels."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = dict.fromkeys(SERVED_COUNTERS, 0.0)
    for family in text_string_to_metric_families(server.metrics()):
        for sample in family.samples:
            for key, name in SERVED_COUNTERS.items():
                if sample.name == name:
                    counts[key] += sample.value
    return {k: round(v) for k, v in counts.items()}


def check_served(server, arm: str, phase: str, load: Load, before: dict[str, int], wait_s: float = 10.0) -> None:
    """The server took the tokens the load states, or the run measured some other load. SGLang counts a request
    just after it answers it, so the counters may trail the client's last answer by a moment."""
    want, deadline = load.served_tokens(), time.monotonic() + wait_s
    while True:
        after = served_counts(server)
        took = {k: after[k] - before[k] for k in SERVED_COUNTERS}
        if took == want:
            return
        if any(took[k] > want[k] for k in want) or time.monotonic() > deadline:
            raise RuntimeError(f"arm {arm} {phase}: the server took {took} tokens (SGLang's counters), the load "
                               f"{load} sends {want}")
        time.sleep(0.05)


def prefill_latency(servers: dict, size: Size) -> dict[str, list[float]]:
    """Seconds per prompt of the prefill load's length sent alone (one output token), to each arm in turn (ABC,
    CBA, ...; the same random token ids to every arm): the prefill's latency without the client's concurrency,
    paired prompt by prompt. Within a run it is tighter than the `bench_serving` runs; between runs it still moves
    with a shared host."""
    import random

    rng = random.Random(0)
    order = list(size.arms)
    seconds: dict[str, list[float]] = {arm: [] for arm in order}
    for i in range(size.latency_prompts + 1):  # the first round warms each server's path up and is dropped
        ids = [rng.randrange(5, size.model.vocab) for _ in range(size.prefill.input_len)]
        for arm in order if i % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            servers[arm].generate_ids(ids, 1)
            if i:
                seconds[arm].append(time.perf_counter() - t0)
    return seconds


LAYER_KINDS = ("routed", "dense", "outside")


def run_clock(before: dict, after: dict, phase: str) -> dict:
    """One run's ms a pass per layer kind (`LAYER_KINDS`) and in all (`model`), its passes and the tokens they
    ran, and its seconds per layer kind and part (`seconds`), from a server's part clock (its attestation's
    `part_clock`) read before and after the run; on a GPU (where `model` is the host's launches) also the device's
    span of a pass (`device`, ms; None where no pass of the run reached the device's clock) over `device_passes`,
    the forward's thread's CPU ms and waits a pass (`thread_clock`), and what the clock's own calls cost a pass
    (`own_clock`).
    A clock of pass spans alone (`parts: false`: each forward timed whole, as `outside`) times no layer: its
    routed and dense layers' ms are None, its `model` the forward's."""
    def delta(field: str) -> float:
        return after.get(field, {}).get(phase, 0) - before.get(field, {}).get(phase, 0)

    passes, tokens = delta("passes_total"), delta("tokens_total")
    was, now = before["seconds_total"].get(phase, {}), after["seconds_total"].get(phase, {})
    seconds = {where: {part: t - was.get(where, {}).get(part, 0.0) for part, t in parts.items()}
               for where, parts in now.items()}
    ms = {where: sum(seconds.get(where, {}).values()) / passes * 1e3 if passes else 0.0 for where in LAYER_KINDS}
    model = sum(ms.values())
    if after.get("parts") is False:
        ms.update(routed=None, dense=None)
    device_passes = delta("device_passes_total")
    device = delta("device_seconds_total") / device_passes * 1e3 if device_passes else None
    return {**ms, "model": model, "passes": passes, "tokens": tokens, "seconds": seconds, "device": device,
            "device_passes": device_passes, **thread_clock(before, after, phase, passes),
            **own_clock(before, after, phase, passes)}


def own_clock(before: dict, after: dict, phase: str, passes: int) -> dict:
    """The part clock's own calls in one run's passes: wrapped calls a pass (`calls`) and the host ms a pass they
    cost by the clock's own measure of one (`own`, its `call_cost_s`), None where a reading lacks them."""
    cost = after.get("call_cost_s")
    if not passes or phase not in (after.get("calls_total") or {}):
        return {"calls": None, "own": None}
    calls = (after["calls_total"][phase] - (before.get("calls_total") or {}).get(phase, 0)) / passes
    return {"calls": calls, "own": None if cost is None else calls * cost * 1e3}


def thread_clock(before: dict, after: dict, phase: str, passes: int) -> dict:
    """The forward's thread in one run's passes, from its part clock's `forward_thread`: its CPU ms a pass (`cpu`),
    its waits a pass (`waits`: how often it gave up the processor) and the garbage collector's ms a pass (`gc`),
    each None where a reading lacks them (a server from before the clock read them, a platform without per-thread
    usage, reads that failed, no pass)."""
    was, now = before.get("forward_thread") or {}, after.get("forward_thread") or {}
    stopped = (after.get("errors") or {}).get("thread")  # its reads failed: the totals stopped growing

    def per_pass(field: str, scale: float = 1.0) -> float | None:
        if not passes or stopped or phase not in now.get(field, {}):
            return None
        return (now[field][phase] - was.get(field, {}).get(phase, 0)) / passes * scale

    return {"cpu": per_pass("cpu_seconds_total", 1e3), "waits": per_pass("waits_total"),
            "gc": per_pass("gc_seconds_total", 1e3)}


def runs_clock(runs: list[dict], phase: str) -> dict:
    """A part clock (the attestation's shape) of these runs alone (`run_clock`): one phase's load, without the
    passes of the other phase's runs (a decode run's short prompts are prefill passes, a prefill run's warm-up
    request decodes) or of the servers' own warm-up."""
    seconds: dict[str, dict[str, float]] = {}
    for run in runs:
        for where, parts in run["seconds"].items():
            for part, t in parts.items():
                seconds.setdefault(where, {})[part] = seconds.get(where, {}).get(part, 0.0) + t
    return {"passes_total": {phase: sum(run["passes"] for run in runs)}, "seconds_total": {phase: seconds}}


def same_work(runs: dict[str, dict[str, list[dict]]], phase: str, rep: int) -> None:
    """The arms' runs of one repetition computed the same tokens (their servers' part clocks, `run_clock`), or
    their rates would compare different work. Each arm gets the same prompts, but a prompt that repeats within a
    run is served from SGLang's radix cache (as deployed), and where its twin is still in flight in one arm and
    already cached in another, the two arms prefill different tokens."""
    tokens = {arm: phases[phase][rep]["tokens"] for arm, phases in runs.items() if len(phases[phase]) > rep}
    counts = ", ".join(f"{arm} {n}" for arm, n in tokens.items())
    if tokens and min(tokens.values()) == 0:
        raise RuntimeError(f"repetition {rep}, {phase}: a server's part clock counted no tokens ({counts}): is "
                           "every server's part clock on, and does its hook pass the batch's tokens?")
    if len(set(tokens.values())) > 1:
        raise RuntimeError(f"repetition {rep}, {phase}: the arms computed different tokens ({counts}), so their "
                           "rates would not compare the same work: a repeated prompt served from the radix cache in "
                           "some arms and not in others, or a request retracted and computed again in one arm; "
                           "rerun")


def run_arms(ckpt: Path, out: Path, size: Size, threads: int,
             start_order: tuple[str, ...] | None = None) -> tuple[dict[str, dict[str, list[float]]],
                                                                  dict[str, list[float]], dict[str, dict],
                                                                  dict[str, dict[str, list[dict]]]]:
    """The paired runs, then the prefill prompts one at a time; returns the rates, the latencies, each arm's
    part clock as it stood after the paired runs, and each run's own share of it (`run_clock`). The servers
    start in `start_order` (default: the size's arms), the runs alternate in the size's order."""
    from vskipper.sglang.launch import launched
    from vskipper.sglang.spec import ENV_PART_CLOCK

    # The three servers share the machine: an idle SGLang scheduler polls in a busy loop, so the two arms not being
    # driven would take CPU from the one that is; each sleeps while it has no request.
    extra = ["--enable-metrics", "--sleep-on-idle", "--max-total-tokens", str(size.max_total_tokens)]
    results: dict[str, dict[str, list[float]]] = {arm: {"prefill": [], "decode": []} for arm in size.arms}
    runs: dict[str, dict[str, list[dict]]] = {arm: {"prefill": [], "decode": []} for arm in size.arms}
    with ExitStack() as stack:
        client = BenchServing()
        stack.callback(client.close)
        servers = {}
        for arm in start_order or size.arms:
            spec = ARMS[arm]
            kwargs = {"arm": "dense"}
            if spec is not None:
                arm_file = out / f"arm-{arm}.json"
                arm_file.write_text(json.dumps({"name": f"bench-{arm}", **spec}))
                kwargs = {"arm_file": arm_file}
            # One after another: SGLang sizes its KV pool from the memory free when it starts (on CPU, the
            # host's), so servers loading side by side race for it and one can find none left.
            # Killed, not drained, once measured: SGLang's graceful shutdown costs about 5 s a server.
            servers[arm] = stack.enter_context(launched(ckpt, out / f"server-{arm}", dtype="bfloat16", extra=extra,
                                                        graceful=False,
                                                        env={**threads_env(threads), ENV_PART_CLOCK: "1"},
                                                        **kwargs)).wait_ready(timeout=900)
        order = list(size.arms)
        for rep in range(size.repetitions):
            # Phase by phase, so the runs a ratio pairs are back to back.
            for phase, load in (("prefill", size.prefill), ("decode", size.decode)):
                for arm in order if rep % 2 == 0 else order[::-1]:
                    server = servers[arm]
                    before, clock = served_counts(server), part_clock(server)
                    record = client.run(server.url, ckpt, load, out / f"{arm}-{phase}-{rep}.jsonl", seed=rep)
                    check_served(server, arm, phase, load, before)
                    runs[arm][phase].append(run_clock(clock, part_clock(server), phase))
                    tps = record["input_throughput"] if phase == "prefill" else record["output_throughput"]
                    results[arm][phase].append(tps)
                    print(f"  rep {rep} {arm:6} {phase:7} {tps:9.1f} tok/s", flush=True)
                same_work(runs, phase, rep)
        clocks = {arm: part_clock(server) for arm, server in servers.items()}
        latency = prefill_latency(servers, size)
        for arm, server in servers.items():
            passes = server.get_json("/vskipper/attestation")["passes_total"]
            print(f"  {arm:6} passes {json.dumps(passes)}")
    return results, latency, clocks, runs


def part_clock(server) -> dict:
    """The server's part clock as its attestation holds it now: a document the server served late (its counters
    may lack the last passes, and a run's tokens would then differ between arms that computed the same) is read
    again (`loadgen.attestation.read_answered`)."""
    from loadgen.attestation import read_answered

    return read_answered(lambda: server.get_json("/vskipper/attestation"))["part_clock"]


# What a Project-Only row skips, as the part clock names it (`vskipper.sglang.part_times`); Q at every row is the
# fused projection's time less the K/V projection's (the routed arm's, over every row).
SKIPPED_PARTS = ("q", "read", "o", "mlp")


def served_limit(clock_all: dict, clock_run: dict, phase: str) -> dict:
    """The time limit of s=0.5 over s=0 measured in the servers themselves (their part clocks over the same load):
    what the skipped parts of the routed layers cost in the s=0 server (every row RUN) less what they cost in the
    s=0.5 server (at its RUN rows), less the adapter there, against the s=0 server's model time (the scheduler's
    own time outside the forward left out: an upper bound). Also each part's time a pass in both arms.

    Both clocks are over the same load, and both are divided by the s=0 server's passes: SGLang may cut the same
    prefill load into other passes in the two servers, and the time of the whole load is what compares."""
    n = clock_all["passes_total"][phase]

    def per_pass(clock: dict) -> dict[str, dict[str, float]]:
        return {where: {part: t / n * 1e3 for part, t in parts.items()}
                for where, parts in clock["seconds_total"][phase].items()}

    a, r = per_pass(clock_all), per_pass(clock_run)
    ra, rr = a.get("routed", {}), r.get("routed", {})
    skipped_all = {"q": max(ra.get("qkv", 0.0) - rr.get("kv", 0.0), 0.0),
                   **{k: ra.get(k, 0.0) for k in SKIPPED_PARTS[1:]}}
    skipped_run = {k: rr.get(k, 0.0) for k in SKIPPED_PARTS}
    saving = sum(skipped_all.values()) - sum(skipped_run.values()) - rr.get("projector", 0.0)
    step_all = sum(sum(parts.values()) for parts in a.values())
    step_run = sum(sum(parts.values()) for parts in r.values())
    return {"passes": {"s=0": clock_all["passes_total"][phase], f"s={SKIP}": clock_run["passes_total"][phase]},
            "step_ms": {"s=0": step_all, f"s={SKIP}": step_run},
            "layers_ms": {kind: {"s=0": sum(a.get(kind, {}).values()), f"s={SKIP}": sum(r.get(kind, {}).values())}
                          for kind in ("routed", "dense")},
            "routed_parts_ms": {"s=0": ra, f"s={SKIP}": rr},
            "skipped_all_ms": skipped_all, "skipped_run_ms": skipped_run, "projector_ms": rr.get("projector", 0.0),
            "saving_ms": saving, "skippable_share": saving / step_all, "limit": step_all / (step_all - saving),
            "model_ratio": step_all / step_run}


def routed_parts(served: dict) -> str:
    """Each part of the routed layers, ms a pass, s=0 -> s=0.5 (`served_limit`'s `routed_parts_ms`)."""
    before, after = (served["routed_parts_ms"][arm] for arm in ("s=0", f"s={SKIP}"))
    return ", ".join(f"{k} {before.get(k, 0.0):.2f} -> {after.get(k, 0.0):.2f}" for k in sorted(set(before) | set(after)))


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def paired(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of the repetitions' ratios num[i] / den[i] (each pair measured back to back)."""
    return spread([a / b for a, b in zip(num, den, strict=True)])


def drift_corrected(num: list[float], den: list[float], num_runs: list[dict],
                    den_runs: list[dict]) -> dict[str, tuple[float, float, float] | list[float]]:
    """The repetitions' ratios num[i] / den[i], each corrected for the host's drift between its two runs: times
    the dense layers' time in the numerator's run over the denominator's (layers 0 to the first routed one, dense
    in every arm: the same work on the same load, so their ratio is the host's speed between the runs, and it is
    taken to scale the whole step alike). Whole runs, not passes: SGLang may cut the same prefill load into
    passes otherwise from run to run. Also the model time alone from the clocks (den's over num's, the speed-up),
    raw and corrected: (median, min, max) each; and the factors."""
    def total(run: dict, kind: str) -> float:
        return run[kind] * run["passes"]

    factors = [total(a, "dense") / total(b, "dense") for a, b in zip(num_runs, den_runs, strict=True)]
    model = [total(b, "model") / total(a, "model") for a, b in zip(num_runs, den_runs, strict=True)]
    return {"factors": factors,
            "ratios": spread([n / d * f for n, d, f in zip(num, den, factors, strict=True)]),
            "model": spread(model), "model_corrected": spread([m * f for m, f in zip(model, factors, strict=True)])}


def gain_share(speedup: float, limit: float) -> str:
    """What share of the limit's gain a speed-up realises: (speedup - 1) / (limit - 1)."""
    return f"{(speedup - 1) / (limit - 1):.0%}" if limit > 1 else "none"


def report(results: dict, config: dict, size: Size, profiles: dict[str, dict], latency: dict[str, list[float]],
           served: dict[str, dict], runs: dict[str, dict[str, list[dict]]]) -> dict:
    """Print the arms' rates, s=0.5 over s=0 per phase beside its limits and corrected for the host's drift
    (`drift_corrected`, from each run's clock in `runs`), the servers' part clocks, the served layer's profiles;
    the summary. The goal's limit: the FLOP limit for prefill, the time limit measured in the servers
    (`served_limit`) for decode."""
    print("\n  arm     prefill tok/s  decode tok/s   (median of the repetitions)")
    for arm, r in results.items():
        print(f"  {arm:6} {statistics.median(r['prefill']):14.1f} {statistics.median(r['decode']):13.1f}")
    limits = {"prefill": flop_limit(config, size.prefill, SKIP), "decode": flop_limit(config, size.decode, SKIP)}
    goal = {"prefill": limits["prefill"], "decode": served["decode"]["limit"]}
    ratios = {phase: paired(results["s=0.5"][phase], results["s=0"][phase]) for phase in ("prefill", "decode")}
    overhead = ({phase: paired(results["dense"][phase], results["s=0"][phase]) for phase in ("prefill", "decode")}
                if "dense" in results else None)
    drift = {phase: drift_corrected(results["s=0.5"][phase], results["s=0"][phase], runs["s=0.5"][phase],
                                    runs["s=0"][phase]) for phase in ("prefill", "decode")}
    print(f"\n  s=0.5 over s=0 (median, [min, max] of {size.repetitions} paired repetitions):")
    for phase in ("prefill", "decode"):
        m, lo, hi = ratios[phase]
        timed, in_server = profiles[phase]["limit"], served[phase]["limit"]
        print(f"  {phase:7} {m:5.3f}x [{lo:.3f}, {hi:.3f}]   FLOP limit {limits[phase]:.3f}x "
              f"({gain_share(m, limits[phase])} of its gain)   time limit in the servers {in_server:.3f}x "
              f"({gain_share(m, in_server)})   the layer alone's {timed:.3f}x ({gain_share(m, timed)})")
        if m > min(timed, in_server):
            print(f"          ABOVE a time limit ({min(timed, in_server):.3f}x): a question, not a win. Both arms "
                  f"routed every pass with the same kernels (passes above); if [{lo:.3f}, {hi:.3f}] straddles the "
                  "limit, the host's noise is the first suspect: rerun alone with more repetitions")
        elif m > goal[phase]:
            print(f"          above its FLOP limit, within its time limits: what a Project-Only row skips takes "
                  f"{served[phase]['skippable_share']:.1%} of the servers' model time (below), more than its share "
                  "of their FLOPs")
        d = drift[phase]
        (c, clo, chi), (mm, mlo, mhi), (mc, mclo, mchi) = d["ratios"], d["model"], d["model_corrected"]
        print(f"          corrected for the host's drift {c:5.3f}x [{clo:.3f}, {chi:.3f}] ({gain_share(c, goal[phase])} "
              f"of the goal limit's gain; each pair times its dense layers' time, s={SKIP} run over s=0 run: "
              + ", ".join(f"{f:.3f}" for f in d["factors"]) + ")")
        print(f"          the model time alone (the servers' clocks, run by run) {mm:5.3f}x [{mlo:.3f}, {mhi:.3f}], "
              f"corrected {mc:5.3f}x [{mclo:.3f}, {mchi:.3f}]")
    lat = paired(latency["s=0"], latency["s=0.5"])  # the speed-up: s=0's time over s=0.5's, prompt by prompt
    print(f"  prefill one prompt at a time ({size.latency_prompts} prompts of {size.prefill.input_len} tokens, "
          f"alternating): s=0 {statistics.median(latency['s=0']) * 1e3:.0f} ms, s=0.5 "
          f"{statistics.median(latency['s=0.5']) * 1e3:.0f} ms: {lat[0]:5.3f}x [{lat[1]:.3f}, {lat[2]:.3f}]   "
          f"{gain_share(lat[0], limits['prefill'])} of the FLOP limit's gain, "
          f"{gain_share(lat[0], profiles['prefill']['limit'])} of the time limit's")
    print(f"  in the servers (their part clocks over each phase's own runs; ms a pass, s=0 -> s={SKIP}):")
    for phase in ("prefill", "decode"):
        sv = served[phase]
        arms = ("s=0", f"s={SKIP}")
        step, layers = sv["step_ms"], sv["layers_ms"]
        print(f"  {phase}: model time {step[arms[0]]:.1f} -> {step[arms[1]]:.1f} ({sv['model_ratio']:.3f}x; passes "
              f"{sv['passes'][arms[0]]}, {sv['passes'][arms[1]]}); routed layers {layers['routed'][arms[0]]:.1f} "
              f"-> {layers['routed'][arms[1]]:.1f}, dense layers {layers['dense'][arms[0]]:.1f} -> "
              f"{layers['dense'][arms[1]]:.1f} (the same work: their difference is the host's drift)")
        print("    what a Project-Only row skips, at every row -> at the RUN rows: " + ", ".join(
            f"{k} {sv['skipped_all_ms'][k]:.2f} -> {sv['skipped_run_ms'][k]:.2f}" for k in SKIPPED_PARTS)
            + f"; projector {sv['projector_ms']:.2f}")
        print(f"    saves {sv['saving_ms']:.1f} ms a pass ({sv['skippable_share']:.1%} of s=0's model time) -> time "
              f"limit {sv['limit']:.3f}x")
        saved = layers["routed"][arms[0]] - layers["routed"][arms[1]]
        print(f"    the routed layers saved {saved:.1f} ms a pass of the {sv['saving_ms']:.1f} ms their skipped parts "
              f"allow ({saved / sv['saving_ms']:.0%}: what the body pays beyond the skipped work, and the host's "
              "drift between the arms, which the dense layers show)" if sv["saving_ms"] > 0 else
              f"    the routed layers saved {saved:.1f} ms a pass; their skipped parts allow none")
        print(f"    the routed layers' parts, s=0 -> s={SKIP}: {routed_parts(sv)}")
    for phase in ("prefill", "decode"):
        pr = profiles[phase]
        shape = (f"{pr['rows']} rows at context {pr['context']}" if phase == "decode"
                 else f"one prompt of {pr['rows']} tokens")
        print(f"  {phase}, the served layer alone ({shape}, {pr['project_only_rows']} Project-Only, read "
              f"{pr['read']!r}): dense layer {pr['layer_ms']:.2f} ms, step (the layers) {pr['step_ms']:.1f} ms")
        print("    what a Project-Only row skips, ms over all rows -> over the RUN rows: " + ", ".join(
            f"{k} {pr['parts_all_ms'][k]:.2f} -> {pr['parts_run_ms'][k]:.2f}" for k in pr["saving_ms"])
            + f"; projector {pr['projector_ms']:.2f}")
        print(f"    saves {pr['layer_saving_ms']:.2f} ms a routed layer, {pr['saved_ms']:.1f} ms a step "
              f"({pr['skippable_share']:.1%}) -> time limit {pr['limit']:.3f}x")
        routed_ms = list(pr["routed_ms"].values())
        print(f"    the routed layer itself: nothing skipped {routed_ms[0]:.2f} ms, s={SKIP} {routed_ms[1]:.2f} ms: "
              f"saves {pr['routed_saving_ms']:.2f} ms of the {pr['layer_saving_ms']:.2f} ms limit")
    if overhead is None:
        tail = "s=0 overhead not measured (no dense arm)"
    else:
        for phase in ("prefill", "decode"):
            m, lo, hi = overhead[phase]
            c, clo, chi = drift_corrected(results["dense"][phase], results["s=0"][phase], runs["dense"][phase],
                                          runs["s=0"][phase])["ratios"]
            print(f"  dense over s=0 {phase:7} {m:5.3f}x [{lo:.3f}, {hi:.3f}]   corrected for the host's drift "
                  f"{c:5.3f}x [{clo:.3f}, {chi:.3f}]")
        tail = f"s=0 overhead {(max(overhead[p][0] for p in overhead) - 1) * 100:.1f}%"
    line = (f"prefill {ratios['prefill'][0]:.2f}x of limit {goal['prefill']:.2f}x; "
            f"decode {ratios['decode'][0]:.2f}x of limit {goal['decode']:.2f}x; {tail}")
    return {"results": results, "prefill_latency_s": latency, "prefill_latency_speedup": lat,
            "flop_limits": limits, "time_limits": {phase: profiles[phase]["limit"] for phase in profiles},
            "served_limits": served, "drift_corrected": drift, "run_clocks": runs,
            "ratios": ratios, "overhead": overhead, "profiles": profiles, "size": asdict(size), "line": line}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=SIZES, default="full",
                   help="full: 16 layers, three arms (tens of minutes); demo: 8 layers, the routed arms (about three "
                        "minutes); quick: a tiny model, the routed arms (smoke test, figures mean nothing)")
    p.add_argument("--quick", dest="size", action="store_const", const="quick", help="the same as --size quick")
    p.add_argument("--out", default="out/bench-cpu", help="checkpoint, server logs, client records, bench.json")
    p.add_argument("--repetitions", type=int, help="alternating repetitions of the arms (default: by size)")
    p.add_argument("--server-threads", type=int, default=default_threads(),
                   help="torch threads of each server and of the layer profiles (default: the cores but one, %(default)s "
                        "here)")
    p.add_argument("--start-order", help="the order the servers start in, comma-separated (default: the size's "
                   "arms; the runs alternate in the size's order whatever this is)")
    p.add_argument("--profile-layer", nargs=2, metavar=("CKPT", "JSON"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.profile_layer:  # the child process of `profile_layer`
        print(json.dumps(served_layer_profile(Path(args.profile_layer[0]), **json.loads(args.profile_layer[1]))))
        return 0
    if args.server_threads < 1:
        raise SystemExit("--server-threads must be at least 1")
    size = SIZES[args.size]
    if args.repetitions is not None:
        if args.repetitions < 1:
            raise SystemExit("--repetitions must be at least 1")
        size = replace(size, repetitions=args.repetitions)
    start_order = tuple(args.start_order.split(",")) if args.start_order else None
    if start_order is not None and sorted(start_order) != sorted(size.arms):
        raise SystemExit(f"--start-order must name the arms {', '.join(size.arms)} once each, got {args.start_order}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = write_model(out, size)
    config = tiny_config(ARCH, size.model, "bfloat16")
    print(f"model: {config['num_hidden_layers']} layers, d={config['hidden_size']}, MLP "
          f"{config['intermediate_size']}, heads {config['num_attention_heads']}/{config['num_key_value_heads']} of "
          f"{config['head_dim']}, routed {config['routing_layers'][0]}-{config['routing_layers'][-1]}, bf16 ({ckpt})",
          flush=True)
    print(f"servers and profiles: {args.server_threads} torch thread(s) each (OMP_NUM_THREADS)", flush=True)
    profiles = {phase: profile_layer(ckpt, phase, getattr(size, phase), SKIP, size.profile_rounds, args.server_threads)
                for phase in ("prefill", "decode")}
    if any(pr["torch_threads"] != args.server_threads for pr in profiles.values()):
        raise RuntimeError(f"the layer profiles ran on {[pr['torch_threads'] for pr in profiles.values()]} torch "
                           f"threads, not {args.server_threads}")
    results, latency, clocks, runs = run_arms(ckpt, out, size, args.server_threads, start_order)
    served = {phase: served_limit(runs_clock(runs["s=0"][phase], phase), runs_clock(runs[f"s={SKIP}"][phase], phase),
                                  phase) for phase in ("prefill", "decode")}
    summary = report(results, config, size, profiles, latency, served, runs)
    summary["part_clocks"] = clocks
    summary["server_threads"] = args.server_threads
    (out / "bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(summary["line"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
