"""GRPO (jaxsys/rl/): the loss and its gradient against NumPy statements, the weight sync between
disjoint sub-meshes (bitwise, bytes by formula), async k=0 = sync bitwise, the staleness bound, and
bad input named before anything compiles."""

import copy
import time

import jax
import numpy as np
import pytest

from jaxsys import program as program_lib
from jaxsys.analysis import rl as rl_analysis
from jaxsys.config import ConfigError
from jaxsys.mesh import make_mesh
from jaxsys.rl import loop, loss, tasks
from jaxsys.rl import program as rl_program
from jaxsys.serve.engine import reshard
from tests.helpers import config_file, small_config


def np_advantages(rewards, g):
    out = []
    for start in range(0, len(rewards), g):
        grp = [float(r) for r in rewards[start : start + g]]
        mean = sum(grp) / g
        std = (sum((r - mean) ** 2 for r in grp) / g) ** 0.5
        out += [(r - mean) / (std + 1e-6) for r in grp]
    return np.asarray(out)


def np_loss_and_dlogp(logp, old, ref, adv, mask, clip, beta):
    """GRPO's masked token-level objective and its derivative by logp, written out in NumPy."""
    n = max(mask.sum(), 1.0)
    ratio = np.exp(logp - old)
    low, high = 1 - clip, 1 + clip
    clipped_ratio = np.minimum(np.maximum(ratio, low), high)
    surrogate = np.minimum(ratio * adv, clipped_ratio * adv)
    kl = np.exp(ref - logp) - (ref - logp) - 1
    loss_value = np.sum(mask * (-surrogate + beta * kl)) / n
    # d(-min(r A, clip(r) A))/dlogp: -r A where the unclipped branch is the minimum, else 0 (flat clip)
    unclipped_active = ratio * adv <= clipped_ratio * adv
    d_pg = np.where(unclipped_active, -ratio * adv, 0.0)
    d_kl = 1 - np.exp(ref - logp)
    return loss_value, mask * (d_pg + beta * d_kl) / n


def random_terms(rng, b=8, t=6):
    logp = -rng.uniform(0.1, 3, (b, t))
    old = logp + rng.normal(0, 0.3, (b, t))  # ratios both inside and outside [0.8, 1.2]
    ref = logp + rng.normal(0, 0.5, (b, t))
    adv = np.repeat(np_advantages(rng.normal(size=b), 4)[:, None], t, 1)
    mask = (rng.uniform(size=(b, t)) < 0.7).astype(np.float64)
    return logp, old, ref, adv, mask


def test_advantages_loss_and_gradient_against_numpy():
    rng = np.random.default_rng(0)
    rewards = rng.uniform(size=12)
    np.testing.assert_allclose(loss.group_advantages(rewards, 4), np_advantages(rewards, 4), rtol=1e-5, atol=1e-6)
    assert np.all(loss.group_advantages([1.0, 1, 1, 1], 4) == 0)  # a group without signal: no gradient
    with pytest.raises(ValueError, match="groups of 4"):
        loss.group_advantages(rewards[:10], 4)
    logp, old, ref, adv, mask = random_terms(rng)
    clip, beta = 0.2, 0.1

    def objective(lp):
        terms = loss.token_terms(lp, old, ref, adv, clip, beta)
        return jax.numpy.sum(terms["loss"] * mask) / mask.sum()

    with jax.enable_x64():
        value, grad = jax.value_and_grad(objective)(jax.numpy.asarray(logp))
    want_value, want_grad = np_loss_and_dlogp(logp, old, ref, adv, mask, clip, beta)
    np.testing.assert_allclose(value, want_value, rtol=1e-10)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-9, atol=1e-12)
    assert np.all(grad[mask == 0] == 0)  # masked tokens contribute nothing


def grpo_config(mesh=None):
    c = small_config(mesh, n_kv_heads=4)
    c.rl.task, c.rl.clip, c.rl.kl = "reverse", 0.2, 0.1
    c.train.batch_size, c.data.seq_len = 8, 12
    return c


def test_model_gradient_on_a_sharded_mesh_against_numpy_chain_rule():
    """The trainer's objective and gradients (fsdp=2 x tensor=2) equal the NumPy objective of the
    single-device log-probabilities and the vector-Jacobian product of those log-probabilities with
    NumPy's derivative of the objective by them."""
    single = grpo_config()
    sharded = grpo_config({"fsdp": 2, "tensor": 2})
    one = rl_program.build(single, make_mesh(single, jax.devices()[:1]))
    many = rl_program.build(sharded, make_mesh(sharded, jax.devices()[:4]))
    params = one.init(3).params
    rng = np.random.default_rng(1)
    b, t = 8, single.data.seq_len
    tokens = rng.integers(0, 256, (b, t + 1)).astype(np.int32)
    logp_fn = lambda p: one.logprobs_fn()(p, tokens)
    logp, vjp = jax.vjp(logp_fn, params)
    logp64 = np.asarray(logp, np.float64)
    _, old, ref, adv, mask = random_terms(rng, b, t)
    old, ref = logp64 + (old - old.mean()), logp64 + (ref - ref.mean())  # near the policy, as in training
    f32 = lambda a: np.asarray(a, np.float32)
    batch = rl_program.Rollouts(tokens, f32(mask), f32(adv), f32(old), f32(ref))
    want_value, dlogp = np_loss_and_dlogp(logp64, f32(old), f32(ref), f32(adv), mask, 0.2, 0.1)
    (want_grads,) = vjp(f32(dlogp))
    placed = jax.device_put(params, many.param_shardings)
    value, grads = many.loss_and_grads_fn()(placed, jax.device_put(batch, many.batch_sharding))
    np.testing.assert_allclose(float(value), want_value, rtol=2e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-7)


@pytest.mark.parametrize(
    "src_mesh,dst_mesh",
    [({"fsdp": 4}, {"tensor": 2, "data": 2}), ({"pipe": 2, "fsdp": 2}, {"tensor": 4})],
    ids=["fsdp4-to-tensor2xdata2", "pipe2xfsdp2-to-tensor4"],
)
def test_weight_sync_between_disjoint_sub_meshes_is_bitwise_and_moves_the_formula(src_mesh, dst_mesh):
    """Trainer weights on devices 0-3 in one layout land on devices 4-7 in another bitwise, and the
    bytes the transfer counts equal analysis.rl.sync_bytes (each generator device gets its pieces)."""
    src_config = small_config(src_mesh, n_kv_heads=4, n_layers=4)
    if src_mesh.get("pipe", 1) > 1:
        src_config.train.microbatches = 2
    dst_config = small_config(dst_mesh, n_kv_heads=4, n_layers=4)
    src = program_lib.build(src_config, make_mesh(src_config, jax.devices()[:4]))
    dst = program_lib.build(dst_config, make_mesh(dst_config, jax.devices()[4:8]))
    trained = src.init(5).params
    placed, moved = reshard(trained, dst.param_shardings)
    assert {d.id for a in jax.tree.leaves(placed) for d in a.devices()} == {4, 5, 6, 7}
    for got, want, sharding in zip(
        jax.tree.leaves(placed), jax.tree.leaves(trained), jax.tree.leaves(dst.param_shardings)
    ):
        assert got.sharding == sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert moved == rl_analysis.sync_bytes(dst_config) > 0
    total = sum(np.asarray(a).nbytes for a in jax.tree.leaves(trained))
    assert rl_analysis.all_gather_bytes(dst_config) == 4 * total > moved


def rl_test_config(**rl):
    c = config_file("grpo_tiny", "test")
    for k, v in rl.items():
        c.rl[k] = v
    return c


@pytest.fixture(scope="module")
def run():
    """One disaggregated run (trainer fsdp=4 on 0-3, engine data=2 x tensor=2 on 4-7), compiled once."""
    r = loop.Run(rl_test_config(steps=3))
    r.start = reshard(r.trainer.state, r.trainer.program.state_shardings)[0]
    return r


def reset(r, steps=3):
    r.trainer.state = reshard(r.start, r.trainer.program.state_shardings)[0]
    r.generator.set_params(r.trainer.state.params, 0)
    r.records = []
    r.config.rl.steps = steps


def test_async_k0_equals_sync_bitwise(run):
    reset(run)
    sync = run.sync()
    sync_params = jax.device_get(run.trainer.state.params)
    reset(run)
    asynchronous = run.asynchronous(staleness=0)
    assert [r["staleness"] for r in asynchronous] == [0, 0, 0]
    for key in ("reward", "loss", "kl", "grad_norm", "tokens_generated", "sync_bytes"):
        assert [r[key] for r in asynchronous] == [r[key] for r in sync], key
    for got, want in zip(jax.tree.leaves(jax.device_get(run.trainer.state.params)), jax.tree.leaves(sync_params)):
        np.testing.assert_array_equal(got, want)
    assert sync[0]["sync_bytes"] == rl_analysis.sync_bytes(run.plan.generator_config)


@pytest.mark.parametrize("k", [1, 2])
def test_async_never_uses_weights_older_than_k(run, k, monkeypatch):
    """With a trainer slower than the generator the rollouts run ahead: each uses weights at most k
    versions old (and, the generator being that far ahead, exactly k once the queue is full)."""
    reset(run, steps=k + 3)
    train = loop.Run._train

    def slow(self, roll):
        time.sleep(1.5)  # let the generator run ahead (an ordering, not a timing assertion)
        return train(self, roll)

    monkeypatch.setattr(loop.Run, "_train", slow)
    records = run.asynchronous(staleness=k)
    lags = [r["staleness"] for r in records]
    assert all(0 <= lag <= k for lag in lags) and max(lags) == k, lags
    assert all(r["version"] <= r["step"] - 1 for r in records)


def test_bad_input_is_named_before_compiling():
    base = rl_test_config()
    with pytest.raises(ConfigError, match="overlap on devices"):
        loop.check(_with(base, trainer_devices="0-3", generator_devices="3-6"))
    with pytest.raises(ConfigError, match="cover every device"):
        loop.check(_with(base, trainer_devices="0-3", generator_devices="4-6"))
    with pytest.raises(ConfigError, match="group_size=3 does not divide"):
        loop.check(_with(base, group_size=3))
    with pytest.raises(ConfigError, match="temperature=0.7"):
        loop.check(_with(base, temperature=0.7))
    with pytest.raises(ConfigError, match="placement"):
        loop.check(_with(base, placement="both"))
    with pytest.raises(ConfigError, match="seq_len"):
        c = _with(base)
        c.data.seq_len = 6
        loop.check(c)

    def broken(prompt, completion):
        raise KeyError(completion)

    with pytest.raises(loop.RewardError, match="'broken' raised on prompt"):
        loop.check(base, reward_fn=broken)
    with pytest.raises(loop.RewardError, match="finite number"):
        loop.check(base, reward_fn=lambda p, c: float("nan"))
    plan = loop.check(base)
    assert [d.id for d in plan.trainer_devices] == [0, 1, 2, 3] and [d.id for d in plan.generator_devices] == [
        4,
        5,
        6,
        7,
    ]


def _with(config, **rl):
    c = copy.deepcopy(config)
    for k, v in rl.items():
        c.rl[k] = v
    return c


def test_tasks_rewards():
    t = tasks.get("reverse", 3)
    assert t.reward("abc=", "cba") == 1.0 and t.reward("abc=", "cbb") == pytest.approx(2 / 3)
    assert t.reward("abc=", "") == 0.0 and t.reward("abc=", "cbaa") == pytest.approx(3 / 4)
    assert tasks.get("add", 2).reward("12+47=", "59") == 1.0
    assert tasks.get("sort", 3).reward("cab=", "abc") == 1.0


@pytest.mark.slow
def test_iteration_model_picks_layouts_and_composes_its_terms():
    """analysis.rl.iteration_times on the tiny model over 8 H100s: every placement gets layouts from
    the planner and the engine's roofline, and the times compose as the model states (async = the
    slower side, disaggregated = the sum, both on the same best split for their own criterion)."""
    from jaxsys.analysis import hardware

    c = small_config(n_kv_heads=4)
    out = rl_analysis.iteration_times(c, 8, hardware.profile("h100"), prompts=4, group=4, prompt=8, completion=8)
    for name in ("colocated", "disaggregated", "async"):
        assert out[name]["trainer"] and out[name]["generator"], name
    col, dis, asy = out["colocated"], out["disaggregated"], out["async"]
    assert col["seconds"] == pytest.approx(col["gen_s"] + col["train_s"] + col["swap_s"] + col["sync_s"])
    assert dis["seconds"] == pytest.approx(dis["gen_s"] + dis["train_s"] + dis["sync_s"])
    assert asy["seconds"] == pytest.approx(max(asy["gen_s"], asy["train_s"] + asy["sync_s"]))
    assert asy["seconds"] <= dis["seconds"]
    n_t, n_g = (int(x) for x in dis["split"].split(" + "))
    assert n_t + n_g == 8


def test_colocated_takes_turns_on_the_devices():
    """Colocated on one device: the rollouts run with the optimizer state on the host and the KV
    pool allocated, the update with the pool freed and the state back; the reward is recorded."""
    c = rl_test_config(placement="colocated", trainer_mesh="", generator_mesh="", steps=2)
    run = loop.Run(c, devices=jax.devices()[:1])
    eng, seen = run.generator.engine, []
    engine_run = eng.run

    def watched(*args, **kwargs):
        seen.append((run.trainer.state.opt_state is None, eng.cache is not None))
        return engine_run(*args, **kwargs)

    eng.run = watched
    records = run.sync()
    assert len(records) == 2 and all(0 <= r["reward"] <= 1 for r in records)
    assert seen == [(True, True)] * 2  # generating: optimizer state on the host, the KV pool allocated
    assert run.trainer.state.opt_state is not None and eng.cache is None  # after an update: back, asleep


def test_planner_chooses_placement_split_and_layouts_before_compiling():
    """config.rl.plan_hardware: check() takes the iteration model's fastest async placement; the
    sides it returns are disjoint, cover the devices and have the chosen meshes."""
    c = rl_test_config(mode="async", plan_hardware="h100")
    plan = loop.check(c)
    assert plan.choice.startswith(("async", "colocated"))
    t, g = plan.trainer_config, plan.generator_config
    n_t = int(np.prod([t.mesh[a] for a in t.mesh]))
    n_g = int(np.prod([g.mesh[a] for a in g.mesh]))
    assert (n_t, n_g) == (len(plan.trainer_devices), len(plan.generator_devices))
    ids_t, ids_g = ({d.id for d in plan.trainer_devices}, {d.id for d in plan.generator_devices})
    if t.rl.placement == "disaggregated":
        assert not ids_t & ids_g and ids_t | ids_g == set(range(8))
    assert t.mesh.pipe == 1 and t.mesh.seq == 1
    with pytest.raises(ConfigError, match="plan_hardware='tpu9'"):
        loop.check(rl_test_config(plan_hardware="tpu9"))


def test_set_params_forgets_the_prefix_cache():
    """After new weights the engine does not reuse prompt pages cached under the old ones: the same
    prompt then gets the tokens of an engine built with the new weights."""
    from jaxsys.serve import engine
    from tests.helpers import program_for

    program = program_for(small_config(n_kv_heads=4))
    old, new = program.init(1).params, program.init(2).params
    kw = dict(num_pages=16, page_size=4, token_budget=16, chunk_size=16, max_seqs=2)
    prompt = [5, 9, 2, 7, 1, 8, 3, 6, 4, 2]
    eng = engine.Engine(program, old, **kw)
    engine.generate(eng, [prompt], 4)  # its full prompt pages are now cached
    eng.set_params(new)
    got = engine.generate(eng, [prompt], 4)
    assert eng.pools[0].hits == 0  # nothing matched after the weights changed
    assert got == engine.generate(engine.Engine(program, new, **kw), [prompt], 4)
