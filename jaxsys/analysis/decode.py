"""Decode (serving) analysis of a config: KV-cache bytes, the batch that fits, a roofline latency.

    python -m jaxsys.analyze --config C --mode decode [--hardware h100] [--contexts 512,2048,8192]
        [--batches 1,8,32,128]

Per device, on the config's tensor (and data) layout, with the engine's full-precision cache (keys
and values of every layer in the compute dtype, kv heads split over `tensor`):

    KV bytes per token     = 2 L K H b_c / t                  (K kv heads, H head dim, t = tensor)
                             L H_c b_c                        (MLA's latent cache: one row of
                                                               C + R padded to H_c, on every rank)
    weight bytes           = the parameter shards at rest (quantized codes and scales as stored)
    batch that fits at S   = floor((HBM - weights) / (S x KV bytes per token)) per data shard
    decode step (batch b, context S), one token per sequence (`DecodeStep`, the same roofline that
    prices the serving engine's steps in analysis/serving.py):
        memory   = (weights + b S KV bytes per token) / HBM bandwidth
        compute  = 2 (matmul parameters / t) b / peak + attention 4 L b S N H_c / t / peak
                   (H_c the cache's width: H padded to a power of two, or a latent cache's row)
        comm     = 2 all-reduces per layer of [b, D] b_c over `tensor`, ring bytes / link bandwidth
        latency  = max(memory, compute) + comm          (collectives not overlapped, as in decode)
    with sliding-window ("local") layers, S in the memory and attention terms is the positions a
    row reads averaged over the layers: min(S, W) for a local layer (`DecodeStep.read_context`);
    the batch that fits holds all S, except when every layer is local and config.serve.rolling:
    then a sequence holds R pages (serve/scheduler.ring_pages), min(S, R p) positions. The engine
    step's pricing (analysis/serving.py) takes summed contexts and does not apply the window.
    KV handed from a prefill to a decode mesh (disaggregated serving, serve/disagg.py), per request
    of T prompt tokens in pages of p slots:
        transfer bytes = 2 L ceil(T / p) p K H b_c      (whole pages; over all devices, not per device;
                                                         a latent cache: L ceil(T / p) p H_c b_c per tensor rank)

Formulas only: nothing is compiled (the step is tiny; the question is what bounds it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxsys.analysis import cost_model
from jaxsys.analysis import flops as flops_lib
from jaxsys.analysis.hardware import Hardware
from jaxsys.cache import base as cache_base
from jaxsys.models import transformer
from jaxsys.models.params import is_spec
from jaxsys.sharding import Layout

CONTEXTS = (512, 2048, 8192, 32768)
BATCHES = (1, 8, 32, 128)


def weight_bytes_per_device(config) -> int:
    """Parameter bytes one device holds at rest (its shards, in each leaf's stored dtype)."""
    import jax

    layout = Layout.from_config(config)
    specs = transformer.param_specs(config.model)
    total = 0
    for s in jax.tree.leaves(specs, is_leaf=is_spec):
        itemsize = np.dtype(s.dtype or config.model.param_dtype).itemsize
        total += math.prod(layout.local_shape(s.shape, s.axes)) * itemsize
    return total


def kv_transfer_bytes(model, tokens: int, page_size: int = 1, tensor: int = 1) -> int:
    """Bytes of KV cache that disaggregated serving moves from the prefill to the decode mesh for
    a request of `tokens` prompt tokens: keys and values of every layer for whole pages of
    `page_size` slots, in the compute dtype (the sum over devices: each decode device receives its
    kv heads' share once; each of the decode mesh's `tensor` ranks the whole of a latent cache).
    page_size=1: no page rounding."""
    padded = math.ceil(tokens / page_size) * page_size
    copies = tensor if cache_base.latent(model) else 1
    return int(padded * cache_base.token_bytes(model) * copies)


_WEIGHTS: dict = {}


def cached_weight_bytes(config) -> int:
    """`weight_bytes_per_device`, remembered per (model, mesh): replays price thousands of steps."""
    from jaxsys.config import MESH_AXES

    key = (repr(config.model), tuple(config.mesh[a] for a in MESH_AXES))
    if key not in _WEIGHTS:
        _WEIGHTS[key] = weight_bytes_per_device(config)
    return _WEIGHTS[key]


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    """The roofline of one serving step in a config's layout on a hardware profile, written once:
    the decode report prices its (batch, context) rows with it, the serving cost model
    (analysis/serving.py, `step_seconds`) its engine steps, prefill chunks included. For a batch
    shard running `rows` tokens whose context lengths sum to `context`:

        memory   = (weights + context x KV bytes per token) / HBM bandwidth
        compute  = (2 (matmul parameters / t) rows + 4 L context N H / t) / (peak x mfu)
        comm     = 2 all-reduces per layer of [rows, D] b_c over `tensor`, ring bytes / link bandwidth
        step     = max(memory, compute) + comm"""

    model: Any  # config.model
    tensor: int  # t: the devices the kv heads are split over
    weights: int  # parameter bytes per device at rest
    kv_bytes_per_token: int  # 2 L K H b_c / t (cache_base.token_bytes)
    tensor_bytes_per_s: float  # the `tensor` axis's link
    matmul_params: float  # per device (/ t)
    peak: float  # FLOP/s of one device in the compute dtype
    hbm_bytes_per_s: float

    @classmethod
    def for_config(cls, config, hw: Hardware, weights: int | None = None) -> "DecodeStep":
        m = config.model
        layout = Layout.from_config(config)
        t = layout.size(layout.compute_axes("kv_heads"))
        return cls(
            m,
            t,
            weight_bytes_per_device(config) if weights is None else weights,
            int(cache_base.token_bytes(m, t)),
            cost_model.axis_bandwidth(layout.mesh_sizes, hw).get("tensor", hw.intra_node_bytes_per_s),
            flops_lib.matmul_params(m) / t,
            hw.peak(m.compute_dtype),
            hw.hbm_bytes_per_s,
        )

    def times(self, rows: int, context: int, mfu: float = 1.0) -> tuple[float, float, float]:
        """(memory_s, compute_s, comm_s) of a step of `rows` tokens over `context` cached positions."""
        m, t = self.model, self.tensor
        memory = (self.weights + context * self.kv_bytes_per_token) / self.hbm_bytes_per_s
        # q.k and p.v per head and cached position over the cache's (padded) width: H_c + H_c
        width = 2 * cache_base.head_dim(m)
        attention = 2 * m.n_layers * context * m.n_heads * width / t
        compute = (2 * self.matmul_params * rows + attention) / (self.peak * mfu)
        b = np.dtype(m.compute_dtype).itemsize
        all_reduce = cost_model.ring_bytes("all_reduce", rows * m.d_model * b, t)
        comm = 0.0 if t == 1 else 2 * m.n_layers * all_reduce / self.tensor_bytes_per_s
        return memory, compute, comm

    def read_context(self, context: int) -> float:
        """The positions a row of `context` cached tokens reads per layer, averaged over the layers:
        `context`, less for the sliding-window ("local") layers, which read the last W only."""
        from jaxsys.models import attention

        m = self.model
        reads = [min(context, m.sliding_window) if kind == "local" else context for kind in attention.layer_types(m)]
        return sum(reads) / len(reads)

    def seconds(self, rows: int, context: int, mfu: float = 1.0) -> float:
        memory, compute, comm = self.times(rows, context, mfu)
        return max(memory, compute) + comm


def held_context(config):
    """S -> the positions a sequence of S tokens holds in the serving engine's cache: S, or with
    rolling pages (every layer local, config.serve.rolling, a paged cache without kv_quant or a
    drafter) at most the ring's R pages."""
    from jaxsys.serve.scheduler import ring_pages

    sv = config.serve
    rolling = sv.get("rolling", True) and sv.get("cache", "paged") == "paged" and sv.kv_quant == "none"
    rolling = rolling and sv.policy == "chunked"
    ring = ring_pages(config.model, sv.page_size, sv.chunk_size) if rolling and sv.spec_k == 0 else 0
    return (lambda S: min(S, ring * sv.page_size)) if ring else (lambda S: S)


def decode_report(config, hw: Hardware, contexts=CONTEXTS, batches=BATCHES) -> dict:
    m = config.model
    layout = Layout.from_config(config)
    data = layout.size(layout.compute_axes("batch"))
    step = DecodeStep.for_config(config, hw)
    kv_per_token, weights = step.kv_bytes_per_token, step.weights
    free = hw.hbm_bytes - weights
    held = held_context(config)
    fit = lambda S: max(int(free // (held(S) * kv_per_token)), 0) if free > 0 else 0
    rows = []
    for S in contexts:
        fits = fit(S)
        for b in batches:
            local_b = max(b // data, 1)
            memory_s, compute_s, comm_s = step.times(local_b, local_b * step.read_context(S))
            latency = max(memory_s, compute_s) + comm_s
            rows.append(
                {
                    "context": S,
                    "batch": b,
                    "batch_per_device": local_b,
                    "fits": local_b <= fits,
                    "memory_s": memory_s,
                    "compute_s": compute_s,
                    "comm_s": comm_s,
                    "latency_s": latency,
                    "tokens_per_s": b / latency,
                    "bound": "memory" if memory_s >= compute_s else "compute",
                }
            )
    return {
        "mode": "decode",
        "hardware": hw.name,
        "mesh": {a: s for a, s in layout.mesh_sizes.items() if s > 1},
        "quant": m.quant,
        "compute_dtype": m.compute_dtype,
        "param_dtype": m.param_dtype,
        "kv_bytes_per_token": kv_per_token,
        "weight_bytes_per_device": weights,
        "hbm_bytes": hw.hbm_bytes,
        "kv_bytes_per_sequence": {S: held(S) * kv_per_token for S in contexts},
        # disaggregated serving: a prompt of S tokens' KV moved prefill -> decode mesh (all devices)
        "transfer_bytes_per_request": {
            S: kv_transfer_bytes(m, S, config.serve.page_size, step.tensor) for S in contexts
        },
        "transfer_s_per_request": {
            S: kv_transfer_bytes(m, S, config.serve.page_size, step.tensor) / hw.intra_node_bytes_per_s
            for S in contexts
        },
        "max_batch_per_device": {S: fit(S) for S in contexts},
        "rows": rows,
    }


def decode_analysis(config, hardware: str, target=None, contexts=CONTEXTS, batches=BATCHES) -> dict:
    """`jaxsys analyze --mode decode`: the decode report on an accelerator profile (formulas only:
    no --target, and not the CPU's profile)."""
    from jaxsys.analysis import hardware as hardware_lib
    from jaxsys.config import ConfigError

    if hardware == "cpu" or target is not None:
        names = [n for n in hardware_lib.PROFILES if n != "cpu"]
        raise ConfigError(f"--mode decode takes --hardware {', '.join(names[:-1])} or {names[-1]} (no --target)")
    return decode_report(config, hardware_lib.profile(hardware), contexts, batches)


def format_decode_report(r: dict) -> str:
    from jaxsys.analysis.report import _b

    layout = " x ".join(f"{a}={s}" for a, s in r["mesh"].items()) or "1 device"
    out = [
        f"decode on {layout}, {r['hardware']}; weights {r['quant'] if r['quant'] != 'none' else r['param_dtype']}"
        f", KV cache {r['compute_dtype']}",
        "",
        f"KV cache per token per device: {_b(r['kv_bytes_per_token'])}; weights per device "
        f"{_b(r['weight_bytes_per_device'])} of {_b(r['hbm_bytes'])}",
        "",
        "context   KV per sequence   sequences that fit per device   prefill->decode transfer (one link)",
    ]
    for S, per_seq in r["kv_bytes_per_sequence"].items():
        xfer = r.get("transfer_bytes_per_request", {}).get(S)
        note = f"   {_b(xfer):>12} {r['transfer_s_per_request'][S] * 1e3:8.3f} ms" if xfer is not None else ""
        out.append(f"{S:>7}   {_b(per_seq):>15}   {r['max_batch_per_device'][S]:>29,}{note}")
    out += ["", "context  batch   latency/step   tokens/s   bound     (memory / compute / comm ms)"]
    for row in r["rows"]:
        note = "" if row["fits"] else "  does not fit"
        out.append(
            f"{row['context']:>7} {row['batch']:>6} {row['latency_s'] * 1e3:>11.3f} ms "
            f"{row['tokens_per_s']:>10,.0f}   {row['bound']:<8}  ({row['memory_s'] * 1e3:.3f} / "
            f"{row['compute_s'] * 1e3:.3f} / {row['comm_s'] * 1e3:.3f}){note}"
        )
    return "\n".join(out)
