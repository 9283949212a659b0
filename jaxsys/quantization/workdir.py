"""Quantize a workdir's checkpoint into a new workdir (`python -m jaxsys.quantize` is the command).

`quantize_workdir` reads the checkpoint onto one device (`checkpoint.load`), quantizes its dense
layers (params.py: RTN, or GPTQ calibrated on the config's corpus, read as the model reads text:
`tokenizer.corpus_for`) and writes the new workdir: config.json (the source config with
config.model.quant* set), checkpoint step S (the source's), whose parameters are the quantized tree
and whose optimizer state is empty, and the source's tokenizer record. It restores onto any
mesh that divides the model (tensor parallelism included) like any workdir.
"""

from __future__ import annotations

import copy
import os
import time

import jax
import numpy as np
import optax

from jaxsys import checkpoint as checkpoint_lib
from jaxsys import tokenizer as tokenizer_lib
from jaxsys.config import QUANT_FORMATS, ConfigError, validate
from jaxsys.models import quant
from jaxsys.quantization.params import gptq_params, quantize_params, single_device

METHODS = ("rtn", "gptq")


def quantized_config(config, fmt: str, group_size: int, zero_point: bool, rotate: bool = False):
    """The config of the quantized workdir: `config` with config.model.quant* set, for inference."""
    out = copy.deepcopy(config)
    out.model.quant, out.model.quant_group_size, out.model.quant_zero_point = fmt, group_size, zero_point
    out.model.quant_rotate = rotate
    out.model.quant_train = "none"
    out.train.virtual_stages = 1  # quantized layers are stored [L, ...] whatever the source's schedule
    if out.mesh.pipe > 1 and out.train.pipeline_schedule == "interleaved_1f1b":
        out.train.pipeline_schedule = "1f1b"
    return out


def quantize_workdir(
    workdir: str,
    out: str,
    fmt: str,
    method: str = "rtn",
    group_size: int = 128,
    zero_point: bool = False,
    calibration_batches: int = 8,
    step: int | None = None,
    log=print,
    rotate: bool = False,
) -> dict:
    """Read `workdir`'s checkpoint (default: latest) onto one device, quantize it, write `out`.
    Returns a summary (step, bytes before and after, seconds)."""
    from jaxsys import program as program_lib
    from jaxsys.mesh import cpu_unless_accelerator, make_mesh

    cpu_unless_accelerator()
    if fmt not in QUANT_FORMATS[1:]:
        raise ConfigError(f"--format {fmt!r}: choose one of {QUANT_FORMATS[1:]}")
    if method not in METHODS:
        raise ConfigError(f"--method {method!r}: choose one of {METHODS}")
    checkpoint_lib.require_new_workdir(out)
    source, step = checkpoint_lib.saved_config(workdir, (), step)
    if source.model.quant != "none":
        raise ConfigError(
            f"{workdir} step {step} is already quantized (config.model.quant="
            f"{source.model.quant!r}): quantize the float checkpoint it came from"
        )
    target = quantized_config(source, fmt, group_size, zero_point, rotate)
    validate(target)  # group sizes against the model and the saved mesh, before any reading
    start = time.perf_counter()
    # calibration text through the model's tokenizer (never byte ids into a converted model), read
    # (or refused) before the checkpoint
    corpus = None
    if method == "gptq":  # a corpus of documents opens through the loader (docs/data.md)
        from jaxsys import data as data_lib
        from jaxsys.data import loader as loader_lib

        documents = data_lib.is_documents(source.data)
        corpus = (
            loader_lib.load_corpus(source.data)
            if documents
            else tokenizer_lib.corpus_for(source, workdir, splits=("train",))
        )
    _, params, one = checkpoint_lib.load(workdir, checkpoint_lib.ONE_DEVICE, step, jax.devices()[:1])
    m = one.model
    if method == "gptq":
        qparams = gptq_params(params, one, corpus, fmt, group_size, zero_point, calibration_batches, log, rotate)
    else:
        qparams = quantize_params(jax.tree.map(np.asarray, params), m, fmt, group_size, zero_point, rotate=rotate)
    one_q = single_device(target)
    program_q = program_lib.build(one_q, make_mesh(one_q, jax.devices()[:1]))
    abstract = program_q.abstract_state()
    qparams = jax.tree.map(lambda a, s: jax.device_put(np.asarray(a, s.dtype), s.sharding), qparams, abstract.params)
    state = program_lib.TrainState(jax.device_put(np.int32(step), abstract.step.sharding), qparams, optax.EmptyState())
    os.makedirs(out, exist_ok=True)
    writer = checkpoint_lib.Checkpointer(out, target.checkpoint)
    writer.save(step, state, target)
    writer.close()
    if jax.process_index() == 0:
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write(target.to_json_best_effort(indent=2))
        tokenizer_lib.copy_record(workdir, out)
    nbytes = lambda tree: sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))
    dense = lambda tree: {k: v for k, v in tree["layers"].items() if k in quant.CONTRACTED}
    return {
        "step": int(step),
        "format": fmt,
        "method": method,
        "group_size": group_size,
        "zero_point": zero_point,
        "rotate": rotate,
        "dense_bytes_before": nbytes(dense(params)),
        "dense_bytes_after": nbytes(dense(qparams)),
        "total_bytes_before": nbytes(params),
        "total_bytes_after": nbytes(qparams),
        "seconds": time.perf_counter() - start,
    }
