"""DiLoCo, Streaming DiLoCo and CO2 (jaxsys/optim/outer.py, docs/diloco.md): islands on the `data`
axis that train apart and synchronise by an outer step; checked against plain data parallelism and
NumPy statements of the outer update and of the quantizer's bound."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys import data
from jaxsys.analysis import hlo
from jaxsys.config import ConfigError, validate
from jaxsys.optim import outer
from tests.helpers import program_for, small_config

MESH = dict(data=4, fsdp=2)  # 4 islands of 2 devices (FSDP inside an island)
M = 4


def _config(**o):
    c = small_config(MESH)
    c.train.schedule, c.train.warmup_steps = "constant", 0
    c.train.outer.method = "diloco"
    for k, v in o.items():
        c.train.outer[k] = v
    return c


def _batches(program, n):
    corpus = data.load_corpus(program.config.data)
    c = program.config
    return [
        data.global_batch(corpus, program.batch_sharding, c.seed, i, c.train.batch_size, c.data.seq_len)
        for i in range(n)
    ]


def _np(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


@pytest.fixture(scope="module")
def adamw():
    """An AdamW DiLoCo program (H=2, Nesterov 0.9, outer lr 0.7), its step and sync, 4 batches."""
    program = program_for(_config(every=2))
    return program, program.train_step_fn(), outer.sync_fn(program, 0), _batches(program, 4)


def test_h1_sgd_outer_lr1_is_data_parallelism():
    """H=1, outer SGD with lr 1 and no momentum, inner SGD: theta' = mean_i (theta - lr (g_i + wd theta))
    = theta - lr (mean_i g_i + wd theta), and mean_i g_i (island i's mean gradient over its B/M rows)
    is the global batch's mean gradient: the data-parallel step. Equal up to float rounding (the
    islands' means are M x their partial sums, averaged after the update instead of summed before
    it). With AdamW inside, the mean of M Adam updates is not the Adam update of the mean: not DP."""
    c = _config(every=1, lr=1.0, momentum=0.0, nesterov=False)
    c.train.optimizer, c.train.lr, c.train.grad_clip = "sgd", 0.5, 0.0
    dp_config = small_config(MESH)
    dp_config.train.optimizer, dp_config.train.lr, dp_config.train.grad_clip = "sgd", 0.5, 0.0
    dp_config.train.schedule, dp_config.train.warmup_steps = "constant", 0
    program, dp = program_for(c), program_for(dp_config)
    batches = _batches(program, 3)
    step, sync, dp_step = program.train_step_fn(), outer.sync_fn(program, 0), dp.train_step_fn()
    state, dp_state = program.init(), dp.init()
    for b in batches:
        state, _ = step(state, b)
        state = sync(state)
        dp_state, _ = dp_step(dp_state, b)
    for a, b in zip(jax.tree.leaves(_np(state.params)), jax.tree.leaves(_np(dp_state.params))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(dp_state.params["embed"] - dp.init().params["embed"]).max()) > 1e-3  # it moved


def test_islands_train_apart_and_theta_stays(adamw):
    program, step, _, batches = adamw
    state = program.init()
    theta = _np(state.params)
    state, metrics = step(state, batches[0])
    local = _np(state.opt_state.local)["layers"]["wq"]  # [M, ...]: each island's own
    assert local.shape[0] == M and not np.allclose(local[0], local[1])
    np.testing.assert_array_equal(_np(state.params)["layers"]["wq"], theta["layers"]["wq"])
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0


def _outer_reference(theta, local, momentum, lr, mu, nesterov=True):
    """NumPy: Delta = theta - mean_i theta_i; m = mu m + Delta; u = Delta + mu m; theta - lr u."""
    delta = theta - local.mean(axis=0)
    m = mu * momentum + delta
    u = delta + mu * m if nesterov else m
    return theta - lr * u, m, delta


def test_outer_update_against_numpy(adamw):
    """Two rounds of H=2 AdamW inner steps on 4 islands, each ended by the Nesterov outer step; the
    second round starts with the first's momentum."""
    program, step, sync, batches = adamw
    state = program.init()
    momentum = jax.tree.map(np.zeros_like, _np(state.params))
    for r in range(2):
        for b in batches[2 * r : 2 * r + 2]:
            state, _ = step(state, b)
        theta, local = _np(state.params), _np(state.opt_state.local)
        expect = jax.tree.map(lambda t, x, m: _outer_reference(t, x, m, 0.7, 0.9), theta, local, momentum)
        state = sync(state)
        got_theta, got_m = _np(state.params), _np(state.opt_state.momentum)
        for path, (t_ref, m_ref, _) in jax.tree_util.tree_flatten_with_path(
            expect, is_leaf=lambda x: isinstance(x, tuple)
        )[0]:
            get = lambda tree: tree
            for key in path:
                get = (lambda g, k: lambda tree: g(tree)[k.key])(get, key)
            np.testing.assert_allclose(get(got_theta), t_ref, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(get(got_m), m_ref, rtol=1e-5, atol=1e-7)
            islands = get(_np(state.opt_state.local))
            np.testing.assert_array_equal(islands, np.broadcast_to(get(got_theta), islands.shape))
        momentum = got_m
    assert float(np.abs(got_m["embed"]).max()) > 0


CLIP = 0.05  # the outer momentum's norm bound in the CO2 test: it binds in rounds 2 and 3


def _co2_reference(theta, local, mom, delayed, last, lr, mu, clip):
    """NumPy: CO2 with the staleness gap penalty and momentum clipping (docs/diloco.md).
    Delta = theta - mean_i theta_i; D = delayed / (1 + |last| / (lr |delayed|)); m = mu m + D,
    scaled to norm <= clip over all leaves; u = D + mu m; theta' = theta - lr u; delayed' = Delta,
    last' = theta' - theta. Trees of float64."""
    pen = jax.tree.map(lambda d, g: d / (1 + np.abs(g) / (lr * np.abs(d) + 1e-300)), delayed, last)
    m = jax.tree.map(lambda m0, d: mu * m0 + d, mom, pen)
    norm = np.sqrt(sum(float(np.sum(x**2)) for x in jax.tree.leaves(m)))
    m = jax.tree.map(lambda x: x * min(1.0, clip / (norm + 1e-12)), m)
    new = jax.tree.map(lambda t, d, x: t - lr * (d + mu * x), theta, pen, m)
    delta = jax.tree.map(lambda t, x: t - x.mean(0), theta, local)
    return new, m, delta, jax.tree.map(lambda a, b: a - b, new, theta), norm


def test_co2_with_gap_penalty_and_momentum_clipping_against_numpy():
    """CO2 (H=1, outer lr 0.7, Nesterov 0.5) with the staleness gap penalty and outer momentum
    clipping, three rounds against `_co2_reference`. Round 1 applies nothing (no earlier round);
    round 2 applies round 1's average (no gap yet: the penalty is 1); round 3's is penalized."""
    c = _config(method="co2", every=1, lr=0.7, momentum=0.5, co2_penalty=True, momentum_clip=CLIP)
    program = program_for(c)
    step, sync = program.train_step_fn(), outer.sync_fn(program, 0)
    state = program.init()
    theta0 = _np(state.params)
    penalties, norms = [], []
    for b in _batches(program, 3):
        state, _ = step(state, b)
        s = state.opt_state
        before = [_np(x) for x in (state.params, s.local, s.momentum, s.delayed, s.last_step)]
        new, m, delta, last, norm = _co2_reference(*before, 0.7, 0.5, CLIP)
        norms.append(norm)
        penalties.append(
            max(
                float(np.max(np.abs(g) / (0.7 * np.abs(d) + 1e-300))) for d, g in zip(*map(jax.tree.leaves, before[3:]))
            )
        )
        state = sync(state)
        s = state.opt_state
        for got, want in [(state.params, new), (s.momentum, m), (s.delayed, delta), (s.last_step, last)]:
            for a, b in zip(jax.tree.leaves(_np(got)), jax.tree.leaves(want)):
                np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(_np(state.params)), jax.tree.leaves(theta0)):
        assert not np.array_equal(a, b)
    assert penalties[1] == 0 and penalties[2] > 1  # the gap penalty acted in round 3
    assert norms[0] == 0 and min(norms[1:]) > CLIP  # the clipping bound acted in rounds 2 and 3


@pytest.mark.parametrize("bits", [8, 4])
def test_quantizer_within_its_bound(bits):
    """|x - dequantize(quantize(x))| <= scale / 2 = block absmax / (2 (2^(b-1) - 1)) for every value."""
    rng = np.random.default_rng(bits)
    x = (rng.standard_normal(1000) * np.exp(rng.uniform(-6, 2, 1000))).astype(np.float32).reshape(10, 100)
    codes, scales = outer.quantize(jnp.asarray(x), bits)
    assert codes.dtype == (jnp.uint8 if bits == 4 else jnp.int8)
    assert codes.size == -(-x.size // outer.BLOCK) * outer.BLOCK * bits // 8
    back = np.asarray(outer.dequantize(codes, scales, x.shape, bits))
    flat = np.pad(x.reshape(-1), (0, -x.size % outer.BLOCK)).reshape(-1, outer.BLOCK)
    bound = np.abs(flat).max(axis=1) / (2 * (2 ** (bits - 1) - 1))
    err = np.pad(np.abs(back - x).reshape(-1), (0, -x.size % outer.BLOCK)).reshape(-1, outer.BLOCK)
    assert np.all(err <= bound[:, None] * (1 + 1e-6) + 1e-12)
    assert np.abs(back - x).max() > 0  # it did quantize


@pytest.fixture(scope="module")
def int4_ef():
    """8 islands of one device (a device quantizes whole leaves), int4 outer gradients with error
    feedback, outer lr 1 and no momentum: theta' = theta - mean_i Q(Delta_i + e_i)."""
    c = _config(every=1, lr=1.0, momentum=0.0, nesterov=False, quantize="int4", error_feedback=True)
    c.mesh.data, c.mesh.fsdp = 8, 1
    program = program_for(c)
    return program, program.train_step_fn(), outer.sync_fn(program, 0)


def _blocks(x):
    """[islands, ...] -> [islands, blocks, BLOCK], zero-padded as the quantizer pads."""
    flat = x.reshape(x.shape[0], -1)
    return np.pad(flat, ((0, 0), (0, -flat.shape[1] % outer.BLOCK))).reshape(x.shape[0], -1, outer.BLOCK)


def _int4_roundtrip(x):
    """NumPy: symmetric int4 round to nearest, one scale (block absmax / 7) per BLOCK values of
    each island's x [islands, ...], in float32 as the quantizer computes."""
    b = _blocks(x.astype(np.float32))
    absmax = np.abs(b).max(axis=2, keepdims=True)
    scale = np.where(absmax > 0, absmax / np.float32(7), np.float32(1))
    back = np.clip(np.round(b / scale), -7, 7) * scale
    return back.reshape(x.shape[0], -1)[:, : x[0].size].reshape(x.shape)


def test_int4_outer_average_within_the_quantizers_bound(int4_ef):
    """Outer lr 1, no momentum, first round (no residual yet): theta' = theta - mean_i Q(Delta_i);
    each Q(Delta_i) is within its blocks' bound of Delta_i, so theta' is within the mean of the
    islands' bounds of the exact step."""
    program, step, sync = int4_ef
    state = program.init()
    state, _ = step(state, _batches(program, 1)[0])
    theta, local = _np(state.params), _np(state.opt_state.local)
    state = sync(state)
    for t, x, got in zip(*(jax.tree.leaves(a) for a in (theta, local, _np(state.params)))):
        deltas = t[None] - x
        bound = (np.abs(_blocks(deltas)).max(axis=2) / 14).mean(axis=0)  # mean over islands of scale / 2
        exact = t - deltas.mean(0)
        err = _blocks((np.abs(got - exact))[None])[0]
        assert np.all(err <= bound[:, None] * (1 + 1e-5) + 1e-7)


def test_error_feedback_residual_and_accumulated_update(int4_ef):
    """The same outer gradients D_i (fixed, heavy-tailed) sent for R rounds. Every round each
    island's residual is the quantization error of what it sent, D_i + e_i - Q(D_i + e_i)
    (NumPy). The update applied over the rounds telescopes to R mean_i D_i - mean_i e_R with error
    feedback, while without it the same rounding error repeats R times: the accumulated error must
    be several times smaller (fails if the residual is not added back)."""
    program, _, sync = int4_ef
    state = program.init()
    theta0 = _np(state.params)
    rng = np.random.default_rng(0)
    deltas = jax.tree.map(
        lambda t: (rng.standard_normal((8, *t.shape)) * np.exp(rng.uniform(-4, 0, (8, *t.shape))) * 1e-2).astype(
            np.float32
        ),
        theta0,
    )
    rounds = 8
    for _ in range(rounds):
        theta = jax.tree.map(np.asarray, state.params)  # float32, as the sync computes
        residual = jax.tree.map(np.asarray, state.opt_state.residual)
        local = jax.tree.map(lambda t, d: (t[None] - d).astype(np.float32), theta, deltas)
        put = jax.tree.map(lambda x, old: jax.device_put(x, old.sharding), local, state.opt_state.local)
        state = sync(state._replace(opt_state=state.opt_state._replace(local=put)))
        for t, x, e, got in zip(*(jax.tree.leaves(a) for a in (theta, local, residual, state.opt_state.residual))):
            sent = (t[None] - x) + e  # float32: the island's outer gradient plus its residual
            # atol: a few float32 ulps of the largest values (~0.05); one code off would be ~1e-3
            np.testing.assert_allclose(np.asarray(got), sent - _int4_roundtrip(sent), rtol=1e-5, atol=1e-8)
    flat = lambda tree: np.concatenate([x.reshape(-1) for x in jax.tree.leaves(tree)])
    exact = rounds * flat(jax.tree.map(lambda d: d.astype(np.float64).mean(0), deltas))
    applied = flat(theta0) - flat(_np(state.params))
    without = rounds * flat(jax.tree.map(lambda d: _int4_roundtrip(d).astype(np.float64).mean(0), deltas))
    err_ef, err_plain = np.linalg.norm(applied - exact), np.linalg.norm(without - exact)
    assert err_ef < 0.3 * err_plain, (err_ef, err_plain)


def test_streaming_fragments_sync_on_a_staggered_schedule():
    c = _config(every=4, fragments=2)
    assert [outer.fragment_due(c.train, s) for s in range(1, 9)] == [[], [0], [], [1], [], [0], [], [1]]
    c = _config(every=2, fragments=2, lr=1.0, momentum=0.0, nesterov=False)
    c.model.n_layers = 2
    program = program_for(c)
    step, sync0 = program.train_step_fn(), outer.sync_fn(program, 0)
    state = program.init()
    state, _ = step(state, _batches(program, 1)[0])
    theta, local = _np(state.params), _np(state.opt_state.local)
    state = sync0(state)
    got = _np(state.params)
    mean = lambda x: x.mean(0)
    # fragment 0: layer 0 and the leaves outside the stack; layer 1 waits
    np.testing.assert_allclose(got["layers"]["wq"][0::2], mean(local["layers"]["wq"])[0::2], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(got["layers"]["wq"][1::2], theta["layers"]["wq"][1::2])
    np.testing.assert_allclose(got["embed"], mean(local["embed"]), rtol=1e-5, atol=1e-7)
    islands = _np(state.opt_state.local)["layers"]["wq"]
    np.testing.assert_array_equal(islands[:, 1::2], local["layers"]["wq"][:, 1::2])  # still their own


def _streaming_reference(tree, step, t, fragments=2, tau=1, alpha=0.5, lr=0.7, mu=0.9):
    """NumPy: Streaming DiLoCo's syncs after inner step `step` (Nesterov outer step). `tree`: dict of
    theta, local [M, ...], momentum, delayed (float64), taken after the inner step. Fragment p (rows
    p::P of the layer stack; fragment 0 also the other leaves) starts at steps s with
    s % H == (p+1) H/P % H: delayed_p = theta_p - mean_i local_i,p (the deltas as of s); at s + tau
    it finishes: theta_p' = theta_p - lr (avg + mu m'), m' = mu m + avg, and every island merges,
    local_i,p = alpha local_i,p (its values now) + (1 - alpha) theta_p'."""
    out = jax.tree.map(np.copy, tree)
    h = t.outer.every
    due = lambda s: [p for p in range(fragments) if s >= 1 and s % h == ((p + 1) * h // fragments) % h]
    for path, theta in jax.tree_util.tree_leaves_with_path(tree["theta"]):
        stacked = jax.tree_util.keystr(path[:1]) == "['layers']"
        get = lambda name: functools.reduce(lambda x, k: x[k.key], path, out[name])
        th, loc, mom, dly = get("theta"), get("local"), get("momentum"), get("delayed")
        rows = lambda p: slice(p, None, fragments) if stacked else slice(None)
        for p in due(step - tau):  # finish
            if not stacked and p:
                continue
            r = rows(p)
            avg = dly[r].copy()
            mom[r] = mu * mom[r] + avg
            th[r] = th[r] - lr * (avg + mu * mom[r])
            loc[:, r] = alpha * loc[:, r] + (1 - alpha) * th[r][None]
        for p in due(step):  # start
            if not stacked and p:
                continue
            r = rows(p)
            dly[r] = th[r] - loc[:, r].mean(0)
    return out


def test_streaming_overlap_and_merge_against_numpy():
    """Streaming DiLoCo with tau = 1 and alpha = 0.5 (2 fragments, H = 2, AdamW inside, Nesterov
    0.9, lr 0.7), four inner steps: after each, the syncs due (`outer.Syncs`: finishes of the
    fragments started tau steps ago, starts of those due) against `_streaming_reference`. Fragments
    0 and 1 start at odd and even steps, so every step after the first finishes one and starts the
    other; fragment 0 finishes twice (the second time with momentum). Then: `start` and `finish`
    run back to back equal the synchronous program (`phase="all"`, what tau = 0 runs) bitwise."""
    c = _config(every=2, fragments=2, overlap_steps=1, merge=0.5)
    c.model.n_layers = 2  # one a fragment
    program = program_for(c)
    step, state = program.train_step_fn(), program.init()
    syncs = outer.Syncs(program, state)
    names = ("theta", "local", "momentum", "delayed")
    for i, b in enumerate(_batches(program, 4), start=1):
        state, _ = step(state, b)
        s = state.opt_state
        want = _streaming_reference(
            dict(zip(names, map(_np, (state.params, s.local, s.momentum, s.delayed)))), i, c.train
        )
        state = syncs(state, i)
        s = state.opt_state
        got = dict(zip(names, map(_np, (state.params, s.local, s.momentum, s.delayed))))
        for name in names:
            for a, b in zip(jax.tree.leaves(got[name]), jax.tree.leaves(want[name])):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=f"{name} after step {i}")
    local = got["local"]["layers"]["wq"]
    assert not np.allclose(local[0], local[1])  # the islands keep half of their own values
    # with no inner step between them, start then finish is the synchronous sync (tau = 0) bitwise
    copy = lambda st: jax.tree.map(lambda x: x.copy(), st)
    split = syncs.fns[0, "finish"](syncs.fns[0, "start"](copy(state)))
    whole = outer.sync_fn(program, 0)(copy(state))
    kept = lambda st: (st.params, st.opt_state.local, st.opt_state.momentum)  # `delayed`: start's only
    for a, b in zip(jax.tree.leaves(kept(split)), jax.tree.leaves(kept(whole))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_round_bytes_formula_matches_the_compiled_program(quantize):
    """The bytes each island contributes to one outer round (f32 all-reduce operands, or int4 codes
    and f32 scales all-gathered) as the compiled sync's collectives over `data` hold them."""
    c = _config(every=2, quantize=quantize)
    program = program_for(c)
    state = program.abstract_state()
    text = outer.sync_fn(program, 0).lower(state).compile().as_text()
    sizes = {a: c.mesh[a] for a in c.mesh}
    found = [x for x in hlo.parse(text).collectives(sizes) if x.axes == ("data",)]
    kinds = {x.kind for x in found}
    assert kinds == ({"all_reduce"} if quantize == "none" else {"all_gather"})
    got = sum(x.operand_bytes * x.executions for x in found)
    # per device: its shard of every parameter (FSDP splits D over 2 inside the island)
    local_specs = jax.tree.map(
        lambda s, p: s.__class__(
            tuple(n // (2 if "fsdp" in str(ax) else 1) for n, ax in zip(s.shape, tuple(p) + (None,) * 9)), s.axes
        ),
        program.specs,
        program.param_pspecs,
        is_leaf=lambda x: hasattr(x, "axes"),
    )
    expect = outer.round_bytes(local_specs, c.train, M)
    assert got == expect["operand"]  # exact: 246400 B f32, 32844 B int4 (codes + scales) here


def test_config_errors_name_the_problem():
    c = _config()
    c.train.zero_stage = 1
    with pytest.raises(ConfigError, match="zero_stage=0"):
        validate(c)
    c = _config(every=5, fragments=2)
    with pytest.raises(ConfigError, match="multiple of"):
        validate(c)
    c = _config(method="diloko")
    with pytest.raises(ConfigError, match="choose one of"):
        validate(c)
    for keys, message in [
        (dict(every=4, overlap_steps=4), r"overlap_steps=4 must be an integer in \[0, every=4\)"),
        (dict(method="co2", overlap_steps=1), r"overlap_steps=1 is Streaming DiLoCo's overlap"),
        (dict(merge=1.0), r"merge=1.0 must be in \[0, 1\)"),
        (dict(error_feedback=True), r"error_feedback=True .* set config.train.outer.quantize"),
        (dict(co2_penalty=True), r"co2_penalty=True .* set config.train.outer.method='co2'"),
        (dict(momentum_clip=-1.0), r"momentum_clip=-1.0 must be >= 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate(_config(**keys))
    c = small_config(dict(fsdp=8))
    c.train.outer.method = "diloco"
    with pytest.raises(ConfigError, match="mesh.data >= 2"):
        program_for(c)


@pytest.mark.slow
def test_training_loop_syncs_and_a_restart_resumes_every_island(tmp_path):
    """train.main with H=2: the loop runs the outer steps; a restart from the step-2 checkpoint
    (the islands' parameters and AdamW moments saved apart, stacked over `data`) logs the same
    steps 3-4 and the same eval loss of theta, bitwise."""
    import shutil

    from jaxsys import train

    c = _config(every=2)
    c.train.steps, c.train.log_every = 4, 1
    c.checkpoint.every_steps, c.checkpoint.async_save = 2, False
    first = train.main(c, str(tmp_path / "run"))
    assert [r["step"] for r in first] == [1, 2, 3, 4] and first[-1]["loss"] < first[0]["loss"]
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "4")
    again = train.main(c, str(tmp_path / "run"))
    assert [(r["step"], r["loss"]) for r in again] == [(r["step"], r["loss"]) for r in first[2:]]
    assert again[-1]["eval_loss"] == first[-1]["eval_loss"]
