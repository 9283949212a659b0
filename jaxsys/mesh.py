"""The one mesh: axes (data, pipe, fsdp, expert, seq, tensor), always all present; and start-up of
several processes (jax.distributed) before the first device is touched."""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxsys.config import MESH_AXES, ConfigError, validate

_ENV_COORDINATOR = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS")


def maybe_initialize_distributed(dist_cfg) -> bool:
    """Call `jax.distributed.initialize` when the config or the environment asks for it.

    Explicit config wins (`config.distributed.*`); otherwise JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES and JAX_PROCESS_ID; otherwise a single process. Returns True when initialised.
    Must run before anything touches a device.
    """
    address = dist_cfg.coordinator_address or next(
        (os.environ[k] for k in _ENV_COORDINATOR if os.environ.get(k)), "")
    if not address:
        return False
    if jax.distributed.is_initialized():
        return True
    num = dist_cfg.num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0"))
    pid = dist_cfg.process_id if dist_cfg.process_id >= 0 else int(os.environ.get("JAX_PROCESS_ID", "-1"))
    if num < 1 or pid < 0:
        raise ConfigError(
            f"coordinator address {address!r} is set but the process count ({num}) or id ({pid}) is "
            "not: set config.distributed.num_processes and .process_id (or JAX_NUM_PROCESSES and "
            "JAX_PROCESS_ID)")
    jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid)
    return True


def make_mesh(config, devices=None) -> Mesh:
    """The mesh of `config.mesh`, over all devices of all processes, axis order MESH_AXES
    (slow outer links first, fast inner ones last). Validates the config against the device count."""
    devices = list(jax.devices() if devices is None else devices)
    validate(config, num_devices=len(devices))
    shape = tuple(config.mesh[a] for a in MESH_AXES)
    # Sort by (process, id): a process's devices stay contiguous on the inner axes.
    devices.sort(key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))
