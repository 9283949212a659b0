"""XLA flags of the test processes: 8 simulated CPU devices, and LLVM's optimisation of the generated
CPU code turned down. The tests compile many small programs whose run time is negligible next to
their compile time: this halves the suite's time and keeps the HLO passes, buffer assignment (the
memory tests), cost analysis and lowered StableHLO (the collective tests) as they are. Experiments
and benchmarks keep XLA's defaults."""

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def xla_flags(devices: int) -> str:
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
