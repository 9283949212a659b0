"""A Llama-3-8B-shaped model (8.0B parameters: D=4096, L=32, N=32, K=8, H=128, F=14336,
V=128256, untied, rope theta 500000): tensor parallelism 8 inside each node (or over 8 TPU chips)
and FSDP over the rest of the devices (config.mesh.fsdp=-1: 32 on 256 GPUs, 16 on a v5p-256, which
has 128 chips), bf16 compute, full remat, 1M tokens per step.

    python -m jaxsys.analyze --config configs/llama_8b.py --devices 256 --hardware h100
    python -m jaxsys.analyze --config configs/llama_8b.py --target v5p-256      # the TPU compiler
    python -m jaxsys.train --config configs/llama_8b.py --workdir runs/llama_8b   # on 32 x 8 GPUs

On v5p-256 (2026-11-25, libtpu 0.0.48.1, docs/benchmarks/tpu_aot.md) the TPU compiler puts the step
at 13.9 GiB of HBM per chip (XLA:CPU's estimate: 16.6), compiling in 30 s on a 2-core laptop.

Meant for the analysis (what this layout costs, from a laptop) and for a real cluster; it is far
too large to train on a CPU. `:small` keeps the layout but 2 layers, for quick looks.
"""

from jaxsys.config import base_config


def get_config(arg=None):
    c = base_config()
    m = c.model
    m.vocab_size, m.d_model, m.n_layers = 128256, 4096, 32
    m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff = 32, 8, 128, 14336
    m.rope_theta, m.tie_embeddings = 500000.0, False
    m.compute_dtype, m.remat = "bfloat16", "full"
    c.data.seq_len = 4096
    c.train.batch_size = 256
    c.train.steps = 20000
    c.train.lr, c.train.warmup_steps, c.train.schedule = 3e-4, 2000, "cosine"
    c.train.log_every, c.train.eval_every = 50, 1000
    c.mesh.fsdp, c.mesh.tensor = -1, 8  # fsdp: whatever the device count leaves
    c.parallel.sequence_parallel = True
    if arg == "small":
        m.n_layers = 2
    elif arg is not None:
        raise ValueError(f"configs/llama_8b.py: unknown argument {arg!r}; use small")
    return c
