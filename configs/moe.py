"""A small mixture-of-experts LM on the embedded corpus (docs/moe.md): every second layer's MLP is
8 experts of 192 hidden units, 2 per token (dropless: every token copy is computed).

    python -m jaxsys.train --config configs/moe.py --workdir /tmp/jaxsys_moe

Hardware: a laptop CPU (2 cores: about 5 minutes; XLA:CPU runs the grouped matmuls as 8 masked dense
ones). Expect the loss to fall from ln(256) = 5.55 nats to about 2 nats in 300 steps, as
configs/tiny.py does (2026-11-23: 1.77 train, 1.98 eval, 4m49s), with the per-device imbalance and
expert loads in metrics.jsonl. Arguments
(set XLA_FLAGS=--xla_force_host_platform_device_count=8 first for the 8-device ones):
    :ep8          experts over 8 devices (expert parallelism; the expert axis splits the batch too)
    :ep4_dp2      4-way expert x 2-way data parallelism
    :ep2_tp2_dp2  expert x tensor (expert hidden units over tensor, Megatron SP) x data
    :ep4_pp2      expert x 2 pipeline stages, 4 micro-batches, 1F1B
    :capacity     the capacity path instead: C = ceil(1.25 k T / E) slots per expert and sequence
    :rebalance    :ep8 with 32 experts re-placed on the devices every 50 steps by their load
    :test         a few steps of a smaller model, for the tests
"""

from jaxsys.config import base_config

LAYOUTS = {
    "ep8": dict(expert=8),
    "ep4_dp2": dict(expert=4, data=2),
    "ep2_tp2_dp2": dict(expert=2, tensor=2, data=2),
    "ep4_pp2": dict(expert=4, pipe=2),
    "rebalance": dict(expert=8),
}


def get_config(arg=None):
    c = base_config()
    c.model.d_model = 128
    c.model.n_layers = 4
    c.model.n_heads = 8
    c.model.n_kv_heads = 2
    c.model.head_dim = 16
    c.model.d_ff = 384
    c.model.mlp_pattern = "dense,moe"
    c.model.moe.experts = 8
    c.model.moe.top_k = 2
    c.model.moe.d_ff = 192
    c.data.seq_len = 128
    c.train.batch_size = 16
    c.train.steps = 300
    c.train.lr = 3e-3
    c.train.warmup_steps = 20
    c.train.log_every = 20
    c.train.eval_every = 100
    if arg in LAYOUTS:
        for axis, size in LAYOUTS[arg].items():
            c.mesh[axis] = size
        if arg == "ep2_tp2_dp2":
            c.parallel.sequence_parallel = True
        if arg == "ep4_pp2":
            c.train.microbatches = 4
            c.train.pipeline_schedule = "1f1b"
        if arg == "rebalance":
            c.model.moe.experts = 32
            c.model.moe.d_ff = 48
            c.parallel.expert_rebalance_every = 50
    elif arg == "capacity":
        c.model.moe.capacity_factor = 1.25
    elif arg == "test":
        c.model.d_model = 64
        c.model.n_layers = 2
        c.model.d_ff = 128
        c.model.moe.d_ff = 32
        c.data.seq_len = 32
        c.train.batch_size = 8
        c.train.steps = 4
        c.train.warmup_steps = 1
        c.train.log_every = 1
        c.train.eval_every = 0
        c.train.eval_batches = 1
        c.train.progress = False
    elif arg is not None:
        raise ValueError(f"configs/moe.py: unknown argument {arg!r}; use {', '.join(LAYOUTS)}, capacity or test")
    return c
