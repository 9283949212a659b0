"""The MoE layer on one device against independent references: a per-token float64 numpy loop (the
definition: route, pick k experts, weight their SwiGLUs), a dense jnp computation of every expert
for every token for the gradients, and a numpy queue for the capacity path's drops.

Tolerances: the layer computes in fp32 with "highest" matmul precision; its outputs (~1e-2) differ
from float64 by ~1e-7, so rtol 1e-5 / atol 1e-7. A wrong expert, gate or dropped copy changes an
output by its whole contribution (~1e-3 here), far above that.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.config import ConfigError, validate
from jaxsys.models import moe
from jaxsys.models.params import init_params
from jaxsys.sharding import Layout
from tests.helpers import small_config

B, T, D, E, K, F = 2, 16, 32, 8, 2, 24


def moe_config(**changes):
    c = small_config()
    c.model.d_model, c.model.mlp_pattern = D, "moe"
    c.model.moe.experts, c.model.moe.top_k, c.model.moe.d_ff = E, K, F
    for key, value in changes.items():
        c.model.moe[key] = value
    return c


def layer(config, seed=0):
    """One MoE layer's weights (random router so that routing is far from ties) and an input."""
    specs = moe.param_specs(config.model, 1)
    w = init_params(specs, jax.random.key(seed), jnp.float32)
    w = jax.tree.map(lambda a: a[0], w)
    w["router"] = jax.random.normal(jax.random.key(seed + 1), (D, E))
    if "router_bias" in w:  # a bias that changes the choice (the scores are in (0, 1))
        w["router_bias"] = 0.3 * jax.random.normal(jax.random.key(seed + 3), (E,))
    h = jax.random.normal(jax.random.key(seed + 2), (B, T, D))
    return w, h


def apply(config, w, h, previous=None):
    layout = Layout.from_config(config)
    previous = jnp.full((B, T, config.model.moe.top_k), -1, jnp.int32) if previous is None else previous
    return moe.apply(h, w, config.model, layout, previous)


def _silu(x):
    return x / (1 + np.exp(-x))


def reference_routing(w, h, m):
    """(logits, scores, experts [B, T, k] best first, gates) in float64."""
    logits = np.asarray(h, np.float64) @ np.asarray(w["router"], np.float64)
    if m.router == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    choice = scores + np.asarray(w["router_bias"], np.float64) if "router_bias" in w else scores
    if m.groups > 1:  # DeepSeek's group-limited choice, group by group
        grouped = choice.reshape(*choice.shape[:-1], m.groups, -1)
        best_two = np.sort(grouped, -1)[..., -2:].sum(-1)
        group_scores = grouped.max(-1) if m.group_score == "max" else best_two
        best = np.argsort(-group_scores, -1, kind="stable")[..., : m.group_top_k]
        kept = np.zeros(group_scores.shape, bool)
        np.put_along_axis(kept, best, True, -1)
        choice = np.where(np.repeat(kept, m.experts // m.groups, -1), choice, -np.inf)
    experts = np.argsort(-choice, axis=-1, kind="stable")[..., : m.top_k]
    gates = np.take_along_axis(scores, experts, -1)
    if m.renormalize:
        gates = gates / gates.sum(-1, keepdims=True)
    return logits, scores, experts, gates * m.routed_scale


def reference_queue(experts, n_experts, slots):
    """Admitted copies [B, T, k] and the dropped count: per sequence, first choices of every
    position before second choices, each expert taking at most `slots` copies."""
    b, t, k = experts.shape
    kept, dropped = np.zeros(experts.shape, bool), 0
    for i in range(b):
        fill = np.zeros(n_experts, int)
        for r in range(k):
            for p in range(t):
                e = experts[i, p, r]
                if fill[e] < slots:
                    fill[e] += 1
                    kept[i, p, r] = True
                else:
                    dropped += 1
    return kept, dropped


def reference_output(w, h, m, kept=None):
    """The definition, token by token in float64."""
    f64 = lambda a: np.asarray(a, np.float64)
    _, _, experts, gates = reference_routing(w, h, m)
    x = f64(h)
    out = np.zeros_like(x)
    for i in range(x.shape[0]):
        for p in range(x.shape[1]):
            for r in range(m.top_k):
                if kept is not None and not kept[i, p, r]:
                    continue
                e = experts[i, p, r]
                hidden = _silu(x[i, p] @ f64(w["w_gate"][e])) * (x[i, p] @ f64(w["w_up"][e]))
                out[i, p] += gates[i, p, r] * hidden @ f64(w["w_down"][e])
            if m.shared_experts:
                hidden = _silu(x[i, p] @ f64(w["shared_gate"])) * (x[i, p] @ f64(w["shared_up"]))
                scale = 1 / (1 + np.exp(-x[i, p] @ f64(w["shared_expert_gate"]))) if m.shared_expert_gate else 1.0
                out[i, p] += scale * hidden @ f64(w["shared_down"])
    return out


ROUTERS = [
    dict(router="softmax", renormalize=True),
    dict(router="softmax", renormalize=False),
    dict(router="sigmoid", renormalize=True, shared_experts=1),
    dict(router="softmax", renormalize=False, shared_experts=2, shared_expert_gate=True),  # Qwen2-MoE
    # DeepSeek-V2's group-limited greedy and DeepSeek-V3's biased sigmoid choice over the best groups
    dict(router="softmax", renormalize=False, shared_experts=2, groups=4, group_top_k=1, routed_scale=16.0),
    dict(
        router="sigmoid",
        shared_experts=1,
        groups=4,
        group_top_k=2,
        group_score="top2",
        score_bias=True,
        routed_scale=2.5,
    ),
]


@pytest.mark.parametrize("router", ROUTERS, ids=lambda r: "-".join(f"{k}={v}" for k, v in r.items()))
def test_dropless_equals_the_per_token_definition(router):
    config = moe_config(**router)
    w, h = layer(config)
    y, experts, stats = apply(config, w, h)
    np.testing.assert_allclose(np.asarray(y), reference_output(w, h, config.model.moe), rtol=1e-5, atol=1e-7)
    _, _, want_experts, _ = reference_routing(w, h, config.model.moe)
    np.testing.assert_array_equal(np.asarray(experts), want_experts)
    np.testing.assert_array_equal(np.asarray(stats["load"]), np.bincount(want_experts.ravel(), minlength=E))
    assert int(stats["dropped"]) == 0


@pytest.mark.parametrize("router", ROUTERS[4:], ids=["deepseek-v2", "deepseek-v3"])
def test_group_limits_and_bias_change_the_choice(router):
    """The group limit (and V3's bias) pick other experts than plain top-k for some tokens, so the
    definition test above checks them; the gates are the unbiased scores times routed_scale."""
    config = moe_config(**router)
    m = config.model.moe
    w, h = layer(config)
    plain = moe_config(**{k: v for k, v in router.items() if k not in ("groups", "group_top_k", "score_bias")})
    _, scores, experts, gates = reference_routing(w, h, m)
    _, _, plain_experts, _ = reference_routing({"router": w["router"]}, h, plain.model.moe)
    assert 0 < np.mean(np.any(experts != plain_experts, -1)) < 1
    r = moe.route(h, w["router"], m, w.get("router_bias"))
    np.testing.assert_array_equal(np.asarray(r.experts), experts)
    np.testing.assert_allclose(np.asarray(r.gates), gates, rtol=1e-5)
    picked = np.take_along_axis(scores, experts, -1)
    want = picked / picked.sum(-1, keepdims=True) if m.renormalize else picked
    np.testing.assert_allclose(np.asarray(r.gates), want * m.routed_scale, rtol=1e-5)


def dense_reference(w, h, m, kept=None):
    """The same layer as plain jnp: every expert on every token, combined by one-hot gate weights
    (no sorting, grouped matmul or slot buffers), for gradients."""
    r = moe.route(h, w["router"], m, w.get("router_bias"))
    weights = jax.nn.one_hot(r.experts, m.experts) * r.gates[..., None]  # [B, T, k, E]
    if kept is not None:
        weights = weights * jnp.asarray(kept, jnp.float32)[..., None]
    hidden = jax.nn.silu(jnp.einsum("btd,edf->btef", h, w["w_gate"])) * jnp.einsum("btd,edf->btef", h, w["w_up"])
    every = jnp.einsum("btef,efd->bted", hidden, w["w_down"])
    y = jnp.einsum("btke,bted->btd", weights, every)
    if m.shared_experts:
        shared = jax.nn.silu(h @ w["shared_gate"]) * (h @ w["shared_up"]) @ w["shared_down"]
        y = y + (jax.nn.sigmoid(h @ w["shared_expert_gate"])[..., None] * shared if m.shared_expert_gate else shared)
    return y


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
@pytest.mark.parametrize(
    "router", [ROUTERS[i] for i in (0, 2, 3, 5)], ids=["softmax", "sigmoid-shared", "gated-shared", "deepseek-v3"]
)
def test_gradients_equal_the_dense_reference(router, capacity_factor):
    config = moe_config(capacity_factor=capacity_factor, **router)
    m = config.model.moe
    w, h = layer(config)
    kept = None
    if capacity_factor:
        kept, _ = reference_queue(reference_routing(w, h, m)[2], E, moe.capacity(T, m))
    cotangent = jax.random.normal(jax.random.key(9), (B, T, D))
    got = jax.grad(lambda w, h: jnp.sum(apply(config, w, h)[0] * cotangent), argnums=(0, 1))(w, h)
    want = jax.grad(lambda w, h: jnp.sum(dense_reference(w, h, m, kept) * cotangent), argnums=(0, 1))(w, h)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("capacity_factor", [0.25, 0.5, 1.0])
def test_capacity_drops_equal_an_independent_count(capacity_factor):
    config = moe_config(capacity_factor=capacity_factor)
    m = config.model.moe
    w, h = layer(config)
    slots = moe.capacity(T, m)
    kept, dropped = reference_queue(reference_routing(w, h, m)[2], E, slots)
    y, _, stats = apply(config, w, h)
    assert int(stats["dropped"]) == dropped
    assert dropped > 0, "the test should exercise dropping"
    np.testing.assert_allclose(np.asarray(y), reference_output(w, h, m, kept), rtol=1e-5, atol=1e-7)


def test_no_drops_when_capacity_suffices():
    """cf = E / k gives C = T slots per expert and sequence: every copy fits, and the capacity path
    computes what the dropless one does."""
    config = moe_config(capacity_factor=E / K)
    w, h = layer(config)
    y, _, stats = apply(config, w, h)
    y_dropless, _, _ = apply(moe_config(), w, h)
    assert int(stats["dropped"]) == 0
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_dropless), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_balance_and_z_losses_equal_their_formulas(router):
    """Switch's a E sum_e f_e P_e and ST-MoE's b mean lse(z)^2, summed over tokens by the layer."""
    config = moe_config(router=router, aux_loss_weight=0.3, z_loss_weight=0.07)
    w, h = layer(config)
    _, _, stats = apply(config, w, h)
    logits, scores, experts, _ = reference_routing(w, h, config.model.moe)
    probs = scores / scores.sum(-1, keepdims=True)
    f = np.bincount(experts.ravel(), minlength=E) / experts.size
    n = B * T
    aux = 0.3 * E * np.sum(f * probs.reshape(n, E).mean(0))
    lse = np.log(np.exp(logits).sum(-1))
    z = 0.07 * np.mean(lse**2)
    np.testing.assert_allclose(float(stats["aux_loss"]) / n, aux, rtol=1e-5)
    np.testing.assert_allclose(float(stats["z_loss"]) / n, z, rtol=1e-5)


def test_co_routing_counts_pairs_of_consecutive_layers():
    config = moe_config()
    w, h = layer(config)
    previous = jax.random.randint(jax.random.key(5), (B, T, K), 0, E)
    previous = previous.at[0, :3].set(-1)  # no previous layer for these positions
    _, experts, stats = apply(config, w, h, previous)
    want = np.zeros((E, E), int)
    for i in range(B):
        for p in range(T):
            for a in np.asarray(previous)[i, p]:
                for b in np.asarray(experts)[i, p]:
                    if a >= 0:
                        want[a, b] += 1
    np.testing.assert_array_equal(np.asarray(stats["pairs"]), want)


def test_admission_queues_first_choices_first():
    experts = jnp.asarray([[[0, 1], [0, 2], [0, 1]]])  # T=3, k=2: expert 0 is everyone's first choice
    slot = np.asarray(moe.admit(experts, 3, 2))
    # two slots per expert: positions 0 and 1 get expert 0, position 2's first choice is dropped;
    # second choices (1, 2, 1) all fit, queued after every first choice
    np.testing.assert_array_equal(slot[0], [[0, 2], [1, 4], [6, 3]])


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(mesh=dict(expert=4), experts=6),
            r"config.model.moe.experts=6 is not divisible by the 4 shards of mesh axis 'expert'",
        ),
        (dict(top_k=9), r"config.model.moe.top_k=9 is larger than config.model.moe.experts=8"),
        (dict(router="topk"), r"config.model.moe.router='topk': choose one of"),
        (dict(top_k=1), r"renormalize with a softmax router and top_k=1"),
        (dict(mesh=dict(tensor=2), d_ff=13), r"config.model.moe.d_ff=13 is not divisible by the 2 shards"),
        (dict(capacity_factor=-1.0), r"config.model.moe.capacity_factor must be >= 0"),
        (dict(groups=3), r"groups=3 does not divide config.model.moe.experts=8"),
        (dict(groups=4, group_top_k=1, top_k=3), r"group_top_k=1 of 4 groups of 2 experts leaves fewer than top_k=3"),
        (
            dict(groups=8, group_top_k=2, group_score="top2"),
            r"group_score='top2' sums each group's best two experts, but a group has 1",
        ),
        (dict(group_score="sum"), r"group_score='sum': choose one of"),
        (dict(routed_scale=0.0), r"routed_scale=0.0 must be > 0"),
        (dict(bias_update_rate=0.001), r"bias_update_rate=0.001 moves the choice bias, but"),
        (dict(mesh=dict(pipe=2), score_bias=True, bias_update_rate=0.001), r"not implemented with a pipeline"),
    ],
)
def test_bad_moe_configs_are_refused(changes, message):
    changes = dict(changes)
    c = moe_config(**{k: v for k, v in changes.items() if k != "mesh"})
    for axis, size in changes.get("mesh", {}).items():
        c.mesh[axis] = size
    with pytest.raises(ConfigError, match=message):
        validate(c)


def test_bad_patterns_and_placement_settings_are_refused():
    c = moe_config()
    c.model.mlp_pattern = "dense,expert"
    with pytest.raises(ConfigError, match=r"mlp_pattern='dense,expert': a comma-separated list of"):
        validate(c)
    c = moe_config()
    c.model.mlp_pattern, c.model.layer_pattern, c.model.n_layers = "dense,moe", "linear,linear,softmax", 3
    with pytest.raises(ConfigError, match=r"n_layers=3 is not a multiple of 6"):
        validate(c)
    c = moe_config()
    c.parallel.expert_rebalance_every = 10
    with pytest.raises(ConfigError, match=r"the experts are not split"):
        validate(c)
    c = small_config()  # dense
    c.parallel.expert_rebalance_every = 10
    with pytest.raises(ConfigError, match=r"expert_rebalance_every needs MoE layers"):
        validate(c)


@pytest.mark.parametrize("mesh", [{}, {"data": 2, "expert": 2}])
def test_auxiliary_loss_free_bias_follows_the_loads(mesh):
    """DeepSeek-V3's balancing (moe.bias_update_rate u): after each step every MoE layer's bias is
    b + u sign(mean load - load) of that step's global loads (NumPy here), on one device and with the
    experts split; the optimizer leaves it alone (no gradient reaches it)."""
    from jaxsys import data
    from tests.helpers import program_for

    rate = 0.01
    c = moe_config(router="sigmoid", score_bias=True, bias_update_rate=rate, aux_loss_weight=0.0)
    for axis, size in mesh.items():
        c.mesh[axis] = size
    program = program_for(c)
    corpus = data.load_corpus(c.data)
    batch = lambda s: data.global_batch(corpus, program.batch_sharding, c.seed, s, c.train.batch_size, c.data.seq_len)
    state = program.init()
    step = program.train_step_fn()
    bias = np.zeros((c.model.n_layers, E))
    for s in range(2):
        state, metrics = step(state, batch(s))
        load = np.asarray(metrics["moe_load"], np.float64)
        assert load.shape == (c.model.n_layers, E) and load.sum() > 0
        bias = bias + rate * np.sign(load.mean(-1, keepdims=True) - load)
        np.testing.assert_allclose(np.asarray(state.params["layers"]["moe"]["router_bias"]), bias, atol=1e-7)
    assert np.abs(bias).max() > 0
