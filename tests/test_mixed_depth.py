"""Mixed-depth execution on CPU: route tape, cohort maps, routed layers against dense and a per-row reference,
Invariant 1 (every layer writes its own KV) and Invariant 2 (no stale or foreign row metadata), fuzzed."""

import random

import pytest
import torch
from mixed_world import TapeSkipper, World, random_routes
from torch.utils.flop_counter import FlopCounterMode

from vskipper.mixed.bench_stack import BenchStack
from vskipper.mixed.cohorts import CohortBuilder, build_cohorts
from vskipper.mixed.reference import reference_forward
from vskipper.mixed.tape import RouteTape
from vskipper.skippers.base import LayerRoute
from vskipper.skippers.static_depth import StaticDepth
from vskipper.skippers.trained_gate import FlexiDepthGate

CAPACITY = 8


@pytest.fixture(scope="module", params=["flexidepth", "qwen3"])
def model(request, tiny_flexidepth, tiny_qwen3):
    path = tiny_flexidepth if request.param == "flexidepth" else tiny_qwen3
    return BenchStack.from_pretrained(path, capacity=CAPACITY)


def prefilled_world(model, seed, n_requests=5, skipper=None):
    world = World(model, n_requests, seed)
    ids, batch = world.prefill_batch({r: world.rng.randint(1, 5) for r in range(n_requests)})
    model(ids, batch, world.kv, skipper)
    return world


# -- route tape ------------------------------------------------------------------------------------------------

def test_tape_records_routes_in_place_and_pads_with_unit_run():
    tape = RouteTape(6, (2, 3))
    run_ptr, w_ptr = tape.run.data_ptr(), tape.weights.data_ptr()
    tape.record(3, LayerRoute(torch.zeros(6, 1, dtype=torch.bool), torch.full((6, 1), 0.5)))
    tape.record(2, LayerRoute(torch.zeros(6, 1, dtype=torch.bool), torch.full((6, 1), 0.5)))
    tape.pad(3)  # a pass of three rows: every layer's rows past them RUN with unit weight
    tape.record(3, LayerRoute(torch.tensor([[True], [False], [False]]), torch.tensor([[0.7], [0.2], [0.4]])))
    run, w = tape.layer(3)
    assert run.tolist() == [True, False, False, True, True, True]
    assert w.tolist() == pytest.approx([0.7, 0.2, 0.4, 1, 1, 1])
    assert tape.layer(2)[0].tolist() == [False] * 3 + [True] * 3  # padded too, its first rows as recorded
    tape.pad(6)  # a full pass: nothing past it
    tape.record(3, LayerRoute(torch.zeros(6, 1, dtype=torch.bool), torch.full((6, 1), 0.5)))
    assert tape.layer(3, 6)[0].tolist() == [False] * 6
    assert (tape.run.data_ptr(), tape.weights.data_ptr()) == (run_ptr, w_ptr)  # no reallocation


def test_tape_rejects_more_rows_than_capacity_and_unknown_layers():
    tape = RouteTape(2, (5,))
    with pytest.raises(ValueError, match="capacity 2"):
        tape.record(5, LayerRoute(torch.ones(3, 1, dtype=torch.bool), torch.ones(3, 1)))
    with pytest.raises(KeyError, match="layer 4 is not a routed layer"):
        tape.layer(4)


# -- cohort maps -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_cohort_maps_list_each_cohort_in_batch_order_with_device_counts(seed):
    rng = random.Random(seed)
    builder = CohortBuilder(16)
    for rows in (1, 5, 16, 3):  # one builder, shrinking and growing row sets: nothing carries over
        share = rng.choice([0.0, 1.0, rng.random()])
        mask = torch.tensor([rng.random() >= share for _ in range(rows)])
        c = builder.build(mask)
        run_rows = mask.nonzero().view(-1).tolist()
        proj_rows = (~mask).nonzero().view(-1).tolist()
        assert c.n_run.shape == (1,) and c.n_proj.shape == (1,)
        assert c.host_counts() == (len(run_rows), len(proj_rows))
        assert c.run_idx.shape == (rows,) and c.proj_idx.shape == (rows,)
        assert c.run_idx[: len(run_rows)].tolist() == run_rows
        assert c.proj_idx[: len(proj_rows)].tolist() == proj_rows
        fresh = build_cohorts(mask)
        assert torch.equal(fresh.run_idx, c.run_idx) and torch.equal(fresh.proj_idx, c.proj_idx)


# -- routed forward vs dense and vs the per-row reference --------------------------------------------------------

@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_all_run_routed_forward_equals_dense_forward(model, phase):
    dense_world = prefilled_world(model, seed=1)
    routed_world = prefilled_world(model, seed=1, skipper=StaticDepth(0.0))
    if phase == "prefill":
        args = [w.prefill_batch({0: 3, 2: 2, 4: 1}) for w in (dense_world, routed_world)]
    else:
        args = [w.decode_batch([3, 0, 4, 1], padding=2) for w in (dense_world, routed_world)]
    dense = model(*args[0], dense_world.kv)
    passes = model.stats.all_run_fast_path
    routed = model(*args[1], routed_world.kv, StaticDepth(0.0))
    assert model.stats.all_run_fast_path == passes + len(model.routed_layers)
    valid = args[0][1].valid
    torch.testing.assert_close(routed[valid], dense[valid], rtol=0, atol=1e-6)
    torch.testing.assert_close(routed_world.kv.k, dense_world.kv.k, rtol=0, atol=1e-6)
    torch.testing.assert_close(routed_world.kv.v, dense_world.kv.v, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["random", "all_run", "all_project"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_mixed_routes_match_the_per_row_reference(model, phase, mode):
    for seed in range(3):
        world = prefilled_world(model, seed=10 + seed)
        if phase == "prefill":
            ids, batch = world.prefill_batch({1: 3, 3: 2, 4: 3})
        else:
            # ragged: from one row to the full capacity, padding rows included
            n = world.rng.randint(1, 5)
            ids, batch = world.decode_batch(world.rng.sample(range(5), n), padding=world.rng.randint(0, 3))
        routes = random_routes(model.routed_layers, batch.rows, world.rng, batch.valid, mode)
        ref_kv = world.fork_cache()
        routed = model(ids, batch, world.kv, TapeSkipper(routes))
        expected = reference_forward(model, ids, batch, ref_kv, routes)
        torch.testing.assert_close(routed[batch.valid], expected[batch.valid], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(world.kv.k[:, 1:], ref_kv.k[:, 1:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(world.kv.v[:, 1:], ref_kv.v[:, 1:], rtol=1e-5, atol=1e-5)


def test_routed_forward_with_the_trained_gate_matches_the_reference_on_the_gates_own_routes(model):
    world = prefilled_world(model, seed=7)
    ids, batch = world.decode_batch([4, 2, 0, 1, 3], padding=1)
    ref_kv = world.fork_cache()
    routed = model(ids, batch, world.kv, FlexiDepthGate())
    tape = model.last_tape
    routes = {layer: tuple(t.clone() for t in tape.layer(layer, batch.rows)) for layer in model.routed_layers}
    expected = reference_forward(model, ids, batch, ref_kv, routes)
    torch.testing.assert_close(routed[batch.valid], expected[batch.valid], rtol=1e-5, atol=1e-5)


def test_project_only_rows_skip_the_mlp_and_attention_work_on_cpu(model):
    """The torch backend bounds the work by the cohort sizes: all-Project-Only does fewer FLOPs than dense."""
    flops = {}
    for name, skipper in (("dense", None), ("routed", StaticDepth(1.0))):
        world = prefilled_world(model, seed=3)
        ids, batch = world.decode_batch([0, 1, 2, 3, 4])
        with FlopCounterMode(display=False) as counter:
            model(ids, batch, world.kv, skipper)
        flops[name] = counter.get_total_flops()
    c = model.config
    mlp = 3 * 2 * c["hidden_size"] * c["intermediate_size"]
    proj = 3 * 2 * c["hidden_size"] * c["intermediate_size"] // 16
    saved_at_least = 5 * len(model.routed_layers) * (mlp - proj)
    assert flops["dense"] - flops["routed"] >= saved_at_least


# -- Invariant 1 ---------------------------------------------------------------------------------------------

def test_every_layer_writes_its_own_kv_for_every_position(model):
    """Prefill then decode steps with random mixed routes: every (layer, position) slot of every request holds
    that layer's own k/v projection of that token's input to the layer, Project-Only rows included."""
    world = World(model, 4, seed=21)
    expected = {}  # slot -> (layer -> (k, v))
    steps = [world.prefill_batch({0: 3, 1: 1, 2: 4, 3: 2})]
    for _ in range(3):
        steps.append(world.decode_batch(world.rng.sample(range(4), 3), padding=1))
    projected = 0
    for ids, batch in steps:
        routes = random_routes(model.routed_layers, batch.rows, world.rng, batch.valid)
        projected += sum(int((~run).sum()) for run, _ in routes.values())
        inputs = []
        model(ids, batch, world.kv, TapeSkipper(routes), layer_inputs=inputs)
        for layer, x in zip(model.model.layers, inputs, strict=True):
            k, v = layer.self_attn.project_kv(layer.input_layernorm(x), batch.positions)
            for i in range(batch.rows):
                if batch.valid[i]:
                    slot = int(world.kv.req_to_token[batch.req_indices[i], batch.positions[i]])
                    expected.setdefault(slot, {})[layer.layer_id] = (k[i], v[i])
    assert projected > 0
    assert len(expected) == sum(world.lengths.values())
    for slot, per_layer in expected.items():
        assert sorted(per_layer) == list(range(model.config["num_hidden_layers"]))
        for layer, (k, v) in per_layer.items():
            torch.testing.assert_close(world.kv.k[layer, slot], k, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(world.kv.v[layer, slot], v, rtol=1e-6, atol=1e-6)


# -- Invariant 2 ---------------------------------------------------------------------------------------------

def _fill_foreign(world, owned, value):
    slots = torch.tensor([s for s in range(1, world.kv.num_slots) if s not in owned])
    world.kv.k[:, slots] = value
    world.kv.v[:, slots] = value
    return slots


@pytest.mark.parametrize("seed", range(8))
def test_canaries_in_other_requests_pages_are_never_read_nor_written(model, seed):
    """Fuzzed: random batch compositions, page permutations, phases and tapes. Every slot the batch's requests
    do not own (other requests' pages, spare pages) holds a canary; swapping NaN canaries for large finite ones
    changes no output, and after the step the canaries are intact."""
    rng = random.Random(seed)
    outputs = []
    for canary in (float("nan"), 1e4):
        world = prefilled_world(model, seed=100 + seed, n_requests=6)
        rng.seed(seed)  # the same composition and tape for both canaries
        members = rng.sample(range(6), rng.randint(1, 5))
        if rng.random() < 0.5:
            ids, batch = world.decode_batch(members, padding=rng.randint(0, CAPACITY - len(members)))
        else:
            ids, batch = world.prefill_batch({r: rng.randint(1, 2) for r in members})
        owned = world.owned_slots(members)
        foreign = _fill_foreign(world, owned, canary)
        routes = random_routes(model.routed_layers, batch.rows, rng, batch.valid)
        out = model(ids, batch, world.kv, TapeSkipper(routes))
        assert torch.isfinite(out[batch.valid]).all()
        after_k, after_v = world.kv.k[:, foreign], world.kv.v[:, foreign]
        if canary != canary:
            assert after_k.isnan().all() and after_v.isnan().all()
        else:
            assert (after_k == canary).all() and (after_v == canary).all()
        outputs.append(out[batch.valid])
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)


def test_model_attests_the_backend_it_chose(model):
    world = prefilled_world(model, seed=5)
    model(*world.decode_batch([0, 1]), world.kv, StaticDepth(0.5))
    att = model.attestation()
    assert att["decode_backend"] == "torch" and att["prefill_backend"] == "torch"
    assert att["backends_used"]["decode"] == "torch" and att["cohort_counts"] == "cohort shapes"
    assert att["routed_layers"] == list(model.routed_layers)


def test_a_decode_batch_over_the_capacity_is_refused_but_a_long_prefill_is_routed(model):
    world = World(model, 2, seed=0)
    ids, batch = world.prefill_batch({0: 9, 1: 9})
    ref_kv = world.fork_cache()
    routes = random_routes(model.routed_layers, batch.rows, world.rng, batch.valid)
    out = model(ids, batch, world.kv, TapeSkipper(routes))
    torch.testing.assert_close(out, reference_forward(model, ids, batch, ref_kv, routes), rtol=1e-5, atol=1e-5)
    ids, batch = world.decode_batch([0, 1], padding=CAPACITY - 1)
    with pytest.raises(ValueError, match="exceeds the routed capacity"):
        model(ids, batch, world.kv, StaticDepth(0.5))


def test_qwen3_project_only_rows_write_k_normed_per_head_before_rope(tiny_qwen3):
    """Checked against an independent RoPE (complex rotation of the (i, i + d/2) pairs): the cached K of a row
    that projects at every routed layer is RoPE(k_norm(k_proj(LN1 x))), not k_norm(RoPE(...))."""
    model = BenchStack.from_pretrained(tiny_qwen3, capacity=CAPACITY)
    world = World(model, 2, seed=4)
    model(*world.prefill_batch({0: 3, 1: 2}), world.kv)
    ids, batch = world.decode_batch([1, 0])
    inputs = []
    model(ids, batch, world.kv, StaticDepth(1.0), layer_inputs=inputs)
    attn = model.model.layers[model.routed_layers[-1]].self_attn
    layer = model.routed_layers[-1]
    hd = attn.head_dim
    inv = 1.0 / (attn.theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    angle = batch.positions.double()[:, None] * inv[None, :]  # [rows, hd/2]

    def rope(t):
        pairs = torch.complex(t[..., : hd // 2].double(), t[..., hd // 2 :].double()) * torch.polar(
            torch.ones_like(angle), angle)[:, None, :]
        return torch.cat([pairs.real, pairs.imag], dim=-1).float()

    with torch.no_grad():
        raw = attn.k_proj(model.model.layers[layer].input_layernorm(inputs[layer])).view(2, attn.kv_heads, hd)
        expected, wrong_order = rope(attn.k_norm(raw)), attn.k_norm(rope(raw))
    cached = world.kv.k[layer, world.kv.req_to_token[batch.req_indices, batch.positions]]
    torch.testing.assert_close(cached, expected, rtol=1e-5, atol=1e-5)
    assert (cached - wrong_order).abs().max() > 1e-3  # the order is observable with these norm weights


def test_dense_mode_rows_in_a_routed_batch_compute_the_dense_forward(model):
    """A mixed-mode batch takes the routed path with dense-mode rows forced to RUN with unit weight; those rows'
    outputs equal a dense step of the same batch (rows are independent; to a few float32 ulps, since the routed
    path multiplies a subset of rows, whose sums a GEMM may block differently), while routed rows do differ."""
    outs = []
    for skipper in (None, StaticDepth(1.0)):
        world = prefilled_world(model, seed=31)
        ids, batch = world.decode_batch([4, 1, 3, 0, 2])
        batch.dense_rows = torch.tensor([True, False, True, False, True])
        outs.append(model(ids, batch, world.kv, skipper))
    dense, mixed = outs
    torch.testing.assert_close(mixed[batch.dense_rows], dense[batch.dense_rows], rtol=1e-6, atol=1e-6)
    assert (mixed[~batch.dense_rows] - dense[~batch.dense_rows]).abs().max() > 1e-3
    run, weights = model.last_tape.layer(model.routed_layers[0], 5)
    assert run.tolist() == batch.dense_rows.tolist() and (weights[batch.dense_rows] == 1).all()
