"""GRPO post-training with the serving engine for rollouts (docs/rl.md).

    python -m jaxsys.train --config configs/grpo_tiny.py --workdir /tmp/grpo      # config.rl.task set

Two sides, each a jaxsys Program on its own mesh:

- the trainer: `rl.program.GRPOProgram` (the Program's gradients, ZeRO / FSDP and AdamW with GRPO's
  objective) on `config.rl.trainer_mesh`;
- the generator: an `Engine` (jaxsys/serve/engine.py) on `config.rl.generator_mesh`, its own layout.

Placement (`config.rl.placement`): `colocated` puts both on every device and they take turns: the
trainer's optimizer state goes to host memory and the engine wakes (its KV pool allocated) for the
rollouts, then the engine sleeps (pool freed) and the optimizer state comes back for the update.
`disaggregated` puts them on disjoint devices (`trainer_devices`, `generator_devices`).

After an update the new weights reach the generator by a resharding transfer
(`serve.engine.reshard`, what `Engine.set_params` does): bytes counted, time measured.

Mode (`config.rl.mode`): `sync` generates update i's rollouts with the weights of version i.
`async` runs the generator in a thread that produces rollouts into a bounded queue while the trainer
trains; rollout i may use any published version v >= i - k (k = `config.rl.staleness`; the
generator waits otherwise), and the importance ratio pi / pi_v of the loss corrects for the lag.
k = 0 is the synchronous schedule, bitwise. Colocated async takes turns on the devices under a lock.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import queue
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from jaxsys import program as program_lib
from jaxsys.config import MESH_AXES, ConfigError, validate
from jaxsys.mesh import make_mesh
from jaxsys.rl import loss as loss_lib
from jaxsys.rl import program as rl_program
from jaxsys.rl import tasks as tasks_lib
from jaxsys.serve import disagg
from jaxsys.serve.engine import Engine, pool_settings, reshard
from jaxsys.serve.runner import check_servable
from jaxsys.serve.sampling import Sampling

MODES = ("sync", "async")
PLACEMENTS = ("colocated", "disaggregated")
EOS_ID = ord(tasks_lib.EOS)


class RewardError(ConfigError):
    """The reward function raised, or returned something that is not a finite number."""


def parse_devices(text: str, key: str, n: int) -> list[int] | None:
    """ "0-3" or "0,1,2,3" -> ids (None for ""); ConfigError naming `key`."""
    if not str(text).strip():
        return None
    ids: list[int] = []
    try:
        for part in str(text).split(","):
            lo, dash, hi = part.strip().partition("-")
            ids += list(range(int(lo), int(hi) + 1)) if dash else [int(lo)]
    except ValueError:
        raise ConfigError(f"{key}={text!r}: give device ids as '0-3' or '0,1,2,3'") from None
    bad = [i for i in ids if not 0 <= i < n]
    if bad or len(set(ids)) != len(ids):
        raise ConfigError(f"{key}={text!r}: ids must be distinct and in [0, {n}); got {ids}")
    return ids


def call_reward(reward_fn: Callable, prompt: str, completion: str) -> float:
    try:
        value = reward_fn(prompt, completion)
    except Exception as e:
        raise RewardError(
            f"the reward function {getattr(reward_fn, '__name__', reward_fn)!r} raised on prompt {prompt!r}, "
            f"completion {completion!r}: {type(e).__name__}: {e}"
        ) from e
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not math.isfinite(value):
        raise RewardError(
            f"the reward function {getattr(reward_fn, '__name__', reward_fn)!r} returned {value!r} on prompt "
            f"{prompt!r}: it must return a finite number"
        )
    return float(value)


@dataclasses.dataclass
class Plan:
    """What `check` settles before anything is built: each side's config and devices, the task."""

    trainer_config: Any
    generator_config: Any
    trainer_devices: list
    generator_devices: list
    task: tasks_lib.Task
    reward_fn: Callable
    choice: str = ""  # what config.rl.plan_hardware's iteration model chose


def _side(config, sizes: dict | None, key: str, n: int, servable: bool, overrides: dict | None = None):
    c = config.copy_and_resolve_references()
    for dotted, value in (overrides or {}).items():
        section, name = dotted.split(".", 1)
        c[section][name] = value
    if sizes is not None:
        for axis in MESH_AXES:
            c.mesh[axis] = sizes[axis]
    try:
        if servable:  # the engine takes any number of requests: its config's training batch is moot
            c.train.batch_size = math.prod(c.mesh[a] for a in ("data", "fsdp", "expert") if c.mesh[a] > 0)
            validate(c, num_devices=n)
            check_servable(c)
        else:
            validate(c, num_devices=n)
    except ConfigError as e:
        raise ConfigError(f"{key}: {e}") from None
    disagg._model_divides(c, key)
    return c


def check(config, devices=None, reward_fn: Callable | None = None) -> Plan:
    """Every named error before compiling: the rl settings, the sub-meshes (disjoint, covering the
    devices, each dividing the model), G dividing the batch, the sequence length, the reward function
    (called on a probe prompt)."""
    devices = list(jax.devices() if devices is None else devices)
    rl, t = config.rl, config.train
    if rl.task not in tasks_lib.TASKS:
        raise ConfigError(f"config.rl.task={rl.task!r}: choose one of {tasks_lib.TASKS}")
    for key in ("task_length", "group_size", "max_new_tokens", "steps"):
        if isinstance(rl[key], bool) or not isinstance(rl[key], int) or rl[key] < 1:
            raise ConfigError(f"config.rl.{key}={rl[key]!r} must be an integer >= 1")
    for key in ("warmup_steps", "staleness", "eval_prompts"):
        if isinstance(rl[key], bool) or not isinstance(rl[key], int) or rl[key] < 0:
            raise ConfigError(f"config.rl.{key}={rl[key]!r} must be an integer >= 0")
    if t.batch_size % rl.group_size:
        raise ConfigError(
            f"config.rl.group_size={rl.group_size} does not divide config.train.batch_size={t.batch_size}: "
            "a batch is prompts x group_size samples; choose a batch size that is a multiple of the group"
        )
    if rl.mode not in MODES:
        raise ConfigError(f"config.rl.mode={rl.mode!r}: choose one of {MODES}")
    if rl.placement not in PLACEMENTS:
        raise ConfigError(f"config.rl.placement={rl.placement!r}: choose one of {PLACEMENTS}")
    if rl.temperature != 1.0:
        raise ConfigError(
            f"config.rl.temperature={rl.temperature!r}: rollouts sample at 1.0, where the engine's "
            "log-probabilities (the model's own) are the behaviour policy's that the importance ratio needs"
        )
    if not (0 < rl.clip < 1) or rl.kl < 0:
        raise ConfigError(f"config.rl.clip={rl.clip!r} must be in (0, 1) and config.rl.kl={rl.kl!r} >= 0")
    task = tasks_lib.get(rl.task, rl.task_length)
    need = tasks_lib.longest_prompt(task) + rl.max_new_tokens
    if config.data.seq_len + 1 < need:
        raise ConfigError(
            f"config.data.seq_len={config.data.seq_len}: a row holds prompt (up to "
            f"{tasks_lib.longest_prompt(task)} tokens) + config.rl.max_new_tokens={rl.max_new_tokens}, "
            f"so seq_len must be >= {need - 1}"
        )
    if rl.max_new_tokens < tasks_lib.longest_answer(task) + 1:
        raise ConfigError(
            f"config.rl.max_new_tokens={rl.max_new_tokens}: the answer and its newline need "
            f"{tasks_lib.longest_answer(task) + 1}"
        )
    n = len(devices)
    trainer_overrides: dict = {}
    choice = ""
    if rl.plan_hardware:
        config, trainer_overrides, choice = choose_layouts(config, n)
        rl = config.rl
    trainer_ids = parse_devices(rl.trainer_devices, "config.rl.trainer_devices", n)
    generator_ids = parse_devices(rl.generator_devices, "config.rl.generator_devices", n)
    if rl.placement == "colocated":
        for key, ids in (("trainer_devices", trainer_ids), ("generator_devices", generator_ids)):
            if ids is not None and sorted(ids) != list(range(n)):
                raise ConfigError(
                    f"config.rl.{key}={rl[key]!r}: colocated, both sides use every device (all {n}); "
                    "use placement='disaggregated' for sub-meshes"
                )
        trainer_ids = generator_ids = list(range(n))
        trainer_sizes = disagg.parse_mesh(rl.trainer_mesh, "config.rl.trainer_mesh") if rl.trainer_mesh else None
    else:
        if not rl.trainer_mesh or not rl.generator_mesh:
            raise ConfigError("config.rl.placement='disaggregated' needs config.rl.trainer_mesh and generator_mesh")
        trainer_sizes = disagg.parse_mesh(rl.trainer_mesh, "config.rl.trainer_mesh")
        n_train = math.prod(trainer_sizes.values())
        trainer_ids = trainer_ids if trainer_ids is not None else list(range(n_train))
        if generator_ids is None:
            generator_ids = [i for i in range(n) if i not in trainer_ids]
        overlap = sorted(set(trainer_ids) & set(generator_ids))
        if overlap:
            raise ConfigError(
                f"config.rl.trainer_devices and generator_devices overlap on devices {overlap}: disaggregated "
                "sub-meshes must be disjoint (or use placement='colocated')"
            )
        missing = sorted(set(range(n)) - set(trainer_ids) - set(generator_ids))
        if missing:
            raise ConfigError(
                f"the trainer ({len(trainer_ids)} devices) and the generator ({len(generator_ids)}) leave devices "
                f"{missing} of {n} unused: together the sub-meshes must cover every device"
            )
    generator_sizes = disagg.parse_mesh(rl.generator_mesh, "config.rl.generator_mesh") if rl.generator_mesh else None
    for key, sizes, ids in (
        ("config.rl.trainer_mesh", trainer_sizes, trainer_ids),
        ("config.rl.generator_mesh", generator_sizes or trainer_sizes, generator_ids),
    ):
        got = math.prod(sizes.values()) if sizes else math.prod(config.mesh[a] for a in MESH_AXES)
        if got != len(ids) and not (sizes is None and -1 in [config.mesh[a] for a in MESH_AXES]):
            raise ConfigError(f"{key}: its axes give {got} devices but it has {len(ids)} ({ids})")
    trainer_config = _side(
        config, trainer_sizes, "config.rl.trainer_mesh", len(trainer_ids), servable=False, overrides=trainer_overrides
    )
    trainer_config.train.steps = rl.warmup_steps + rl.steps  # the schedule spans warm-up and updates
    if trainer_config.mesh.pipe > 1 or trainer_config.mesh.seq > 1:
        raise ConfigError("config.rl.trainer_mesh: the GRPO trainer runs without pipe or seq axes")
    generator_config = _side(
        config, generator_sizes or trainer_sizes, "config.rl.generator_mesh", len(generator_ids), servable=True
    )
    reward_fn = reward_fn or task.reward
    probe_prompt, probe_answer = task.sample(np.random.default_rng(0))
    call_reward(reward_fn, probe_prompt, probe_answer)
    call_reward(reward_fn, probe_prompt, "")
    return Plan(
        trainer_config,
        generator_config,
        [devices[i] for i in trainer_ids],
        [devices[i] for i in generator_ids],
        task,
        reward_fn,
        choice,
    )


def choose_layouts(config, n: int) -> tuple:
    """(config with rl.placement, trainer_mesh and generator_mesh set, the trainer's other planner
    overrides, a line saying what was chosen): the iteration-time model's fastest placement for config.rl.mode on n devices
    (analysis/rl.iteration_times on the profile config.rl.plan_hardware; splits n/4, n/2, 3n/4)."""
    from jaxsys.analysis import hardware
    from jaxsys.analysis import rl as rl_analysis

    rl = config.rl
    if rl.plan_hardware not in hardware.PROFILES:
        raise ConfigError(f"config.rl.plan_hardware={rl.plan_hardware!r}: choose one of {sorted(hardware.PROFILES)}")
    splits = sorted({n // 4, n // 2, 3 * n // 4} - {0, n})
    base = config.copy_and_resolve_references()
    base.rl.plan_hardware = ""
    out = rl_analysis.iteration_times(
        base,
        n,
        hardware.profile(rl.plan_hardware),
        prompts=config.train.batch_size // rl.group_size,
        group=rl.group_size,
        prompt=config.data.seq_len - rl.max_new_tokens,
        completion=rl.max_new_tokens,
        splits=splits,
    )
    keys = ("async", "colocated") if rl.mode == "async" else ("colocated", "disaggregated")
    options = [(out[k]["seconds"], k) for k in keys if k in out]
    if not options:
        raise ConfigError(f"config.rl.plan_hardware={rl.plan_hardware!r}: no placement of {n} devices fits this model")
    _, pick = min(options)
    row = out[pick]
    chosen = base.copy_and_resolve_references()
    chosen.rl.placement = "colocated" if pick == "colocated" else "disaggregated"
    mesh = {k.split(".", 1)[1]: v for k, v in row["trainer_overrides"].items() if k.startswith("mesh.")}
    chosen.rl.trainer_mesh = ",".join(f"{a}={v}" for a, v in mesh.items() if v > 1) or "data=1"
    chosen.rl.generator_mesh = row["generator_mesh"]
    chosen.rl.trainer_devices = chosen.rl.generator_devices = ""
    chosen.rl.plan_hardware = rl.plan_hardware
    others = {k: v for k, v in row["trainer_overrides"].items() if not k.startswith("mesh.")}
    return chosen, others, f"{pick}, {row['split']} devices: trainer {row['trainer']}, generator {row['generator']}"


# ----------------------------------------------------------------------------- the two sides


class Trainer:
    """The GRPO program, its state, the frozen reference and the update."""

    def __init__(self, plan: Plan, colocated: bool):
        c = plan.trainer_config
        self.program = rl_program.build(c, make_mesh(c, plan.trainer_devices))
        self.state = self.program.init()
        self.step_fn = self.program.train_step_fn()
        self.logp_fn = self.program.logprobs_fn()
        self.ref = None
        self.colocated = colocated
        self.opt_host = None
        self.offloaded_bytes = 0

    def put(self, a):
        return jax.device_put(np.asarray(a), self.program.batch_sharding)

    def update(self, tokens, mask, advantages, old_logp, ref_logp=None) -> dict:
        tokens = self.put(tokens)
        if ref_logp is None:
            if self.ref is not None and self.program.config.rl.kl > 0:
                ref_logp = self.logp_fn(self.ref, tokens)
            else:
                ref_logp = self.put(old_logp)
        else:
            ref_logp = self.put(ref_logp)
        batch = rl_program.Rollouts(tokens, self.put(mask), self.put(advantages), self.put(old_logp), ref_logp)
        self.restore()
        self.state, metrics = self.step_fn(self.state, batch)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        return metrics

    def warm_up(self, task: tasks_lib.Task, steps: int, seed: int) -> list[float]:
        """Supervised steps on the task's format, a fraction config.rl.warmup_right of the examples with
        the right answer and the others with random ones: the policy gradient with
        advantage 1 at ratio 1 (old = ref = the current log-probabilities) is the cross-entropy's."""
        c = self.program.config
        b, t = c.train.batch_size, c.data.seq_len
        losses = []
        for s in range(steps):
            rng = np.random.default_rng([seed, 7, s])
            examples = [task.format_example(rng, self.program.config.rl.warmup_right) for _ in range(b)]
            tokens, mask = _rows([_ids(p) for p, _ in examples], [_ids(a + tasks_lib.EOS) for _, a in examples], t)
            logp = np.asarray(self.logp_fn(self.state.params, self.put(tokens)))
            self.update(tokens, mask, mask, logp, logp)
            losses.append(-float(np.sum(logp * mask) / mask.sum()))
        return losses

    def freeze_reference(self) -> None:
        self.ref = reshard(self.state.params, self.program.param_shardings)[0]

    # colocated: the optimizer state leaves the devices while the engine holds its KV pool
    def offload(self) -> None:
        if not self.colocated or self.opt_host is not None:
            return
        self.opt_host = jax.device_get(self.state.opt_state)
        self.offloaded_bytes = sum(np.asarray(a).nbytes for a in jax.tree.leaves(self.opt_host))
        for a in jax.tree.leaves(self.state.opt_state):
            a.delete()
        self.state = self.state._replace(opt_state=None)

    def restore(self) -> None:
        if self.opt_host is None:
            return
        self.state = self.state._replace(
            opt_state=jax.device_put(self.opt_host, self.program.state_shardings.opt_state)
        )
        self.opt_host = None


def _ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _text(ids) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _rows(prompts: list, completions: list, t: int):
    """tokens [B, T+1] (prompt, completion, zeros) and the mask [B, T] of completion targets."""
    b = len(prompts)
    tokens = np.zeros((b, t + 1), np.int32)
    mask = np.zeros((b, t), np.float32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        row = (p + c)[: t + 1]
        tokens[i, : len(row)] = row
        mask[i, len(p) - 1 : len(row) - 1] = 1.0
    return tokens, mask


class Generator:
    """The engine on the generator's mesh and the rollouts of one update."""

    def __init__(self, plan: Plan, params, colocated: bool):
        c = plan.generator_config
        self.program = program_lib.build(c, make_mesh(c, plan.generator_devices))
        rl, b = c.rl, plan.trainer_config.train.batch_size  # samples per update
        self.batch = b
        layout = self.program.layout
        shards = layout.size(layout.compute_axes("batch"))
        max_seqs = max(-(-b // shards), -(-rl.eval_prompts // shards), 1)
        length = tasks_lib.longest_prompt(plan.task) + rl.max_new_tokens
        settings = pool_settings(c.serve)
        page = settings["page_size"]
        settings.update(
            num_pages=max_seqs * -(-length // page) + 1,
            max_seqs=max_seqs,
            token_budget=max(8, max_seqs * 2),
            chunk_size=max(8, length),
            allocation="reserve",
            decode_steps=1,
        )
        if settings["cache"] == "contiguous":
            settings["max_len"] = length
        self.engine = Engine(self.program, reshard(params, self.program.param_shardings)[0], **settings)
        self.task, self.reward_fn, self.config = plan.task, plan.reward_fn, c
        self.colocated = colocated
        self.version = 0

    def set_params(self, params, version: int) -> int:
        moved = self.engine.set_params(params)
        self.version = version
        return moved

    def _run(self, prompts: list, group: int, sampling: Callable) -> dict:
        eng = self.engine
        if self.colocated:
            eng.wake()
        for j, p in enumerate(prompts):
            for g in range(group):
                eng.submit((j, g), _ids(p), self.config.rl.max_new_tokens, sampling(j, g))
        done = {r.id: r for r in eng.run()}
        eng.forget_finished()
        if self.colocated:
            eng.sleep()
        return done

    def rollouts(self, index: int) -> dict:
        """Update `index`'s samples: prompts of (seed, index), G samples each at the rollout
        temperature with each token's log-probability, rewards, advantages; host arrays."""
        rl = self.config.rl
        n = self.batch // rl.group_size
        prompts = self.task.prompts(self.config.seed, index, n)
        seed = lambda j, g: int(np.random.default_rng([self.config.seed, index, j, g]).integers(0, 2**31 - 1))
        start = time.perf_counter()
        done = self._run(
            prompts,
            rl.group_size,
            lambda j, g: Sampling(temperature=rl.temperature, seed=seed(j, g), logprobs=0, stop_ids=(EOS_ID,)),
        )
        gen_s = time.perf_counter() - start
        prompt_ids, completions, logps, rewards = [], [], [], []
        for j, p in enumerate(prompts):
            for g in range(rl.group_size):
                r = done[(j, g)]
                prompt_ids.append(_ids(p))
                completions.append(list(r.generated))
                logps.append(list(r.logprobs))
                rewards.append(call_reward(self.reward_fn, p, _text(t for t in r.generated if t != EOS_ID)))
        t = self.config.data.seq_len
        tokens, mask = _rows(prompt_ids, completions, t)
        old = np.zeros_like(mask)
        for i, (p, lp) in enumerate(zip(prompt_ids, logps)):
            old[i, len(p) - 1 : len(p) - 1 + len(lp)] = lp[: t - len(p) + 1]
        adv = loss_lib.group_advantages(rewards, rl.group_size)
        return dict(
            index=index,
            version=self.version,
            tokens=tokens,
            mask=mask,
            old_logp=old,
            advantages=adv[:, None] * mask,
            rewards=np.asarray(rewards, np.float32),
            generated=int(sum(len(c) for c in completions)),
            gen_s=gen_s,
        )

    def evaluate(self, prompts: list) -> float:
        """Mean reward of greedy completions of `prompts`."""
        done = self._run(prompts, 1, lambda j, g: Sampling(stop_ids=(EOS_ID,)))
        texts = [_text(t for t in done[(j, 0)].generated if t != EOS_ID) for j in range(len(prompts))]
        return float(np.mean([call_reward(self.reward_fn, p, c) for p, c in zip(prompts, texts)]))


# ----------------------------------------------------------------------------- the drivers


class Run:
    """Both sides built, the policy warmed up and the reference frozen; `sync()` / `asynchronous()`."""

    def __init__(self, config, devices=None, reward_fn: Callable | None = None, log: Callable | None = None):
        self.plan = check(config, devices, reward_fn)
        config = self.config = self.plan.trainer_config  # rl placement as checked (or chosen by the model)
        self.colocated = config.rl.placement == "colocated"
        self.trainer = Trainer(self.plan, self.colocated)
        self.warmup_losses = self.trainer.warm_up(self.plan.task, config.rl.warmup_steps, config.seed)
        self.trainer.freeze_reference()
        self.generator = Generator(self.plan, self.trainer.state.params, self.colocated)
        self.eval_prompts = self.plan.task.prompts(config.seed + 1, 2**31 - 1, config.rl.eval_prompts)
        self.log = log or (lambda record: None)
        self.records: list[dict] = []
        self.lock = threading.Lock() if self.colocated else None

    def _devices(self):
        return self.lock if self.lock is not None else _Nothing()

    def evaluate(self) -> float:
        with self._devices():
            self.trainer.offload()
            return self.generator.evaluate(self.eval_prompts) if self.eval_prompts else float("nan")

    def _train(self, roll: dict) -> dict:
        start = time.perf_counter()
        with self._devices():
            metrics = self.trainer.update(roll["tokens"], roll["mask"], roll["advantages"], roll["old_logp"])
        metrics["train_s"] = time.perf_counter() - start
        return metrics

    def _transfer(self):
        """The new weights into the generator's layout: (placed, bytes, seconds)."""
        start = time.perf_counter()
        placed, moved = reshard(self.trainer.state.params, self.generator.program.param_shardings)
        jax.block_until_ready(placed)
        return placed, moved, time.perf_counter() - start

    def _record(self, i: int, roll: dict, metrics: dict, sync_bytes: int, sync_s: float, start: float) -> None:
        b, t = self.config.train.batch_size, self.config.data.seq_len
        record = dict(
            step=i + 1,
            version=roll["version"],
            staleness=i - roll["version"],
            reward=float(roll["rewards"].mean()),
            reward_std=float(roll["rewards"].std()),
            **{k: metrics[k] for k in ("loss", "kl", "clipped", "ratio", "grad_norm", "train_s")},
            gen_s=roll["gen_s"],
            tokens_generated=roll["generated"],
            tokens_trained=b * t,
            sync_bytes=sync_bytes,
            sync_s=sync_s,
            wall_s=time.perf_counter() - start,
        )
        every = self.config.train.eval_every
        if every and (i + 1) % every == 0 and self.config.rl.mode == "sync":
            record["eval_reward"] = self.evaluate()
        self.records.append(record)
        self.log(record)

    def sync(self) -> list[dict]:
        """Update i trains on rollouts of the weights of version i; the transfer follows each update."""
        start = time.perf_counter()
        sync_bytes, sync_s = 0, 0.0
        for i in range(self.config.rl.steps):
            with self._devices():
                self.trainer.offload()
                roll = self.generator.rollouts(i)
            metrics = self._train(roll)
            placed, sync_bytes, sync_s = self._transfer()
            self.generator.set_params(placed, i + 1)
            self._record(i, roll, metrics, sync_bytes, sync_s, start)
        return self.records

    def asynchronous(self, staleness: int | None = None) -> list[dict]:
        """The generator runs ahead in a thread: rollout i waits until version i - k is published,
        then uses the newest version; a queue of at most k + 1 rollouts lies between the sides."""
        k = self.config.rl.staleness if staleness is None else staleness
        steps = self.config.rl.steps
        store = _Published(0, self.generator.engine.params)
        rollouts: queue.Queue = queue.Queue(maxsize=k + 1)

        def produce():
            try:
                for i in range(steps):
                    version, params = store.wait_for(i - k)
                    if version != self.generator.version:
                        self.generator.set_params(params, version)
                    with self._devices():
                        self.trainer.offload()
                        roll = self.generator.rollouts(i)
                    rollouts.put(roll)
            except BaseException as e:  # handed to the trainer, which raises it
                rollouts.put(e)

        thread = threading.Thread(target=produce, name="rl-generator", daemon=True)
        start = time.perf_counter()
        thread.start()
        try:
            for i in range(steps):
                roll = rollouts.get()
                if isinstance(roll, BaseException):
                    raise roll
                if i - roll["version"] > k:
                    raise RuntimeError(f"rollout {i} used weights of version {roll['version']}: more than {k} old")
                metrics = self._train(roll)
                placed, sync_bytes, sync_s = self._transfer()
                store.publish(i + 1, placed)
                self._record(i, roll, metrics, sync_bytes, sync_s, start)
        finally:
            store.close()
            thread.join()
        return self.records


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Published:
    """The newest weights on the generator's devices and their version (the trainer publishes)."""

    def __init__(self, version: int, params):
        self.version, self.params = version, params
        self.cond = threading.Condition()
        self.closed = False

    def publish(self, version: int, params) -> None:
        with self.cond:
            self.version, self.params = version, params
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def wait_for(self, version: int):
        with self.cond:
            while self.version < version and not self.closed:
                self.cond.wait()
            if self.version < version:
                raise RuntimeError("the trainer stopped")
            return self.version, self.params


def main(config, workdir: str, reward_fn: Callable | None = None) -> list[dict]:
    """GRPO on config.rl.task; metrics.jsonl in `workdir` (one line per update, then a summary)."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(path):
        raise FileExistsError(f"{path} exists: give a new workdir")
    out = open(path, "w")

    def log(record):
        out.write(json.dumps(record) + "\n")
        out.flush()
        if record.get("step", 0) % max(config.train.log_every, 1) == 0 or "eval_reward" in record:
            keys = ("step", "reward", "eval_reward", "kl", "staleness", "gen_s", "train_s", "sync_bytes")
            print(" ".join(f"{k}={record[k]:.4g}" for k in keys if k in record), flush=True)

    try:
        run = Run(config, reward_fn=reward_fn, log=log)
        if run.plan.choice:
            print(f"layouts by the iteration-time model ({config.rl.plan_hardware}): {run.plan.choice}", flush=True)
        before = run.evaluate()
        print(f"warm-up: {config.rl.warmup_steps} steps, greedy reward before RL {before:.3f}", flush=True)
        records = run.sync() if config.rl.mode == "sync" else run.asynchronous()
        after = run.evaluate()
        summary = dict(summary=True, eval_reward_before=before, eval_reward_after=after, **_rates(records))
        log(summary)
        print(json.dumps(summary), flush=True)
    finally:
        out.close()
    return records


def _rates(records: list[dict]) -> dict:
    gen_s = sum(r["gen_s"] for r in records)
    train_s = sum(r["train_s"] for r in records)
    return dict(
        generated_tokens_per_s=sum(r["tokens_generated"] for r in records) / max(gen_s, 1e-9),
        trained_tokens_per_s=sum(r["tokens_trained"] for r in records) / max(train_s, 1e-9),
        wall_s=records[-1]["wall_s"] if records else 0.0,
        sync_bytes=records[-1]["sync_bytes"] if records else 0,
        sync_s_mean=float(np.mean([r["sync_s"] for r in records])) if records else 0.0,
    )


__all__ = ["Run", "check", "main", "RewardError"]
