"""The roofline rule: when routed decode pays for its fixed cost, on which device, for which model.

Below the device's ridge point a decode step streams every weight whether or not a row skips, so what a
Project-Only row saves at a routed layer is its attention read of its own context: b bytes per resident token.
Over L_r routed layers with a fraction s of decisions projecting, a step holding V resident KV tokens saves
s * L_r * b * V / BW seconds, against routed mode's fixed per-step cost tau. Routing is profitable when

    V > V* = tau * BW / (s * L_r * b),      tau = tau_16 * L_r / 16.

The served thresholds are a hysteresis band around it: exit = V*, enter = 1.25 V*, both rounded to the nearest
10k tokens, enter at least one step above exit. The ridge point M* = peak FLOP/s / BW (in rows) says where decode
GEMMs turn compute-bound, above which skipped rows also save arithmetic and the rule is conservative.

Pure Python: no torch, no I/O (the operator imports this without torch).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from vskipper.constants import CONSTANTS, SwitchConstants


@dataclass(frozen=True)
class Device:
    name: str
    bandwidth_gbps: float  # HBM/GDDR bandwidth, GB/s (1e9 bytes/s)
    dense_tflops: float  # dense (no sparsity) FP16/BF16 tensor-core TFLOP/s
    capability: int  # CUDA compute capability, major * 10 + minor (the architecture kernels compile for)
    gfd_products: tuple[str, ...] = ()  # `nvidia.com/gpu.product` values set by GPU Feature Discovery

    @property
    def shared_mem_per_block(self) -> int:
        """Bytes a thread block may opt into, by the compute capability."""
        return SHARED_MEM_PER_BLOCK[self.capability]

    @property
    def ridge_rows(self) -> float:
        return ridge_rows(self.dense_tflops, self.bandwidth_gbps)


# Sources: the paper's Table "hardware bands" for the three devices it measured (A100-SXM4-80GB, H100 SXM,
# RTX A6000); NVIDIA's data sheets for the rest; compute capabilities from NVIDIA's CUDA GPUs table. Shared
# memory per block is the opt-in maximum from the CUDA C++ Programming Guide's per-compute-capability table.
# Product labels are NVML names as GPU Feature Discovery sanitises them (k8s-device-plugin internal/lm).
KIB = 1024
SHARED_MEM_PER_BLOCK = {80: 163 * KIB, 86: 99 * KIB, 89: 99 * KIB, 90: 227 * KIB, 100: 227 * KIB}
DEVICES: tuple[Device, ...] = (
    # Paper, Table hardware bands: 1,935 GB/s and 312 TFLOP/s. (NVIDIA's A100 data sheet gives 1,935 GB/s for
    # the 80GB PCIe card and 2,039 GB/s for SXM4; the paper's figure is kept so its thresholds reproduce, and a
    # SkipperDeployment can override the bandwidth per product.)
    Device("A100-SXM4-80GB", 1935.0, 312.0, 80, ("NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe")),
    # NVIDIA A100 data sheet, 40GB columns (SXM4 and PCIe): 1,555 GB/s, 312 TFLOP/s dense BF16.
    Device("A100-40GB", 1555.0, 312.0, 80, ("NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB")),
    # Paper, Table hardware bands: 3,350 GB/s and 990 TFLOP/s (NVIDIA H100 data sheet, SXM: 989.4 dense).
    Device("H100-SXM", 3350.0, 990.0, 90, ("NVIDIA-H100-80GB-HBM3",)),
    # NVIDIA H100 product brief (PCIe): 2,000 GB/s, 756 TFLOP/s dense BF16 (1,513 with sparsity).
    Device("H100-PCIe", 2000.0, 756.0, 90, ("NVIDIA-H100-PCIe",)),
    # NVIDIA H100 NVL data sheet: 3,900 GB/s, 835 TFLOP/s dense BF16.
    Device("H100-NVL", 3900.0, 835.0, 90, ("NVIDIA-H100-NVL",)),
    # NVIDIA H200 data sheet (SXM): 4.8 TB/s HBM3e, 989 TFLOP/s dense BF16 (1,979 with sparsity).
    Device("H200", 4800.0, 989.0, 90, ("NVIDIA-H200",)),
    # Paper, Table hardware bands: 768 GB/s, 155 TFLOP/s (data sheet: 309.7 with sparsity); 99 KiB per block.
    Device("RTX-A6000", 768.0, 155.0, 86, ("NVIDIA-RTX-A6000",)),
    # NVIDIA L40S data sheet: 864 GB/s GDDR6, 362 TFLOP/s dense FP16/BF16 (733 with sparsity).
    Device("L40S", 864.0, 362.0, 89, ("NVIDIA-L40S",)),
    # NVIDIA L4 data sheet: 300 GB/s GDDR6, 121 TFLOP/s dense FP16/BF16 (242 with sparsity).
    Device("L4", 300.0, 121.0, 89, ("NVIDIA-L4",)),
    # NVIDIA A10 data sheet: 600 GB/s GDDR6, 125 TFLOP/s dense FP16 (250 with sparsity).
    Device("A10", 600.0, 125.0, 86, ("NVIDIA-A10",)),
    # AWS G5 (A10G): 600 GB/s GDDR6. NVIDIA publishes no tensor figure for the A10G and it is known to be
    # lower than the A10's; the A10's 125 is an upper bound (it only affects the ridge point, not V*).
    Device("A10G", 600.0, 125.0, 86, ("NVIDIA-A10G",)),
    # NVIDIA HGX B200 specifications: 8 TB/s HBM3e, 2.25 PFLOP/s dense FP16/BF16 per GPU (4.5 with sparsity).
    Device("B200", 8000.0, 2250.0, 100, ("NVIDIA-B200",)),
)

class UnknownDeviceError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


def normalize_product(product: str) -> str:
    """Strip the suffixes GPU Feature Discovery adds to `nvidia.com/gpu.product` for shared GPUs.

    Time-slicing and MPS append `-SHARED`; the bandwidth of the physical card is unchanged. MIG products
    (`...-MIG-1g.10gb`) get only a slice of the card's bandwidth and are *not* normalized: they stay unknown.
    """
    return re.sub(r"-SHARED$", "", product.strip())


def product_key(name: str) -> str:
    """The key a device name or GFD product label is catalogued under: shared-GPU suffixes stripped, case and
    separators ignored (`NVIDIA-H100-80GB-HBM3-SHARED` and `nvidia h100 80gb hbm3` have the same key)."""
    return re.sub(r"[^a-z0-9]+", "", normalize_product(name).lower())


_BY_KEY: dict[str, Device] = {}
for _d in DEVICES:
    for _alias in (_d.name, *_d.gfd_products):
        _BY_KEY[product_key(_alias)] = _d


def lookup_device(name: str) -> Device:
    """Find a device by catalogue name, GFD product label, or a spelling of either (case and separators ignored)."""
    device = _BY_KEY.get(product_key(name))
    if device is None:
        known = ", ".join(d.name for d in DEVICES)
        raise UnknownDeviceError(f"unknown device {name!r}: known devices are {known}; pass a bandwidth instead")
    return device


def find_device(name: str) -> Device | None:
    try:
        return lookup_device(name)
    except UnknownDeviceError:
        return None


def kv_bytes_per_token_layer(num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """b: K and V bytes one token occupies at one layer."""
    for field, value in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("dtype_bytes", dtype_bytes)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{field} must be a positive integer, got {value!r}")
    return 2 * num_kv_heads * head_dim * dtype_bytes


def tau_seconds(routed_layers: int, constants: SwitchConstants = CONSTANTS) -> float:
    """Routed mode's fixed per-step cost for L_r routed layers (tau scaled by L_r / 16)."""
    return constants.tau_ms_per_16_layers * 1e-3 * routed_layers / constants.tau_reference_routed_layers


def v_star_tokens(
    bandwidth_gbps: float,
    skip_ratio: float,
    routed_layers: int,
    kv_bytes: int,
    constants: SwitchConstants = CONSTANTS,
    tau_s: float | None = None,
) -> float:
    """V* = tau * BW / (s * L_r * b), in resident KV tokens (unrounded)."""
    if not (isinstance(bandwidth_gbps, (int, float)) and math.isfinite(bandwidth_gbps) and bandwidth_gbps > 0):
        raise ValueError(f"bandwidth_gbps must be a positive number, got {bandwidth_gbps!r}")
    if not (isinstance(skip_ratio, (int, float)) and 0.0 < skip_ratio <= 1.0):
        raise ValueError(f"skip_ratio must be in (0, 1], got {skip_ratio!r}: with no skipping routing never pays")
    if not isinstance(routed_layers, int) or routed_layers <= 0:
        raise ValueError(f"routed_layers must be a positive integer, got {routed_layers!r}")
    if not isinstance(kv_bytes, int) or kv_bytes <= 0:
        raise ValueError(f"kv_bytes must be a positive integer, got {kv_bytes!r}")
    tau = tau_seconds(routed_layers, constants) if tau_s is None else tau_s
    if not tau > 0:
        raise ValueError(f"tau must be positive, got {tau!r}")
    return tau * bandwidth_gbps * 1e9 / (skip_ratio * routed_layers * kv_bytes)


def round_to_step(value: float, step: int) -> int:
    """Round half up to the nearest multiple of step (no banker's rounding: 155k -> 160k)."""
    return int(math.floor(value / step + 0.5)) * step


def rounded_thresholds(v_star: float, step: int, enter_factor: float, least: int = 0) -> tuple[int, int]:
    """(exit, enter) for a V*: exit = V*, enter = enter_factor * V*, each rounded to the step; exit at least `least`.
    Where enter_factor > 1, enter stays at least one step above exit: below four steps of V* the two may round to
    one value (V* = 35k: 40k and 40k at a 10k step), and a switch with no band flips at every step V crosses it."""
    exit_tokens = max(least, round_to_step(v_star, step))
    band = step if enter_factor > 1 else 0
    return exit_tokens, max(exit_tokens + band, round_to_step(enter_factor * v_star, step))


def ridge_rows(dense_tflops: float, bandwidth_gbps: float) -> float:
    """M* = peak FLOP/s / BW: the decode batch size (rows) above which a 16-bit weight GEMM is compute-bound."""
    if dense_tflops <= 0 or bandwidth_gbps <= 0:
        raise ValueError("dense_tflops and bandwidth_gbps must be positive")
    return dense_tflops * 1e12 / (bandwidth_gbps * 1e9)


def gemm_floor_ms(rows: int, n: int, k: int, weights: int, dtype_bytes: int, device: Device) -> float:
    """The least time a GEMM of `rows` rows by `weights` [n, k] weights (a gate-up reads two and writes one fused
    output) can take on `device`: the longer of its bytes at the HBM bandwidth (every weight, the rows' input [rows,
    k] and output [rows, n] once each) and its multiply-adds at the dense tensor-core peak. A decode GEMM over few
    rows sits on the first, a prefill's on the second (`ridge_rows` apart)."""
    if min(rows, n, k, weights, dtype_bytes) <= 0:
        raise ValueError("rows, n, k, weights and dtype_bytes must be positive")
    moved = (weights * n * k + rows * k + rows * n) * dtype_bytes
    flops = 2 * weights * rows * n * k
    return max(moved / (device.bandwidth_gbps * 1e9), flops / (device.dense_tflops * 1e12)) * 1e3


@dataclass(frozen=True)
class Thresholds:
    v_star_tokens: float
    exit_tokens: int
    enter_tokens: int
    bandwidth_gbps: float
    skip_ratio: float
    routed_layers: int
    kv_bytes_per_token_layer: int
    tau_ms: float
    ridge_rows: float | None = None

    def as_dict(self) -> dict:
        return {
            "v_star_tokens": self.v_star_tokens,
            "exit_tokens": self.exit_tokens,
            "enter_tokens": self.enter_tokens,
            "ridge_rows": self.ridge_rows,
            "bandwidth_gbps": self.bandwidth_gbps,
            "skip_ratio": self.skip_ratio,
            "routed_layers": self.routed_layers,
            "kv_bytes_per_token_layer": self.kv_bytes_per_token_layer,
            "tau_ms": self.tau_ms,
        }


def derive_thresholds(
    bandwidth_gbps: float,
    skip_ratio: float,
    routed_layers: int,
    kv_bytes: int,
    dense_tflops: float | None = None,
    constants: SwitchConstants = CONSTANTS,
) -> Thresholds:
    """The served decode thresholds: exit = V*, enter = enter_factor * V*, each rounded to the rounding step, enter
    at least one step above exit (`rounded_thresholds`)."""
    v_star = v_star_tokens(bandwidth_gbps, skip_ratio, routed_layers, kv_bytes, constants)
    exit_tokens, enter_tokens = rounded_thresholds(v_star, constants.threshold_rounding_tokens,
                                                   constants.enter_factor)
    return Thresholds(
        v_star_tokens=v_star,
        exit_tokens=exit_tokens,
        enter_tokens=enter_tokens,
        bandwidth_gbps=float(bandwidth_gbps),
        skip_ratio=float(skip_ratio),
        routed_layers=routed_layers,
        kv_bytes_per_token_layer=kv_bytes,
        tau_ms=tau_seconds(routed_layers, constants) * 1e3,
        ridge_rows=None if dense_tflops is None else ridge_rows(dense_tflops, bandwidth_gbps),
    )
