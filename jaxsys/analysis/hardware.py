"""The hardware facts: one table that MFU, the roofline, the planner, the accelerator targets and
the serving cost model all read.

    hw = hardware.profile("h100")                # a named profile: PROFILES
    hw = hardware.tpu("v5p", chips_per_slice=64) # a TPU chip on a slice of that size
    hw = hardware.for_device(jax.devices()[0])   # the profile of a JAX device (its device_kind)
    peak = hardware.job_peak_flops("bfloat16")   # the whole job's peak, for MFU

`Hardware` is one device's profile: peak FLOP/s per compute dtype, HBM capacity and bandwidth,
the links inside a node (NVLink / ICI) and across (network / DCN), the host link and memory, how
many devices share a node and a host, the latency constants of the alpha-beta model, the
collectives its compiler runs asynchronously, and (the CPU) a measured compute rate. The TPU
chips (`TPU_CHIPS`) and the NVIDIA GPUs as XLA:GPU's deviceless compiler needs them described
(`GPU_CHIPS`) are here too: `analysis/targets.py` keeps only the topology logic.

Datasheet figures (dense, no sparsity) unless marked: they set the scale, not the decimals. Link
bandwidths are per device and direction.
"""

from __future__ import annotations

import dataclasses
import os

from jaxsys.config import ConfigError

ASYNC_ALL = ("all_gather", "reduce_scatter", "all_reduce", "collective_permute", "all_to_all")


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict  # compute dtype -> dense FLOP/s per device
    hbm_bytes_per_s: float
    hbm_bytes: float  # capacity per device
    devices_per_node: int
    intra_node_bytes_per_s: float  # per device, one direction (NVLink / ICI)
    inter_node_bytes_per_s: float  # per device, one direction (InfiniBand / DCN)
    host_link_bytes_per_s: float = 32e9  # device <-> host memory, per device, one direction (PCIe)
    host_memory_bytes_per_s: float = 200e9  # host DRAM, per host (its devices_per_host devices share it)
    devices_per_host: int = 0  # devices sharing one host's DRAM; 0: devices_per_node (GPU nodes)
    # The alpha of the alpha-beta model (`cost_model.collective_latency`): a collective costs
    # collective_latency_s + hops x (hop_latency_s within a node, inter_hop_latency_s across) on top
    # of its bytes over the bandwidth; every kernel launched costs op_overhead_s (`kernel_count`).
    collective_latency_s: float = 0.0
    hop_latency_s: float = 0.0
    inter_hop_latency_s: float = 0.0
    op_overhead_s: float = 0.0
    # The collective kinds the compiler runs asynchronously, so that an overlap option can hide them
    # (`cost_model.hidden_communication`): what the compiled schedules showed (docs/comm_overlap.md,
    # docs/analysis.md). XLA:GPU: all; libtpu 0.0.48.1, default flags: collective-permutes on every
    # TPU, all-gathers on v5e only; XLA:CPU: none (every collective in line).
    async_collectives: tuple[str, ...] = ASYNC_ALL
    achieved_flops_per_s: float = 0.0  # the compute rate predicted_step uses; 0: the datasheet peak

    @property
    def overlaps(self) -> bool:
        """Whether any collective can run beside compute."""
        return bool(self.async_collectives)

    @property
    def host_sharers(self) -> int:
        return self.devices_per_host or self.devices_per_node

    def peak(self, dtype: str) -> float:
        """Dense FLOP/s of one device in `dtype` (the bf16 figure for a dtype the table lacks)."""
        return self.peak_flops.get(dtype, self.peak_flops["bfloat16"])

    def job_peak(self, dtype: str, devices: int) -> float:
        """Peak FLOP/s of `devices` devices: what every MFU here divides by (training's and the
        roofline's alike), so that the two agree for the same device and dtype."""
        return self.peak(dtype) * devices


# ----------------------------------------------------------------------------- latency

# Latency (the alpha of the alpha-beta model), per collective and per ring step (hop).
# NVIDIA: NCCL's own tuning model (src/graph/tuning.cc, NCCL 2.18-2.21): ring base latency 6.6 us
# (LL protocol, the one NCCL picks for small messages), 0.6 us per NVLink step, and ~5 us per
# network step (its NET tree/LL figure); a kernel costs ~1 us of launch gap (an order of magnitude:
# launches are asynchronous, CUDA graphs hide most of it). TPU: ~1 us per ICI hop, the order of
# magnitude of the scaling book ("How to Scale Your Model", Austin et al. 2025), and no per-kernel
# launch (one compiled program); DCN ~10 us per step. Orders of magnitude, not measured here.
NCCL_LATENCY = dict(collective_latency_s=6.6e-6, hop_latency_s=0.6e-6, inter_hop_latency_s=5e-6, op_overhead_s=1e-6)
ICI_LATENCY = dict(collective_latency_s=2e-6, hop_latency_s=1e-6, inter_hop_latency_s=10e-6, op_overhead_s=0.0)


# ----------------------------------------------------------------------------- TPU chips

GiB = 2**30
TPU_CHIPS_PER_HOST = 4  # v4, v5p and multi-host v5e/v6e slices: 4 chips per host VM share its DRAM


@dataclasses.dataclass(frozen=True)
class TpuChip:
    """One TPU generation, per chip (Google Cloud TPU pages; ICI and DCN as in the scaling book's
    tables). HBM capacity as libtpu describes the chip (what its compiler plans against)."""

    generation: str
    peak_flops: dict  # compute dtype -> dense FLOP/s
    hbm_bytes: float
    hbm_bytes_per_s: float
    ici_link_bytes_per_s: float  # one direction, one link
    dcn_bytes_per_s: float  # per chip, one direction, across slices
    max_slice_chips: int  # the largest slice (pod) of the generation: its ICI domain
    # what libtpu (0.0.48.1, default flags) ran asynchronously in the train steps compiled here:
    # collective-permutes everywhere, all-gathers on v5e (Viperlite) only; reduce-scatters,
    # all-reduces and all-to-alls never (docs/analysis.md, "What the analysis reports about overlap")
    async_collectives: tuple[str, ...] = ("collective_permute",)


def _tpu_peaks(bf16: float, **more) -> dict:
    # fp32 matmuls on the MXU take several bf16 passes; half the bf16 peak is the usual planning figure
    return {"bfloat16": bf16, "float32": bf16 / 2, **more}


TPU_CHIPS = {
    "v4": TpuChip("v4", _tpu_peaks(275e12), 32 * GiB, 1.2e12, 4.5e10, 6.25e9, 4096),
    # v5p: int8 918 TOPS (dense), for W8A8
    "v5p": TpuChip("v5p", _tpu_peaks(459e12, int8=918e12), 95.74 * GiB, 2.76e12, 9e10, 6.25e9, 8960),
    "v5e": TpuChip(
        "v5e", _tpu_peaks(197e12), 16 * GiB, 8.1e11, 4.5e10, 6.25e9, 256, ("all_gather", "collective_permute")
    ),
    "v6e": TpuChip("v6e", _tpu_peaks(918e12), 32 * GiB, 1.64e12, 9e10, 6.25e9, 256),
}


def tpu(generation: str, chips_per_slice: int | None = None, name: str | None = None) -> Hardware:
    """A TPU chip's profile on a slice of `chips_per_slice` chips (default: the generation's largest
    slice, so that every mesh axis runs over ICI): a slice is one "node" whose mesh axes run over
    ICI (a bidirectional ring along a torus axis: 2 links' worth per direction); axes with a DCN
    factor (config.dcn) cross slices at the chip's DCN share."""
    chip = TPU_CHIPS[generation]
    n = chips_per_slice or chip.max_slice_chips
    return Hardware(
        name or f"TPU {chip.generation}",
        dict(chip.peak_flops),
        chip.hbm_bytes_per_s,
        chip.hbm_bytes,
        n,
        2 * chip.ici_link_bytes_per_s,
        chip.dcn_bytes_per_s,
        devices_per_host=min(TPU_CHIPS_PER_HOST, n),
        **ICI_LATENCY,
        async_collectives=chip.async_collectives,
    )


# ----------------------------------------------------------------------------- NVIDIA GPUs

# H100 and H200 SXM: dense bf16 989 TFLOP/s, int8 1,979 TOPS (half the datasheet's 3,958 with
# sparsity). float32: 495 TFLOP/s, the TF32 tensor-core rate, because that is what a float32 matmul
# gets under JAX's default precision on NVIDIA GPUs (XLA:GPU lowers a DEFAULT-precision f32 dot to
# TF32 on Ampere and later). The CUDA-core FP32 rate (67 TFLOP/s) applies only to matmuls asked for
# at precision HIGHEST (jax_default_matmul_precision='highest'); MFU against it would exceed 1 for
# a default-precision run.
_HOPPER_PEAKS = {"bfloat16": 989e12, "float32": 495e12, "int8": 1979e12}


@dataclasses.dataclass(frozen=True)
class GpuChip:
    """An NVIDIA GPU as XLA:GPU's deviceless compiler needs it described (`targets.target_config`):
    the figures the driver reports, which XLA plans against (memory a little above the datasheet's
    decimal GB), and the SMs, clock and L2 of the part. Its roofline figures are PROFILES[profile]."""

    profile: str
    device_kind: str  # what JAX reports as device_kind (Pallas/Triton read it)
    memory_bytes: int  # as the driver reports it
    memory_bytes_per_s: int  # as the driver reports it
    sm_count: int = 132
    clock_ghz: float = 1.98
    l2_bytes: int = 50 * 2**20
    compute_capability: int = 9


GPUS_PER_NODE = 8
GPU_CHIPS = {  # Hopper SXM: 132 SMs at 1.98 GHz, 50 MB L2
    "h100": GpuChip("h100", "NVIDIA H100 80GB HBM3", 84942979072, 3352320000000),
    "h200": GpuChip("h200", "NVIDIA H200", 150754820096, 4800000000000),
}


# ----------------------------------------------------------------------------- the host CPU

CPU_FLOPS_PER_CYCLE = 32  # fp32 per core: 2 FMA units x 8 lanes (AVX2) x 2 FLOPs


def cpu_peak_flops() -> float:
    """Cores x 32 fp32 FLOP/cycle x clock (from /proc/cpuinfo, else 2.5 GHz): the host's peak, which
    all simulated CPU devices share."""
    mhz = 2500.0
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    mhz = float(line.split(":")[1])
                    break
    except OSError:
        pass
    return (os.cpu_count() or 1) * CPU_FLOPS_PER_CYCLE * mhz * 1e6


def _cpu() -> Hardware:
    # XLA:CPU's simulated devices, in CPU seconds of the process per device (all threads / devices):
    # measured by experiments/planner/calibrate_cpu.py on this 2-core host (AVX-512, jax 0.11.2;
    # cpu_calibration.json), not fitted to any layout's step time. Its collectives run in line. The
    # peak is the host's (`cpu_peak_flops`), per simulated device.
    peak = cpu_peak_flops()
    return Hardware(
        "this CPU (simulated devices share it)",
        {"bfloat16": peak, "float32": peak},
        13.2e9,  # x * 1.0001 + 1 over 8 MiB per device: bytes read + written per CPU second
        24e9,
        1 << 30,
        9.96e9,  # psum of 1 MiB over 8 devices: ring bytes per CPU second, less the 32-byte psum's
        9.96e9,
        collective_latency_s=5.26e-6,  # 32-byte psum / all_gather / psum_scatter / ppermute over 2, 4, 8:
        hop_latency_s=0.19e-6,  # least squares of alpha + hops x alpha_hop
        inter_hop_latency_s=0.19e-6,
        op_overhead_s=0.13e-6,  # a chain of dependent [8, 8] dots: the cost of one more kernel
        async_collectives=(),
        achieved_flops_per_s=134e9,  # a chain of [256, 256] fp32 dots: FLOPs per CPU second
    )


# ----------------------------------------------------------------------------- the profiles

# H100/H200 nodes: 8 GPUs on NVLink 4 (900 GB/s bidirectional: 450 GB/s per direction), one
# 400 Gb/s NIC per GPU (50 GB/s), PCIe Gen5 x16 per GPU to the host (64 GB/s per direction), ~300 GB/s
# DRAM per 8-GPU host. HBM capacity: the datasheet's decimal GB.
PROFILES = {
    "h100": Hardware(
        "NVIDIA H100 SXM", dict(_HOPPER_PEAKS), 3.35e12, 80e9, GPUS_PER_NODE, 450e9, 50e9, 64e9, 300e9, **NCCL_LATENCY
    ),
    "h200": Hardware(
        "NVIDIA H200 SXM", dict(_HOPPER_PEAKS), 4.8e12, 141e9, GPUS_PER_NODE, 450e9, 50e9, 64e9, 300e9, **NCCL_LATENCY
    ),
    **{f"tpu_{gen}": tpu(gen) for gen in TPU_CHIPS},  # one slice of the chip, every axis on ICI
    "cpu": _cpu(),
}


def profile(name: str) -> Hardware:
    """A named profile (PROFILES); ConfigError naming the known ones."""
    if name not in PROFILES:
        raise ConfigError(f"unknown hardware {name!r}: choose one of {sorted(PROFILES)}")
    return PROFILES[name]


def profile_name(device) -> str | None:
    """The PROFILES key of a JAX device, from its platform and device_kind ("NVIDIA H100 80GB
    HBM3", "TPU v5 lite", "TPU v5p", ...); None for a device the table does not know."""
    if device.platform == "cpu":
        return "cpu"
    kind = device.device_kind.lower()
    for name in ("h100", "h200"):
        if name in kind:
            return name
    if "tpu" in kind:
        if "v6" in kind:
            return "tpu_v6e"
        if "v5" in kind:
            return "tpu_v5e" if "lite" in kind or "v5e" in kind else "tpu_v5p"
        if "v4" in kind:
            return "tpu_v4"
    return None


def for_device(device) -> Hardware | None:
    """The profile of a JAX device (None: unknown; MFU is then reported as 0)."""
    name = profile_name(device)
    return PROFILES[name] if name else None


def job_peak_flops(compute_dtype: str, devices=None) -> float:
    """Peak FLOP/s of the whole job, for MFU: the device's profile's `job_peak` (per-device peak x
    device count, as the roofline counts it) on accelerators; on CPU the host's peak once per
    process (simulated devices do not add cores). 0 for a device the table does not know (set
    config.hardware.peak_flops)."""
    import jax

    devices = jax.devices() if devices is None else devices
    if devices[0].platform == "cpu":
        return cpu_peak_flops() * max(1, jax.process_count())
    hw = for_device(devices[0])
    return hw.job_peak(compute_dtype, len(devices)) if hw else 0.0
