"""The ladder residual (config.model.residual="ladder"; Zhang et al. 2025, "Ladder-residual:
parallelism-aware architecture for accelerating large model inference with communication
overlapping").

A standard block adds each module's output (attention, then MLP) to the residual stream before the
next module reads it, so the next module waits for the tensor-parallel all-reduce that finishes the
output. The ladder residual lets module i read the stream *without* module i-1's output, which joins
the stream one module later: the all-reduce of module i-1 can then run beside module i's compute.
It is another architecture (another function of the weights), not a schedule of the same one.

The stream the layer stack carries is then a `LadderStream(h, pending)`: `h`, what the next module
reads, and `pending`, the last module's output, already reduced over `tensor`, added to h only after
the next module has read h. The block calls `module_input` and `add_output` and works for both
streams: for a plain array they are the identity and `x + out`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LadderStream(NamedTuple):
    h: jax.Array  # [B, T, D]: what the next module reads
    pending: jax.Array  # [B, T, D]: the last module's output, not yet in h


def residual_stream(x, m):
    """The stream a layer stack carries for x[B, T, D]: x itself, or under the ladder residual
    (x, nothing pending yet)."""
    return LadderStream(x, jnp.zeros_like(x)) if m.residual == "ladder" else x


def flushed(stream):
    """x[B, T, D] at the end of a layer stack: under the ladder residual with the pending output added."""
    return stream.h + stream.pending if isinstance(stream, LadderStream) else stream


def module_input(stream):
    """What a module (attention, MLP) reads of the residual stream: the stream through the module
    before the last one under the ladder residual, else all of it."""
    return stream.h if isinstance(stream, LadderStream) else stream


def add_output(stream, out):
    """The stream after a module's output `out`: x + out, or under the ladder residual (h + pending,
    out): the previous module's output joins h now, this one's waits for the next module."""
    if isinstance(stream, LadderStream):
        return LadderStream(stream.h + stream.pending, out)
    return stream + out
