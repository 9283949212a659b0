"""A small GPT written in Flax NNX (examples/flax_gpt.py), trained by jaxsys on the embedded byte
corpus (the Python standard library's sources): bring your own Flax model (docs/flax.md).

    python -m jaxsys.train --config configs/flax_gpt.py --workdir /tmp/jaxsys_flax_gpt
    python -m jaxsys.analyze --config configs/flax_gpt.py:fsdp8 --hardware cpu

Hardware: a laptop CPU (2 cores: a few minutes). Expect the loss to fall from ln(256) = 5.55 nats
towards 2 nats in 300 steps, as configs/tiny.py does. The model is plain Flax (no jaxsys import):
its parameters carry logical axis names (`embed`, `mlp`, `heads`, `vocab`, ...) that jaxsys's
rules table (config.sharding) maps onto the mesh, so the layouts below need no change to it.
Arguments (set XLA_FLAGS=--xla_force_host_platform_device_count=8 first for the 8-device ones):
    :dp8      data parallelism over 8 devices (add --config.train.zero_stage=1 or 2 for ZeRO)
    :fsdp8    FSDP / ZeRO-3: every `embed` dimension split over 8 devices at rest
    :hybrid8  2-way data x 4-way fsdp
    :test     a few steps of a smaller model, for the tests
"""

import ml_collections

from jaxsys.config import base_config

LAYOUTS = {"dp8": dict(data=8), "fsdp8": dict(fsdp=8), "hybrid8": dict(data=2, fsdp=4)}


def get_config(arg=None):
    c = base_config()
    c.model.kind = "flax"
    c.model.flax_module = "examples.flax_gpt:GPT"
    c.model.vocab_size = 256  # the byte corpus; the GPT's logits must have this width
    c.data.seq_len = 128
    c.model.flax_kwargs = ml_collections.ConfigDict(
        dict(
            vocab_size=c.model.vocab_size,
            d_model=128,
            n_layers=4,
            n_heads=4,
            d_ff=512,
            max_len=c.data.seq_len,
            tie_embeddings=True,
            init_std=0.02,
        )
    )
    c.train.batch_size = 16
    c.train.steps = 300
    c.train.lr = 3e-3
    c.train.warmup_steps = 20
    c.train.log_every = 20
    c.train.eval_every = 100
    if arg in LAYOUTS:
        for axis, size in LAYOUTS[arg].items():
            c.mesh[axis] = size
    elif arg == "test":
        k = c.model.flax_kwargs
        k.d_model, k.n_layers, k.n_heads, k.d_ff, k.tie_embeddings = 64, 2, 4, 128, False
        c.data.seq_len = k.max_len = 32
        c.train.batch_size = 8
        c.train.steps = 4
        c.train.warmup_steps = 1
        c.train.log_every = 1
        c.train.eval_every = 0
        c.train.eval_batches = 1
        c.train.progress = False
    elif arg is not None:
        raise ValueError(f"configs/flax_gpt.py: unknown argument {arg!r}; use dp8, fsdp8, hybrid8 or test")
    return c
