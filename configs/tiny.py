"""Tiny byte-level LM on the embedded corpus (the Python standard library's sources).

    python -m jaxsys.train --config configs/tiny.py --workdir /tmp/jaxsys_tiny

Hardware: a laptop CPU (2 cores: about 3 minutes). Expect the loss to fall from ln(256) = 5.55
nats to about 2 nats in 300 steps (eval loss close behind). Arguments:
    :test   a few steps of a smaller model, for the tests
    :dp8    the same run data-parallel on 8 simulated devices (set
            XLA_FLAGS=--xla_force_host_platform_device_count=8 first); also :fsdp8, :tp8, :hybrid8
    :pp8    2 pipeline stages x 2 data x 2 tensor, 4 micro-batches, 1F1B, vocabulary parallelism
            (docs/pipeline.md)
"""

from jaxsys.config import base_config


def get_config(arg=None):
    c = base_config()
    c.model.d_model = 128
    c.model.n_layers = 4
    c.model.n_heads = 8
    c.model.n_kv_heads = 2
    c.model.head_dim = 16
    c.model.d_ff = 384
    c.data.seq_len = 128
    c.train.batch_size = 16
    c.train.steps = 300
    c.train.lr = 3e-3
    c.train.warmup_steps = 20
    c.train.log_every = 20
    c.train.eval_every = 100
    if arg in ("dp8", "fsdp8", "tp8", "hybrid8"):
        layouts = {
            "dp8": dict(data=8),
            "fsdp8": dict(fsdp=8),
            "tp8": dict(tensor=8),
            "hybrid8": dict(data=2, fsdp=2, tensor=2),
        }
        for axis, size in layouts[arg].items():
            c.mesh[axis] = size
    elif arg == "pp8":
        c.mesh.pipe, c.mesh.data, c.mesh.tensor = 2, 2, 2
        c.train.microbatches = 4
        c.train.pipeline_schedule = "1f1b"
        c.parallel.vocab_parallel = True
    elif arg == "test":
        c.model.d_model = 64
        c.model.n_layers = 2
        c.model.d_ff = 128
        c.data.seq_len = 32
        c.train.batch_size = 8
        c.train.steps = 4
        c.train.warmup_steps = 1
        c.train.log_every = 1
        c.train.eval_every = 0
        c.train.eval_batches = 1
        c.train.progress = False
    elif arg is not None:
        raise ValueError(f"configs/tiny.py: unknown argument {arg!r}; use test, dp8, fsdp8, tp8, hybrid8 or pp8")
    return c
