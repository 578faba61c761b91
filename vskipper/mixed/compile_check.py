"""Every Triton kernel of `vskipper.mixed.kernels`, compiled ahead of time for a GPU's architecture, no GPU needed.

    python -m vskipper.mixed.compile_check [--device NAME ...] [--json FILE]

Triton's compiler and the ptxas it ships lower each kernel to a cubin for the device's compute capability, at the
launch configurations a server uses on it: every tile its tile table holds (the measured table where one ships,
the shared-memory default elsewhere) for the cohort GEMMs, and the served Llama-3-8B shapes (bf16, head_dim 128,
four query heads a KV head) for the attention reads and the cohort maps. A kernel that does not compile, or
whose shared memory exceeds the device's per-block limit, is a failure found here instead of on the device. Each
launch's registers a thread and spilled bytes are ptxas's own report (`ptxas -v` on the same PTX, with the ptxas
Triton picks for the architecture): a spill is printed beside the launch. The interpreter (`TRITON_INTERPRET=1`,
the tests') checks what the kernels compute; this checks that they build, and what they cost in registers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from vskipper.roofline import Device, lookup_device

# Compute capability of each catalogued device (NVIDIA's CUDA GPUs table).
CAPABILITY = {"A100-SXM4-80GB": 80, "A100-40GB": 80, "H100-SXM": 90, "H100-PCIe": 90, "H100-NVL": 90, "H200": 90,
              "RTX-A6000": 86, "L40S": 89, "L4": 89, "A10": 86, "A10G": 86, "B200": 100}
DEFAULT_DEVICES = ("H100-SXM", "A100-SXM4-80GB", "RTX-A6000")
HEAD_DIM, GROUP = 128, 4  # Llama-3-8B: 32 query heads over 8 KV heads
SPLITS, BLOCK_T = 8, 64  # the masked decode read's defaults (`decode_splits`, `masked_decode_attention`)
COHORT_MAP_ROWS = (256, 8192)  # a captured decode batch, a prefill chunk

_GEMM_OPERANDS = {"x_ptr": "*bf16", "idx_ptr": "*i64", "count_ptr": "*i64"}
_STRIDES = ("stride_xm", "stride_xk", "stride_wn", "stride_wk", "stride_om", "stride_on")


@dataclass(frozen=True)
class Launch:
    """One kernel at one launch configuration."""

    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, int | bool], ...]
    num_warps: int
    num_stages: int

    def label(self) -> str:
        consts = ", ".join(f"{k}={v}" for k, v in self.constexprs)
        return f"{self.kernel}({consts}; warps {self.num_warps}, stages {self.num_stages})"


def _sig(*pairs: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(pairs)


def _gemm_launches(table) -> list[Launch]:
    """The cohort GEMM kernels at every tile of the device's table."""
    gate_up = _sig(*_GEMM_OPERANDS.items(), ("wg_ptr", "*bf16"), ("wu_ptr", "*bf16"), ("out_ptr", "*bf16"),
                   ("N", "i32"), ("K", "i32"), *((s, "i32") for s in _STRIDES))
    gemm = _sig(*_GEMM_OPERANDS.items(), ("w_ptr", "*bf16"), ("out_ptr", "*bf16"), ("N", "i32"), ("K", "i32"),
                *((s, "i32") for s in _STRIDES))
    down = _sig(("a_ptr", "*bf16"), ("idx_ptr", "*i64"), ("count_ptr", "*i64"), ("w_ptr", "*bf16"),
                ("wd_ptr", "*bf16"), ("y_ptr", "*bf16"), ("D", "i32"), ("N", "i32"),
                *((s, "i32") for s in ("stride_am", "stride_an", "stride_wd", "stride_wn", "stride_ym", "stride_yd")))
    out: dict[Launch, None] = {}
    for op, entries in table.entries.items():
        for _lo, _hi, t in entries:
            blocks = (("BLOCK_M", t.block_m), ("BLOCK_N", t.block_n), ("BLOCK_K", t.block_k))
            if op.endswith("gate_up"):
                launches = [("cohort_gate_up_kernel", gate_up, blocks)]
            elif op == "attn_q":
                launches = [("cohort_gemm_kernel", gemm, blocks)]
            elif op == "attn_o":  # the unweighted scatter onto the residual
                launches = [("cohort_down_scatter_kernel", down, (*blocks, ("WEIGHTED", False), ("ACCUMULATE", True)))]
            else:  # the FFNs' down GEMM: weighted, stored (the served body) or added (the bench stack, the tuner)
                launches = [("cohort_down_scatter_kernel", down, (*blocks, ("WEIGHTED", True), ("ACCUMULATE", acc)))
                            for acc in (False, True)]
            for name, sig, consts in launches:
                out[Launch(name, sig, consts, t.num_warps, t.num_stages)] = None
    return list(out)


def _attention_launches() -> list[Launch]:
    from triton import next_power_of_2

    from vskipper.mixed.kernels import PACKED_PREFILL_BLOCK_N, cohort_maps_warps, packed_prefill_block_m

    decode = _sig(("q_ptr", "*bf16"), ("k_ptr", "*bf16"), ("v_ptr", "*bf16"), ("r2t_ptr", "*i32"), ("req_ptr", "*i64"),
                  ("pos_ptr", "*i64"), ("read_ptr", "*i1"), ("mid_o_ptr", "*fp32"), ("mid_ml_ptr", "*fp32"),
                  ("scale", "fp32"), *((s, "i32") for s in ("stride_qr", "stride_qh", "stride_ks", "stride_kh",
                                                             "stride_r2t")))
    merge = _sig(("mid_o_ptr", "*fp32"), ("mid_ml_ptr", "*fp32"), ("read_ptr", "*i1"), ("out_ptr", "*bf16"),
                 ("stride_or", "i32"), ("stride_oh", "i32"))
    prefill = _sig(("q_ptr", "*bf16"), ("k_ptr", "*bf16"), ("v_ptr", "*bf16"), ("r2t_ptr", "*i32"), ("req_ptr", "*i64"),
                   ("pos_ptr", "*i64"), ("read_ptr", "*i1"), ("out_ptr", "*bf16"), ("scale", "fp32"),
                   ("slots_total", "i32"), *((s, "i32") for s in ("stride_qm", "stride_qh", "stride_ks", "stride_kh",
                                                                   "stride_r2t", "stride_om", "stride_oh")))
    maps = _sig(("run_ptr", "*i1"), ("rows", "i32"), ("run_idx_ptr", "*i64"), ("proj_idx_ptr", "*i64"),
                ("counts_ptr", "*i64"), ("live_ptr", "*i1"))
    block_g = next_power_of_2(GROUP)
    launches = [
        Launch("masked_decode_split_kernel", decode, (("GROUP", GROUP), ("BLOCK_G", max(16, block_g)),
                                                      ("HEAD_DIM", HEAD_DIM), ("BLOCK_T", BLOCK_T),
                                                      ("SPLITS", SPLITS)), 4, 3),
        Launch("masked_decode_merge_kernel", merge, (("HEADS", 32), ("HEAD_DIM", HEAD_DIM), ("SPLITS", SPLITS),
                                                     ("BLOCK_S", next_power_of_2(SPLITS))), 4, 3),
        Launch("packed_prefill_kernel", prefill, (("GROUP", GROUP), ("BLOCK_G", block_g), ("HEAD_DIM", HEAD_DIM),
                                                  ("BLOCK_M", packed_prefill_block_m(block_g)),
                                                  ("BLOCK_N", PACKED_PREFILL_BLOCK_N)), 4, 2),
    ]
    for rows in COHORT_MAP_ROWS:
        block = next_power_of_2(rows)
        launches.append(Launch("cohort_maps_kernel", maps, (("BLOCK", block),), cohort_maps_warps(block), 3))
    return launches


def launches_for(device: Device) -> list[Launch]:
    from vskipper.mixed.tiles import tile_table_for

    return _gemm_launches(tile_table_for(device.name)) + _attention_launches()


def compile_launch(launch: Launch, capability: int) -> dict:
    """Compile one launch for `capability`; {'shared': bytes} or {'error': ...}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vskipper.mixed import kernels

    fn = getattr(kernels, launch.kernel)
    constexprs = dict(launch.constexprs)
    signature = {**dict(launch.signature), **{name: "constexpr" for name in constexprs}}
    try:
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", capability, 32),
                                  options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    except Exception as exc:  # the compiler's own error, reported with the launch that raised it
        return {"error": f"{type(exc).__name__}: {str(exc).strip()[:800]}"}
    return {"shared": int(compiled.metadata.shared), **ptxas_report(compiled.asm["ptx"], capability)}


def ptxas_report(ptx: str, capability: int) -> dict:
    """Registers a thread and spilled bytes (stores) of the kernel in `ptx`, by ptxas -v (the ptxas Triton uses
    for the architecture); {} where it reports neither."""
    from triton.backends.nvidia.compiler import get_ptxas

    arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        res = subprocess.run([get_ptxas(capability).path, "-v", "--gpu-name", arch, str(src), "-o",
                              str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True, timeout=120)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spills = re.search(r"(\d+) bytes spill stores", res.stderr)
    return {**({"registers": int(regs.group(1))} if regs else {}),
            **({"spill_bytes": int(spills.group(1))} if spills else {})}


def check(device_name: str) -> dict:
    device = lookup_device(device_name)
    capability = CAPABILITY.get(device.name)
    if capability is None:
        raise SystemExit(f"compile_check: no compute capability catalogued for {device.name!r}")
    results = []
    for launch in launches_for(device):
        result = {"launch": launch.label(), **asdict(launch), **compile_launch(launch, capability)}
        if "shared" in result and result["shared"] > device.shared_mem_per_block:
            result["error"] = (f"needs {result['shared']} bytes of shared memory, more than the "
                               f"{device.shared_mem_per_block} a block of {device.name} may use")
        results.append(result)
    return {"device": device.name, "capability": capability, "launches": results,
            "failed": [r["launch"] for r in results if "error" in r]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", action="append", help=f"catalogued device (default: {', '.join(DEFAULT_DEVICES)})")
    parser.add_argument("--json", type=Path, help="write every launch's result here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 replaces the kernels by the interpreter's: unset it to compile them")
    reports = [check(name) for name in (args.device or DEFAULT_DEVICES)]
    for report in reports:
        print(f"{report['device']} (sm_{report['capability']}): {len(report['launches'])} launches, "
              f"{len(report['failed'])} failed")
        for r in report["launches"]:
            status = f"FAILED: {r['error']}" if "error" in r else \
                f"{r['shared']} B shared, {r.get('registers', '?')} registers" + \
                (f", SPILLS {r['spill_bytes']} B" if r.get("spill_bytes") else "")
            print(f"  {r['launch']}: {status}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(reports, indent=1) + "\n")
    return 1 if any(r["failed"] for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
