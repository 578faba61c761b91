"""Tiny checkpoints carry the real layout, and the loader reads routers/adapters by their real names."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from vskipper.checkpoint import load_skipper_modules, make_tiny_model
from vskipper.modelspec import load_model_facts


def test_flexidepth_tiny_checkpoint_has_the_released_layout(tiny_flexidepth):
    cfg = json.loads((tiny_flexidepth / "config.json").read_text())
    assert cfg["architectures"] == ["DDLlamaForCausalLM"] and cfg["model_type"] == "ddllama"
    assert cfg["routing_layers"] == [2, 3] and cfg["router_reduction_factor"] == 16
    t = load_file(str(tiny_flexidepth / "model.safetensors"))
    d, inter = cfg["hidden_size"], cfg["intermediate_size"]
    r, m = d // 16, inter // 16
    for layer in (2, 3):
        p = f"model.layers.{layer}."
        assert t[p + "router.router_enc.weight"].shape == (r, d)
        assert t[p + "router.router_norm.weight"].shape == (r,)
        assert t[p + "router.router_dec.weight"].shape == (d, r)
        assert t[p + "router.router_head.weight"].shape == (1, d)
        assert t[p + "router_proj.gate_proj.weight"].shape == (m, d)
        assert t[p + "router_proj.down_proj.weight"].shape == (m, d)  # d -> m despite the name
        assert t[p + "router_proj.up_proj.weight"].shape == (d, m)
    assert not any(k.startswith(("model.layers.0.router", "model.layers.1.router")) for k in t)
    assert "lm_head.weight" in t and "model.layers.0.self_attn.q_norm.weight" not in t
    facts = load_model_facts(str(tiny_flexidepth))
    assert facts.routed_layers == (2, 3) and facts.kv_bytes_per_token_layer == 2 * 2 * 16 * 4


def test_qwen3_tiny_checkpoint_has_qk_norms_and_tied_embeddings(tiny_qwen3):
    cfg = json.loads((tiny_qwen3 / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_skipper" and cfg["tie_word_embeddings"] is True
    t = load_file(str(tiny_qwen3 / "model.safetensors"))
    assert t["model.layers.0.self_attn.q_norm.weight"].shape == (cfg["head_dim"],)
    assert t["model.layers.3.self_attn.k_norm.weight"].shape == (cfg["head_dim"],)
    assert "lm_head.weight" not in t


def test_same_seed_same_weights_and_dtype_option(tmp_path):
    a = load_file(str(make_tiny_model("flexidepth-llama", tmp_path / "a", seed=3) / "model.safetensors"))
    b = load_file(str(make_tiny_model("flexidepth-llama", tmp_path / "b", seed=3) / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    h = load_file(str(make_tiny_model("flexidepth-llama", tmp_path / "h", dtype="bfloat16") / "model.safetensors"))
    assert {v.dtype for v in h.values()} == {torch.bfloat16}


def test_loader_names_a_missing_or_misshapen_tensor(tmp_path, tiny_flexidepth):
    t = load_file(str(tiny_flexidepth / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_flexidepth / "config.json").read_text())
    broken = dict(t)
    del broken["model.layers.3.router.router_head.weight"]
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="model.layers.3.router.router_head.weight"):
        load_skipper_modules(tmp_path)
    broken = dict(t)
    broken["model.layers.2.router_proj.up_proj.weight"] = torch.zeros(3, 3)
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"router_proj.up_proj.weight' has shape \(3, 3\)"):
        load_skipper_modules(tmp_path)


def test_loader_refuses_a_checkpoint_without_routed_layers(tmp_path, tiny_flexidepth):
    cfg = json.loads((tiny_flexidepth / "config.json").read_text())
    del cfg["routing_layers"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="routing_layers"):
        load_skipper_modules(tmp_path)


def test_projector_adapter_matches_its_formula(tiny_flexidepth):
    t = load_file(str(tiny_flexidepth / "model.safetensors"))
    _, adapter = load_skipper_modules(tiny_flexidepth)[3]
    v = torch.randn(5, 64)
    p = "model.layers.3.router_proj."
    want = (torch.nn.functional.silu(v @ t[p + "gate_proj.weight"].T) * (v @ t[p + "down_proj.weight"].T)) \
        @ t[p + "up_proj.weight"].T
    torch.testing.assert_close(adapter(v), want)
