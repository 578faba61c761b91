"""Routed layers are built by upstream's own layer factory (`layers_built_routed`), and the Llama routed layer
hands its output on as upstream's layers do (`Handoff`: delta and residual, summed by the next fused add-norm).

Runs SGLang's real model classes (`LlamaModel`, `Qwen3Model`) and decoder layers in this process on CPU
(`sglang_layer_world`); a whole server is not needed to see which classes the factory built.
"""

from __future__ import annotations

import pytest
import torch
from sglang_layer_world import ARCHS, LayerWorld, init_sglang


def _upstream(arch: str):
    if arch == "flexidepth-llama":
        from sglang.srt.models import llama

        from vskipper.sglang.models.ddllama import DDLlamaForCausalLM

        return llama, llama.LlamaModel, DDLlamaForCausalLM
    from sglang.srt.models import qwen3

    from vskipper.sglang.models.qwen3_skipper import Qwen3SkipperForCausalLM

    return qwen3, qwen3.Qwen3Model, Qwen3SkipperForCausalLM


def _config(arch: str, tmp_path):
    from transformers import AutoConfig

    from vskipper.checkpoint import make_tiny_model
    from vskipper.sglang.configs import register_configs

    register_configs()
    return AutoConfig.from_pretrained(str(make_tiny_model(arch, tmp_path / arch)))


@pytest.mark.parametrize("arch", ARCHS)
def test_upstream_factory_builds_each_routed_layer_once_with_upstream_arguments(arch, tmp_path, monkeypatch):
    init_sglang()
    from vskipper.sglang.models.routed import StepSlot, layers_built_routed

    config = _config(arch, tmp_path)
    module, model_class, causal_lm = _upstream(arch)
    assert causal_lm.upstream_layer[0] is module
    layer_name = causal_lm.upstream_layer[1]
    upstream_layer = getattr(module, layer_name)
    built: list[tuple[str, int]] = []
    init = upstream_layer.__init__

    def counting_init(self, *args, **kwargs):
        built.append((type(self).__name__, kwargs["layer_id"]))
        init(self, *args, **kwargs)

    monkeypatch.setattr(upstream_layer, "__init__", counting_init)
    routed = tuple(config.routing_layers)
    slot = StepSlot()
    with layers_built_routed(module, layer_name, causal_lm.routed_layer_class, routed, slot):
        model = model_class(config, quant_config=None, prefix="model")
    assert getattr(module, layer_name) is upstream_layer  # the factory's name is upstream's class again

    n = config.num_hidden_layers
    expected = [(causal_lm.routed_layer_class.__name__ if i in routed else upstream_layer.__name__, i)
                for i in range(n)]
    assert built == expected  # one construction per layer: no upstream layer built and thrown away
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, causal_lm.routed_layer_class) == (i in routed)
        assert layer.self_attn.attn.layer_id == i
    first = model.layers[routed[0]]
    assert first._slot is slot and hasattr(first, "router") and hasattr(first, "router_proj")
    names = {name for name, _ in model.named_parameters()}
    assert f"layers.{routed[0]}.router_proj.gate_proj.weight" in names


@pytest.mark.parametrize("arch", ARCHS)
def test_model_refuses_an_upstream_that_no_longer_builds_layers_by_the_declared_name(arch, tmp_path, monkeypatch):
    """If upstream stops looking its layer class up by that name, the skipper model would silently serve dense
    layers without routers: it refuses to construct, naming the layer and the name."""
    init_sglang()
    config = _config(arch, tmp_path)
    module, _, causal_lm = _upstream(arch)

    class Elsewhere:  # a module where upstream's factory name no longer resolves to anything it calls
        pass

    setattr(Elsewhere, causal_lm.upstream_layer[1], getattr(module, causal_lm.upstream_layer[1]))
    Elsewhere.__name__ = "elsewhere"
    monkeypatch.setattr(causal_lm, "upstream_layer", (Elsewhere, causal_lm.upstream_layer[1]))
    monkeypatch.setattr("vskipper.sglang.models.routed.get_runtime",
                        lambda *a, **k: pytest.fail("the layers are checked before the runtime is built"))
    with pytest.raises(RuntimeError, match=rf"layer {config.routing_layers[0]} was built as .*upstream no longer "
                                           rf"builds its layers by elsewhere\.{causal_lm.upstream_layer[1]}"):
        causal_lm(config)


@pytest.fixture(scope="module")
def llama_world(tmp_path_factory):
    return LayerWorld.prefilled("flexidepth-llama", tmp_path_factory.mktemp("factory"), seed=5, prompts={0: 5, 1: 3})


def _forward(world: LayerWorld, fb, hidden, residual, run=None, weights=None):
    """The Llama layer's forward with SGLang's (hidden_states, residual) pair; `run` None: the dense forward."""
    from mixed_world import TapeSkipper

    from vskipper.mixed.cohorts import CohortBuilder
    from vskipper.mixed.tape import RouteTape
    from vskipper.sglang.models.routed import plan_pass
    from vskipper.sglang.runtime import Step

    layer, rows = world.layer, hidden.shape[0]
    lid = layer.layer_id
    if run is not None:
        world.slot.step = Step("decode", True, TapeSkipper({lid: (run, weights)}), None, RouteTape(rows, (lid,)),
                               CohortBuilder(rows), None, rows)
        world.slot.plan = plan_pass(fb, rows)
    try:
        with world.context(), torch.no_grad():
            return layer(fb.positions, hidden.clone(), fb, None if residual is None else residual.clone())
    finally:
        world.slot.step = world.slot.plan = None


@pytest.mark.parametrize("first_layer", [True, False], ids=["embeddings-in", "pair-in"])
def test_llama_all_run_hands_on_upstream_pair(llama_world, first_layer):
    """Every row RUN with unit weight: the routed layer hands on what upstream's layer hands on, the pair itself
    (delta = MLP output, residual = h), not (y, 0)."""
    world = llama_world
    kv0, lengths0 = world.kv(), list(world.lengths)
    hidden = world.hidden(2)
    residual = None if first_layer else world.hidden(2)
    fb = world.batch({0: 1, 1: 1})
    dense = _forward(world, fb, hidden, residual)
    world.restore(kv0, lengths0)
    fb = world.batch({0: 1, 1: 1})
    routed = _forward(world, fb, hidden, residual, torch.ones(2, dtype=torch.bool), torch.ones(2))
    world.restore(kv0, lengths0)
    assert isinstance(routed, tuple) and len(routed) == 2
    torch.testing.assert_close(routed[1], dense[1], rtol=1e-6, atol=1e-6)  # residual: h
    torch.testing.assert_close(routed[0], dense[0], rtol=1e-6, atol=1e-6)  # delta: the MLP's output
    assert routed[1].abs().sum() > 0 and routed[0].abs().sum() > 0


def test_llama_mixed_rows_hand_on_the_body_pair_whose_sum_is_the_layer_output(llama_world):
    """One RUN row and one Project-Only row, weights not one: residual is h (RUN) and x (Project-Only); the sum
    is the routed body's y on the summed input (which the layer tests hold to the per-row reference)."""
    world = llama_world
    kv0, lengths0 = world.kv(), list(world.lengths)
    hidden, residual = world.hidden(2), world.hidden(2)
    run, weights = torch.tensor([True, False]), torch.tensor([0.75, 0.5])
    fb = world.batch({0: 1, 1: 1})
    delta, res = _forward(world, fb, hidden, residual, run, weights)
    world.restore(kv0, lengths0)
    fb = world.batch({0: 1, 1: 1})
    y = world.routed(fb, hidden + residual, run, weights)
    world.restore(kv0, lengths0)
    x = hidden + residual
    torch.testing.assert_close(res[1], x[1])  # the Project-Only row's residual is its input
    assert not torch.equal(res[0], x[0])  # the RUN row's is h = x + attention
    torch.testing.assert_close(res + delta, y, rtol=1e-5, atol=1e-5)


def test_the_standalone_layer_prepares_cpu_or_cuda_and_one_of_them_per_process():
    """`StandaloneLayer(device=...)` publishes SGLang's context for its device type; a second type in the same
    process is refused by name (SGLang picked its platform when first imported), as is a device it has no profile
    for. (The CUDA path itself runs only on a GPU: `benchmarks/mixed_depth_bench.py`, section 4.)"""
    from vskipper.sglang.standalone import device_process

    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'xpu'"):
        device_process("xpu")
    init_sglang()
    with pytest.raises(RuntimeError, match="published for cpu, not cuda"):
        init_sglang("cuda")
