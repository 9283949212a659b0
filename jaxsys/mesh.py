"""The one mesh: axes (data, pipe, fsdp, expert, seq, tensor), always all present; and start-up of
several processes (jax.distributed) before the first device is touched."""

from __future__ import annotations

import math
import os
import sys

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxsys.config import MESH_AXES, ConfigError, validate

_ENV_COORDINATOR = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS")
# What JAX's SlurmCluster (jax/_src/clusters/slurm_cluster.py) reads; srun sets all of them in every
# task of a job step. The batch script itself and salloc's shell have no SLURM_STEP_NODELIST.
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


def maybe_initialize_distributed(dist_cfg) -> bool:
    """Call `jax.distributed.initialize` when the config or the environment asks for it (see
    `distributed_plan` for the order). Process 0 prints where the settings came from. Returns True
    when initialised. Must run before anything touches a device."""
    if jax.distributed.is_initialized():
        return True
    plan = distributed_plan(dist_cfg, os.environ)
    if plan is None:
        return False
    source, kwargs = plan
    jax.distributed.initialize(**kwargs)
    if jax.process_index() == 0:
        from jax._src import distributed  # the coordinator JAX settled on (no public accessor)

        address = getattr(distributed.global_state, "coordinator_address", None) or "?"
        print(
            f"jaxsys: jax.distributed initialised from {source}: {jax.process_count()} processes, "
            f"{jax.device_count()} devices, coordinator {address}",
            flush=True,
        )
    return True


def distributed_plan(dist_cfg, env) -> tuple[str, dict] | None:
    """Where the process settings come from and the `jax.distributed.initialize` arguments, or None
    for a single process. In order:

    1. `config.distributed.*`, then JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID;
    2. a SLURM job step with more than one task (srun): JAX's own SLURM detection (coordinator: the
       step's first node, port 61440 + SLURM_JOB_ID % 4096 unless JAX_COORDINATOR_PORT is set);
    3. a Cloud TPU pod slice or several slices (more than one host): JAX's own TPU detection
       (metadata or GKE variables, MEGASCALE_* for multi-slice).
    A single-task SLURM job and a single TPU host run as one process, as anywhere else.
    """
    name = next((k for k in _ENV_COORDINATOR if env.get(k)), None)
    address = dist_cfg.coordinator_address or (env[name] if name else "")
    if address:
        num = dist_cfg.num_processes or _env_int(env, "JAX_NUM_PROCESSES", 0)
        pid = dist_cfg.process_id if dist_cfg.process_id >= 0 else _env_int(env, "JAX_PROCESS_ID", -1)
        if num < 1 or pid < 0:
            raise ConfigError(
                f"coordinator address {address!r} is set but the process count ({num}) or id ({pid}) "
                "is not: set config.distributed.num_processes and .process_id (or JAX_NUM_PROCESSES "
                "and JAX_PROCESS_ID), or unset the address to let srun / Cloud TPU provide all three"
            )
        kwargs = dict(coordinator_address=address, num_processes=num, process_id=pid)
        if all(env.get(k) for k in _SLURM_VARS):  # JAX would still pick this task's GPU from SLURM
            kwargs["local_device_ids"] = _slurm_local_devices(env)
        return ("config.distributed" if dist_cfg.coordinator_address else str(name)), kwargs
    if _slurm_tasks(env) > 1:
        # cluster_detection_method pins SLURM: JAX would otherwise take Open MPI first if both are set.
        return "SLURM", dict(cluster_detection_method="slurm", local_device_ids=_slurm_local_devices(env))
    tpu = _tpu_cluster()
    if tpu is not None:
        return f"Cloud TPU ({tpu.name})", dict(cluster_detection_method=tpu.name)
    return None


def _env_int(env, key: str, default: int) -> int:
    value = env.get(key)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r} is not an integer: fix or unset it") from None


def _slurm_tasks(env) -> int:
    """Tasks of this process's SLURM job step (1 outside SLURM). Above 1, checks that the step has
    what JAX's SLURM detection reads, so that a half environment fails here and not in a hang."""
    if not env.get("SLURM_JOB_ID"):
        return 1
    ntasks = _env_int(env, "SLURM_NTASKS", 0)
    step = _env_int(env, "SLURM_STEP_NUM_TASKS", 0)
    n = ntasks or step  # SLURM_NTASKS as JAX reads it; set to 1, it runs one process on purpose
    if n <= 1:
        return 1
    if not env.get("SLURM_STEP_NODELIST"):
        raise ConfigError(
            f"SLURM_NTASKS={n} but SLURM_STEP_NODELIST is not set: this process was not started by "
            "srun (a batch script or salloc shell runs once, not once per task). Start one process per "
            "task with `srun python -m jaxsys.train ...` (scripts/launch/slurm.sbatch), or run a "
            "single process with SLURM_NTASKS=1"
        )
    missing = [k for k in _SLURM_VARS if not env.get(k)]
    if missing:
        raise ConfigError(
            f"SLURM job step with {n} tasks but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
            f"not set: JAX's SLURM detection needs {', '.join(_SLURM_VARS)} (srun sets them in every "
            "task). Start the processes with srun, or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and "
            "JAX_PROCESS_ID instead"
        )
    if step and ntasks != step:
        raise ConfigError(
            f"SLURM_NTASKS={ntasks} but SLURM_STEP_NUM_TASKS={step}: JAX counts processes from "
            f"SLURM_NTASKS, so it would wait for the wrong number; export SLURM_NTASKS={step} before "
            "srun starts the step, or do not override it"
        )
    pid = _env_int(env, "SLURM_PROCID", -1)
    if not 0 <= pid < n:
        raise ConfigError(
            f"SLURM_PROCID={pid} is not in 0..{n - 1} (SLURM_NTASKS={n}): start the "
            "processes with srun, which numbers them"
        )
    if not env.get("JAX_COORDINATOR_PORT"):
        _env_int(env, "SLURM_JOB_ID", 0)  # JAX derives the coordinator port from it
    return n


def _slurm_local_devices(env) -> list[int] | None:
    """`local_device_ids` for a SLURM step; None keeps JAX's default, GPU number SLURM_LOCALID: right
    for one task per GPU when every task sees all the node's GPUs. Wrong for one task per node (it
    would drive 1 GPU of 8) and for tasks SLURM bound to one GPU (--gpus-per-task=1: there is no GPU
    SLURM_LOCALID), so there [] lets the process use every GPU it sees. JAX_LOCAL_DEVICE_IDS wins."""
    if env.get("JAX_LOCAL_DEVICE_IDS"):
        return None  # JAX reads it
    nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES")
    if nodes and nodes == (env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")):
        return []  # as many tasks as nodes: one task per node
    visible = next(
        (env[k] for k in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES") if env.get(k)), ""
    )
    return [] if visible and len(visible.split(",")) == 1 else None


def _tpu_cluster():
    """JAX's Cloud TPU cluster class (GKE or TPU VM) when this process runs on a Cloud TPU with more
    than one host (a pod slice, or several slices), else None. A single host stays one process."""
    try:
        from jax._src import cloud_tpu_init, clusters  # the detection jax.distributed.initialize() runs
    except ImportError:
        return None
    if not cloud_tpu_init.running_in_cloud_tpu_vm:
        return None
    try:
        for cluster in (clusters.GkeTpuCluster, clusters.GceTpuCluster):
            if cluster.is_env_present():
                return cluster if cluster.get_process_count() > 1 else None
    except Exception as e:  # metadata server unreachable: libtpu still joins the hosts, as before
        print(
            f"jaxsys: warning: Cloud TPU detection failed ({e}); not initialising jax.distributed "
            "(set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID to force it)",
            file=sys.stderr,
            flush=True,
        )
    return None


def cpu_unless_accelerator() -> None:
    """Use the CPU backend when this machine has no TPU chip and no NVIDIA GPU, unless the user chose
    platforms (JAX_PLATFORMS): with libtpu or the CUDA plugin installed for ahead-of-time analysis
    (`pip install -e '.[tpu,gpu-aot]'`), JAX would otherwise spend seconds probing for a TPU and
    print the plugins' start-up errors before falling back to the CPU. Call before any device work."""
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return
    from jax._src import hardware_utils

    tpu_chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
    if tpu_chips == 0 and not hardware_utils.has_visible_nvidia_gpu():
        jax.config.update("jax_platforms", "cpu")


def make_mesh(config, devices=None) -> Mesh:
    """The mesh of `config.mesh`, over all devices of all processes, axis order MESH_AXES
    (slow outer links first, fast inner ones last). Validates the config against the device count
    (resolving a -1 axis in place) and places the devices by `device_grid`."""
    devices = list(jax.devices() if devices is None else devices)
    validate(config, num_devices=len(devices))
    shape = tuple(config.mesh[a] for a in MESH_AXES)
    dcn = tuple(config.dcn[a] for a in MESH_AXES)
    return Mesh(device_grid(devices, shape, dcn), MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))


def mesh_for(config) -> Mesh:
    """The mesh of `config` on the first devices it needs (all of them when an axis is -1 or it
    needs more than there are, so that `make_mesh` names the mismatch)."""
    n = math.prod(config.mesh[a] for a in MESH_AXES)
    whole = any(config.mesh[a] == -1 for a in MESH_AXES) or n > jax.device_count()
    return make_mesh(config, None if whole else jax.devices()[:n])


def _granules(devices) -> int:
    """TPU slices (slice_index) the devices span; 1 for a single slice or other platforms."""
    return len({getattr(d, "slice_index", 0) or 0 for d in devices})


def device_grid(devices, shape, dcn) -> np.ndarray:
    """Devices arranged as `shape` (an array of the mesh's axes).

    - TPU: by the physical topology (`mesh_utils.create_device_mesh`: each mesh axis a ring of ICI
      links where the shape allows), and over several slices by `create_hybrid_device_mesh`, the
      `dcn` factor of each axis spanning slices. Shapes the topology cannot map onto whole physical
      axes split them; if even that fails, devices are taken in (slice, id) order.
    - Several processes with a `dcn` factor (GPU clusters): hybrid, one granule per process (host).
    - Otherwise sorted by (process, id): a process's devices stay contiguous on the inner axes.
    """
    from jax.experimental import mesh_utils

    n_dcn = math.prod(dcn)
    platform = devices[0].platform
    slices = _granules(devices) if platform == "tpu" else 1
    if platform == "tpu" and slices != n_dcn:
        raise ConfigError(
            f"the TPU devices span {slices} slice(s) but config.dcn.* multiplies to {n_dcn}: set the "
            f"DCN factors so that their product is {slices} (e.g. config.dcn.data={slices} with "
            f"config.mesh.data a multiple of it)"
        )
    hosts = len({d.process_index for d in devices})
    if n_dcn > 1 and platform != "tpu" and hosts > 1:
        if hosts != n_dcn:
            raise ConfigError(
                f"config.dcn.* multiplies to {n_dcn} but the devices are on {hosts} hosts "
                "(processes): make them equal, or set config.dcn.* to 1"
            )
        ici = tuple(s // d for s, d in zip(shape, dcn))
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
    if platform == "tpu":
        try:
            if n_dcn > 1:
                ici = tuple(s // d for s, d in zip(shape, dcn))
                return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
            return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError):
            order = sorted(devices, key=lambda d: (getattr(d, "slice_index", 0) or 0, d.id))
            return np.array(order).reshape(shape)
    return np.array(sorted(devices, key=lambda d: (d.process_index, d.id))).reshape(shape)
