"""A Llama-3.2-1B-shaped model (1.24B parameters: D=2048, L=16, N=32, K=8, H=64, F=8192,
V=128256, tied embeddings, rope theta 500000), bf16 compute, FSDP over all devices
(config.mesh.fsdp=-1: one 8-GPU node, or the 16 chips of a v5e-16).

    python -m jaxsys.train --config configs/llama_1b.py --workdir runs/llama_1b
    python -m jaxsys.train --config configs/llama_1b.py:cpu --workdir runs/llama_1b_cpu
    python -m jaxsys.analyze --config configs/llama_1b.py --target v5e-16 --config.model.remat=full

On a v5e-16 (16 GiB chips) the default remat `dots` does not fit (the TPU compiler asks for 45 GiB of
temporaries); `remat=full` fits at 8.4 GiB per chip (docs/benchmarks/tpu_aot.md).

Hardware: 8 GPUs of 80 GB (fsdp=8, batch 64 x 2048 tokens; remat `dots` keeps activations small).
Data: `config.data.source=tokens` with a pre-tokenized file in the Llama 3 vocabulary
(--config.data.path=...); without one it falls back to the byte corpus, which uses 256 of the
128256 rows. Expect a loss falling from ln(V) = 11.8 nats.

`:cpu` keeps the shape of the model (GQA 4:1, tied, SwiGLU, theta) at D=256, L=4 and the byte
vocabulary so it runs on a laptop CPU in about a minute; add `--config.mesh.fsdp=8` (with
XLA_FLAGS=--xla_force_host_platform_device_count=8) to try the 8-way layout on simulated devices.
"""

from jaxsys.config import base_config


def get_config(arg=None):
    c = base_config()
    m = c.model
    m.vocab_size, m.d_model, m.n_layers = 128256, 2048, 16
    m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff = 32, 8, 64, 8192
    m.rope_theta, m.tie_embeddings, m.norm_eps = 500000.0, True, 1e-5
    m.compute_dtype, m.remat = "bfloat16", "dots"
    c.data.seq_len = 2048
    c.train.batch_size = 64
    c.train.steps = 10000
    c.train.lr, c.train.warmup_steps, c.train.schedule = 3e-4, 500, "wsd"
    c.train.log_every, c.train.eval_every = 50, 1000
    c.mesh.fsdp = -1  # all devices
    if arg == "cpu":
        m.vocab_size, m.d_model, m.n_layers = 256, 256, 4
        m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff = 8, 2, 32, 768
        m.compute_dtype, m.remat = "float32", "none"
        c.data.seq_len, c.train.batch_size, c.train.steps = 128, 8, 50
        c.train.lr, c.train.warmup_steps, c.train.log_every, c.train.eval_every = 2e-3, 5, 10, 0
        c.mesh.fsdp = 1
    elif arg is not None:
        raise ValueError(f"configs/llama_1b.py: unknown argument {arg!r}; use cpu")
    return c
