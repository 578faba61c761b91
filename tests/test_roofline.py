"""The roofline rule reproduces the paper's published thresholds exactly, and refuses bad inputs by name."""

import pytest

from vskipper.constants import CONSTANTS
from vskipper.modelspec import PRESETS, ModelConfigError, ModelFacts, decode_bytes, flop_limit, token_macs
from vskipper.roofline import (
    DEVICES,
    UnknownDeviceError,
    derive_thresholds,
    find_device,
    gemm_floor_ms,
    lookup_device,
    round_to_step,
    rounded_thresholds,
    v_star_tokens,
)

LLAMA = PRESETS["llama-3-8b"]


def llama_thresholds(device: str, s: float = 0.5):
    d = lookup_device(device)
    return derive_thresholds(d.bandwidth_gbps, s, LLAMA.num_routed_layers, LLAMA.kv_bytes_per_token_layer,
                             d.dense_tflops)


@pytest.mark.parametrize("device,v_star_k,exit_k,enter_k", [
    ("A100-SXM4-80GB", 157.7, 160, 200),
    ("H100-SXM", 273.0, 270, 340),
    ("RTX-A6000", 62.6, 60, 80),
])
def test_hardware_bands_table_is_reproduced(device, v_star_k, exit_k, enter_k):
    t = llama_thresholds(device)
    assert round(t.v_star_tokens / 1e3, 1) == v_star_k
    assert (t.exit_tokens, t.enter_tokens) == (exit_k * 1000, enter_k * 1000)


def test_a100_ridge_point_is_about_161_rows():
    assert round(llama_thresholds("A100-SXM4-80GB").ridge_rows) == 161


# Table "The nine RandomSkip arms": V* and own thresholds per (r, d), s = r * d, A100.
RANDOM_SKIP = [
    (0.25, 0.25, 1261, 1260, 1580), (0.25, 0.50, 631, 630, 790), (0.25, 0.75, 420, 420, 530),
    (0.50, 0.25, 631, 630, 790), (0.50, 0.50, 315, 320, 390), (0.50, 0.75, 210, 210, 260),
    (0.75, 0.25, 420, 420, 530), (0.75, 0.50, 210, 210, 260), (0.75, 0.75, 140, 140, 180),
]


@pytest.mark.parametrize("r,d,v_star_k,exit_k,enter_k", RANDOM_SKIP)
def test_random_skip_table_is_reproduced(r, d, v_star_k, exit_k, enter_k):
    t = llama_thresholds("A100-SXM4-80GB", r * d)
    assert round(t.v_star_tokens / 1e3) == v_star_k
    assert (t.exit_tokens, t.enter_tokens) == (exit_k * 1000, enter_k * 1000)


@pytest.mark.parametrize("model,s,exit_k,enter_k", [
    ("qwen3-4b", 0.25, 320, 390),  # Qwen3-4B step 20k, probe skip 0.25
    ("qwen3-8b", 0.445, 180, 220),  # Qwen3-8B penalty 2e-4, step 10k
    ("qwen3-8b", 0.485, 160, 200),  # Qwen3-8B penalty 2e-4, step 18.75k
    ("qwen3-8b", 0.520, 150, 190),  # Qwen3-8B penalty 4e-4, step 15k (served)
])
def test_qwen3_thresholds_are_reproduced(model, s, exit_k, enter_k):
    facts = PRESETS[model]
    assert facts.num_routed_layers == 18 and facts.kv_bytes_per_token_layer == 4096
    t = derive_thresholds(1935.0, s, facts.num_routed_layers, facts.kv_bytes_per_token_layer)
    assert (t.exit_tokens, t.enter_tokens) == (exit_k * 1000, enter_k * 1000)
    # tau scales with L_r / 16, so L_r cancels: V* depends on the device, s and b only.
    assert t.tau_ms == pytest.approx(CONSTANTS.tau_ms_per_16_layers * 18 / 16)


def test_v_star_scales_inversely_with_skip_and_kv_bytes():
    base = v_star_tokens(2000, 0.5, 16, 4096)
    assert v_star_tokens(2000, 0.25, 16, 4096) == pytest.approx(2 * base)
    assert v_star_tokens(2000, 0.5, 16, 2048) == pytest.approx(2 * base)
    assert v_star_tokens(4000, 0.5, 16, 4096) == pytest.approx(2 * base)


def test_rounding_never_closes_the_band():
    """Below four rounding steps of V* exit and enter may round to one value; enter stays one step above."""
    assert rounded_thresholds(35_000, 10_000, 1.25) == (40_000, 50_000)  # 35k and 43.75k both round to 40k
    assert rounded_thresholds(0.0, 10_000, 1.25, least=10_000) == (10_000, 20_000)
    assert rounded_thresholds(45_000, 10_000, 1.25) == (50_000, 60_000)  # the rounding's own band is kept
    assert rounded_thresholds(35_000, 10_000, 1.0) == (40_000, 40_000)  # no band asked, none made
    for v_star in range(0, 400_000, 2_500):
        exit_tokens, enter_tokens = rounded_thresholds(v_star, 10_000, 1.25)
        assert enter_tokens > exit_tokens and exit_tokens == round_to_step(v_star, 10_000)


def test_rounding_is_half_up_not_bankers():
    assert round_to_step(155_000, 10_000) == 160_000
    assert round_to_step(154_999, 10_000) == 150_000
    assert round_to_step(165_000, 10_000) == 170_000


@pytest.mark.parametrize("label,name", [
    ("NVIDIA-A100-SXM4-80GB", "A100-SXM4-80GB"),
    ("NVIDIA-A100-PCIE-40GB", "A100-40GB"),
    ("NVIDIA-H100-80GB-HBM3", "H100-SXM"),
    ("NVIDIA-H100-80GB-HBM3-SHARED", "H100-SXM"),  # time-slicing keeps the card's bandwidth
    ("NVIDIA-H200", "H200"),
    ("NVIDIA-RTX-A6000", "RTX-A6000"),
    ("NVIDIA-L40S", "L40S"),
    ("NVIDIA-L4", "L4"),
    ("NVIDIA-A10G", "A10G"),
    ("NVIDIA-B200", "B200"),
    ("nvidia h100 80gb hbm3", "H100-SXM"),
])
def test_gpu_feature_discovery_labels_resolve(label, name):
    assert lookup_device(label).name == name


def test_mig_slices_and_unknown_products_are_unknown():
    assert find_device("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb") is None
    with pytest.raises(UnknownDeviceError, match="unknown device 'NVIDIA-Z9'"):
        lookup_device("NVIDIA-Z9")


def test_catalogue_covers_the_required_devices_with_sane_numbers():
    names = {d.name for d in DEVICES}
    assert {"A100-SXM4-80GB", "A100-40GB", "H100-SXM", "H200", "RTX-A6000", "L40S", "L4", "A10G", "B200"} <= names
    for d in DEVICES:
        assert 100 <= d.bandwidth_gbps <= 10_000 and 50 <= d.dense_tflops <= 5_000
        assert 48 * 1024 <= d.shared_mem_per_block <= 228 * 1024
    labels = [label for d in DEVICES for label in d.gfd_products]
    assert len(labels) == len(set(labels))


@pytest.mark.parametrize("kwargs,field", [
    ({"bandwidth_gbps": 0}, "bandwidth_gbps"),
    ({"skip_ratio": 0.0}, "skip_ratio"),
    ({"skip_ratio": 1.5}, "skip_ratio"),
    ({"routed_layers": 0}, "routed_layers"),
    ({"kv_bytes": -1}, "kv_bytes"),
])
def test_bad_inputs_name_the_field(kwargs, field):
    args = {"bandwidth_gbps": 1935.0, "skip_ratio": 0.5, "routed_layers": 16, "kv_bytes": 4096} | kwargs
    with pytest.raises(ValueError, match=field):
        v_star_tokens(**args)


def test_model_facts_from_config():
    cfg = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "torch_dtype": "bfloat16", "routing_layers": list(range(16, 32))}
    facts = ModelFacts.from_config(cfg)
    assert (facts.head_dim, facts.kv_bytes_per_token_layer, facts.num_routed_layers) == (128, 4096, 16)
    assert ModelFacts.from_config(cfg | {"torch_dtype": "float32"}).kv_bytes_per_token_layer == 8192
    no_routes = {k: v for k, v in cfg.items() if k != "routing_layers"}
    assert ModelFacts.from_config(no_routes).routed_layers == tuple(range(16, 32))
    with pytest.raises(ModelConfigError, match="routing_layers"):
        ModelFacts.from_config(cfg | {"routing_layers": [40]})
    with pytest.raises(ModelConfigError, match="num_hidden_layers"):
        ModelFacts.from_config(cfg | {"num_hidden_layers": "32"})
    with pytest.raises(ModelConfigError, match="torch_dtype"):
        ModelFacts.from_config(cfg | {"torch_dtype": "int3"})


def test_decode_bytes_reads_every_weight_once_and_the_kv_the_project_only_rows_do_not_skip():
    """Llama-3-8B's shape: 436 MiB of weights per layer, 21 MiB of adapter (m = 14336 / 16) read where rows
    project; 4 KiB of K/V per resident token per layer (bf16)."""
    cfg = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "routing_layers": list(range(16, 32))}
    layer = {**cfg, "num_hidden_layers": 1, "routing_layers": [0], "vocab_size": 0}  # one routed layer alone
    weights, adapter = 4096 * (32 + 16) * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336, 3 * 4096 * 896
    assert decode_bytes(layer, 0, 0.0) == 2 * weights
    assert decode_bytes(layer, 0, 0.5) == 2 * (weights + adapter)
    assert decode_bytes(layer, 1000, 0.0) - decode_bytes(layer, 0, 0.0) == 1000 * 4096
    assert decode_bytes(layer, 1000, 0.5) - decode_bytes(layer, 0, 0.5) == 500 * 4096
    model = decode_bytes(cfg, 1000, 0.5) - decode_bytes(cfg, 0, 0.5)
    assert model == 1000 * 4096 * (32 - 8)  # a quarter of the model's layer reads skipped
    assert decode_bytes(cfg, 0, 0.5) - decode_bytes(cfg, 0, 0.0) == 16 * 2 * adapter
    with pytest.raises(ValueError, match="proj_reduction_factor"):
        decode_bytes(cfg | {"proj_reduction_factor": 5}, 0, 0.5)


def test_a_project_only_row_does_its_kv_and_the_projector_and_the_flop_limit_is_s_0s_work_over_the_skips():
    """Llama-3-8B's shape: a RUN row's multiply-adds at a layer are Q, K/V, the read over its context, o_proj and
    the MLP; a Project-Only row's are K/V and the projector (m = 896), and the read too where the backend reads
    every row. Half of 16 routed layers' rows Project-Only: a 1,024-token prompt does 1/1.2956 of s = 0's work."""
    cfg = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "routing_layers": list(range(16, 32))}
    macs = token_macs(cfg, 100, 0.5, 0.0)
    kv, read = 2 * 4096 * 8 * 128, 2 * 32 * 128 * 100
    assert macs["run_row"] == 4096 * 4096 + kv + read + 4096 * 4096 + 3 * 4096 * 14336
    assert macs["project_only_row"] == kv + 3 * 4096 * 896
    assert token_macs(cfg, 100, 0.5, 0.0, project_only_reads=True)["project_only_row"] == kv + 3 * 4096 * 896 + read
    assert macs["per_token"] == 16 * macs["run_row"] + 16 * (macs["run_row"] + macs["project_only_row"]) / 2
    assert token_macs(cfg, 100, 0.0, 1.0)["per_token"] == 32 * macs["run_row"] + 4096 * 128256
    assert flop_limit(cfg, 1024, 1, 0.5) == pytest.approx(1.2956, abs=1e-4)
    assert flop_limit(cfg, 1024, 1, 0.0) == 1.0
    assert flop_limit(cfg, 1024, 1, 0.5, project_only_reads=True) < flop_limit(cfg, 1024, 1, 0.5)
    assert flop_limit(cfg, 900, 120, 0.5) < flop_limit(cfg, 1024, 1, 0.5)  # decode: every token's logits, unskipped


def test_a_gemms_floor_is_its_bytes_at_the_bandwidth_below_the_ridge_and_its_flops_at_the_peak_above():
    """Llama-3-8B's MLP down on the H200 (4.8 TB/s, 989 TFLOP/s): at a decode batch of 128 rows it moves its 117 MB
    weight and the rows (25.5 us, where its multiply-adds take 15.2 us); over a 4,096-token prefill its
    multiply-adds take 486 us, its bytes 56 us. A gate-up reads two weights and writes one output, silu(g) * u."""
    h200 = lookup_device("H200")
    down = (4096 * 14336 + 128 * 14336 + 128 * 4096) * 2 / 4.8e12 * 1e3
    assert gemm_floor_ms(128, 4096, 14336, 1, 2, h200) == pytest.approx(down)
    assert gemm_floor_ms(4096, 4096, 14336, 1, 2, h200) == pytest.approx(2 * 4096 * 4096 * 14336 / 989e12 * 1e3)
    assert gemm_floor_ms(16, 14336, 4096, 2, 2, h200) == pytest.approx(
        (2 * 14336 * 4096 + 16 * 4096 + 16 * 14336) * 2 / 4.8e12 * 1e3)
    with pytest.raises(ValueError, match="must be positive"):
        gemm_floor_ms(0, 4096, 14336, 1, 2, h200)
