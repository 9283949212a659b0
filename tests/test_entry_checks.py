"""A wrong call of a kernel or a parallel op fails at its entry, naming what it takes, rather than
deep inside XLA or silently: chex's trace-time checks on the parallel ops (AssertionError), the
kernels' own ValueErrors. Every check fires before any collective, so no mesh is needed."""

import jax.numpy as jnp
import pytest

from jaxsys.config import base_config
from jaxsys.kernels.flash_attention import flash_attention, reference_attention
from jaxsys.kernels.quantized_matmul import kernel as qkernel
from jaxsys.kernels.quantized_matmul import reference as qref
from jaxsys.models import attention
from jaxsys.parallel import context, expert, fsdp, tensor
from jaxsys.sharding import Layout

TP = ("tensor",)


def test_tensor_ops_name_the_shapes_they_take():
    flat = jnp.zeros((8, 16))  # [B*T, D]: an all-gather over dim 1 would gather D
    with pytest.raises(AssertionError, match=r"rank 2.*tensor.enter under sequence parallelism takes x\[B, T/sp, D\]"):
        tensor.enter(flat, TP, TP)
    with pytest.raises(AssertionError, match=r"tensor.leave under sequence parallelism takes y\[B, T, D\]"):
        tensor.leave(flat, TP, TP)
    with pytest.raises(AssertionError, match=r"float32.*tensor.embed_lookup takes integer token ids"):
        tensor.embed_lookup(jnp.zeros((16, 4)), jnp.zeros((2, 3)), TP)
    with pytest.raises(AssertionError, match=r"tensor.embed_lookup takes table\[V/tp, D\]"):
        tensor.embed_lookup(jnp.zeros((16,)), jnp.zeros((2, 3), jnp.int32), TP)
    logits = jnp.zeros((2, 3, 16))
    with pytest.raises(AssertionError, match=r"\(6,\).*tensor.cross_entropy takes targets\[B, T\]"):
        tensor.cross_entropy(logits, jnp.zeros((6,), jnp.int32), TP)
    with pytest.raises(AssertionError, match=r"tensor.cross_entropy takes integer targets"):
        tensor.cross_entropy(logits, jnp.zeros((2, 3)), TP)


def test_fsdp_gather_needs_one_logical_name_per_dimension():
    layout = Layout.from_config(base_config())
    with pytest.raises(AssertionError, match=r"rank 2.*fsdp.gather: a weight with logical axes \('embed',\)"):
        fsdp.gather({"w": jnp.zeros((4, 8))}, {"w": ("embed",)}, layout)


def test_expert_dispatch_and_combine_name_their_buffers():
    axes = ("expert",)
    with pytest.raises(AssertionError, match=r"expert.capacity_dispatch takes buffer\[G, E, C, D\]"):
        expert.capacity_dispatch(jnp.zeros((2, 4, 8)), axes)
    with pytest.raises(AssertionError, match=r"expert.capacity_combine takes y\[ep G, E_l, C, D\]"):
        expert.capacity_combine(jnp.zeros((2, 4, 8)), axes)
    with pytest.raises(AssertionError, match=r"expert.dropless_dispatch takes rows\[M, D\], counts\[E\]"):
        expert.dropless_dispatch(jnp.zeros((2, 4, 8)), jnp.zeros((4,), jnp.int32), axes)
    with pytest.raises(AssertionError, match=r"expert.dropless_dispatch takes integer counts"):
        expert.dropless_dispatch(jnp.zeros((8, 4)), jnp.zeros((4,)), axes)
    with pytest.raises(AssertionError, match=r"expert.dropless_combine takes results\[ep M, D\]"):
        expert.dropless_combine(jnp.zeros((8,)), None, 4, axes)
    x, ids = jnp.zeros((2, 8, 4)), jnp.zeros((2, 8, 2), jnp.int32)  # x[B, T, D], experts[B, T, k]
    with pytest.raises(AssertionError, match=r"expert.dispatch takes experts\[B, T, k\]"):
        expert.dispatch(x, expert.Routed(ids[:, :4], ids[:, :4], None, None), None, None)
    with pytest.raises(AssertionError, match=r"expert.dispatch takes integer expert ids"):
        expert.dispatch(x, expert.Routed(ids.astype(jnp.float32), ids, None, None), None, None)
    with pytest.raises(AssertionError, match=r"expert.combine takes gates\[B, T, k\]"):
        expert.combine(x, None, jnp.zeros((16, 2)))


def test_context_attention_and_lasp2_name_their_shapes():
    seq = context.SeqLayout(("seq",), 2, balance=False)
    q, kv = jnp.zeros((1, 8, 4, 16)), jnp.zeros((1, 8, 2, 16))
    blocks = attention.BlockAttention()
    with pytest.raises(AssertionError, match=r"context.attention takes q\[B, T/P, N, H\]"):
        context.attention(q[0], kv, kv, seq, blocks)
    with pytest.raises(AssertionError, match=r"context.attention takes"):
        context.attention(q, kv, kv[:, :, :1], seq, blocks)  # k and v differ
    with pytest.raises(AssertionError, match=r"context.attention takes"):
        context.attention(q, kv[:, :4], kv[:, :4], seq, blocks)  # another local T
    chunk = lambda q, k, v: (v, None)
    with pytest.raises(AssertionError, match=r"context.lasp2 takes q/k\[B, T/P, N, H\]"):
        context.lasp2(q, kv, kv, jnp.zeros((4,)), 1.0, seq, chunk)  # K/V heads not repeated
    with pytest.raises(AssertionError, match=r"context.lasp2 takes .* log_decay\[N\]"):
        context.lasp2(q, q, q, jnp.zeros((2,)), 1.0, seq, chunk)


def test_kernels_refuse_float_segment_ids_and_zero_points():
    q = jnp.zeros((1, 16, 2, 16))
    ids = jnp.zeros((1, 16))
    for attend in (flash_attention, reference_attention):
        with pytest.raises(ValueError, match=r"q_segment_ids must be integers; got float32"):
            attend(q, q, q, q_segment_ids=ids, kv_segment_ids=ids.astype(jnp.int32))
    x, w = jnp.zeros((2, 64)), jnp.ones((64, 128)) * 0.1
    codes, s, z = qref.quantize_w4(w, 32, zero_point=True)
    packed = qref.repack_w4(qref.pack_int4(codes), 32)
    with pytest.raises(ValueError, match=r"matmul_w4a16 takes integer zero points; got float32"):
        qkernel.matmul_w4a16(x, packed, s, z.astype(jnp.float32), interpret=True)
