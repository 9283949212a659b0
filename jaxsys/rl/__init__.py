"""RL post-training (GRPO) with the serving engine for rollouts (docs/rl.md).

loss.py     group-normalised advantages, the clipped policy-gradient loss with a KL term (formulas)
program.py  the trainer: a Program whose objective is GRPO's over a batch of `Rollouts`
tasks.py    toy tasks with a verifiable reward (prompt generator + reward function)
loop.py     placement (colocated / disaggregated), rollouts from the Engine, weight sync,
            sync and async (bounded staleness) drivers; `main(config, workdir)`
"""
