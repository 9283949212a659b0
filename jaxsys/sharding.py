"""Logical axis names -> mesh axes -> PartitionSpecs, by the rules in `config.sharding`.

Model code names the axes of every parameter and activation (`embed`, `heads`, `mlp`, ...) and
never a mesh axis. `Layout` holds the two rule tables (where parameters live at rest, where they
are used) and the mesh sizes; `jaxsys.parallel` asks it which mesh axes a collective runs over.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from jax.sharding import PartitionSpec as P

from jaxsys.config import MESH_AXES, axes_of

Logical = tuple[str | None, ...]


def adaptive_groups(config) -> tuple[tuple[int, float], ...]:
    """config.data.adaptive_cp_groups parsed ((g, share), ...), () without adaptive_cp."""
    if not config.data.get("adaptive_cp"):
        return ()
    from jaxsys.parallel import context

    return context.parse_groups(str(config.data.get("adaptive_cp_groups", "")))


@dataclasses.dataclass(frozen=True)
class Layout:
    """How logical axes map onto the mesh. Axes of size 1 are dropped everywhere so that a
    one-device layout has no collectives at all."""

    mesh_sizes: Mapping[str, int]
    param_rules: Mapping[str, tuple[str, ...]]
    compute_rules: Mapping[str, tuple[str, ...]]
    sequence_parallel: bool = False
    params_on_host: bool = False  # config.offload.params: weights at rest in host memory
    offload_activations: tuple[str, ...] = ()  # config.offload.activations: saved to host memory
    collective_matmul: bool = False  # config.parallel.collective_matmul (with sequence parallelism)
    fsdp_prefetch: bool = False  # config.parallel.fsdp_prefetch: gather layer i+1 during layer i
    seq_local: float = 0.0  # config.data.adaptive_cp_local: each seq device's local region (parallel/context.py)
    seq_groups: tuple[tuple[int, float], ...] = ()  # config.data.adaptive_cp_groups: subgroup ring tiers
    # ZeRO++ (parallel/zeropp.py): hpZ's secondary copy over `data`, its int8 gather and reduce-scatter
    hpz: bool = False
    qwz: bool = False
    qgz: bool = False
    qgz_bits: int = 8  # qgZ's codes: 8, or 4 packed two to a byte

    @classmethod
    def from_config(cls, config) -> "Layout":
        sizes = {a: int(config.mesh[a]) for a in MESH_AXES}

        def keep(rules):
            out = {k: tuple(a for a in axes_of(v) if sizes[a] > 1) for k, v in rules.items()}
            if config.parallel.vocab_parallel and sizes["pipe"] > 1:  # vocabulary parallelism
                out["vocab"] = ("pipe",) + out.get("vocab", ())
            return out

        from jaxsys.config import offloaded_activations

        return cls(
            sizes,
            keep(config.sharding.params),
            keep(config.sharding.compute),
            bool(config.parallel.sequence_parallel) and sizes["tensor"] > 1,
            bool(config.offload.params),
            offloaded_activations(config),
            collective_matmul=bool(config.parallel.get("collective_matmul", False))
            and bool(config.parallel.sequence_parallel)
            and sizes["tensor"] > 1,
            fsdp_prefetch=bool(config.parallel.get("fsdp_prefetch", False)),
            seq_local=float(config.data.get("adaptive_cp_local", 0.0)) if config.data.get("adaptive_cp") else 0.0,
            seq_groups=adaptive_groups(config),
            hpz=bool(config.parallel.get("zeropp_hpz", False)),
            qwz=bool(config.parallel.get("zeropp_qwz", False)),
            qgz=bool(config.parallel.get("zeropp_qgz", False)),
            qgz_bits=int(config.parallel.get("zeropp_qgz_bits", 8)),
        )

    # -- mesh axes of logical names
    def param_axes(self, logical: str | None) -> tuple[str, ...]:
        return self.param_rules.get(logical, ()) if logical else ()

    def compute_axes(self, logical: str | None) -> tuple[str, ...]:
        return self.compute_rules.get(logical, ()) if logical else ()

    def size(self, axes: Sequence[str]) -> int:
        return math.prod(self.mesh_sizes[a] for a in axes)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """Mesh axes that split the batch or the sequence: gradients are summed over them."""
        return self.compute_axes("batch") + self.compute_axes("seq")

    @property
    def tensor_axes(self) -> tuple[str, ...]:
        """The Megatron tensor-parallel axes (those holding the attention heads)."""
        return self.compute_axes("heads")

    @property
    def sp_axes(self) -> tuple[str, ...]:
        """Mesh axes that split the sequence between tensor-parallel blocks (Megatron SP)."""
        return self.tensor_axes if self.sequence_parallel else ()

    # -- PartitionSpecs
    def param_spec(self, logical: Logical) -> P:
        return _spec(self.param_axes(n) for n in logical)

    def compute_spec(self, logical: Logical) -> P:
        return _spec(self.compute_axes(n) for n in logical)

    def local_shape(self, shape: Sequence[int], logical: Logical) -> tuple[int, ...]:
        """Shape of one device's block of a parameter at rest."""
        return tuple(d // self.size(self.param_axes(n)) for d, n in zip(shape, logical))


def _spec(per_dim) -> P:
    entries = []
    for axes in per_dim:
        entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def spec_axes(spec: P) -> set[str]:
    """All mesh axes named in a PartitionSpec."""
    out = set()
    for entry in spec:
        if entry is None:
            continue
        out.update((entry,) if isinstance(entry, str) else entry)
    return out
