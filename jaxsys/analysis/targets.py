"""Accelerator targets that the analysis compiles for without owning one: TPU slices through
libtpu's ahead-of-time topology descriptions, and NVIDIA GPU nodes through the CUDA plugin's
deviceless compilation (`jax.experimental.topologies`).

    target = targets.parse("v5p-256")            # Cloud's name: 256 TensorCores = 128 chips
    target = targets.parse("v5p:4x4x8")          # or the topology itself
    target = targets.parse("v6e-16", slices=2)   # two slices joined by the data-centre network
    target = targets.parse("h100-256")           # 32 nodes of 8 H100s (XLA:GPU, deviceless)
    devices = targets.devices(target)            # compile-only devices (needs libtpu / the plugin)

TPU names follow Google Cloud's accelerator types: v4-N and v5p-N count TensorCores (2 per chip,
used as one "megacore" device), v5e-N (also v5litepod-N) and v6e-N count chips. GPU names count
GPUs, 8 per node. Nothing runs on these devices: programs lower and compile, and the compiler's
memory analysis is the target's own.

This module holds names, topologies and compilers; the chips' numbers (HBM, bandwidth, peaks,
ICI, DCN, the GPU description XLA:GPU compiles against) are analysis/hardware.py's table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import re
import sys
import tempfile

from jaxsys.analysis import hardware as hardware_lib
from jaxsys.config import ConfigError

INSTALL_HINT = (
    "--target needs libtpu (the TPU compiler, a ~690 MB wheel): install it with "
    "`.venv/bin/pip install -e '.[tpu]'` (or `pip install 'jax[tpu]==0.11.2'`)"
)
GPU_INSTALL_HINT = (
    "a GPU --target needs the CUDA plugin and ptxas (~270 MB): install them with "
    "`.venv/bin/pip install -e '.[gpu-aot]'` (jax-cuda13-plugin, jax-cuda13-pjrt, "
    "nvidia-cuda-nvcc)"
)


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation's topology: how libtpu names its slices and which shapes it builds. Its
    numbers (HBM, bandwidth, peak, ICI, DCN) are `hardware.TPU_CHIPS[generation]`."""

    generation: str
    topology_prefix: str  # what libtpu's topology names start with
    megacore: bool  # two TensorCores presented as one device (names count cores)
    torus_dims: int  # 3: v4/v5p (wrap-around links on full axes), 2: v5e/v6e
    shapes: dict  # chips -> topology shape of the slice

    def shape(self, chips: int) -> str:
        return self.shapes[chips]

    @property
    def facts(self) -> hardware_lib.TpuChip:
        return hardware_lib.TPU_CHIPS[self.generation]


_3D = {
    4: "2x2x1",
    8: "2x2x2",
    16: "2x2x4",
    32: "2x4x4",
    64: "4x4x4",
    128: "4x4x8",
    256: "4x8x8",
    512: "8x8x8",
    1024: "8x8x16",
    2048: "8x16x16",
    4096: "16x16x16",
}
_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}

CHIPS = {
    "v4": Chip("v4", "v4", True, 3, _3D),
    "v5p": Chip("v5p", "v5p", True, 3, _3D),
    "v5e": Chip("v5e", "v5e", False, 2, _2D),
    "v6e": Chip("v6e", "v6e", False, 2, _2D),
}
_ALIASES = {"v5litepod": "v5e", "v5": "v5p", "v4p": "v4"}


@dataclasses.dataclass(frozen=True)
class Gpu:
    """An NVIDIA GPU target: nodes of `hardware.GPUS_PER_NODE` on NVLink. The figures XLA:GPU's
    deviceless compiler needs (`target_config`) and the roofline profile are the table's
    (`hardware.GPU_CHIPS[generation]`, `hardware.PROFILES[its profile]`)."""

    generation: str

    @property
    def facts(self) -> hardware_lib.GpuChip:
        return hardware_lib.GPU_CHIPS[self.generation]

    @property
    def description(self) -> str:
        """device_kind of the compile-only devices (Pallas/Triton read it)."""
        return self.facts.device_kind

    def target_config(self) -> str:
        """A GpuTargetConfigProto: the part's figures from the table, and the CUDA limits of its
        compute capability (9.0: 227 KiB of shared memory per block opt-in, 228 KiB per SM)."""
        g = self.facts
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32
  shared_memory_per_block: 49152 shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472 threads_per_core_limit: 2048
  core_count: {g.sm_count} fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  thread_dim_limit_x: 1024 thread_dim_limit_y: 1024 thread_dim_limit_z: 64
  memory_bandwidth: {g.memory_bytes_per_s} l2_cache_size: {g.l2_bytes} clock_rate_ghz: {g.clock_ghz}
  device_memory_size: {g.memory_bytes}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
  cuda_compute_capability {{ major: {g.compute_capability} }}
}}
platform_name: "CUDA"
device_description_str: "{g.device_kind}"
"""


GPUS_PER_NODE = hardware_lib.GPUS_PER_NODE
GPUS = {gen: Gpu(gen) for gen in hardware_lib.GPU_CHIPS}


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as the user wrote it
    chip: Chip | Gpu
    topology: str  # libtpu's name of one slice, e.g. "v5p:4x4x8"; for GPUs "1x<nodes>x<per node>"
    slices: int = 1  # TPU slices joined by DCN (GPU nodes are in the topology)

    @property
    def platform(self) -> str:
        return "gpu" if isinstance(self.chip, Gpu) else "tpu"

    @property
    def chips_per_slice(self) -> int:
        """Chips that share the fast links: a TPU slice (ICI), a GPU node (NVLink)."""
        dims = [int(d) for d in self.topology.split(":")[-1].split("x")]
        return dims[-1] if self.platform == "gpu" else math.prod(dims)

    @property
    def chips(self) -> int:
        if self.platform == "gpu":
            return math.prod(int(d) for d in self.topology.split("x"))
        return self.chips_per_slice * self.slices

    def describe(self) -> str:
        if self.platform == "gpu":
            nodes = self.chips // self.chips_per_slice
            return f"{self.name} ({nodes} node(s) x {self.chips_per_slice} {self.chip.description} GPUs)"
        many = f" x {self.slices} slices" if self.slices > 1 else ""
        return f"{self.name} ({self.topology}{many}: {self.chips} chips of TPU {self.chip.generation})"


def known_names() -> list[str]:
    """Every accelerator-type name `parse` accepts (one per slice size; GPUs up to 64 nodes)."""
    out = []
    for gen, chip in CHIPS.items():
        per = 2 if chip.megacore else 1
        out += [f"{gen}-{chips * per}" for chips in chip.shapes]
    for gen in GPUS:
        out += [f"{gen}-{n}" for n in (1, 2, 4, 8)] + [f"{gen}-{8 * k}" for k in (2, 4, 8, 16, 32, 64)]
    return out


def _known_text() -> str:
    sizes = {gen: ", ".join(str(c * (2 if chip.megacore else 1)) for c in chip.shapes) for gen, chip in CHIPS.items()}
    return (
        "; ".join(f"{gen}-N for N in {{{s}}}" for gen, s in sizes.items())
        + "; or a topology such as v5p:4x4x8 or v6e:4x4; GPUs: "
        + ", ".join(f"{g}-N" for g in GPUS)
        + " for N GPUs (1, 2, 4, or a multiple of 8: N/8 nodes of 8)"
    )


def parse(name: str, slices: int = 1) -> Target:
    """A target from an accelerator type ("v5p-256", "v6e-16") or a topology ("v5p:4x4x8")."""
    if not isinstance(slices, int) or slices < 1:
        raise ConfigError(f"--slices {slices!r}: the number of slices must be a positive integer")
    text = name.strip().lower()
    gpu = re.fullmatch(r"([a-z]\d+)-(\d+)", text)
    if gpu and gpu.group(1) in GPUS:
        n = int(gpu.group(2))
        if slices != 1:
            raise ConfigError(
                f"--slices is for TPU targets; GPU nodes are in the name ({name!r}: {n} GPUs, 8 per node)"
            )
        if n in (1, 2, 4):
            return Target(name, GPUS[gpu.group(1)], f"1x1x{n}")
        if n < 1 or n % GPUS_PER_NODE:
            raise ConfigError(f"GPU target {name!r}: N must be 1, 2, 4 or a multiple of 8 (nodes of 8 GPUs)")
        return Target(name, GPUS[gpu.group(1)], f"1x{n // GPUS_PER_NODE}x{GPUS_PER_NODE}")
    topo = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+){1,2})", text)
    typed = re.fullmatch(r"([a-z0-9]+)-(\d+)", text)
    gen_name = (topo or typed).group(1) if (topo or typed) else ""
    gen_name = _ALIASES.get(gen_name, gen_name)
    chip = CHIPS.get(gen_name)
    if chip is None:
        raise ConfigError(f"unknown target {name!r}: known targets are {_known_text()}")
    if topo:
        dims = topo.group(2).split("x")
        if len(dims) != chip.torus_dims:
            raise ConfigError(
                f"TPU target {name!r}: a {chip.generation} slice has {chip.torus_dims} "
                f"dimensions, e.g. {chip.generation}:{chip.shapes[max(chip.shapes)]}"
            )
        return Target(name, chip, f"{chip.topology_prefix}:{topo.group(2)}", slices)
    count = int(typed.group(2))
    per = 2 if chip.megacore else 1
    if count % per or count // per not in chip.shapes:
        sizes = ", ".join(str(c * per) for c in chip.shapes)
        unit = "TensorCores, 2 per chip" if chip.megacore else "chips"
        raise ConfigError(
            f"unknown TPU target {name!r}: {chip.generation}-N counts {unit}; N is one of "
            f"{sizes} (or give a topology such as {chip.generation}:"
            f"{chip.shapes[max(chip.shapes)]})"
        )
    return Target(name, chip, f"{chip.topology_prefix}:{chip.shape(count // per)}", slices)


def hardware(target: Target) -> hardware_lib.Hardware:
    """The roofline profile of a target (`hardware.Hardware`). GPUs: the profile of the GPU
    (`hardware.PROFILES`, 8 per NVLink node). TPUs: the chip on a slice of the target's size
    (`hardware.tpu`: ICI inside the slice, DCN across slices)."""
    if isinstance(target.chip, Gpu):
        return hardware_lib.profile(target.chip.facts.profile)
    gen = target.chip.generation
    name = f"TPU {gen} ({target.topology}" + (f" x {target.slices} slices)" if target.slices > 1 else ")")
    return hardware_lib.tpu(gen, target.chips_per_slice, name)


def libtpu_version() -> str:
    try:
        from importlib.metadata import version

        return version("libtpu")
    except Exception:  # not installed
        return "none"


def has_libtpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def has_cuda_plugin() -> bool:
    return (
        importlib.util.find_spec("jax_cuda13_plugin") is not None
        and importlib.util.find_spec("jax_plugins") is not None
    )


def compiler_name(target: Target) -> str:
    if target.platform == "gpu":
        from importlib.metadata import version

        try:
            return f"XLA:GPU deviceless (jax-cuda13-plugin {version('jax-cuda13-plugin')})"
        except Exception:
            return "XLA:GPU deviceless"
    return f"TPU compiler (libtpu {libtpu_version()})"


def require_compiler(target: Target) -> None:
    """Raise ConfigError with the install command when the target's compiler is missing."""
    if target.platform == "gpu" and not has_cuda_plugin():
        raise ConfigError(GPU_INSTALL_HINT)
    if target.platform == "tpu" and not has_libtpu():
        raise ConfigError(INSTALL_HINT)


_HARMLESS = (
    "TPU_ACCELERATOR_TYPE",
    "TPU_WORKER_HOSTNAMES",
    "host bounds",
    "Source Location Trace",
    "libtpu_init_utils",
    "InitGoogle",
    "metadata",
    "TPU_WORKER_ID",
    "=== ",
)


@contextlib.contextmanager
def quiet_libtpu():
    """libtpu, started on a machine without TPUs, writes warnings about TPU_ACCELERATOR_TYPE,
    TPU_WORKER_HOSTNAMES and the metadata server straight to file descriptor 2. They are harmless for
    ahead-of-time compilation: capture fd 2 and pass on only the lines that are not those."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [
                line
                for line in captured.read().decode(errors="replace").splitlines()
                if line.strip() and not any(h in line for h in _HARMLESS)
            ]
            if kept:
                print("\n".join(kept), file=sys.stderr)


def _gpu_devices(target: Target) -> list:
    import jax
    from jax.experimental import topologies

    # The CUDA plugin checks its CUDA libraries when it becomes a backend; with the CPU as the only
    # backend it still registers the topology factory that deviceless compilation needs.
    if "cuda" in (jax.config.jax_platforms or "") or "gpu" in (jax.config.jax_platforms or ""):
        raise ConfigError(
            "a GPU --target compiles from the CPU: set JAX_PLATFORMS=cpu (a real GPU "
            "backend has no target description to compile against)"
        )
    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")
    try:
        with quiet_libtpu():
            return list(
                topologies.get_topology_desc(
                    platform="cuda", topology=target.topology, target_config=target.chip.target_config()
                ).devices
            )
    except Exception as e:
        raise ConfigError(f"the CUDA plugin cannot describe GPU target {target.describe()}: {e}") from e


def devices(target: Target) -> list:
    """The target's compile-only devices (every TPU slice, every GPU node); raises ConfigError
    naming the install command when the compiler is missing."""
    require_compiler(target)
    if target.platform == "gpu":
        return _gpu_devices(target)
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no GCE metadata server to ask here
    # libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) meant for processes sharing real
    # chips; compile-only processes share none, and tests run several at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    dims = [int(d) for d in target.topology.split(":")[1].split("x")] + [1]
    # hosts of 2x2x1 chips (Cloud's VM shapes); a smaller slice is one host
    bounds = tuple(min(b, d) for b, d in zip((2, 2, 1), dims[:3]))
    kwargs = dict(
        chip_config_name="megacore" if target.chip.megacore else "default",
        chips_per_host_bounds=bounds,
        num_slices=target.slices,
    )
    try:
        with quiet_libtpu():
            return list(topologies.get_topology_desc(platform="tpu", topology_name=target.topology, **kwargs).devices)
    except Exception as e:  # libtpu's INVALID_ARGUMENT for shapes it does not know
        raise ConfigError(
            f"libtpu cannot describe TPU target {target.describe()}: {e}. Known targets: {_known_text()}"
        ) from e
