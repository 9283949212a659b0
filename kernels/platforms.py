"""Choosing a kernel variant by the platform a program is lowered for.

The Pallas kernels come in a generic variant (interpret mode on CPU, Triton on GPU) and a Mosaic
variant for TPU. `jax.default_backend()` cannot choose between them: a program jitted on a CPU host
and lowered ahead of time for TPU devices (`jaxsys.analyze --target`) has "cpu" as its default
backend. `lax.platform_dependent` chooses at lowering instead: every branch is traced, only the one
for the platform being lowered for is lowered. Flash attention also has a Mosaic GPU variant for
Hopper: it takes the "cuda" branch only when the kernel's caller found (at trace time) a Hopper GPU
and a supported shape and handed `plan` its config; otherwise CUDA lowers the default (generic)
branch. A `Plan` is the static choice (hashable: it is the custom_vjp's static argument of each
kernel); `dispatch` runs it.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import sys

import jax
import jax.numpy as jnp
from jax import lax

LANES = 128  # Mosaic's lane width: the minor dimension of a TPU tile

BACKENDS = ("generic", "tpu")
MOSAIC_GPU = "mosaic_gpu"  # flash attention's Hopper variant; other kernels have none


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which variant runs where: (platforms, variant, config) per branch of lax.platform_dependent;
    platforms None is the default branch."""

    branches: tuple


def check_backend(backend, backends=BACKENDS) -> None:
    if backend not in (None, *backends):
        raise ValueError(f"backend must be None (chosen by platform) or one of {backends}; got backend={backend!r}")


def plan(backend, interpret, generic_cfg, tpu_cfg, mgpu_cfg=None) -> Plan:
    """backend None (auto): interpret=None -> the generic variant interpreted when lowered for CPU,
    Mosaic on TPU, the generic variant compiled (Triton) elsewhere; interpret=False -> Mosaic on
    TPU, Triton elsewhere; interpret=True -> the generic variant interpreted everywhere. With
    mgpu_cfg given (the caller decided a Hopper GPU runs a supported shape), CUDA gets the Mosaic
    GPU variant instead of Triton unless interpret=True. backend "generic" / "tpu": that variant
    only, interpreted on CPU when interpret=None; "mosaic_gpu" likewise (mgpu_cfg required). The
    configs are dataclasses with an `interpret` field."""
    check_backend(backend, (*BACKENDS, MOSAIC_GPU) if mgpu_cfg is not None else BACKENDS)
    g = lambda interp: ("generic", dataclasses.replace(generic_cfg, interpret=interp))
    t = lambda interp: ("tpu", dataclasses.replace(tpu_cfg, interpret=interp))
    m = lambda interp: (MOSAIC_GPU, dataclasses.replace(mgpu_cfg, interpret=interp))
    cuda = ((("cuda",), *m(False)),) if mgpu_cfg is not None else ()
    if backend is None:
        if interpret is None:
            return Plan(((("cpu",), *g(True)), (("tpu",), *t(False)), *cuda, (None, *g(False))))
        if interpret:
            return Plan(((None, *g(True)),))
        return Plan(((("tpu",), *t(False)), *cuda, (None, *g(False))))
    make = {"generic": g, "tpu": t, MOSAIC_GPU: m}[backend]
    if interpret is None:
        return Plan(((("cpu",), *make(True)), (None, *make(False))))
    return Plan(((None, *make(bool(interpret))),))


def dispatch(plan: Plan, variants: dict, which: int, *args):
    """Run entry `which` of `variants[name]` (e.g. 0 forward, 1 backward; called as fn(*args,
    cfg=cfg)) of the plan's variant for the platform the program is lowered for."""
    fns = [
        (platforms, functools.partial(variants[variant][which], cfg=cfg)) for platforms, variant, cfg in plan.branches
    ]
    if len(fns) == 1:
        return fns[0][1](*args)
    per_platform = {p: fn for platforms, fn in fns if platforms for p in platforms}
    default = next((fn for platforms, fn in fns if platforms is None), None)
    return lax.platform_dependent(*args, default=default, **per_platform)


def lanes(x, width: int):
    """A Mosaic softmax statistic x [rows, 128] (equal over its lanes) as [rows, width], to meet a
    tile of `width` lanes without a relayout."""
    if width == LANES:
        return x
    if width < LANES:
        return x[:, :width]
    return jnp.tile(x, (1, -(-width // LANES)))[:, :width]  # a width past a multiple of 128: cut


def error_line(e: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message` (cut to `limit`): how the benches and the sweep record a
    configuration that failed, so one failure does not hide the others."""
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0][:limit] if text else ''}"


def bench_record(module: str, argv=None, **fields) -> dict:
    """The head of every kernel bench's JSON: when (UTC), on what (the first device's kind, the
    backend, jax), by which command (`python -m module` and argv, default sys.argv's); then the
    bench's own `fields` (its args, conventions, results)."""
    args = sys.argv[1:] if argv is None else argv
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=jax.devices()[0].device_kind,
        backend=jax.default_backend(),
        jax=jax.__version__,
        command=" ".join(["python", "-m", module, *args]),
        **fields,
    )
