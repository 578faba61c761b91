"""Skipper plugins: the contract (shapes, device, dtype, no host sync), each policy's semantics, the registry."""

import math
import random
import re

import pytest
import torch

from vskipper.checkpoint import load_skipper_modules
from vskipper.skippers import (
    Action,
    SkipperConfigError,
    SkipperEntry,
    build_skipper,
    get_entry,
    register_skipper,
    unregister_skipper,
)
from vskipper.skippers.base import BatchContext, LayerRoute, Skipper
from vskipper.skippers.random_skip import RandomSkip, reference_routes
from vskipper.skippers.static_depth import tail_layers

ROUTED = tuple(range(16, 32))


def batch(rows=8, hidden=64, keys=None, positions=None, valid=None, dtype=torch.float32, routed=ROUTED,
          phase="decode"):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    valid = torch.ones(rows, dtype=torch.bool) if valid is None else valid
    keys = torch.arange(rows, dtype=torch.int64) if keys is None else keys
    positions = torch.full((rows,), 7, dtype=torch.int64) if positions is None else positions
    return BatchContext(x, valid, routed, phase, keys, positions)


def routes(skipper, ctx, routers=None):
    state = skipper.prepare_batch(ctx)
    out = {}
    for layer in ctx.routed_layers:
        router = routers[layer][0] if routers else None
        out[layer] = skipper.route(layer, ctx.hidden_states, state, router)
    return out


def check_contract(route: LayerRoute, ctx: BatchContext):
    assert route.run_mask.shape == (ctx.rows, 1) and route.run_mask.dtype == torch.bool
    assert route.weights.shape == (ctx.rows, 1) and route.weights.dtype == ctx.hidden_states.dtype
    assert route.run_mask.device == ctx.hidden_states.device == route.weights.device
    assert bool(route.run_mask[~ctx.valid_rows].all())  # padding rows always RUN


# ---- RandomSkip -----------------------------------------------------------------------------------------

def test_random_skip_matches_the_pure_python_reference_bit_for_bit():
    rng = random.Random(1)
    keys = torch.tensor([rng.randrange(-2**63, 2**63) for _ in range(64)], dtype=torch.int64)
    pos = torch.tensor([rng.randrange(0, 1 << 20) for _ in range(64)], dtype=torch.int64)
    sk = build_skipper("random_skip", {"r": 0.5, "d": 0.5, "seed": 1234})
    ctx = batch(64, keys=keys, positions=pos)
    got = torch.cat([~r.run_mask for r in routes(sk, ctx).values()], dim=1)
    want = torch.tensor([reference_routes(1234, int(k), int(p), 0.5, 0.5, len(ROUTED))
                         for k, p in zip(keys, pos, strict=True)])
    assert torch.equal(got, want)


def test_random_skip_routes_on_cpu_through_numpy_equal_the_device_chain_of_tensor_ops():
    """On CPU `prepare_batch` runs the hash as numpy's ufuncs over the tensors' memory; a device runs the same
    functions as tensor ops. Both agree bit for bit, padding rows included (they always RUN)."""
    rng = random.Random(2)
    rows = 48
    keys = torch.tensor([rng.randrange(-2**63, 2**63) for _ in range(rows)], dtype=torch.int64)
    pos = torch.tensor([rng.randrange(0, 1 << 20) for _ in range(rows)], dtype=torch.int64)
    valid = torch.rand(rows, generator=torch.Generator().manual_seed(2)) < 0.8
    sk = build_skipper("random_skip", {"r": 0.6, "d": 0.4, "seed": 99})
    state = sk.prepare_batch(batch(rows, keys=keys, positions=pos, valid=valid))
    layers = len(ROUTED)
    chain = sk._run(keys, pos, valid, torch.arange(layers, dtype=torch.int64))  # the tensor ops
    assert isinstance(chain, torch.Tensor)
    assert torch.equal(state["run"].squeeze(-1), chain)
    assert bool(chain[:, ~valid].all()) and not bool(chain[:, valid].all())
    want = torch.tensor([reference_routes(99, int(k), int(p), 0.6, 0.4, layers) for k, p in zip(keys, pos, strict=True)])
    assert torch.equal(~chain[:, valid], want[valid].T)


def test_random_skip_routes_do_not_depend_on_batch_composition():
    """The same (request, position) gets the same routes alone, in a big batch, permuted, or with padding."""
    sk = build_skipper("random_skip", {"r": 0.5, "d": 0.75, "seed": 7})
    keys = torch.arange(100, 140, dtype=torch.int64) * 104729
    pos = torch.arange(40, dtype=torch.int64) * 3

    def table(k, p, valid=None):
        rs = routes(sk, batch(len(k), keys=k, positions=p, valid=valid))
        return torch.cat([~r.run_mask for r in rs.values()], dim=1)

    full = table(keys, pos)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(table(keys[perm], pos[perm]), full[perm])
    for i in (0, 17, 39):
        assert torch.equal(table(keys[i:i + 1], pos[i:i + 1]), full[i:i + 1])
    padded_valid = torch.cat([torch.ones(40, dtype=torch.bool), torch.zeros(8, dtype=torch.bool)])
    padded = table(torch.cat([keys, keys[:8]]), torch.cat([pos, pos[:8]]), padded_valid)
    assert torch.equal(padded[:40], full) and not padded[40:].any()


@pytest.mark.parametrize("r", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("d", [0.25, 0.5, 0.75])
def test_random_skip_realized_ratio_is_within_two_percent_of_r_times_d(r, d):
    """10k rows: 200 requests x 50 consecutive decode positions, 16 routed layers."""
    sk = build_skipper("random_skip", {"r": r, "d": d, "seed": 99})
    keys = (torch.arange(200, dtype=torch.int64) * 2654435761).repeat_interleave(50)
    pos = torch.arange(50, dtype=torch.int64).repeat(200) + 300
    rs = routes(sk, batch(10_000, keys=keys, positions=pos))
    projected = sum(int((~rt.run_mask).sum()) for rt in rs.values())
    realized = projected / (10_000 * len(ROUTED))
    assert abs(realized - r * d) <= 0.02 * r * d, realized


def test_random_skip_edges_route_nothing_or_everything():
    none = routes(build_skipper("random_skip", {"r": 0.0, "d": 1.0}), batch(32))
    assert all(bool(rt.run_mask.all()) for rt in none.values())
    every = routes(build_skipper("random_skip", {"r": 1.0, "d": 1.0}), batch(32))
    assert not any(bool(rt.run_mask.any()) for rt in every.values())


def test_random_skip_needs_request_keys_and_positions():
    ctx = batch(4)
    ctx.request_keys = None
    with pytest.raises(ValueError, match="request_keys and positions"):
        build_skipper("random_skip", {"r": 0.5, "d": 0.5}).prepare_batch(ctx)


# ---- StaticDepth ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("ratio,projected", [(0.0, 0), (0.5, 8), (0.25, 4), (1.0, 16)])
def test_static_depth_projects_a_tail_for_every_valid_row(ratio, projected):
    valid = torch.tensor([True] * 6 + [False] * 2)
    ctx = batch(8, valid=valid)
    rs = routes(build_skipper("static_depth", {"ratio": ratio}), ctx)
    tail = tail_layers(ROUTED, ratio)
    assert len(tail) == projected and tail == frozenset(ROUTED[len(ROUTED) - projected:])
    for layer, rt in rs.items():
        check_contract(rt, ctx)
        expected_run = ~valid if layer in tail else torch.ones(8, dtype=torch.bool)
        assert torch.equal(rt.run_mask.view(-1), expected_run)
        assert bool((rt.weights == 1).all())


@pytest.mark.parametrize("ratio,layers,projected", [(0.5, 16, 8), (0.3, 16, 4), (0.0, 16, 0), (1.0, 2, 2),
                                                     (0.05, 20, 1)])
def test_static_depth_declares_the_share_its_whole_layers_carry_out(ratio, layers, projected):
    entry = get_entry("static_depth")
    assert entry.declared_skip_ratio({"ratio": ratio}) == ratio
    assert entry.declared_skip_ratio({"ratio": ratio}, layers) == pytest.approx(projected / layers)
    assert len(tail_layers(tuple(range(layers)), ratio)) == projected


@pytest.mark.parametrize("layers", [3, 9, 12, 16, 28, 48])
def test_a_static_depth_ratio_that_projects_no_layer_is_refused_naming_it_and_the_least_that_does(layers):
    entry = get_entry("static_depth")
    with pytest.raises(SkipperConfigError, match=rf"spec\.params\.ratio: 0\.01 of {layers} routed layers projects "
                                                 rf"no layer.*least ratio that projects a layer is 1/{layers} "
                                                 r"\(at least ([0-9.]+);") as err:
        entry.declared_skip_ratio({"ratio": 0.01}, layers, where="spec.params")
    least = float(re.search(r"at least ([0-9.]+);", str(err.value))[1])
    assert entry.declared_skip_ratio({"ratio": least}, layers) == pytest.approx(1 / layers)  # what it suggests serves
    with pytest.raises(SkipperConfigError, match=r"spec\.params\.ratio: the model has no routed layer"):
        entry.declared_skip_ratio({"ratio": 0.5}, 0, where="spec.params")


def test_skippers_that_route_rows_declare_their_params_share_on_any_layers():
    assert get_entry("random_skip").declared_skip_ratio({"r": 0.5, "d": 0.3, "seed": 0}, 16) == pytest.approx(0.15)
    assert get_entry("flexidepth").declared_skip_ratio({"skip_ratio": 0.01}, 16) == 0.01


# ---- trained gates on a tiny checkpoint -----------------------------------------------------------------

def manual_router_weight(u, prefix, tensors, eps):
    z = u @ tensors[prefix + "router_enc.weight"].T
    z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * tensors[prefix + "router_norm.weight"]
    return torch.sigmoid(torch.tanh(z) @ tensors[prefix + "router_dec.weight"].T
                         @ tensors[prefix + "router_head.weight"].T)


@pytest.mark.parametrize("fixture", ["tiny_flexidepth", "tiny_qwen3"])
def test_trained_gates_follow_the_router_weight(fixture, request):
    from safetensors.torch import load_file

    ckpt = request.getfixturevalue(fixture)
    cfg = __import__("json").loads((ckpt / "config.json").read_text())
    modules = load_skipper_modules(ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    routed = tuple(cfg["routing_layers"])
    valid = torch.tensor([True] * 30 + [False] * 2)
    ctx = batch(32, hidden=cfg["hidden_size"], valid=valid, routed=routed)
    name = "flexidepth" if fixture == "tiny_flexidepth" else "qwen3_hard_gate"
    sk = build_skipper(name)
    rs = routes(sk, ctx, modules)
    saw_both = False
    for layer, rt in rs.items():
        check_contract(rt, ctx)
        w = manual_router_weight(ctx.hidden_states, f"model.layers.{layer}.router.", tensors, cfg["rms_norm_eps"])
        run = (w > 0.5) | ~valid.view(-1, 1)
        assert torch.equal(rt.run_mask, run)
        if name == "flexidepth":
            want = torch.where(valid.view(-1, 1), torch.where(run, w, 1 - w), torch.ones_like(w))
            torch.testing.assert_close(rt.weights, want)
            assert bool((rt.weights >= 0.5).all())  # the chosen branch always carries the larger weight
        else:
            assert bool((rt.weights == 1).all())
        saw_both |= bool(rt.run_mask[valid].any()) and bool((~rt.run_mask[valid]).any())
    assert saw_both, "the tiny routers should produce both actions"


def test_trained_gate_without_router_weights_is_refused():
    sk = build_skipper("flexidepth")
    ctx = batch(4)
    with pytest.raises(ValueError, match="router weights"):
        sk.route(16, ctx.hidden_states, sk.prepare_batch(ctx), None)


def test_bf16_routes_keep_the_hidden_dtype(tiny_flexidepth):
    modules = load_skipper_modules(tiny_flexidepth, dtype=torch.bfloat16)
    ctx = batch(8, hidden=64, dtype=torch.bfloat16, routed=(2, 3))
    for name, params, routers in (("flexidepth", {}, modules), ("random_skip", {"r": 0.5, "d": 0.5}, None),
                                  ("static_depth", {"ratio": 0.5}, None)):
        for rt in routes(build_skipper(name, params), ctx, routers).values():
            check_contract(rt, ctx)


# ---- no host synchronisation: every route traces as one graph -------------------------------------------

@pytest.mark.parametrize("name,params", [("flexidepth", {}), ("qwen3_hard_gate", {}),
                                         ("random_skip", {"r": 0.5, "d": 0.5}), ("static_depth", {"ratio": 0.5})])
def test_routes_trace_without_graph_breaks(name, params, tiny_flexidepth):
    """torch.compile(fullgraph=True) refuses `.item()`, host branching on tensor values and other graph breaks:
    the property a captured CUDA decode graph needs (no GPU here, so the check is dynamo's, on CPU)."""
    torch._dynamo.reset()
    modules = load_skipper_modules(tiny_flexidepth)
    sk = build_skipper(name, params)
    routed = (2, 3)

    def step(x, valid, keys, pos):
        ctx = BatchContext(x, valid, routed, "decode", keys, pos)
        state = sk.prepare_batch(ctx)
        outs = []
        for layer in routed:
            rt = sk.route(layer, x, state, modules[layer][0] if sk.requires_router_weights else None)
            outs += [rt.run_mask, rt.weights]
        return outs

    compiled = torch.compile(step, backend="eager", fullgraph=True, dynamic=False)
    args = (torch.randn(8, 64), torch.ones(8, dtype=torch.bool), torch.arange(8), torch.arange(8) + 5)
    for got, want in zip(compiled(*args), step(*args), strict=True):
        assert torch.equal(got, want)


def test_random_skips_tensor_chain_traces_without_graph_breaks():
    """On CPU `RandomSkip.prepare_batch` runs its hash in numpy, so the test above traces that branch; a device
    runs the chain of tensor ops (`_run` over tensors), which a captured decode graph holds: traced here alone, it
    has no graph break and gives what the reference does."""
    torch._dynamo.reset()
    sk = RandomSkip(0.5, 0.5, seed=3)
    layers = torch.arange(2)

    def run(keys, pos, valid):
        return sk._run(keys, pos, valid, layers)

    compiled = torch.compile(run, backend="eager", fullgraph=True, dynamic=False)
    keys, pos = torch.tensor([-7, 11, 1 << 40, 5, 5, 9, 2, 3]), torch.arange(8) + 5
    got = compiled(keys, pos, torch.ones(8, dtype=torch.bool))
    want = [[not p for p in reference_routes(3, int(k), int(q), 0.5, 0.5, 2)] for k, q in zip(keys, pos, strict=True)]
    assert got.T.tolist() == want


# ---- registry -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,params,match", [
    ("no_such", {}, "unknown skipper 'no_such'"),
    ("random_skip", {"r": 1.5, "d": 0.5}, r"params.r must be in \[0.0, 1.0\], got 1.5"),
    ("random_skip", {"d": 0.5}, "params.r: required"),
    ("random_skip", {"r": 0.5, "d": 0.5, "depth": 3}, "params.depth: unknown parameter"),
    ("random_skip", {"r": "half", "d": 0.5}, "params.r must be of type float"),
    ("random_skip", {"r": math.nan, "d": 0.5}, "params.r must be finite"),
    ("static_depth", {"ratio": -0.1}, "params.ratio must be in"),
    ("random_skip", {"r": 0.5, "d": 0.5, "seed": True}, "params.seed must be of type int"),
])
def test_registry_errors_name_the_bad_field(name, params, match):
    with pytest.raises(SkipperConfigError, match=match):
        build_skipper(name, params)


class _WideSkipper(Skipper):
    name = "wide"
    supported_actions = frozenset({Action.RUN, Action.PROJECT_ONLY, "early_exit"})

    def prepare_batch(self, batch):
        return None

    def route(self, layer_id, normed_hidden, state, router=None):
        raise AssertionError


def test_actions_outside_the_whole_layer_set_are_refused():
    with pytest.raises(SkipperConfigError, match="fall outside"):
        register_skipper(SkipperEntry("exit_early", _WideSkipper, actions=frozenset({"run", "early_exit"})))
    register_skipper(SkipperEntry("wide", _WideSkipper))
    try:
        with pytest.raises(SkipperConfigError, match="skipper 'wide'.*fall outside"):
            build_skipper("wide")
    finally:
        unregister_skipper("wide")


def test_attestation_describes_the_policy():
    att = build_skipper("random_skip", {"r": 0.5, "d": 0.5, "seed": 3}).attestation()
    assert att == {"name": "random_skip", "decision": "seeded_hash_of_request_and_position",
                   "parameters": {"r": 0.5, "d": 0.5, "seed": 3, "skip_ratio": 0.25},
                   "supported_actions": ["project_only", "run"], "requires_router_weights": False,
                   "projector_kind": "flexidepth_adapter"}
    assert build_skipper("flexidepth").attestation()["requires_router_weights"] is True
