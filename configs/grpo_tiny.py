"""GRPO on a toy task with a verifiable reward: a byte-level tiny model learns to reverse 3 letters.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m jaxsys.train --config configs/grpo_tiny.py --workdir /tmp/grpo

Hardware: a laptop CPU, 8 simulated devices split 4 + 4 (disaggregated): the trainer fsdp=4 on
devices 0-3, the generator (the serving engine) data=2 x tensor=2 on devices 4-7. About 1-2 minutes
on 2 cores. The policy is first warmed up by 30 supervised steps on the task (`rl.warmup_steps`,
`rl.warmup_right`): it writes 3 letters and a newline and reverses some of them (sampled reward
about 0.2, greedy about 0.45; uniform letters score 0.25). GRPO then raises the sampled reward to
about 0.75 in 150 updates (docs/rl.md, experiments/grpo). From a format-only warm-up (random
answers, warmup_right=0) the reward does not rise in 300 updates at this scale. Arguments:
    :async      the generator runs ahead with weights up to rl.staleness=1 versions old
    :async2     ... up to 2
    :colocated  trainer and generator take turns on all 8 devices (fsdp=8 trainer, tensor=2 x data=4 engine)
    :cpu1       colocated on one device (no XLA_FLAGS needed)
    :planned    placement, device split and both layouts chosen by the iteration-time model for H100s
                (rl.plan_hardware; docs/rl.md), here on the 8 simulated devices; with :async too use
                --config.rl.plan_hardware=h100 --config.rl.mode=async
    :test       a few updates of a smaller batch, for the tests
"""

from jaxsys.config import base_config


def get_config(arg=None):
    c = base_config()
    c.model.d_model = 64
    c.model.n_layers = 2
    c.model.n_heads = 4
    c.model.n_kv_heads = 4
    c.model.head_dim = 16
    c.model.d_ff = 128
    c.data.seq_len = 15
    c.train.batch_size = 64  # 8 prompts x 8 samples
    c.train.lr = 2e-3  # Adam; 5e-3 was too noisy for RL here
    c.train.warmup_steps = 5
    c.train.schedule = "constant"
    c.train.log_every = 5
    c.train.eval_every = 20
    c.train.grad_clip = 1.0
    c.serve.cache = "contiguous"  # short rows: plain attention over each sequence's row (no kernel)
    c.rl.task = "reverse"
    c.rl.task_length = 3
    c.rl.group_size = 8
    c.rl.max_new_tokens = 6
    c.rl.steps = 150
    c.rl.warmup_steps = 30  # a brief SFT on right answers: the policy is partly there, not yet good
    c.rl.warmup_right = 1.0
    c.rl.kl = 0.02
    c.rl.placement = "disaggregated"
    c.rl.trainer_mesh = "fsdp=4"
    c.rl.generator_mesh = "data=2,tensor=2"
    c.rl.eval_prompts = 32
    if arg in ("async", "async2"):
        c.rl.mode = "async"
        c.rl.staleness = 1 if arg == "async" else 2
    elif arg == "colocated":
        c.rl.placement = "colocated"
        c.rl.trainer_mesh = "fsdp=8"
        c.rl.generator_mesh = "data=4,tensor=2"
    elif arg == "planned":
        c.rl.plan_hardware = "h100"
    elif arg == "cpu1":
        c.rl.placement = "colocated"
        c.rl.trainer_mesh = c.rl.generator_mesh = ""
    elif arg == "test":
        c.train.batch_size = 16  # 4 prompts x 4 samples
        c.rl.group_size = 4
        c.rl.steps = 3
        c.rl.warmup_steps = 2
        c.rl.eval_prompts = 4
        c.train.eval_every = 0
    elif arg is not None:
        raise ValueError(
            f"configs/grpo_tiny.py: unknown argument {arg!r}; use async, async2, colocated, planned, cpu1 or test"
        )
    return c
