"""The offline tour of vSkipper on a tiny FlexiDepth checkpoint: no server, no GPU, seconds.

It writes a tiny random FlexiDepth checkpoint (the real layout, with a tiny tokenizer and chat template), loads
its routers through the loader a real checkpoint uses, routes a batch with three skippers, derives the decode
thresholds the rule gives the paper's models on the catalogued devices, and replays a load ramp through the
hybrid mode switch. The live demo (`python -m demo`, `make demo`) runs it first.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vskipper.arms import get_arm
from vskipper.checkpoint import load_skipper_modules, make_tiny_model, write_tiny_tokenizer
from vskipper.modelspec import PRESETS, load_model_facts
from vskipper.roofline import derive_thresholds, lookup_device
from vskipper.skippers import build_skipper
from vskipper.skippers.base import BatchContext
from vskipper.skippers.modules import RMSNorm
from vskipper.switch import ModeSwitch


def _route_table(ckpt: Path) -> None:
    facts = load_model_facts(str(ckpt))
    modules = load_skipper_modules(ckpt)
    g = torch.Generator().manual_seed(0)
    rows = 12
    x = torch.randn(rows, facts.hidden_size, generator=g)
    valid = torch.ones(rows, dtype=torch.bool)
    valid[-2:] = False  # two padding rows of a captured graph
    batch = BatchContext(x, valid, facts.routed_layers, "decode",
                         request_keys=torch.arange(rows, dtype=torch.int64) * 7919,
                         positions=torch.full((rows,), 100, dtype=torch.int64))
    norm = RMSNorm(facts.hidden_size)
    print(f"routes of {rows} decode rows ({int(valid.sum())} valid) at routed layers {list(facts.routed_layers)}:")
    for arm_name in ("hybrid", "random-r50-d50", "static-depth-50"):
        arm = get_arm(arm_name)
        skipper = build_skipper(arm.skipper, arm.params)
        state = skipper.prepare_batch(batch)
        cells = []
        for layer in facts.routed_layers:
            router = modules[layer][0] if skipper.requires_router_weights else None
            route = skipper.route(layer, norm(x), state, router)
            projected = int((~route.run_mask.view(-1) & valid).sum())
            cells.append(f"L{layer}: {int(valid.sum()) - projected} RUN / {projected} PO")
        print(f"  {arm.skipper:14} " + "   ".join(cells))


def _threshold_table() -> None:
    print("decode thresholds from the roofline rule (exit / enter, resident KV tokens):")
    for model, s in (("llama-3-8b", 0.5), ("qwen3-4b", 0.25), ("qwen3-8b", 0.52)):
        facts = PRESETS[model]
        cells = []
        for name in ("A100-SXM4-80GB", "H100-SXM", "H200", "RTX-A6000", "L40S"):
            d = lookup_device(name)
            t = derive_thresholds(d.bandwidth_gbps, s, facts.num_routed_layers, facts.kv_bytes_per_token_layer)
            cells.append(f"{name} {t.exit_tokens // 1000}k/{t.enter_tokens // 1000}k")
        print(f"  {model:10} s={s:<5} " + "  ".join(cells))


def _switch_replay(out: Path) -> None:
    d = lookup_device("A100-SXM4-80GB")
    llama = PRESETS["llama-3-8b"]
    t = derive_thresholds(d.bandwidth_gbps, 0.5, llama.num_routed_layers, llama.kv_bytes_per_token_layer)
    switch = ModeSwitch(get_arm("hybrid").switch_settings(), t.enter_tokens, t.exit_tokens,
                        declared_project_share=0.5)
    print(f"hybrid switch on an A100 (exit {t.exit_tokens}, enter {t.enter_tokens}): a load ramp up and down")
    running: dict[int, int] = {}  # request -> resident tokens
    next_rid, now = 0, 0.0
    for step in range(60):
        now = step * 0.05
        arrivals = 12 if step < 30 else 0
        for _ in range(arrivals):
            running[next_rid] = 1500
            next_rid += 1
        if step >= 30:  # the oldest requests finish
            for rid in sorted(running)[:14]:
                del running[rid]
                switch.finish(rid)
        for rid in running:
            running[rid] += 20
        promoted = switch.observe(sum(running.values()), now)
        for rid in running:
            if rid not in switch.running():
                switch.start_decode(rid)
        if promoted or step % 10 == 0:
            modes = switch.running().values()
            routed = sum(m.value == "routed" for m in modes)
            print(f"  step {step:2d}  V={sum(running.values()):7d}  routing={'on ' if switch.routing_on else 'off'} "
                  f" routed {routed}/{len(running)} requests" + (f"  promoted {len(promoted)}" if promoted else ""))
    att = switch.attestation()
    (out / "switch-attestation.json").write_text(json.dumps(att, indent=2) + "\n")
    print(f"  decisions: {att['decisions_total']}; full attestation in {out / 'switch-attestation.json'}")


def run_tour(out: Path) -> Path:
    """The tour into `out`; returns the tiny checkpoint it wrote (servable: it has a tokenizer)."""
    ckpt = make_tiny_model("flexidepth-llama", out / "tiny-flexidepth")
    write_tiny_tokenizer(ckpt)
    print(f"tiny FlexiDepth checkpoint (with a tiny tokenizer): {ckpt}")
    _route_table(ckpt)
    print()
    _threshold_table()
    print()
    _switch_replay(out)
    return ckpt
