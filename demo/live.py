"""The main job on an embedded default: a tiny FlexiDepth checkpoint, served for real on CPU and measured.

No GPU and no hub. The demo
1. runs the offline tour (`vskipper.tour`: a tiny FlexiDepth checkpoint, its routes, the thresholds the rule
   gives the paper's models, a load ramp through the hybrid mode switch; `--offline` stops here);
2. starts two real SGLang 0.5.21 servers on CPU through `vskipper serve`, the `dense` arm and the `hybrid` arm
   (with decode thresholds scaled down to the tiny model), each in its own session and always stopped;
3. sends a chat completion and a completion through the OpenAI-compatible API;
4. runs a small matched-work A/B between the two servers with loadgen (the code path of `vskipper-loadgen demo`):
   report, table and gates, the comparability gates included (each server executed the configuration its launch
   flags declare, read from SGLang after boot; the two differ only in arm, skipper and thresholds);
5. prints each server's attestation and its `vskipper_*` lines on `/metrics`;
6. once those servers stop, measures what routing saves on this CPU on a model big enough for it to do real work:
   `benchmarks/bench_cpu.py --size demo` (8 layers, d = 1024, Llama-3 width ratios, bf16) serves always-route s = 0
   (every row RUN) and s = 0.5 side by side and prints each ratio next to its limit.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from loadgen.attestation import Attestation, pass_delta
from loadgen.client import Endpoint
from loadgen.demo import demo_suite, print_report, run_rates
from loadgen.experiment import ArmTarget
from loadgen.gates import CellRefused
from vskipper.arms import get_arm
from vskipper.constants import CONSTANTS
from vskipper.metrics_names import NAMESPACE
from vskipper.tour import run_tour

# The hybrid arm's decode thresholds in resident KV tokens, scaled for the tiny model so that routing engages
# once about three of the demo's requests run together (the served band's shape, enter = enter_factor * exit).
# A real deployment takes them from `vskipper thresholds` (hundreds of thousands of tokens on a datacenter GPU).
DEMO_EXIT_TOKENS = 160
DEMO_ENTER_TOKENS = round(CONSTANTS.enter_factor * DEMO_EXIT_TOKENS)
AB_ARMS = ("dense", "hybrid")  # baseline, arm under test
SERVER_FLAGS = ("--enable-metrics", "--sleep-on-idle")  # vskipper_* on /metrics; an idle server yields the CPU
AB_MAX_NEW_TOKENS = 48  # the natural lane's cap per request
AB_MAX_REQUESTS = 150  # loadgen's demo suite: request i's prompt is token ids 5+3i .. 44+3i, inside the tiny vocab
BENCH_SIZES = ("demo", "quick", "off")  # step 6: bench_cpu's size, or none
BENCH_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cpu.py"
BENCH_CAVEAT = ("CPU figures (SGLang's torch-native kernels on this host's cores, a noisy shared machine): the "
                "saving next to what this model's shapes allow on a CPU; a GPU's figures come from "
                "benchmarks/gpu")
CAVEAT = ("a tiny random model on a CPU: these numbers show the pipeline working end to end; they are not "
          "performance claims (routing pays off on a GPU, above the thresholds the roofline rule gives)")


@dataclass(frozen=True)
class Sizing:
    """The live part's A/B: `requests` per cell at `rate` req/s, `repetitions` paired matched-work runs. The
    default rate offers the requests within about a second, so that several of them decode together (routing
    engages) however fast the host decodes the tiny model; a low rate on a fast host never engages it."""

    requests: int = 16
    repetitions: int = 2
    rate: float = 16.0

    def __post_init__(self) -> None:
        if not 2 <= self.requests <= AB_MAX_REQUESTS:
            raise ValueError(f"--requests must be between 2 and {AB_MAX_REQUESTS}, got {self.requests}")
        if self.repetitions < 1:
            raise ValueError(f"--repetitions must be at least 1, got {self.repetitions}")
        if not self.rate > 0:
            raise ValueError(f"--rate must be positive, got {self.rate}")


def _section(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


@contextmanager
def _sigterm_unwinds():
    """SIGTERM unwinds like Ctrl-C, so the servers are stopped either way."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _start_servers(ckpt: Path, out: Path, stack: ExitStack) -> dict:
    from vskipper.sglang.launch import launched, stop_all

    thresholds = {"hybrid": {"enter_tokens": DEMO_ENTER_TOKENS, "exit_tokens": DEMO_EXIT_TOKENS}}
    t0 = time.monotonic()
    servers = {}
    for arm in AB_ARMS:
        servers[arm] = stack.enter_context(launched(ckpt, out / "servers" / arm, arm=arm, extra=SERVER_FLAGS,
                                                    **thresholds.get(arm, {})))
        print(f"  {arm:7} {servers[arm].url}  log {servers[arm].log}")
    stack.callback(stop_all, list(servers.values()))  # runs first on exit: both wind down together
    print(f"  hybrid decode thresholds: enter {DEMO_ENTER_TOKENS} / exit {DEMO_EXIT_TOKENS} resident KV tokens, "
          "scaled for this tiny model so routing engages under the demo's load (real ones come from "
          "`vskipper thresholds`); prefill stays dense: the demo's admission rounds are far below the "
          f"{CONSTANTS.prefill_min_prompt_tokens}-token prefill floor")
    print("  waiting for /health (SGLang starts in about a minute on CPU) ...", flush=True)
    for server in servers.values():
        server.wait_ready()
    print(f"  both servers up after {time.monotonic() - t0:.0f} s")
    return servers


def _openai_requests(server, out: Path) -> dict:
    """One chat completion and one completion through the OpenAI client (a dependency of SGLang's server)."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120)
    chat = client.chat.completions.create(model="tiny", temperature=0, max_tokens=16, messages=[
        {"role": "user", "content": "What is two plus two?"}])
    completion = client.completions.create(model="tiny", prompt="The quick brown fox", temperature=0,
                                           max_tokens=16)
    print(f"  POST {server.url}/v1/chat/completions  (user: What is two plus two?)")
    print(f"    assistant: {chat.choices[0].message.content!r}  [{chat.usage.completion_tokens} tokens, "
          f"finish {chat.choices[0].finish_reason}]")
    print(f"  POST {server.url}/v1/completions  (prompt: The quick brown fox)")
    print(f"    text: {completion.choices[0].text!r}  [{completion.usage.completion_tokens} tokens, "
          f"finish {completion.choices[0].finish_reason}]")
    print("  (random weights: the text is noise; the point is the served API path)")
    doc = {"chat_completion": chat.model_dump(), "completion": completion.model_dump()}
    (out / "openai.json").write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def _mean(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _fmt(value: float | None, scale: float, unit: str, width: int, digits: int) -> str:
    return f"{'n/a':>{width}}" if value is None else f"{value * scale:{width - len(unit)}.{digits}f}{unit}"


def _arm_rows(result) -> list[dict]:
    """Per arm, over the accepted repetitions: mean latencies and throughput, decode passes by mode."""
    rows = []
    for which in ("baseline", "treated"):
        cells = [getattr(rep, which) for rep in result.accepted]
        if not cells:
            continue
        decode = {"dense": 0, "routed": 0}
        for cell in cells:
            delta = pass_delta(Attestation.from_json(cell.attestation_before),
                               Attestation.from_json(cell.attestation_after))
            for mode in decode:
                decode[mode] += delta.passes["decode"][mode]
        rows.append({"arm": cells[0].arm_name, "repetitions": len(cells),
                     "output_tokens": cells[0].summary["output_tokens"],
                     "e2e_mean_s": _mean([c.summary["e2e"]["mean"] for c in cells]),
                     "tpot_mean_s": _mean([c.summary["tpot"]["mean"] for c in cells]),
                     "output_tok_s": _mean([c.summary.get("whole_cell_output_tok_s") for c in cells]),
                     "decode_passes": decode})
    return rows


def declared_execution() -> dict:
    """The configuration both demo servers must attest they executed: what their SGLang launch flags (the CPU
    recipe, then the flags `vskipper.sglang.launch` and the demo add) declare outright, on vSkipper's CPU
    profile and the pinned SGLang."""
    from vskipper.sglang import SGLANG_VERSION
    from vskipper.sglang.executed import CPU_PROFILE
    from vskipper.sglang.executed import declared_execution as from_flags
    from vskipper.sglang.launch import serve_command
    from vskipper.sglang.spec import CPU_FLAGS

    cmd = serve_command("model", 0, Path("state.json"), arm=AB_ARMS[0], extra=SERVER_FLAGS)
    flags = [*CPU_FLAGS, *cmd[cmd.index("--") + 1:]]
    return {**from_flags(flags), "profile": CPU_PROFILE, "sglang_version": SGLANG_VERSION}


def _ab(servers: dict, out: Path, sizing: Sizing) -> dict:
    execution = declared_execution()
    base, target = (ArmTarget(a, Endpoint(servers[a].url), get_arm(a), execution) for a in AB_ARMS)
    suite = demo_suite(sizing.requests)
    label = f"{sizing.rate:g}req-s"
    print(f"  {len(suite)} requests of {len(suite.requests[0].input_ids)} prompt tokens at {sizing.rate:g} req/s "
          f"(Poisson): the dense arm generates naturally (at most {AB_MAX_NEW_TOKENS} tokens each), then "
          f"{sizing.repetitions} paired repetitions replay those lengths in both arms, order alternating")
    report_dir = out / "ab"
    summary: dict = {"report_dir": str(report_dir), "rate": sizing.rate, "requests": len(suite),
                     "repetitions": sizing.repetitions}
    try:
        res = asyncio.run(run_rates(base, target, suite, {label: sizing.rate}, report_dir,
                                    repetitions=sizing.repetitions, max_new_tokens=AB_MAX_NEW_TOKENS,
                                    title="vskipper demo: dense vs hybrid, tiny model on CPU"))
    except CellRefused as exc:
        print(f"  REFUSED: the dense arm's natural cell failed its gates, so no A/B ran: {exc}")
        summary.update(gates_passed=False, refusals=[str(r) for r in exc.refusals])
        return summary
    print_report(res)
    result = res["results"][0]
    rows = _arm_rows(result)
    print(f"  {'arm':7} {'reps':>4} {'out tokens':>10} {'E2E mean':>9} {'TPOT mean':>10} {'tok/s':>7}  decode passes")
    for r in rows:
        print(f"  {r['arm']:7} {r['repetitions']:4d} {r['output_tokens']:10d} {_fmt(r['e2e_mean_s'], 1, 's', 9, 2)} "
              f"{_fmt(r['tpot_mean_s'], 1e3, 'ms', 10, 1)} {_fmt(r['output_tok_s'], 1, '', 7, 1)}  dense "
              f"{r['decode_passes']['dense']}, routed {r['decode_passes']['routed']}")
    hybrid = next((r for r in rows if r["arm"] == AB_ARMS[1]), None)
    if hybrid is not None and hybrid["decode_passes"]["routed"] == 0:
        print(f"  routing never engaged: too few requests decoded together to reach {DEMO_ENTER_TOKENS} resident "
              "tokens; raise --rate (or --requests)")
    print(f"  {CAVEAT}")
    refused = [rep for rep in result.repetitions if not rep.gates.passed]
    if refused:
        print(f"  GATES REFUSED {len(refused)} of {len(result.repetitions)} repetitions (listed under the table); "
              "they are left out of the comparison")
    else:
        checked = sorted({g for rep in result.repetitions for g in rep.gates.checked})
        print(f"  gates: all {len(result.repetitions)} repetitions passed ({', '.join(checked)})")
    ab_json = next(p for name, p in res["paths"].items() if name.startswith("ab-"))
    print(f"  report: {ab_json} (gates, comparison), {report_dir / 'cells'} (every request), plots in {report_dir}")
    summary.update(gates_passed=not refused, accepted=len(result.accepted), report=str(ab_json),
                   table=str(res["paths"]["table"]), arms=rows,
                   refusals=[str(f) for rep in refused for f in rep.gates.refusals])
    return summary


def _show_attestation(arm: str, server, out: Path) -> dict:
    att = server.get_json("/vskipper/attestation")
    (out / f"attestation-{arm}.json").write_text(json.dumps(att, indent=2) + "\n")
    a, sw, rows = att["arm"], att["switch"], att["rows_total"]
    print(f"  {arm}: GET {server.url}/vskipper/attestation  (full document: {out / f'attestation-{arm}.json'})")
    if a["skipper"] is None:
        print(f"    arm {a['name']}: no skipper (upstream-equivalent); switch settings {sw['settings']}")
    else:
        print(f"    arm {a['name']}: skipper {a['skipper']}, prefill {a['prefill']}, decode {a['decode']}, "
              f"promotion {'on' if a['promotion'] else 'off'}; switch settings {sw['settings']}")
    if sw["settings"]["decode"] == "hybrid":
        t = att["thresholds"]
        print(f"    thresholds: enter {t['enter_tokens']} / exit {t['exit_tokens']} resident KV tokens; routing now "
              f"{'on' if sw['routing_on'] else 'off'}; decisions {sw['decisions_total']}")
    for phase in ("prefill", "decode"):
        p = att["passes_total"][phase]
        print(f"    {phase:7} passes: dense {p['dense']}, routed {p['routed']}; rows at routed layers "
              f"{att['model']['routed_layers']}: run {rows[phase]['run']}, project-only {rows[phase]['project_only']}")
    print(f"    promotions {att['promotions_total']}; SGLang {att.get('sglang_version')} on {att['execution']['device']}")
    return att


def _show_metrics(arm: str, server, out: Path) -> list[str]:
    lines = [ln for ln in server.metrics().splitlines() if ln.startswith(NAMESPACE + "_")]
    (out / f"metrics-{arm}.txt").write_text("\n".join(lines) + "\n")
    print(f"  {arm}: {server.url}/metrics  (SGLang's sglang:* beside these; all in {out / f'metrics-{arm}.txt'})")
    for line in lines:
        if line.startswith((f"{NAMESPACE}_passes_total", f"{NAMESPACE}_rows_total", f"{NAMESPACE}_promotions",
                            f"{NAMESPACE}_switch_decisions_total", f"{NAMESPACE}_threshold_tokens")):
            print(f"    {line}")
    return lines


def run_live(ckpt: Path, out: Path, sizing: Sizing) -> dict:
    """Steps 2-5: two real servers, the OpenAI API, the A/B, attestation and metrics; the servers always stop."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        raise ValueError("SGLang is not installed in this environment (`make install` installs 0.5.21 for CPU); "
                         "`python -m demo --offline` runs the offline tour only")
    summary: dict = {"thresholds": {"enter_tokens": DEMO_ENTER_TOKENS, "exit_tokens": DEMO_EXIT_TOKENS}}
    with _sigterm_unwinds(), ExitStack() as stack:
        _section("2. two real SGLang 0.5.21 servers on CPU through `vskipper serve`: dense and hybrid")
        servers = _start_servers(ckpt, out, stack)
        summary["servers"] = {arm: s.url for arm, s in servers.items()}
        _section("3. the OpenAI-compatible API (hybrid server)")
        _openai_requests(servers["hybrid"], out)
        _section("4. matched-work A/B with loadgen: dense vs hybrid")
        summary["ab"] = _ab(servers, out, sizing)
        _section("5. attestation and /metrics")
        summary["attestation"] = {arm: _show_attestation(arm, s, out) for arm, s in servers.items()}
        summary["metrics"] = {arm: _show_metrics(arm, s, out) for arm, s in servers.items()}
        print("  to keep a server up: vskipper serve --model " + f"{ckpt} --arm hybrid --enter-tokens "
              f"{DEMO_ENTER_TOKENS} --exit-tokens {DEMO_EXIT_TOKENS} -- --enable-metrics")
    print("servers stopped")
    return summary


def run_routing_bench(out: Path, size: str) -> dict:
    """Step 6: `benchmarks/bench_cpu.py --size <size>` in a child process (its servers are its own and always
    stop), its report streamed and kept (routing-bench.txt); returns its summary (bench.json)."""
    import subprocess

    if not BENCH_SCRIPT.is_file():
        raise ValueError(f"{BENCH_SCRIPT} is missing: step 6 runs from a checkout of the repository "
                         "(`--bench off` leaves it out)")
    work = out / "routing-bench"
    log = out / "routing-bench.log"  # its stderr (the servers' warnings)
    print(f"  {BENCH_CAVEAT}", flush=True)
    with log.open("w") as err, (out / "routing-bench.txt").open("w") as report:
        proc = subprocess.Popen([sys.executable, str(BENCH_SCRIPT), "--size", size, "--out", str(work)],
                                stdout=subprocess.PIPE, stderr=err, text=True)
        for line in proc.stdout:
            report.write(line)
            print(f"  {line.rstrip()}", flush=True)
        status = proc.wait()
    if status != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"the routing bench failed ({status}); its log is {log}:\n{tail}")
    return json.loads((work / "bench.json").read_text())


def run_demo(out: str | Path = "out/demo", offline: bool = False, sizing: Sizing | None = None,
             bench: str = "demo") -> int:
    if bench not in BENCH_SIZES:
        raise ValueError(f"--bench must be one of {', '.join(BENCH_SIZES)}, got {bench!r}")
    t0 = time.monotonic()
    out = Path(out)
    _section("1. offline tour: a tiny FlexiDepth checkpoint, its routes, the thresholds, the mode switch")
    ckpt = run_tour(out)
    if offline:
        return 0
    try:
        summary = run_live(ckpt, out, sizing or Sizing())
        if bench != "off":
            _section("6. what routing saves on CPU: always-route s = 0.5 over s = 0, next to the limits")
            summary["routing"] = run_routing_bench(out, bench)
    except KeyboardInterrupt:
        print("\ninterrupted: servers stopped", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(f"demo done in {summary['wall_s']:.0f} s; summary in {out / 'summary.json'}")
    ab = summary["ab"]
    if not ab.get("gates_passed"):
        print("the A/B's gates refused cells (see above): the comparison is incomplete", file=sys.stderr)
        return 1
    return 0
