"""Data races in the Mosaic GPU flash-attention kernels, on a CPU: Pallas' GPU interpreter with its
race detector, wgmma operand reads added (kernels/mgpu_races.py).

- The detector itself: on a two-warpgroup kernel that hands a tile from one warpgroup to the
  other's wgmma, it flags a missing barrier and a missing proxy fence (`commit_smem`), and passes
  the correct hand-off; without `detecting_races` the interpreter misses the wgmma read (the gap
  the module fills: if jax closes it, this test says so).
- The kernels: forward and backward (fused and split, H = 64 / 128 / 256, segment ids), at lengths
  where every ring wraps (its slots are refilled after a `free` barrier), have no race, and their
  outputs are finite (the interpreter fills fresh shared memory with NaN, so a read of a slot
  before its load lands shows up too).
- Mutants: the kernel module's source with one synchronisation removed or moved (the H = 256
  exchange's two barrier passes and its fence, the fused dQ staging buffer's wait for the previous
  TMA add, the forward freeing V's ring slot before its P V wgmma read it, O's fence before its
  TMA store):
  each has a race, so the clean runs above are not the detector being blind.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxsys.kernels import mgpu_races
from jaxsys.kernels.flash_attention import kernel_mgpu

# ----------------------------------------------------------------------------------- the detector


def _hand_off(barrier: bool, fence: bool):
    """Warpgroup 0 writes a [64, 64] tile to shared memory; warpgroup 1 multiplies it by wgmma."""

    def body(x_ref, eye_ref, o_ref, tile, eye, bar):
        wg = lax.axis_index("wg")

        @pl.when(wg == 0)
        def _():
            tile[...] = x_ref[...] * 2
            eye[...] = eye_ref[...]
            if fence:
                plgpu.commit_smem()
            if barrier:
                plgpu.barrier_arrive(bar)

        @pl.when(wg == 1)
        def _():
            if barrier:
                plgpu.barrier_wait(bar)

            def mma(acc):
                plgpu.wgmma(acc, tile, eye)
                return acc[...]

            o_ref[...] = pl.run_scoped(mma, plgpu.ACC((64, 64), jnp.float32))

    x = jnp.ones((64, 64), jnp.bfloat16)
    eye = jnp.eye(64, dtype=jnp.bfloat16)
    smem = lambda: plgpu.SMEM((64, 64), jnp.bfloat16)
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
        scratch_types=[smem(), smem(), plgpu.Barrier(num_arrivals=1)],
        num_threads=2,
        thread_name="wg",
        interpret=plgpu.InterpretGPUParams(detect_races=True),
    )(x, eye)


@pytest.mark.parametrize(
    "barrier, fence, race",
    [(True, True, False), (False, True, True), (True, False, True)],
    ids=["ok", "no_barrier", "no_fence"],
)
def test_detector_sees_wgmma_reads(barrier, fence, race):
    with mgpu_races.detecting_races() as report:
        out = _hand_off(barrier, fence)
        jax.block_until_ready(out)
    assert report.kernels == 1
    assert (report.found == [0]) == race
    if not race:
        assert float(out[0, 0]) == 2.0


def test_interpreter_alone_misses_the_wgmma_read():
    """The gap kernels/mgpu_races.py fills (jax 0.11.2): no barrier, yet no race without it."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    jax.block_until_ready(_hand_off(barrier=False, fence=True))
    assert not gpu_callbacks.get_races().races_found


# ------------------------------------------------------------------------------------ the kernels

CASES = {
    # the forward's 4 kv blocks of 256 wrap its 3-slot ring; the dK/dV ring takes 16 q blocks
    "h64_causal_fused": dict(t=1024, h=64),
    "h128_full_split_gqa": dict(t=256, n=4, k=2, h=128, causal=False, backward_variant_name="split"),
    # dK/dV: both warpgroups share 64 keys and exchange P^T | dS^T; dQ streams 32-key blocks
    "h256_causal": dict(t=128, n=2, k=1, h=256),
    "h64_segments": dict(t=512, h=64, segments=True),
}


@pytest.mark.parametrize("name", CASES)
def test_kernels_have_no_race(name):
    kw = CASES[name]
    got = kernel_mgpu.check_races(**kw)
    split_kernels = kw.get("backward_variant_name") == "split" or kw["h"] == 256
    assert got["kernels"] == (3 if split_kernels else 2)  # the forward, dK/dV (+ dQ)
    assert got["races"] == []
    assert got["finite"]


# ------------------------------------------------------------------------------------------ mutants

EXCHANGE_FIRST = "                pass_xchg()  # the other warpgroup's wgmmas have read the last block's P^T, dS^T\n"
EXCHANGE_SECOND = "                pass_xchg()  # both halves written\n"
EXCHANGE_FENCE = (
    "                p_smem2.at[:, pl.ds(bq + wg * nq, nq)][...] = dst\n                plgpu.commit_smem()\n"
)
V_READY = "            plgpu.barrier_wait(v_ready.at[slot])\n            plgpu.barrier_wait(sched)\n"
V_FREE = "            plgpu.barrier_arrive(v_free.at[slot])\n            return acc, m_new, l\n"
O_STORE = "        lse_smem[...] = lse\n        plgpu.commit_smem()\n"
MUTANTS = {
    # one warpgroup overwrites its half of the exchange while the other's wgmma reads the last block's
    "exchange_overwrite": (EXCHANGE_FIRST, "", dict(t=128, h=256)),
    # the wgmmas read the exchange before the other warpgroup's half is written
    "exchange_unwritten": (EXCHANGE_SECOND, "", dict(t=128, h=256)),
    # the stores into the exchange are not fenced before the wgmmas (async proxy) read them
    "exchange_fence": (
        EXCHANGE_FENCE,
        EXCHANGE_FENCE.replace("                plgpu.commit_smem()\n", ""),
        dict(t=128, h=256),
    ),
    # the fused backward stages the next dQ before the TMA add has read the previous one
    "dq_stage_reuse": ("    plgpu.wait_smem_to_gmem(0, wait_read_only=True)\n", "", dict(t=512, h=64)),
    # the forward frees V's slot (the memory warpgroup refills it) before its P V wgmma reads it;
    # two source edits, applied one after the other
    "v_freed_before_read": (
        [V_FREE, V_READY],
        [
            "            return acc, m_new, l\n",
            V_READY.replace(
                "\n            plgpu.barrier_wait(sched)",
                "\n            plgpu.barrier_arrive(v_free.at[slot])\n            plgpu.barrier_wait(sched)",
            ),
        ],
        dict(t=1024, h=64),
    ),
    # O is staged by generic stores and stored by TMA (async proxy) without the fence between
    "o_store_fence": (O_STORE, "        lse_smem[...] = lse\n", dict(t=256, h=64)),
}


def _mutant(old, new, monkeypatch):
    """kernel_mgpu built from its source with `old` (present exactly once) replaced by `new` (or
    each of a list of such edits, in order)."""
    source = inspect.getsource(kernel_mgpu)
    for o, n in zip(*((old, new) if isinstance(old, list) else ([old], [new]))):
        assert source.count(o) == 1, "the mutated line moved: update MUTANTS"
        source = source.replace(o, n)
    name = kernel_mgpu.__name__ + "_mutant"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    module.__package__ = kernel_mgpu.__package__
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n == "v_freed_before_read" else n for n in MUTANTS],  # CI time
)
def test_mutant_has_a_race(name, monkeypatch):
    old, new, kw = MUTANTS[name]
    got = kernel_mgpu.check_races(**kw, module=_mutant(old, new, monkeypatch))
    assert got["races"], got
