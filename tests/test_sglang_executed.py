"""The comparability gates against the real SGLang 0.5.21 server on CPU: what each server attests it executed
(read from SGLang's scheduler after boot), the execution-difference and cross-arm identity gates over those
attestations, and the mechanism gate's pass-count check against the scheduler's own count.

Three servers start side by side: a dense and an always-route arm launched with the same flags (the session's
shared servers, tests/conftest.py), and, for this module only, an always-route arm launched with a larger
`--max-total-tokens`, another chunk size and another attention backend (flex attention, which builds on CPU but
cannot run a batch here: that server skips SGLang's warmup and generating health checks, and only attests).
"""

from __future__ import annotations

import asyncio
import copy
import json

import pytest

from loadgen.attestation import Attestation, pass_delta
from loadgen.gates import cross_arm_identity, execution_difference, mechanism_evidence
from tests.sglang_world import launched
from vskipper.arms import get_arm
from vskipper.sglang.executed import CPU_PROFILE, declared_execution
from vskipper.sglang.spec import CPU_FLAGS

MISMATCHED_FLAGS = ("--max-total-tokens", "8192", "--chunked-prefill-size", "1024", "--attention-backend",
                    "flex_attention", "--skip-server-warmup")
SAME_FLAGS_KV_TOKENS = 4096  # the CPU recipe's --max-total-tokens


def test_launch_flags_declare_the_fields_they_name_and_nothing_sglang_decides():
    flags = [*CPU_FLAGS, "--dtype", "float32", "--chunked-prefill-size=0", "--decode-attention-backend", "triton",
             "--attention-backend", "torch_native", "--kv-cache-dtype", "auto", "--disable-overlap-schedule",
             "--enable-metrics"]
    assert declared_execution(flags) == {
        "attention_backend": {"prefill": "torch_native", "decode": "triton"},  # a phase's own flag wins
        "sampling_backend": "pytorch", "decode_graph_batch_sizes": [], "dtype": "float32",
        "chunked_prefill_size": None, "overlap_scheduler": False}
    with pytest.raises(ValueError, match="--page-size has no value"):
        declared_execution(["--page-size"])


@pytest.fixture(scope="module")
def served_model(served_flexidepth):
    return served_flexidepth


@pytest.fixture(scope="module")
def servers(served_model, shared_servers, tmp_path_factory):
    """{"dense", "always-route", "mismatched"}, started side by side: the first two are the session's shared
    servers (launched with the same flags), the mismatched one stops after the module."""
    with launched(served_model, tmp_path_factory.mktemp("executed-servers") / "mismatched", arm="always-route",
                  extra=MISMATCHED_FLAGS, env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}) as mismatched:
        started = shared_servers.get("dense", "always-route")
        yield {**started, "mismatched": mismatched.wait_ready()}


@pytest.fixture(scope="module")
def declared():
    """What the test servers' launch flags declare (the CPU recipe and `launch.serve_command`'s float32)."""
    from vskipper.sglang import SGLANG_VERSION

    return {**declared_execution([*CPU_FLAGS, "--dtype", "float32"]), "profile": CPU_PROFILE,
            "sglang_version": SGLANG_VERSION}


@pytest.mark.server
def test_each_server_attests_the_configuration_sglang_executes_after_boot(servers, served_model, declared):
    config = json.loads((served_model / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    kv_bytes_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    for name in ("dense", "always-route"):
        attestation = servers[name].get_json("/vskipper/attestation")
        assert execution_difference(name, declared, attestation) == []
        executed = attestation["executed"]
        assert executed["attention_backend"] == {"prefill": "torch_native", "decode": "torch_native"}
        assert executed["decode_graph_batch_sizes"] == [] and executed["dtype"] == executed["kv_dtype"] == "float32"
        assert executed["kv_pool"]["tokens"] == SAME_FLAGS_KV_TOKENS
        # the pool's own K/V buffers: every layer's K and V for each token slot plus SGLang's padding slot
        assert executed["kv_pool"]["bytes"] == kv_bytes_per_token * (SAME_FLAGS_KV_TOKENS + executed["page_size"])
        assert (executed["tp_size"], executed["dp_size"], executed["pp_size"]) == (1, 1, 1)
    mismatched = servers["mismatched"].get_json("/vskipper/attestation")["executed"]
    # read after boot, not from the flags: SGLang resolved the larger pool and the chunk size as launched
    assert mismatched["kv_pool"]["tokens"] == 8192 and mismatched["chunked_prefill_size"] == 1024


@pytest.mark.server
def test_dense_and_routed_arms_launched_with_the_same_flags_pass_both_comparability_gates(servers, declared,
                                                                                          tmp_path):
    """loadgen's matched-work A/B between the two real servers: both arms executed the declared configuration,
    differ only in arm, skipper and thresholds, and every other gate passes too (the mechanism gate with the
    scheduler's own pass counts); the report and the table show the two gates and the KV pool difference."""
    from loadgen.client import Endpoint
    from loadgen.experiment import ArmTarget, run_ab
    from loadgen.report import write_report
    from loadgen.suite import Suite, SuiteRequest

    suite = Suite("executed", tuple(SuiteRequest(f"tiny:test:{i}", tuple(range(5 + i, 13 + i))) for i in range(4)))
    base, arm = (ArmTarget(name, Endpoint(servers[name].url), get_arm(name), declared)
                 for name in ("dense", "always-route"))
    result = asyncio.run(run_ab(base, arm, suite, 4.0, repetitions=1, seed=3, max_new_tokens=4))
    (rep,) = result.repetitions
    assert rep.gates.passed, rep.gates.refusals
    assert {"execution_difference", "cross_arm_identity", "mechanism_evidence"} <= set(rep.gates.checked)
    assert rep.gates.checked.count("execution_difference") == 2
    for cell in (rep.baseline, rep.treated):
        assert Attestation.from_json(cell.attestation_after).scheduler_passes_total is not None
    details = rep.gates.details["cross_arm_identity"]
    assert "arm.name" in details["allowed_differences"]
    assert not [p for p in details["allowed_differences"] if p.split(".")[0] not in ("arm", "skipper", "thresholds")]
    assert details["kv_pool"]["smaller_by_tokens"] == 0
    paths = write_report([result], tmp_path)
    table = paths["table"].read_text()
    assert ("- 4req-s always-route: execution_difference passed 1/1; cross_arm_identity passed 1/1; KV pool "
            "always-route 4096 vs dense 4096 tokens (smaller by 0 tokens, 0.00% of the baseline's pool)") in table
    report = json.loads(next(p for n, p in paths.items() if n.startswith("ab-")).read_text())
    assert report["repetitions"][0]["gates"]["details"]["cross_arm_identity"]["kv_pool"]["arm_tokens"] == 4096


@pytest.mark.server
def test_a_routed_arm_launched_with_a_larger_pool_another_chunk_size_and_attention_backend_is_refused(
        servers, declared):
    dense = servers["dense"].get_json("/vskipper/attestation")
    mismatched = servers["mismatched"].get_json("/vskipper/attestation")
    refusals, _ = cross_arm_identity("dense", dense, "always-route", mismatched)
    reasons = {r.reason.split(":")[0]: r.reason for r in refusals}
    assert {r.gate for r in refusals} == {"cross_arm_identity"}
    assert set(reasons) == {"executed.kv_pool.tokens", "executed.kv_pool.bytes", "executed.chunked_prefill_size",
                            "executed.attention_backend.prefill", "executed.attention_backend.decode"}
    assert reasons["executed.kv_pool.tokens"] == (
        "executed.kv_pool.tokens: arm 'always-route' 8192 is larger than baseline 'dense' 4096 (the arm's KV pool "
        "may not exceed the baseline's)")
    # The dense server's chunk size is the CPU recipe's, the mismatched one's the flag's.
    assert "baseline 'dense' 2048, arm 'always-route' 1024" in reasons["executed.chunked_prefill_size"]
    assert "baseline 'dense' 'torch_native', arm 'always-route' 'flex_attention'" in \
        reasons["executed.attention_backend.decode"]
    (decode, prefill, chunk) = sorted(r.reason for r in execution_difference("always-route", declared, mismatched))
    assert decode == ("arm 'always-route': executed.attention_backend.decode executed 'flex_attention', "
                      "declared 'torch_native'")
    assert "executed.attention_backend.prefill" in prefill
    assert chunk == "arm 'always-route': executed.chunked_prefill_size executed 1024, declared 2048"


@pytest.mark.server
def test_per_mode_passes_sum_to_the_schedulers_own_count_on_the_real_runtime(servers):
    server = servers["always-route"]
    before = Attestation.from_json(server.get_json("/vskipper/attestation"))
    server.generate_ids([3, 1, 4, 1, 5], 6)
    after_doc = server.get_json("/vskipper/attestation")
    after = Attestation.from_json(after_doc)
    delta = pass_delta(before, after)
    assert delta.scheduler is not None  # the scheduler's count is attested, so the gate checks against it
    assert delta.scheduler["prefill"] == sum(delta.passes["prefill"].values()) >= 1
    assert delta.scheduler["decode"] == sum(delta.passes["decode"].values()) >= 5
    assert mechanism_evidence(get_arm("always-route"), before, after) == []
    # the check reads those counts: one scheduler pass the runtime did not count is refused
    skewed = copy.deepcopy(after_doc)
    skewed["scheduler_passes_total"]["decode"] += 1
    (r,) = mechanism_evidence(get_arm("always-route"), before, skewed)
    assert "decode: per-mode passes sum to" in r.reason and "but the scheduler ran" in r.reason
