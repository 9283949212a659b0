"""Peak FLOP/s of the devices a job runs on, for MFU."""

from __future__ import annotations

import os

import jax

# Dense peak FLOP/s per device at the compute dtype's tensor-core rate (bf16); fp32 rates where
# marked. Sources: NVIDIA H100/H200 SXM datasheets, Google Cloud TPU v5p page.
PEAK_FLOPS = {
    "h100": {"bfloat16": 989e12, "float32": 67e12},
    "h200": {"bfloat16": 989e12, "float32": 67e12},
    "tpu v5p": {"bfloat16": 459e12, "float32": 459e12 / 2},
}

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


def job_peak_flops(compute_dtype: str, devices=None) -> float:
    """Peak FLOP/s of the whole job: per-device peak x device count on accelerators; the host's
    peak on CPU (simulated devices do not add cores)."""
    devices = jax.devices() if devices is None else devices
    kind = devices[0].device_kind.lower()
    if devices[0].platform == "cpu":
        return cpu_peak_flops() * max(1, jax.process_count())
    for name, peaks in PEAK_FLOPS.items():
        if name in kind:
            return peaks.get(compute_dtype, peaks["bfloat16"]) * len(devices)
    return 0.0  # unknown device: MFU is reported as 0; set config.hardware.peak_flops
