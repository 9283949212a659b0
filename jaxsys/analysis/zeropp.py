"""Bytes per link class of the weight and gradient collectives of ZeRO-3 and ZeRO++ (docs/zeropp.md),
from a formula (`link_bytes`) and from a compiled step's HLO (`hlo_link_bytes`).

Link classes: a collective whose group spans `data` crosses the slow links ("inter": between hosts,
or the DCN between TPU slices); one over `fsdp` alone stays on the fast ones ("intra"). Bytes are
those each device receives per training step (one micro-batch): an all-gather of an s-byte shard
over n ranks (n - 1) s; a reduce-scatter or all-to-all of an x-byte input (n - 1) / n x. A group
spanning both counts as inter: a flat ring over it is paced by its slow hops (what the compiled
program's one collective over both says). `hierarchical=True` splits such a collective the way a
topology-aware one runs it: the `data` hop of the s-element shards ((d - 1) s, inter), then the
`fsdp` hop of the d s gathered ((f - 1) d s, intra); ZeRO++'s cross-node volumes count this way.

Per leaf with a local shard of s elements (b bytes in the compute dtype), f = fsdp, d = data:
    ZeRO-3 over fsdp x data (n = f d):  all-gather (n - 1) s b in the forward, again in the
        backward for the layer stack (remat never keeps gathered weights), reduce-scatter (n - 1) s b;
        all inter.
    hpZ: the secondary all-gather over data (d - 1) s b and its transpose, the reduce-scatter over
        data (d - 1) s b: inter; the layers' gathers and reduce-scatter over fsdp of the d s-element
        secondary shard (f - 1) d s b each: intra.
    qwZ: the secondary all-gather sends int8 codes and fp32 row scales: (d - 1) (s + 4 r) with r rows.
    qgZ: the data reduce-scatter is an all-to-all of codes and scales: (d - 1) (s b_g / 8 + 4 r), b_g
        = 8, or 4 with `parallel.zeropp_qgz_bits=4` (two codes a byte; `zeropp.grad_bits`: 8 where a
        row has an odd length).
1-D leaves are not quantized (parallel/zeropp.quantized). Only all-gathers, reduce-scatters and
all-to-alls count (the scalar all-reduces of the loss and the gradient norm do not).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxsys.parallel import fsdp, zeropp
from jaxsys.sharding import Layout

CLASSES = ("intra", "inter")


def _link(axes) -> str:
    return "inter" if zeropp.AXIS in axes else "intra"


def leaf_bytes(
    layout: Layout, shape, logical, compute_bytes: int, regathered: bool, hierarchical: bool = False
) -> dict[str, float]:
    """Bytes per link class of one parameter's collectives in one step."""
    out = dict.fromkeys(CLASSES, 0.0)
    local = layout.local_shape(shape, logical)
    s = math.prod(local)
    gathered = tuple(dict.fromkeys(a for n in logical for a in fsdp.gathered_axes(layout, n)))
    dim = zeropp.data_dim(layout, logical)
    if layout.hpz and dim is not None:
        d = layout.mesh_sizes[zeropp.AXIS]
        rows = s // local[zeropp.scale_axis(len(local), dim)] if len(local) >= 2 else s
        quant = zeropp.quantized(len(local))
        full = (d - 1) * s * compute_bytes
        coded = lambda bits: (d - 1) * (s * bits // 8 + zeropp.SCALE_BYTES * rows)
        out["inter"] += coded(8) if layout.qwz and quant else full
        out["inter"] += coded(zeropp.grad_bits(layout, local, dim)) if layout.qgz and quant else full
        s *= d  # the secondary shard the layers gather
    times = 3 if regathered else 2
    if hierarchical and zeropp.AXIS in gathered:  # the data hop first (data is minor), then the rest
        d = layout.mesh_sizes[zeropp.AXIS]
        out["inter"] += times * (d - 1) * s * compute_bytes
        gathered, s = tuple(a for a in gathered if a != zeropp.AXIS), s * d
    n = layout.size(gathered)
    if n > 1:
        out[_link(gathered)] += times * (n - 1) * s * compute_bytes
    return out


def link_bytes(config, hierarchical: bool = False) -> dict[str, float]:
    """Bytes each device receives per training step over each link class (formula above), for the
    transformer's parameters under `config`'s layout."""
    from jaxsys.models import transformer
    from jaxsys.models.params import ParamSpec

    layout = Layout.from_config(config)
    b = jnp.dtype(config.model.compute_dtype).itemsize
    specs = transformer.param_specs(config.model)
    total = dict.fromkeys(CLASSES, 0.0)
    for path, spec in jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, ParamSpec)):
        regathered = jax.tree_util.keystr(path[:1]) == "['layers']"
        for k, v in leaf_bytes(layout, spec.shape, spec.axes, b, regathered, hierarchical).items():
            total[k] += v
    return total


def hlo_link_bytes(collectives) -> dict[str, float]:
    """The same count from a compiled step's collectives (`analysis.hlo.Module.collectives`): each
    all-gather, reduce-scatter and all-to-all over `fsdp` and/or `data` only (tensor parallelism's
    are left out) by its operand bytes, group size and executions."""
    total = dict.fromkeys(CLASSES, 0.0)
    for c in collectives:
        if not c.axes or not set(c.axes) <= {"fsdp", zeropp.AXIS}:
            continue
        n = c.group_size
        if c.kind == "all_gather":
            wire = (n - 1) * c.operand_bytes
        elif c.kind in ("reduce_scatter", "all_to_all"):
            wire = (n - 1) / n * c.operand_bytes
        else:
            continue
        total[_link(c.axes)] += wire * c.executions
    return total
