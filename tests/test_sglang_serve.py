"""The real SGLang 0.5.21 server on CPU, started by `vskipper serve` with tiny FlexiDepth and Qwen3 checkpoints.

Each server starts once per arm (a class-scoped fixture, or a module-scoped one that keeps only the outputs:
bounded start-up, always killed); the dense and always-route FlexiDepth servers are the session's shared ones
(tests/conftest.py). Greedy outputs are compared token for token with
the plain torch forward of `vskipper.mixed` (dense, or routed with the same skipper).
CUDA graphs and the Triton cohort kernels do not run here (CPU): the routed layers run through the torch
cohort backend and SGLang's torch-native attention.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang")

from loadgen.attestation import Attestation, pass_delta  # noqa: E402
from tests.sglang_world import ROOT, greedy_reference, serve  # noqa: E402
from vskipper.arms import get_arm  # noqa: E402
from vskipper.checkpoint import TinySize  # noqa: E402
from vskipper.constants import CONSTANTS  # noqa: E402
from vskipper.metrics_names import PREFILL_LAYER_RUNS  # noqa: E402
from vskipper.modelspec import load_model_facts  # noqa: E402
from vskipper.roofline import derive_thresholds, lookup_device  # noqa: E402
from vskipper.sglang.spec import (  # noqa: E402
    AUTO_PREFILL_GRAPHS,
    ENV_ARM,
    ENV_ENTER,
    ENV_EXECUTION,
    ENV_EXIT,
    ENV_PREFILL_FLOOR,
    ENV_PREFILL_GRAPH_STAND_IN,
    ENV_PREFILL_GRAPHS,
    ENV_PREFILL_READ,
)
from vskipper.skippers.registry import build_skipper  # noqa: E402

pytestmark = pytest.mark.server  # real SGLang servers, and `vskipper serve` processes that refuse to start

PROMPTS = ([5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 300, 12, 7], [100, 200, 300, 400, 17, 18, 19, 20, 21, 22])
NEW_TOKENS = 10
QWEN3_SEED, QWEN3_ROUTED, QWEN3_EMBED_SCALE = 2, [0, 2, 3], 0.3  # the tiny Qwen3 checkpoint (see served_qwen3)
HYBRID_ENTER, HYBRID_EXIT = 30, 20  # resident tokens V of the decode switch (tiny, so one request crosses them)
HYBRID_PREFILL_FLOOR = 48  # the hybrid server's served prefill floor (`--prefill-floor-tokens`), under the constant's


@pytest.fixture(scope="module")
def served_model(served_flexidepth):
    return served_flexidepth


@pytest.fixture(scope="module")
def served_qwen3(tmp_path_factory):
    """The tiny Qwen3 skipper with its first and last layers routed (both ends of upstream's residual stream)
    and its tied embeddings scaled down, so that the layers pick the next token (at full scale the embedding's
    self-similarity repeats the last token whatever the layers do). With seed 2 the hard gate sends rows both
    ways at every routed layer, in prefill and in decode, on PROMPTS."""
    from safetensors.torch import save_file

    from vskipper.checkpoint import make_tiny_model, tiny_state_dict, write_tiny_tokenizer

    path = make_tiny_model("qwen3-skipper", tmp_path_factory.mktemp("serve") / "qwen3")
    config = json.loads((path / "config.json").read_text()) | {"routing_layers": QWEN3_ROUTED}
    state = tiny_state_dict(config, QWEN3_SEED)
    state["model.embed_tokens.weight"] *= QWEN3_EMBED_SCALE
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    write_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def qwen3_dense_run(served_qwen3, tmp_path_factory):
    """The dense arm on the Qwen3 checkpoint: its greedy outputs on PROMPTS (concurrent) and its attestation.
    The server lives only inside this fixture."""
    with serve(served_qwen3, tmp_path_factory.mktemp("qwen3"), arm="dense") as s:
        return _generate_all(s), s.get_json("/vskipper/attestation")


@pytest.fixture(scope="class")
def qwen3_all_run_server(served_qwen3, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen3-allrun")
    with serve(served_qwen3, tmp, arm_file=_all_run_arm(tmp)) as s:
        yield s


@pytest.fixture(scope="class")
def qwen3_routed_server(served_qwen3, tmp_path_factory):
    with serve(served_qwen3, tmp_path_factory.mktemp("qwen3-routed"), arm="qwen3-always-route") as s:
        yield s


@pytest.fixture(scope="class")
def dense_server(shared_servers):
    return shared_servers.get("dense")["dense"]


@pytest.fixture(scope="class")
def all_run_server(served_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("allrun")
    with serve(served_model, tmp, arm_file=_all_run_arm(tmp)) as s:
        yield s


@pytest.fixture(scope="class")
def hybrid_server(served_model, tmp_path_factory):
    with serve(served_model, tmp_path_factory.mktemp("hybrid"), arm="hybrid", enter_tokens=HYBRID_ENTER,
               exit_tokens=HYBRID_EXIT, extra=("--enable-metrics",), prefill_floor_tokens=HYBRID_PREFILL_FLOOR) as s:
        yield s


@pytest.fixture(scope="class")
def routed_server(shared_servers):
    return shared_servers.get("always-route")["always-route"]


@pytest.fixture(scope="class")
def triton_server(served_model, tmp_path_factory):
    """The always-route arm with the triton execution asked for (`ENV_EXECUTION`), its kernels run by Triton's
    interpreter on CPU: the execution a GPU serves, in both phases."""
    with serve(served_model, tmp_path_factory.mktemp("triton-execution"), arm="always-route",
               env={ENV_EXECUTION: "triton", "TRITON_INTERPRET": "1"}) as server:
        yield server


@pytest.fixture(scope="class")
def graphed_server(served_model, tmp_path_factory):
    """The triton server's arm and execution with its routed prefill layers replayed from graphs at the counts "auto"
    asks for (`ENV_PREFILL_GRAPHS`) that its prefill chunk of `GRAPHED_CHUNK` tokens reaches, made by the stand-in
    that reruns each capture at every replay (no CUDA graph on CPU: `ENV_PREFILL_GRAPH_STAND_IN`, honoured under the
    interpreter alone)."""
    with serve(served_model, tmp_path_factory.mktemp("prefill-graphs"), arm="always-route",
               env={ENV_EXECUTION: "triton", "TRITON_INTERPRET": "1", ENV_PREFILL_GRAPHS: "auto",
                    ENV_PREFILL_GRAPH_STAND_IN: "rerun"},
               extra=("--chunked-prefill-size", str(GRAPHED_CHUNK), "--enable-metrics")) as server:
        yield server


GRAPHED_CHUNK = 24  # the graphed server's prefill chunk: "auto"'s counts 16, 20 and 24 reach it


@pytest.fixture(scope="class")
def graphed_hybrid_server(served_model, tmp_path_factory):
    """The hybrid arm (`hybrid_server`'s thresholds and floor) with the triton execution and its routed prefill
    layers replayed from graphs, as `graphed_server` but through SGLang's backend read (as the H200's table reads):
    the headline's graphed hybrid arm, on CPU."""
    with serve(served_model, tmp_path_factory.mktemp("hybrid-prefill-graphs"), arm="hybrid",
               enter_tokens=HYBRID_ENTER, exit_tokens=HYBRID_EXIT, prefill_floor_tokens=HYBRID_PREFILL_FLOOR,
               env={ENV_EXECUTION: "triton", "TRITON_INTERPRET": "1", ENV_PREFILL_GRAPHS: "auto",
                    ENV_PREFILL_GRAPH_STAND_IN: "rerun", ENV_PREFILL_READ: "backend"},
               extra=("--chunked-prefill-size", str(GRAPHED_CHUNK), "--enable-metrics")) as server:
        yield server


VOCAB = TinySize().vocab  # the tiny checkpoints' vocabulary
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# (API, body, the field the 400 must name): each would kill SGLang 0.5.21's scheduler or give a 500 unguarded.
BAD_REQUESTS = [
    ("/generate", {"input_ids": [5, VOCAB]}, "input_ids[1]"),
    ("/generate", {"input_ids": [5, -1]}, "input_ids[1]"),
    ("/generate", {"input_ids": [[5], [6, 10 ** 9]]}, "input_ids[1][1]"),
    ("/generate", {"input_ids": "not a list"}, "input_ids"),
    ("/generate", {"input_ids": [VOCAB], "stream": True, "sampling_params": {"max_new_tokens": 2}}, "input_ids[0]"),
    ("/generate", {"input_ids": [5], "return_logprob": True, "top_logprobs_num": VOCAB + 1}, "top_logprobs_num"),
    ("/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": "8"}}, "sampling_params.max_new_tokens"),
    ("/generate", {"input_ids": [5], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ("/generate", {"input_ids": [5], "sampling_params": {"stop_token_ids": [VOCAB]}},
     "sampling_params.stop_token_ids[0]"),
    ("/v1/completions", {"model": "tiny", "prompt": [5, VOCAB], "max_tokens": 2}, "prompt[1]"),
    ("/v1/completions", {"model": "tiny", "prompt": [[5], [-3]], "max_tokens": 2}, "prompt[1][0]"),
    ("/v1/completions", {"model": "tiny", "prompt": [VOCAB], "max_tokens": 2, "stream": True}, "prompt[0]"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "logprobs": VOCAB + 1}, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "logit_bias": {str(VOCAB): 1.0}},
     f"logit_bias.{VOCAB}"),
    ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": VOCAB + 1}, "top_logprobs"),
    ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": VOCAB + 1, "stream": True}, "top_logprobs"),
    ("/v1/chat/completions", CHAT | {"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ("/v1/chat/completions", CHAT | {"max_tokens": "many"}, "max_tokens"),
]


def _all_run_arm(tmp: Path) -> Path:
    """Always-route with StaticDepth at ratio 0: every row RUNs every routed layer."""
    arm = tmp / "static-depth-0-always.json"
    arm.write_text(json.dumps({"skipper": "static_depth", "params": {"ratio": 0.0}, "prefill": "routed",
                               "decode": "routed"}))
    return arm


def _generate_all(server) -> list[list[int]]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: decode passes batch the requests
        return list(pool.map(lambda p: server.generate_ids(list(p), NEW_TOKENS), PROMPTS))


def _serves_the_routed_reference(server, served_model) -> dict:
    """The always-route FlexiDepth server's greedy tokens on PROMPTS equal the torch routed forward's, with rows
    routed both ways in both phases (the tiny routers send them so) and no dense pass; its attestation."""
    outputs = _generate_all(server)
    skipper = build_skipper("flexidepth", {})
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out == greedy_reference(served_model, list(prompt), NEW_TOKENS, skipper)
    att = server.get_json("/vskipper/attestation")
    for phase in ("prefill", "decode"):
        assert att["rows_total"][phase]["project_only"] > 0 and att["rows_total"][phase]["run"] > 0
        assert att["passes_total"][phase]["dense"] == 0
    return att


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            if found == labels:
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name}{labels} not exposed")


# -- startup refusals (no server needed) -------------------------------------------------------------------------

def _serve_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vskipper.cli", "serve", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)


def _gpu_path(tmp_path, product: str | None) -> dict:
    """An environment whose PATH holds only a stand-in `nvidia-smi` printing `product` (none when None): no GPU
    exists here, so the detection path reads a script that answers the query as nvidia-smi does."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if product is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\n[ \"$1 $2\" = \"--query-gpu=name --format=csv,noheader\" ] || exit 9\n"
                       f"echo '{product}'\n")
        smi.chmod(0o755)
    return dict(os.environ, PATH=str(bin_dir))


def test_serve_refuses_an_unknown_arm_naming_it(served_model):
    r = _serve_cli("--model", str(served_model), "--arm", "no-such-arm", "--dry-run")
    assert r.returncode == 2
    assert "unknown arm 'no-such-arm'" in r.stderr


def test_serve_refuses_a_skipper_trained_for_another_model_family(served_model):
    r = _serve_cli("--model", str(served_model), "--arm", "qwen3-always-route", "--dry-run")
    assert r.returncode == 2
    assert "field 'skipper' is 'qwen3_hard_gate'" in r.stderr and "'ddllama'" in r.stderr


def test_serve_refuses_a_hybrid_arm_without_thresholds_where_no_gpu_is_detected(served_model, tmp_path):
    r = _serve_cli("--model", str(served_model), "--arm", "hybrid", "--dry-run", env=_gpu_path(tmp_path, None))
    assert r.returncode == 2
    assert "no GPU was detected" in r.stderr and "--enter-tokens" in r.stderr and "--gpu" in r.stderr


@pytest.mark.parametrize("detected, flag, device", [
    ("NVIDIA H100 80GB HBM3", None, "H100-SXM"),  # nvidia-smi's name for the SXM part
    ("NVIDIA H100 80GB HBM3", "NVIDIA-A100-SXM4-80GB", "A100-SXM4-80GB"),  # --gpu takes a GFD label and wins
])
def test_serve_derives_hybrid_thresholds_from_the_roofline_rule_for_the_gpu(served_model, tmp_path, detected,
                                                                             flag, device):
    gpu = ("--gpu", flag) if flag else ()
    r = _serve_cli("--model", str(served_model), "--arm", "hybrid", *gpu, "--dry-run",
                   env=_gpu_path(tmp_path, detected))
    assert r.returncode == 0, r.stderr
    env = json.loads(r.stdout)["environment"]
    rule = subprocess.run([sys.executable, "-m", "vskipper.cli", "thresholds", "--device", device, "--skip-ratio",
                           str(get_arm("hybrid").declared_skip_ratio()), "--model", str(served_model), "--json"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, check=True)
    expected = json.loads(rule.stdout)
    assert int(env[ENV_ENTER]) == expected["enter_tokens"] > 0
    assert int(env[ENV_EXIT]) == expected["exit_tokens"] > 0
    assert env["VSKIPPER_THRESHOLDS_SOURCE"] == f"roofline:{device}"


def test_serve_refuses_a_static_depth_ratio_that_projects_none_of_the_checkpoints_routed_layers(served_model, tmp_path):
    """The tiny checkpoint routes 2 layers: 0.25 projects none, while 0.75 projects one and derives its thresholds
    from s = 0.5."""
    def arm(ratio, decode):
        path = tmp_path / f"static-{ratio}.json"
        path.write_text(json.dumps({"skipper": "static_depth", "params": {"ratio": ratio}, "prefill": decode,
                                    "decode": decode}))
        return str(path)

    r = _serve_cli("--model", str(served_model), "--arm-config", arm(0.25, "routed"), "--dry-run")
    assert r.returncode == 2
    assert "field 'params'.ratio: 0.25 of 2 routed layers projects no layer" in r.stderr, r.stderr
    gpu = "NVIDIA H100 80GB HBM3"
    ok = _serve_cli("--model", str(served_model), "--arm-config", arm(0.75, "hybrid"), "--gpu", gpu, "--dry-run")
    assert ok.returncode == 0, ok.stderr
    env = json.loads(ok.stdout)["environment"]
    facts = load_model_facts(str(served_model))
    want = derive_thresholds(lookup_device(gpu).bandwidth_gbps, 0.5, 2, facts.kv_bytes_per_token_layer,
                             lookup_device(gpu).dense_tflops)
    assert (int(env[ENV_ENTER]), int(env[ENV_EXIT])) == (want.enter_tokens, want.exit_tokens)


def test_serve_hands_a_prefill_floor_to_the_server_and_refuses_one_for_an_arm_that_does_not_switch_prefill(
        served_model):
    ok = _serve_cli("--model", str(served_model), "--arm", "prefill-only", "--prefill-floor-tokens", "2048",
                    "--dry-run")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["environment"][ENV_PREFILL_FLOOR] == "2048"
    r = _serve_cli("--model", str(served_model), "--arm", "dense", "--prefill-floor-tokens", "2048", "--dry-run")
    assert r.returncode == 2
    assert "--prefill-floor-tokens: arm 'dense' does not switch prefill" in r.stderr


def test_serve_refuses_an_uncatalogued_gpu_naming_it(served_model, tmp_path):
    r = _serve_cli("--model", str(served_model), "--arm", "hybrid", "--dry-run",
                   env=_gpu_path(tmp_path, "NVIDIA Imaginary X9"))
    assert r.returncode == 2 and "NVIDIA Imaginary X9" in r.stderr


def test_server_process_refuses_an_invalid_arm_before_starting_sglang(served_model, tmp_path):
    from vskipper.sglang.spec import ServeSpec, serve_environment

    env = serve_environment(ServeSpec(get_arm("dense"), 0, 0, tmp_path / "state.json"))
    env[ENV_ARM] = json.dumps({"skipper": "flexidepth", "decode": "sideways"})
    r = subprocess.run([sys.executable, "-m", "vskipper.sglang.server", "--model-path", str(served_model)],
                       capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 2
    assert "field 'decode' must be one of dense, routed, hybrid" in r.stderr


def test_dry_run_shows_the_cpu_recipe_and_the_shim_on_the_server_path_only(served_model):
    r = _serve_cli("--model", str(served_model), "--arm", "dense", "--dry-run")
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    cmd, env = shown["command"], shown["environment"]
    for flag in ("--attention-backend", "torch_native", "--sampling-backend", "pytorch", "--device", "cpu"):
        assert flag in cmd
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "vskipper.sglang.models"
    assert env["PYTHONPATH"].split(":")[0].endswith("vskipper/sglang/shims")
    assert json.loads(env[ENV_ARM])["name"] == "dense"


def test_on_a_gpu_serve_keeps_decode_graphs_for_every_arm_and_runs_routed_prefill_eagerly(served_model):
    """Decode graphs hold a routed variant (captured by the model, `SkipperGraphVariants`); prefill graphs do not,
    so an arm that routes prefill runs it eagerly whatever the caller asked."""
    cmds = {}
    for arm in ("decode-only", "dense", "always-route"):
        r = _serve_cli("--model", str(served_model), "--arm", arm, "--platform", "gpu", "--enter-tokens", "200",
                       "--exit-tokens", "100", "--dry-run", "--", "--cuda-graph-backend-prefill", "full")
        assert r.returncode == 0, r.stderr
        cmds[arm] = json.loads(r.stdout)["command"]

    def last(cmd: list[str], flag: str) -> str:  # SGLang keeps a flag's last value
        return cmd[max(i for i, a in enumerate(cmd) if a == flag) + 1]

    for arm, prefill in (("decode-only", "full"), ("dense", "full"), ("always-route", "disabled")):
        assert last(cmds[arm], "--cuda-graph-backend-decode") == "full", arm
        assert cmds[arm].count("--cuda-graph-backend-decode") == 1, arm
        assert last(cmds[arm], "--cuda-graph-backend-prefill") == prefill, arm


# -- dense arm ---------------------------------------------------------------------------------------------------

class TestDenseArm:
    """The upstream-equivalent dense arm, with --enable-metrics."""

    def test_dense_server_answers_generate_and_chat_completions(self, dense_server):
        assert len(dense_server.generate_ids([5, 6, 7], 4)) == 4
        chat = dense_server.post_json("/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "two plus two?"}], "max_tokens": 5,
            "temperature": 0})
        assert chat["choices"][0]["message"]["role"] == "assistant"
        assert chat["usage"]["completion_tokens"] == 5


    def test_dense_greedy_output_equals_the_torch_reference_token_for_token(self, dense_server, served_model):
        outputs = _generate_all(dense_server)
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            assert out == greedy_reference(served_model, list(prompt), NEW_TOKENS)


    def test_architecture_resolves_to_the_vskipper_class_not_the_transformers_fallback(self, dense_server):
        att = dense_server.get_json("/vskipper/attestation")
        assert att["model"]["class"] == "DDLlamaForCausalLM"
        assert att["model"]["routed_layers"] == [2, 3]
        assert "resolved to vskipper.sglang.models.ddllama.DDLlamaForCausalLM" in dense_server.log.read_text()


    def test_dense_arm_attests_dense_passes_only_in_the_loadgen_contract(self, dense_server):
        before = Attestation.from_json(dense_server.get_json("/vskipper/attestation"))
        dense_server.generate_ids([9, 8, 7, 6], NEW_TOKENS)
        after = Attestation.from_json(dense_server.get_json("/vskipper/attestation"))
        delta = pass_delta(before, after)
        assert not delta.regressions
        assert delta.passes["prefill"] == {"dense": 1, "routed": 0}
        assert delta.passes["decode"]["routed"] == 0 and delta.passes["decode"]["dense"] >= NEW_TOKENS - 1
        assert after.arm == get_arm("dense").as_dict()
        assert after.raw["sglang_version"] == "0.5.21"
        assert after.raw["rows_total"]["decode"] == {"run": 0, "project_only": 0}


    def test_metrics_expose_the_attested_pass_counters(self, dense_server):
        dense_server.generate_ids([1, 2, 3], 3)
        att = dense_server.get_json("/vskipper/attestation")
        text = dense_server.metrics()
        assert "sglang:" in text  # SGLang's own metrics sit beside ours
        for phase in ("prefill", "decode"):
            assert _metric(text, "vskipper_passes_total", mode="dense", phase=phase) == att["passes_total"][phase]["dense"]
        # Decode is not switched in the dense arm: no threshold is exported for alerts to compare V with, nor a floor;
        # nor does it route prefill.
        assert not any(line.startswith(("vskipper_threshold_tokens", "vskipper_prefill_floor_tokens",
                                        "vskipper_routed_prefill_passes_total"))
                       for line in text.splitlines())


    @pytest.mark.parametrize("path,body,field", BAD_REQUESTS, ids=[f"{p}:{f}" for p, _, f in BAD_REQUESTS])
    def test_a_bad_request_gets_a_400_naming_the_field_and_the_server_keeps_serving(self, dense_server, path, body,
                                                                                     field):
        from tests.sglang_world import http

        status, text = http(dense_server.url + path, body)
        assert status == 400, (status, text[:500])
        error = json.loads(text)
        assert field in error.get("message", error.get("error", {}).get("message", "")), text[:500]
        assert len(dense_server.generate_ids([5, 6], 2)) == 2

    def test_the_last_id_of_the_vocabulary_is_served(self, dense_server, served_model):
        last = json.loads((served_model / "config.json").read_text())["vocab_size"] - 1
        assert len(dense_server.generate_ids([5, last], 2)) == 2
        out = dense_server.post_json("/generate", {"input_ids": [5, 6], "return_logprob": True,
                                                   "top_logprobs_num": last + 1,
                                                   "sampling_params": {"max_new_tokens": 1}})
        assert len(out["meta_info"]["output_top_logprobs"][0]) == last + 1


# -- always-route arms ---------------------------------------------------------------------------------------------

class TestAllRunArm:
    """Always-route with StaticDepth at ratio 0: every row RUNs every routed layer."""

    def test_always_route_with_an_all_run_skipper_equals_the_dense_arm_token_for_token(self, all_run_server, served_model):
        before = all_run_server.get_json("/vskipper/attestation")
        outputs = _generate_all(all_run_server)
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            assert out == greedy_reference(served_model, list(prompt), NEW_TOKENS)
        after = all_run_server.get_json("/vskipper/attestation")
        assert after["passes_total"]["decode"]["routed"] > before["passes_total"]["decode"]["routed"]
        assert after["passes_total"]["decode"]["dense"] == before["passes_total"]["decode"]["dense"]
        assert after["rows_total"]["decode"]["project_only"] == 0
        assert after["rows_total"]["decode"]["run"] > before["rows_total"]["decode"]["run"]


class TestAlwaysRouteFlexiDepth:
    """The always-route arm: FlexiDepth's trained routers on every pass, with --enable-metrics."""

    def test_always_route_flexidepth_equals_the_torch_routed_forward_token_for_token(self, routed_server, served_model):
        att = _serves_the_routed_reference(routed_server, served_model)
        # what executed: Project-Only rows skip Q, routed passes run eagerly (no graph replays a dense graph)
        assert att["execution"]["project_only_q"] == "skipped: K/V rows of qkv_proj"
        assert att["execution"]["cuda_graphs"]["backends"] == {"decode": "disabled", "prefill": "disabled"}

    def test_loadgen_cells_against_the_real_server_pass_every_gate(self, routed_server):
        """loadgen end to end against the real server (not a stand-in): an open-loop natural cell, then its
        matched-work replay, each gated on accounting, cell size, zero-empty generations, work identity,
        mechanism evidence (routed passes in both declared phases, read from the attestation before and after)
        and the served design equal to the intended arm field by field."""
        import asyncio

        from loadgen import gates
        from loadgen.client import Endpoint
        from loadgen.driver import matched_plan, natural_plan, record_lengths, run_cell
        from loadgen.suite import Suite, SuiteRequest
        from vskipper.arms import get_arm

        suite = Suite("real-server", tuple(SuiteRequest(f"tiny:test:{i}", tuple(range(5 + i, 13 + i)))
                                           for i in range(6)))
        endpoint = Endpoint(routed_server.url)
        natural = asyncio.run(run_cell(endpoint, natural_plan(suite, 4.0, 1, max_new_tokens=6), "always-route"))
        matched = asyncio.run(run_cell(endpoint, matched_plan(suite, 4.0, 2, record_lengths(natural)),
                                       "always-route"))
        arm = get_arm("always-route")
        refusals = []
        for cell in (natural, matched):
            refusals += gates.accounting(cell) + gates.declared_cell_size(cell, suite.digest, suite.ids)
            refusals += gates.mechanism_evidence(arm, cell.attestation_before, cell.attestation_after)
            refusals += gates.served_design(arm, cell.attestation_after)
        refusals += gates.zero_empty(natural) + gates.work_identity(natural, matched)
        assert refusals == [], refusals
        assert matched.completed == len(suite) and all(r.output_tokens >= 1 for r in matched.records)
        # the gates bite on this server too: the dense arm's design is not what it serves
        assert gates.served_design(get_arm("dense"), matched.attestation_after)

    def test_routed_counters_are_consistent_across_attestation_and_metrics(self, routed_server):
        routed_server.generate_ids([3, 1, 4, 1, 5], 4)
        att = routed_server.get_json("/vskipper/attestation")
        per_layer = att["rows_per_layer_total"]
        assert sorted(per_layer) == ["2", "3"]
        for action in ("run", "project_only"):
            total = sum(att["rows_total"][p][action] for p in ("prefill", "decode"))
            assert sum(layer[action] for layer in per_layer.values()) == total
        text = routed_server.metrics()
        for phase in ("prefill", "decode"):
            for action in ("run", "project_only"):
                assert _metric(text, "vskipper_rows_total", phase=phase, action=action) == att["rows_total"][phase][action]
            assert _metric(text, "vskipper_passes_total", mode="routed", phase=phase) == \
                att["passes_total"][phase]["routed"]
        # no prefill graphs asked: every routed prefill pass's routed layers ran eagerly, counted so
        assert "prefill_graphs" not in att
        assert {how: _metric(text, "vskipper_routed_prefill_passes_total", layers=how) for how in PREFILL_LAYER_RUNS} \
            == {"replayed": 0, "eager_longer": 0, "eager_refused": 0,
                "eager_not_asked": att["passes_total"]["prefill"]["routed"]}
        assert att["skipper"]["name"] == "flexidepth"
        assert att["switch"]["settings"] == {"prefill": "routed", "decode": "routed", "promotion": True}


class TestTritonExecution:
    """The always-route FlexiDepth arm served with the triton execution (Triton's interpreter on CPU): the count-
    bounded cohort GEMMs in prefill and decode, the masked decode read, the prefill read through SGLang's backend."""

    def test_the_triton_execution_serves_the_torch_routed_forward_token_for_token(self, triton_server, served_model):
        att = _serves_the_routed_reference(triton_server, served_model)
        assert att["execution"]["routed_layers_backend"] == {"decode": "triton", "prefill": "triton",
                                                            "prefill_read": "packed", "tiles": "interpreter tile"}
        assert att["execution"]["project_only_q"] == "skipped: the RUN cohort's count-bounded Q GEMM"


class TestRoutedPrefillGraphs:
    """A real server whose routed prefill layers replay from graphs: "auto"'s counts its prefill chunk reaches captured
    and checked before it reports ready (the hook after SGLang's scheduler is built, which reads the chunk), the rest
    left out; then its passes replayed, the packed read inside each routed layer's one segment."""

    def test_the_server_captures_at_start_and_serves_the_torch_routed_forward_token_for_token(
            self, graphed_server, served_model):
        att = graphed_server.get_json("/vskipper/attestation")
        graphs = att["prefill_graphs"]
        routed = len(att["model"]["routed_layers"])
        captured = [16, 20, 24]  # the counts a pass within the chunk reaches
        segments = len(captured) * (1 + routed)  # per count the state and each routed layer's one segment
        assert graphs["tokens"] == list(AUTO_PREFILL_GRAPHS) and graphs["read"] == "packed" \
            and graphs["made_by"] == "stand-in RerunGraph"
        assert graphs["reach"] == {"asked": "auto", "prefill_chunk": GRAPHED_CHUNK,
                                   "left_out": list(AUTO_PREFILL_GRAPHS[len(captured):])}
        assert [int(n) for n, s in graphs["captured_at_boot_s"].items() if s is not None] == captured
        assert graphs["capture_check"]["segments"] == graphs["capture_check"]["rechecked"] == segments
        assert set(graphs["failed"].values()) == {None}
        assert graphs["kv_write_check"]["not_compared"] == "the packed read reads its K/V inside the segment"

        def replays_add_up(att: dict) -> int:
            """Every segment captured at start, none since; the second boot pass's replays and each replayed
            pass's (SGLang's warm-up request's too); the boot's passes counted nowhere."""
            graphs = att["prefill_graphs"]
            replayed = sum(graphs["passes"]["by_tokens"].values())
            assert graphs["segments"] == {"captured": segments, "replayed": segments + (1 + routed) * replayed}
            assert replayed + graphs["passes"]["eager"]["longer than every count"] \
                == att["passes_total"]["prefill"]["routed"]
            return replayed

        before = replays_add_up(att)
        att = _serves_the_routed_reference(graphed_server, served_model)
        assert replays_add_up(att) > before
        graphs, before = att["prefill_graphs"], replays_add_up(att)
        prompt = list(range(3, 43))  # 40 tokens: two chunks, of 24 and 16, each replayed, the second reading the first
        assert graphed_server.generate_ids(prompt, 3) == greedy_reference(
            served_model, prompt, 3, build_skipper("flexidepth", {}))
        after = graphed_server.get_json("/vskipper/attestation")
        assert replays_add_up(after) == before + 2
        by_tokens = after["prefill_graphs"]["passes"]["by_tokens"]
        assert by_tokens["24"] == graphs["passes"]["by_tokens"]["24"] + 1
        assert by_tokens["16"] == graphs["passes"]["by_tokens"]["16"] + 1
        assert after["prefill_graphs"]["passes"]["eager"] == graphs["passes"]["eager"]
        # Prometheus counts each routed prefill pass by how its routed layers ran, as the attestation does
        text = graphed_server.metrics()
        after = graphed_server.get_json("/vskipper/attestation")["prefill_graphs"]["passes"]
        assert {how: _metric(text, "vskipper_routed_prefill_passes_total", layers=how) for how in PREFILL_LAYER_RUNS} \
            == {"replayed": sum(after["by_tokens"].values()), "eager_longer": after["eager"]["longer than every count"],
                "eager_refused": 0, "eager_not_asked": 0}


class TestHybridArmPrefillGraphs:
    """The hybrid arm whose routed prefill rounds replay their routed layers from graphs (through SGLang's backend
    read, its K/V writes checked at start): dense rounds under its floor run as ever, a round over it routes, its
    chunks replayed, the first of them the switch's share probe read from the graph tape; decode then routes (V over
    enter), and the tokens are the torch routed forward's."""

    def test_a_routed_round_replays_its_chunks_probes_from_the_graph_tape_and_decodes_the_routed_tokens(
            self, graphed_hybrid_server, served_model):
        server = graphed_hybrid_server
        before = server.get_json("/vskipper/attestation")
        assert before["prefill_graphs"]["reach"]["left_out"][0] == 28  # 16, 20 and 24 captured
        # the backend read's K/V writes compared at start: every routed layer's first replay after its capture
        kv = before["prefill_graphs"]["kv_write_check"]
        assert before["prefill_graphs"]["read"] == "backend" and kv["not_compared"] is None
        assert kv["compared"] == 3 * len(before["model"]["routed_layers"]) and kv["worst_difference"] == 0.0
        short = [5, 6, 7, 8, 9, 10, 11, 12]  # under the floor: a dense round, no graph
        assert server.generate_ids(short, 2) == greedy_reference(served_model, short, 2)
        prompt = list(range(100, 164))  # 64 tokens, over the floor of 48: chunks of 24, 24 and 16, each replayed
        out = server.generate_ids(prompt, 3)
        after = server.get_json("/vskipper/attestation")
        assert out == greedy_reference(served_model, prompt, 3, build_skipper("flexidepth", {}))
        passes = {p: {m: after["passes_total"][p][m] - before["passes_total"][p][m] for m in ("dense", "routed")}
                  for p in ("prefill", "decode")}
        assert passes["prefill"] == {"dense": 1, "routed": 3} and passes["decode"]["routed"] >= 2
        graphs = after["prefill_graphs"]["passes"]
        was = before["prefill_graphs"]["passes"]
        assert {n: graphs["by_tokens"][n] - was["by_tokens"][n] for n in ("16", "20", "24")} == \
            {"16": 1, "20": 0, "24": 2}
        assert graphs["eager"] == was["eager"]
        switch = after["switch"]
        assert switch["probes_total"] == before["switch"]["probes_total"] + 1  # the round's probe, counted once
        assert 0.0 < switch["prefill_share_estimate"] < 1.0  # rows sent both ways, none of the padding's counted
        assert after["rows_total"]["prefill"]["project_only"] > before["rows_total"]["prefill"]["project_only"]
        text = server.metrics()
        assert _metric(text, "vskipper_routed_prefill_passes_total", layers="replayed") == \
            sum(graphs["by_tokens"].values()) == after["passes_total"]["prefill"]["routed"]


class TestHybridArm:
    """The hybrid arm with decode thresholds of 30/20 resident tokens and a served prefill floor of 48 tokens;
    prompts of 32 tokens or fewer stay under it."""

    def test_decode_turns_routed_when_resident_tokens_cross_enter_and_promotes_the_running_request(
            self, hybrid_server, served_model):
        before = hybrid_server.get_json("/vskipper/attestation")
        prompt = [5, 6, 7, 8, 9, 10, 11, 12]
        out = hybrid_server.generate_ids(prompt, 40)  # V grows from 9 to 48: crosses enter (30) once
        after = hybrid_server.get_json("/vskipper/attestation")
        dense_ref = greedy_reference(served_model, prompt, 40)
        assert out[:15] == dense_ref[:15]  # V < 30 for these steps: dense decode, as the dense model
        passes = {p: {m: after["passes_total"][p][m] - before["passes_total"][p][m] for m in ("dense", "routed")}
                  for p in ("prefill", "decode")}
        assert passes["prefill"] == {"dense": 1, "routed": 0}  # 8 prompt tokens < the served floor
        assert passes["decode"]["dense"] > 0 and passes["decode"]["routed"] > 0
        assert after["promotions_total"] - before["promotions_total"] == 1
        decisions = after["switch"]["decisions_total"]
        assert decisions.get("route_on", 0) - before["switch"]["decisions_total"].get("route_on", 0) == 1
        assert after["thresholds"] == {"enter_tokens": HYBRID_ENTER, "exit_tokens": HYBRID_EXIT, "source": "flags",
                                       "prefill_floor_tokens": HYBRID_PREFILL_FLOOR, "prefill_floor_source": "flags"}

    def test_a_round_over_the_served_prefill_floor_routes_where_the_constants_floor_would_not(self, hybrid_server):
        """The prefill rule takes the floor the server was given (a floor measured on the device) in place of
        vskipper.constants': a round of 64 prompt tokens, over 48 and far under 1,536, routes (this server's first
        round over its floor is the rule's share probe, which routes)."""
        before = hybrid_server.get_json("/vskipper/attestation")
        hybrid_server.generate_ids(list(range(100, 164)), 2)
        after = hybrid_server.get_json("/vskipper/attestation")
        assert after["passes_total"]["prefill"]["routed"] - before["passes_total"]["prefill"]["routed"] == 1
        assert after["switch"]["constants"]["prefill_min_prompt_tokens"] == HYBRID_PREFILL_FLOOR
        assert after["constants"]["prefill_min_prompt_tokens"] == CONSTANTS.prefill_min_prompt_tokens > 64
        new = [d for d in after["switch"]["recent_decisions"] if d["kind"].startswith("prefill_")][-1]
        assert (new["kind"], new["count"]) == ("prefill_routed", 64)

    def test_with_routing_engaged_hybrid_decodes_the_tokens_of_the_same_routes(self, hybrid_server, served_model):
        """A prompt whose own KV puts V over enter: prefill runs dense (under the floor), and every decode step
        routes through FlexiDepth's routers, as the torch forward with the same routes does."""
        prompt = list(range(40, 72))  # 32 tokens: V >= 30 from the first decode step
        before = hybrid_server.get_json("/vskipper/attestation")
        out = hybrid_server.generate_ids(prompt, NEW_TOKENS)
        after = hybrid_server.get_json("/vskipper/attestation")
        assert after["passes_total"]["decode"]["dense"] == before["passes_total"]["decode"]["dense"]
        assert after["passes_total"]["decode"]["routed"] - before["passes_total"]["decode"]["routed"] >= NEW_TOKENS - 1
        routed = greedy_reference(served_model, prompt, NEW_TOKENS, None, decode_skipper=build_skipper("flexidepth", {}))
        assert out == routed
        assert out != greedy_reference(served_model, prompt, NEW_TOKENS)  # the routes change the tokens

    def test_a_new_request_under_exit_turns_routing_off_and_decodes_dense(self, hybrid_server, served_model):
        hybrid_server.generate_ids([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,
                                    23, 24, 25, 26, 27, 28, 29, 30, 31, 32], 2)  # V >= 30: routing on
        before = hybrid_server.get_json("/vskipper/attestation")
        prompt = [40, 41, 300, 12, 7]
        out = hybrid_server.generate_ids(prompt, 6)  # V <= 11 <= exit: routing off, dense decode
        after = hybrid_server.get_json("/vskipper/attestation")
        assert out == greedy_reference(served_model, prompt, 6)
        assert after["passes_total"]["decode"]["routed"] == before["passes_total"]["decode"]["routed"]
        assert after["switch"]["routing_on"] is False
        text = hybrid_server.metrics()
        assert _metric(text, "vskipper_switch_decisions_total", decision="route_off") == \
            after["switch"]["decisions_total"]["route_off"]
        assert _metric(text, "vskipper_promotions_total") == after["promotions_total"]
        assert _metric(text, "vskipper_prefill_floor_tokens") == HYBRID_PREFILL_FLOOR  # the served floor


class TestQwen3Dense:
    """A Qwen3 skipper checkpoint (tied embeddings, q/k norms, routers loaded by name) on the dense arm."""

    def test_qwen3_skipper_dense_output_equals_the_torch_reference(self, qwen3_dense_run, served_qwen3):
        outputs, att = qwen3_dense_run
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            assert out == greedy_reference(served_qwen3, list(prompt), NEW_TOKENS)
        assert att["model"] == {"model_type": "qwen3_skipper", "class": "Qwen3SkipperForCausalLM",
                                "routed_layers": QWEN3_ROUTED}
        assert att["passes_total"]["decode"]["routed"] == 0 and att["passes_total"]["prefill"]["routed"] == 0


class TestQwen3AllRunArm:
    """Always-route on the Qwen3 checkpoint with an all-RUN StaticDepth: the routed layers (the first and the
    last among them) take over upstream's residual stream and must hand on what the dense layers would."""

    def test_qwen3_always_route_with_an_all_run_skipper_equals_the_dense_arm_token_for_token(
            self, qwen3_all_run_server, qwen3_dense_run):
        dense_outputs, _ = qwen3_dense_run
        assert _generate_all(qwen3_all_run_server) == dense_outputs
        att = qwen3_all_run_server.get_json("/vskipper/attestation")
        for phase in ("prefill", "decode"):
            assert att["passes_total"][phase]["dense"] == 0 and att["passes_total"][phase]["routed"] > 0
            assert att["rows_total"][phase]["project_only"] == 0 and att["rows_total"][phase]["run"] > 0
        assert sorted(att["rows_per_layer_total"], key=int) == [str(i) for i in QWEN3_ROUTED]


class TestQwen3AlwaysRoute:
    """The qwen3-always-route arm: the Qwen3 hard gate's trained routers on every pass."""

    def test_qwen3_hard_gate_equals_the_torch_routed_forward_token_for_token(self, qwen3_routed_server,
                                                                             served_qwen3, qwen3_dense_run):
        outputs = _generate_all(qwen3_routed_server)
        skipper = build_skipper("qwen3_hard_gate", {})
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            assert out == greedy_reference(served_qwen3, list(prompt), NEW_TOKENS, skipper)
        assert outputs != qwen3_dense_run[0]  # the skipped layers change the tokens: the comparison can fail
        # routing is engaged: both actions taken, in both phases and at every routed layer
        att = qwen3_routed_server.get_json("/vskipper/attestation")
        for phase in ("prefill", "decode"):
            assert att["rows_total"][phase]["project_only"] > 0 and att["rows_total"][phase]["run"] > 0
            assert att["passes_total"][phase]["dense"] == 0
        for layer in QWEN3_ROUTED:
            rows = att["rows_per_layer_total"][str(layer)]
            assert rows["run"] > 0 and rows["project_only"] > 0, (layer, rows)
        assert att["skipper"]["name"] == "qwen3_hard_gate"
        assert att["model"]["class"] == "Qwen3SkipperForCausalLM"


def test_serve_accepts_the_qwen3_gate_on_a_qwen3_checkpoint_and_refuses_flexidepth_naming_the_field(served_qwen3):
    ok = _serve_cli("--model", str(served_qwen3), "--arm", "qwen3-always-route", "--dry-run")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(json.loads(ok.stdout)["environment"][ENV_ARM])["skipper"] == "qwen3_hard_gate"
    r = _serve_cli("--model", str(served_qwen3), "--arm", "always-route", "--dry-run")
    assert r.returncode == 2
    assert "field 'skipper' is 'flexidepth'" in r.stderr and "this checkpoint is 'qwen3_skipper'" in r.stderr


# -- prefix reuse keyed by prefill mode ----------------------------------------------------------------------------

LONG = 1600  # prompt tokens over the prefill floor (1536): the round may route
SHORT = 400  # under it: the round runs dense


@pytest.fixture(scope="class")
def prefill_switched_server(served_model, tmp_path_factory):
    """Prefill switched by the prefill rule, decode dense: StaticDepth skips exactly half the routed rows, so
    every round over the floor routes (its probe measures a share of 0.5 > 0.35) and every round under it does
    not. The KV pool is large enough that nothing is evicted during the class."""
    tmp = tmp_path_factory.mktemp("prefix")
    arm = tmp / "static-depth-50-prefill.json"
    arm.write_text(json.dumps({"skipper": "static_depth", "params": {"ratio": 0.5}, "prefill": "hybrid",
                               "decode": "dense"}))
    with serve(served_model, tmp, arm_file=arm, extra=("--max-total-tokens", "16384")) as s:
        yield s


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


class TestPrefixReuseByPrefillMode:
    """SGLang's radix cache with vSkipper's namespaces: a prompt reuses only KV its own prefill mode computed,
    and generated KV decoded in another mode than the prefill's never enters the cache."""

    def _generate(self, server, ids: list[int], n: int = 4) -> tuple[dict, str]:
        before = server.get_json("/vskipper/attestation")["requests_total"]["prefill"]
        out = server.post_json("/generate", {"input_ids": ids, "sampling_params": {
            "temperature": 0, "max_new_tokens": n, "ignore_eos": True}})
        after = server.get_json("/vskipper/attestation")["requests_total"]["prefill"]
        (mode,) = [m for m in ("dense", "routed") if after.get(m, 0) > before.get(m, 0)]
        return out, mode

    def test_a_prompt_reuses_only_kv_of_its_own_prefill_mode(self, prefill_switched_server):
        server = prefill_switched_server
        long_prompt = _prompt(LONG, 1)
        first, mode = self._generate(server, long_prompt)
        assert mode == "routed" and first["meta_info"]["cached_tokens"] == 0
        # Its first SHORT tokens are cached, but under the routed namespace: a dense round reuses none of it.
        short, mode = self._generate(server, long_prompt[:SHORT])
        assert mode == "dense" and short["meta_info"]["cached_tokens"] == 0
        again, mode = self._generate(server, long_prompt[:SHORT])
        assert mode == "dense" and again["meta_info"]["cached_tokens"] >= SHORT - 1
        # The long prompt's KV is still there, under its own mode.
        long_again, mode = self._generate(server, long_prompt)
        assert mode == "routed" and long_again["meta_info"]["cached_tokens"] >= LONG - 1
        att = server.get_json("/vskipper/attestation")
        assert att["prefix_cache"]["keyed_by_prefill_mode"] is True
        assert att["prefix_cache"]["unkeyed_admissions_total"] == 0
        assert att["passes_total"]["decode"]["routed"] == 0 and att["rows_total"]["decode"]["run"] == 0  # prefill-only

    def test_generated_kv_of_another_decode_mode_is_not_inserted(self, prefill_switched_server):
        server = prefill_switched_server
        prompt = _prompt(LONG, 2)
        withheld = server.get_json("/vskipper/attestation")["prefix_cache"]["withheld_generated_kv_tokens_total"]
        first, mode = self._generate(server, prompt, n=8)
        assert mode == "routed"  # routed prefill, dense decode (the arm never routes decode)
        follow_up = prompt + first["output_ids"] + _prompt(8, 3)
        second, mode = self._generate(server, follow_up)
        assert mode == "routed"
        # The prompt's KV is reused; the tokens decoded dense were not inserted, so reuse stops at the prompt.
        assert LONG - 1 <= second["meta_info"]["cached_tokens"] <= LONG
        att = server.get_json("/vskipper/attestation")
        assert att["prefix_cache"]["withheld_generated_kv_tokens_total"] > withheld


# -- SGLang's multi-process layout: data-parallel replicas -----------------------------------------------------------

@pytest.fixture(scope="class")
def replicated_server(served_model, tmp_path_factory):
    """Two data-parallel replicas (two scheduler processes, one core each: SGLang's CPU engine binds each rank's
    threads, and this machine has one NUMA node)."""
    with serve(served_model, tmp_path_factory.mktemp("dp"), arm="decode-only-always",
               extra=("--dp-size", "2", "--enable-metrics"), env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}) as s:
        yield s


class TestDataParallelReplicas:
    def test_each_replica_reports_its_own_requests_and_the_server_attests_their_sum(self, replicated_server):
        server = replicated_server
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda i: server.generate_ids([5, 6, 7, i], 4), range(6)))
        att = server.get_json("/vskipper/attestation")  # the replicas write their state files for this read
        state = server.log.parent / f"state-{server.port}.json"
        parts = [json.loads(p.read_text()) for p in (state, state.with_name(f"{state.stem}.dp1-adp0.json"))]
        assert [p["placement"]["replica"] for p in parts] == ["dp0-adp0", "dp1-adp0"]
        assert all(p["passes_total"]["decode"]["routed"] > 0 for p in parts)  # both replicas served requests
        metrics = server.metrics()
        for phase, mode in (("prefill", "dense"), ("decode", "routed")):  # the decode-only arm
            total = sum(p["passes_total"][phase][mode] for p in parts)
            assert att["passes_total"][phase][mode] == total > 0
            assert _metric(metrics, "vskipper_passes_total", mode=mode, phase=phase) == total
        assert att["passes_total"]["prefill"]["routed"] == att["passes_total"]["decode"]["dense"] == 0
        assert att["rows_total"]["prefill"] == {"run": 0, "project_only": 0}
        assert sum(att["requests_total"]["decode"].values()) >= 6
        assert [r["placement"]["replica"] for r in att["replicas"]] == ["dp0-adp0", "dp1-adp0"]


# -- SGLang's multi-process layout: tensor parallelism ---------------------------------------------------------------

@pytest.fixture(scope="class")
def tensor_parallel_server(served_model, tmp_path_factory):
    """Two tensor-parallel ranks on CPU (SGLang falls back to a gloo all-reduce without the CPU shared-memory
    kernel): each rank holds half of every MLP's intermediate width and half of the attention heads."""
    with serve(served_model, tmp_path_factory.mktemp("tp"), arm="always-route",
               extra=("--tp-size", "2", "--enable-metrics"), env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}) as s:
        yield s


class TestTensorParallelRanks:
    def test_routed_cohorts_reduce_their_partial_sums_and_equal_the_torch_routed_forward(
            self, tensor_parallel_server, served_model):
        prompts = [*PROMPTS, list(range(40, 72))]
        skipper = build_skipper("flexidepth", {})
        for prompt in prompts:
            assert tensor_parallel_server.generate_ids(list(prompt), NEW_TOKENS) == \
                greedy_reference(served_model, list(prompt), NEW_TOKENS, skipper)
        att = tensor_parallel_server.get_json("/vskipper/attestation")
        assert att["rows_total"]["decode"]["project_only"] > 0 and att["rows_total"]["decode"]["run"] > 0

    def test_only_one_rank_counts_each_pass(self, tensor_parallel_server):
        server = tensor_parallel_server
        before = server.get_json("/vskipper/attestation")
        for i in range(3):  # one after the other: one admission round and one prefill pass each
            server.generate_ids([9, 8, 7, i], 3)
        after = server.get_json("/vskipper/attestation")
        assert after["passes_total"]["prefill"]["routed"] - before["passes_total"]["prefill"]["routed"] == 3
        assert sum(after["requests_total"]["prefill"].values()) - sum(before["requests_total"]["prefill"].values()) == 3
        assert "replicas" not in after
        assert _metric(server.metrics(), "vskipper_passes_total", mode="routed", phase="prefill") == \
            after["passes_total"]["prefill"]["routed"]


def test_serve_hands_the_server_a_tile_table_for_its_gpu_and_refuses_one_for_another(served_model, tmp_path):
    """`--tile-table`: checked before anything starts (it loads; it names the GPU, here given by --gpu), then
    carried to the scheduler as an absolute path (`ENV_TILE_TABLE`), where the model checks it again on the device."""
    from vskipper.mixed.tiles import COUNT_RANGES, OPERATIONS
    from vskipper.sglang.spec import ENV_TILE_TABLE

    def table(device: str) -> Path:
        tile = {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3}
        path = tmp_path / f"{device}.json"
        path.write_text(json.dumps({"device": device, "dtype": "bfloat16", "tiles": {
            op: [{"rows": [lo, hi], **tile} for lo, hi in COUNT_RANGES] for op in OPERATIONS}}))
        return path

    args = ("--model", str(served_model), "--arm", "dense", "--dry-run", "--gpu", "NVIDIA H100 80GB HBM3")
    r = _serve_cli(*args, "--tile-table", str(table("H100-SXM")))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["environment"][ENV_TILE_TABLE] == str(table("H100-SXM").resolve())
    r = _serve_cli(*args, "--tile-table", str(table("H200")))
    assert r.returncode == 2
    assert "--tile-table" in r.stderr and "field 'device' is 'H200', but this GPU is H100-SXM" in r.stderr
    r = _serve_cli(*args, "--tile-table", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "--tile-table" in r.stderr and "missing.json: no tile table can be read" in r.stderr
    # none given: the shipped table serves, whatever this environment holds (only the checked flag sets it)
    r = _serve_cli("--model", str(served_model), "--arm", "dense", "--dry-run",
                   env=dict(os.environ, **{ENV_TILE_TABLE: str(table("H200"))}))
    assert ENV_TILE_TABLE not in json.loads(r.stdout)["environment"]
