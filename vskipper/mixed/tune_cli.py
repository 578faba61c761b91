"""`vskipper tune-tiles`: pick the device, the widths and the mode, run the tuner, write the table."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from vskipper.modelspec import load_model_facts
from vskipper.roofline import lookup_device

if TYPE_CHECKING:
    from vskipper.mixed.tuner import BackendRead


def run_tune_tiles(args: argparse.Namespace, backend: BackendRead | None = None) -> int:
    """`backend`: the host engine's prefill read to time beside the packed read (the command line passes
    SGLang's, `vskipper.sglang.backend_read`, unless `--attention-backend none`)."""
    if args.interpret:
        # Must precede the first triton import of this process.
        os.environ["TRITON_INTERPRET"] = "1"
    from vskipper.mixed.tuner import TunerError

    try:
        return _run(args, backend)
    except TunerError as exc:
        print(f"vskipper tune-tiles: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, backend: BackendRead | None) -> int:
    import torch

    from vskipper.mixed.tuner import TunerError, tune

    if args.interpret:
        hidden, intermediate, proj, q_width = 32, 64, 16, 32  # tiny smoke widths
        read_heads = (4, 2, 16)  # heads, KV heads, head_dim
        name = args.device or "interpreter-smoke"
        limit = lookup_device(args.device).shared_mem_per_block if args.device else 99 * 1024
    else:
        if not torch.cuda.is_available():
            raise TunerError("tune-tiles times kernels on a GPU and none is visible; pass --interpret for a tiny "
                             "smoke run on the Triton interpreter (its table is not a measurement)")
        facts = load_model_facts(args.model)
        hidden, intermediate = facts.hidden_size, facts.intermediate_size
        proj = intermediate // 16
        q_width = facts.num_attention_heads * facts.head_dim
        read_heads = (facts.num_attention_heads, facts.num_kv_heads, facts.head_dim)
        props = torch.cuda.get_device_properties(0)
        device = lookup_device(args.device or props.name)
        name = device.name
        limit = min(device.shared_mem_per_block,
                    getattr(props, "shared_memory_per_block_optin", None) or device.shared_mem_per_block)
    table = tune(name, limit, hidden, intermediate, proj, args.dtype, args.interpret, args.max_candidates,
                 q_width=q_width, read_heads=read_heads, budget_s=args.budget_s, backend=backend)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=2) + "\n")
    print(f"wrote {out} ({name}, {sum(len(v) for v in table['tiles'].values())} shapes)")
    return 0
