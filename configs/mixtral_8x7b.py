"""A Mixtral-8x7B-shaped MoE (46.7B parameters, 12.9B active per token: D=4096, L=32 all MoE with
8 experts of F=14336 and top-2, N=32, K=8, H=128, V=32000, rope theta 1e6): expert parallelism 8
inside each node x FSDP over the rest (config.mesh.fsdp=-1: 8 nodes of 64 GPUs, or 4 on the 32
chips of a v5p-64), bf16 compute, full remat, 256K tokens per step (docs/moe.md).

    python -m jaxsys.analyze --config configs/mixtral_8x7b.py --devices 64 --hardware h100
    python -m jaxsys.analyze --config configs/mixtral_8x7b.py:capacity --devices 64 --hardware h100
    python -m jaxsys.analyze --config configs/mixtral_8x7b.py --target v5p-64    # the TPU compiler

Meant for the analysis (what expert parallelism costs at this size, from a laptop) and a real
cluster. The default is dropless with the padded all-to-all (ep x the bytes of a ragged one, what
runs on every backend); `:capacity` is GShard's capacity path with C = ceil(1.25 k T / E); `:small`
keeps the layout with 2 layers. On GPUs, --config.parallel.expert_dispatch=ragged sends exact bytes
(lax.ragged_all_to_all; the analysis cannot compile it on fake CPU devices). Measured on 2026-11-23:
dropless peak 41.3 GiB/GPU, 84 GiB/step of padded all-to-all per device; capacity 25.1 GiB and
13.1 GiB. The dropless report's XLA FLOPs (2.3e15 vs 4.5e14 analytic) are CPU XLA's dense
decomposition of ragged_dot (every expert on every row), so read its roofline off the analytic FLOPs.
"""

from jaxsys.config import base_config


def get_config(arg=None):
    c = base_config()
    m = c.model
    m.vocab_size, m.d_model, m.n_layers = 32000, 4096, 32
    m.n_heads, m.n_kv_heads, m.head_dim = 32, 8, 128
    m.rope_theta, m.tie_embeddings = 1e6, False
    m.mlp_pattern = "moe"
    m.moe.experts, m.moe.top_k, m.moe.d_ff = 8, 2, 14336
    m.compute_dtype, m.remat = "bfloat16", "full"
    c.data.seq_len = 4096
    c.train.batch_size = 64
    c.train.steps = 20000
    c.train.lr, c.train.warmup_steps, c.train.schedule = 3e-4, 2000, "cosine"
    c.train.log_every, c.train.eval_every = 50, 1000
    c.mesh.fsdp, c.mesh.expert = -1, 8  # fsdp: whatever the device count leaves
    for option in (arg or "").split(","):
        if option == "capacity":
            m.moe.capacity_factor = 1.25
        elif option == "small":
            m.n_layers = 2
        elif option:
            raise ValueError(
                f"configs/mixtral_8x7b.py: unknown argument {option!r}; use capacity, small (comma-separated)"
            )
    return c
