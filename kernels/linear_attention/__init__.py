"""Causal linear attention (optional per-head decay): Pallas chunked kernel and pure-JAX references.

    from jaxsys.kernels.linear_attention import linear_attention, recurrent, chunked

`linear_attention` is the Pallas kernel with a custom_vjp (the generic kernel, or the Mosaic variant
of kernel_tpu.py when the program is lowered for TPU); `recurrent` is the token-by-token ground
truth; `chunked` is the same chunkwise algorithm in jnp (the XLA baseline). All three share the
signature (q, k, v, *, log_decay=None, initial_state=None, scale=1.0) -> (o, final_state).
See docs/kernels_linear_attention.md.
"""

from jaxsys.kernels.linear_attention.kernel import linear_attention
from jaxsys.kernels.linear_attention.reference import chunked, recurrent

__all__ = ["linear_attention", "recurrent", "chunked"]
