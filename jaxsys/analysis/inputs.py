"""What the analysis commands (`jaxsys analyze`, `jaxsys plan`) were asked for, checked before
anything compiles: the hardware profile or the accelerator target, the device count, the config;
and the fake CPU devices they compile on, which must be asked for before JAX starts a backend.

Each check raises ConfigError with a message that names the flag; the commands print it and exit 2.
"""

from __future__ import annotations

import os

from jaxsys.analysis import hardware as hardware_lib
from jaxsys.analysis import targets
from jaxsys.config import ConfigError, fill_axis, load_config, validate

MAX_FAKE_DEVICES = 2048  # XLA:CPU creates one client device each; past this start-up alone is slow


def mesh_size(config) -> int:
    n = 1
    for axis in ("data", "pipe", "fsdp", "expert", "seq", "tensor"):
        n *= config.mesh[axis]
    return n


def hardware_profile(name: str) -> hardware_lib.Hardware:
    """The profile `--hardware NAME` names (analysis/hardware.py PROFILES)."""
    if name not in hardware_lib.PROFILES:
        raise ConfigError(f"--hardware {name!r}: choose one of {sorted(hardware_lib.PROFILES)}")
    return hardware_lib.PROFILES[name]


def _not_both(target: str, devices: int) -> None:
    if target and devices:
        raise ConfigError("pass --target or --devices, not both (a target has its own chip count)")


def for_analysis(config_path: str, overrides, hardware: str, target: str, slices: int, devices: int):
    """(config, target or None, device count) for `jaxsys analyze`: the profile and target known
    (and the target's compiler installed), the config loaded with its -1 axis resolved and its mesh
    matching the device count (`--devices`, the target's chips, or the config's mesh size)."""
    hardware_profile(hardware)
    if slices != 1 and not target:
        raise ConfigError("--slices needs --target")
    parsed = None
    if target:
        _not_both(target, devices)
        parsed = targets.parse(target, slices)
        targets.require_compiler(parsed)
    config = load_config(config_path, overrides)
    if parsed is None and fill_axis(config) and not devices:
        raise ConfigError(
            f"config.mesh.{fill_axis(config)}=-1 takes its size from the device count: pass --devices N or --target"
        )
    n = parsed.chips if parsed is not None else (devices or mesh_size(config))
    if n > MAX_FAKE_DEVICES:
        raise ConfigError(
            f"--devices {n}: the analysis fakes at most {MAX_FAKE_DEVICES} CPU "
            "devices; analyse a smaller layout and scale the per-axis figures"
        )
    try:
        validate(config, num_devices=n)  # resolves a -1 axis; names a mesh that does not match
    except ConfigError as e:
        if parsed is None or "are available" not in str(e):
            raise
        raise ConfigError(f"{e} (the target is {parsed.describe()})") from None
    return config, parsed, n


def for_plan(config_path: str, overrides, hardware: str, target: str, devices: int, top: int):
    """(base config, profile, target or None, device count) for `jaxsys plan`: a target brings its
    profile and chip count (and needs its compiler when the top k compile); otherwise a known
    profile and --devices N."""
    parsed = None
    if target:
        _not_both(target, devices)
        parsed = targets.parse(target)
        hw, n = targets.hardware(parsed), parsed.chips
    else:
        hw = hardware_profile(hardware)
        if devices < 1:
            raise ConfigError("--devices N (N >= 1) or --target NAME")
        n = devices
    if parsed is not None and top:
        targets.require_compiler(parsed)
    return load_config(config_path, overrides), hw, parsed, n


def fake_cpu_devices(n: int, fresh: str = "run the analysis in a fresh process") -> list:
    """`n` simulated CPU devices to compile on: asked for through XLA_FLAGS before JAX starts its
    backend (importing jax is fine, starting a backend is not); ConfigError if JAX already started
    with fewer (`fresh` says what to do)."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_platforms", "cpu")  # jax may be imported already: the variable alone is too late
    if len(jax.devices()) < n:
        raise ConfigError(f"JAX already started with {len(jax.devices())} devices; {fresh}")
    return jax.devices()[:n]
