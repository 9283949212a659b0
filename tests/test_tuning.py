"""The kernel tuning cache (kernels/tuning.py) and its sweep (kernels/tune.py): shape-class keys,
lookup hit / miss / user override directory / malformed files, flash attention reading its tiles
and launch parameters from the cache (explicit arguments winning), and the sweep's interpret-mode
smoke run writing a file whose winner is correct. Flash attention runs in interpret mode on tiny
shapes; the CPU's device kind is "cpu", so a cpu.json in a JAXSYS_TUNING_DIR drives it here."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.kernels import tune, tuning
from jaxsys.kernels.flash_attention import flash_attention, kernel, reference_attention

H, T = 16, 64  # the flash shapes of this file: q[1, T, 2, H], fp32, causal
FLASH_KEY = tuning.shape_key(tuning.flash_attention_class(head_dim=H, dtype=jnp.float32, causal=True, seq_len=T))


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    """No override directory unless a test sets one, and no file contents kept between tests."""
    monkeypatch.delenv(tuning.ENV_DIR, raising=False)
    tuning.clear_cache()
    yield
    tuning.clear_cache()


def _write(folder, stem: str, kernels: dict, device_kind: str = "cpu"):
    """A cache file holding `kernels` ({kernel: {shape key: config}})."""
    path = folder / f"{stem}.json"
    entries = {kernel: {key: {"config": c} for key, c in v.items()} for kernel, v in kernels.items()}
    path.write_text(json.dumps(dict(format=tuning.FORMAT_VERSION, device_kind=device_kind, header={}, kernels=entries)))
    return path


def _override(monkeypatch, tmp_path, kernels: dict, stem: str = "cpu"):
    _write(tmp_path, stem, kernels)
    monkeypatch.setenv(tuning.ENV_DIR, str(tmp_path))
    tuning.clear_cache()


def test_device_names_and_shape_classes():
    assert tuning.device_file_name("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert tuning.device_file_name("TPU v5 lite") == "tpu_v5_lite"
    assert tuning.device_file_name("cpu") == "cpu"
    assert [tuning.pow2_bucket(n) for n in (1, 2, 3, 4, 5, 4096, 4097)] == [1, 2, 4, 4, 8, 4096, 8192]
    assert tuning.pow2_bucket(3, 16) == 16
    cls = functools.partial(tuning.flash_attention_class, head_dim=128, causal=True)
    assert cls(dtype=jnp.bfloat16, seq_len=3000) == cls(dtype="bfloat16", seq_len=4096)
    assert cls(dtype=jnp.bfloat16, seq_len=4097) != cls(dtype=jnp.bfloat16, seq_len=4096)
    assert cls(dtype=jnp.float32, seq_len=4096) != cls(dtype=jnp.bfloat16, seq_len=4096)
    assert tuning.shape_key(cls(dtype=jnp.bfloat16, seq_len=4096)) == (
        "head_dim=128,dtype=bfloat16,causal=True,t_bucket=4096"
    )
    q = tuning.quantized_matmul_class
    assert q(kind="w8a16", m=9, k=4096, n=11008) == q(kind="w8a16", m=16, k=4096, n=11008, group_size=128)
    assert dict(q(kind="w4a16", m=1, k=4096, n=4096, group_size=64))["group"] == 64
    assert q(kind="w8a8", m=1, k=4096, n=4096) != q(kind="w8a8", m=2, k=4096, n=4096)
    with pytest.raises(ValueError, match="kind"):
        q(kind="w2a16", m=1, k=8, n=8)


def test_shipped_h200_entry_hit_and_misses():
    """The shipped H200 file holds what the 2026-11-26 sweep measured (H=128, bf16, T=4096)."""
    h200 = functools.partial(tuning.flash_attention_config, head_dim=128, dtype=jnp.bfloat16, device_kind="NVIDIA H200")
    assert h200(causal=False, seq_len=4096) == {"block_q": 128, "block_k": 64}
    assert h200(causal=True, seq_len=2049) == {"block_q": 128, "block_k": 64}  # same T bucket
    assert h200(causal=True, seq_len=16384) == {}  # not measured: the kernel's defaults apply
    assert (
        tuning.flash_attention_config(
            head_dim=64, dtype=jnp.bfloat16, causal=True, seq_len=4096, device_kind="NVIDIA H200"
        )
        == {}
    )
    assert h200(causal=True, seq_len=4096, device_kind="Some Other GPU") == {}
    assert tuning.quantized_matmul_config(kind="w8a16", m=1, k=4096, n=4096, device_kind="NVIDIA H200") == {}


def test_override_dir_wins_and_files_are_read_once(tmp_path, monkeypatch):
    h200_key = "head_dim=128,dtype=bfloat16,causal=True,t_bucket=4096"
    qkey = tuning.shape_key(tuning.quantized_matmul_class(kind="w4a16", m=1, k=4096, n=4096, group_size=128))
    path = _write(
        tmp_path,
        "nvidia_h200",
        {"flash_attention": {h200_key: {"block_q": 64, "block_k": 32}}, "quantized_matmul": {qkey: {"block_n": 32}}},
        device_kind="NVIDIA H200",
    )
    monkeypatch.setenv(tuning.ENV_DIR, str(tmp_path))
    h200 = functools.partial(tuning.flash_attention_config, head_dim=128, dtype=jnp.bfloat16, device_kind="NVIDIA H200")
    assert h200(causal=True, seq_len=4096) == {"block_q": 64, "block_k": 32}  # the user's entry
    assert h200(causal=False, seq_len=4096) == {"block_q": 128, "block_k": 64}  # the shipped one still
    qcfg = functools.partial(tuning.quantized_matmul_config, k=4096, n=4096, device_kind="NVIDIA H200")
    assert qcfg(kind="w4a16", m=1, group_size=128) == {"block_n": 32}
    assert qcfg(kind="w4a16", m=1, group_size=64) == {}  # another group size: a miss
    # read once: a change on disk is seen only after clear_cache()
    path.write_text(path.read_text().replace('"block_q": 64', '"block_q": 32'))
    assert h200(causal=True, seq_len=4096)["block_q"] == 64
    tuning.clear_cache()
    assert h200(causal=True, seq_len=4096)["block_q"] == 32
    # lookups return copies: changing one does not change the cache
    h200(causal=True, seq_len=4096)["block_q"] = 999
    assert h200(causal=True, seq_len=4096)["block_q"] == 32


def test_malformed_files_and_entries_are_misses(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.ENV_DIR, str(tmp_path))
    (tmp_path / "cpu.json").write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the tuning cache"):
        assert tuning.flash_attention_config(head_dim=H, dtype=jnp.float32, causal=True, seq_len=T) == {}
    other = tuning.shape_key(tuning.flash_attention_class(head_dim=32, dtype=jnp.float32, causal=True, seq_len=T))
    _override(monkeypatch, tmp_path, {"flash_attention": {FLASH_KEY: {"block_q": 24}, other: {"block_q": 32}}})
    with pytest.warns(UserWarning, match="power of two"):
        assert tuning.flash_attention_config(head_dim=H, dtype=jnp.float32, causal=True, seq_len=T) == {}
    assert tuning.flash_attention_config(head_dim=32, dtype=jnp.float32, causal=True, seq_len=T) == {"block_q": 32}
    for bad in ({"block_q": 8}, {"blockq": 16}, {"num_stages": 0}, {"num_warps": True}, {}):
        with pytest.raises(ValueError):
            tuning.validate_config("flash_attention", bad)


def _grids(fn, *args) -> dict:
    """{pallas_call name: set of grids} in the jaxpr of fn(*args), nested jaxprs included."""
    found: dict = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.setdefault(eqn.params["name"], set()).add(tuple(eqn.params["grid_mapping"].grid))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else [value]:
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(sub, "jaxpr"):
                        walk(sub.jaxpr if hasattr(sub.jaxpr, "eqns") else sub.jaxpr.jaxpr)

    # a new function each time: a traced function keeps the configuration it was traced with
    walk(jax.make_jaxpr(lambda *a: fn(*a))(*args).jaxpr)
    return found


def _qkv(seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((1, T, 2, H)), jnp.float32) for _ in range(3))


def _loss(q, k, v, **blocks):
    return jnp.sum(flash_attention(q, k, v, causal=True, interpret=True, **blocks) ** 2)


def test_flash_attention_reads_its_tiles_from_the_cache(tmp_path, monkeypatch):
    q, k, v = _qkv()
    grad = jax.grad(_loss, argnums=(0, 1, 2))
    names = ("flash_attention_fwd", "flash_attention_bwd_dq", "flash_attention_bwd_dkdv")
    default = _grids(grad, q, k, v)
    # no entry: the built-in 128 tiles, shrunk to T = 64 -> one block along the sequence
    assert [default[n] for n in names] == [{(1, 1, 2)}] * 3
    cached = dict(block_q=16, block_k=32, block_q_bwd=32, block_k_bwd=16, num_warps=2, num_stages=3)
    _override(monkeypatch, tmp_path, {"flash_attention": {FLASH_KEY: cached}})
    grids = _grids(grad, q, k, v)
    # forward grid over q blocks (T / block_q), dq over T / block_q_bwd, dk/dv over S / block_k_bwd
    assert [grids[n] for n in names] == [{(4, 1, 2)}, {(2, 1, 2)}, {(4, 1, 2)}]
    plan, _, _ = kernel._prepare(
        q, k, v, None, None, causal=True, softmax_scale=None, block_q=None, block_k=None,
        block_q_bwd=None, block_k_bwd=None, interpret=True, backend=None,
    )  # fmt: skip
    ((_, _, cfg),) = plan.branches
    assert (cfg.block_q, cfg.block_k, cfg.bwd_block_q, cfg.bwd_block_k) == (16, 32, 32, 16)
    assert (cfg.num_warps, cfg.num_stages) == (2, 3)
    # explicit tiles win; the backward then follows the explicit forward tiles, not the cache's
    explicit = _grids(jax.grad(functools.partial(_loss, block_q=32, block_k=64), argnums=(0, 1, 2)), q, k, v)
    assert [explicit[n] for n in names] == [{(2, 1, 2)}, {(2, 1, 2)}, {(1, 1, 2)}]
    # ... and an explicit backward tile wins over the cached one
    bwd = _grids(jax.grad(functools.partial(_loss, block_k_bwd=64), argnums=(0, 1, 2)), q, k, v)
    assert [bwd[n] for n in names] == [{(4, 1, 2)}, {(2, 1, 2)}, {(1, 1, 2)}]
    # the cached config gives the reference's numbers
    want = jax.grad(lambda q, k, v: jnp.sum(reference_attention(q, k, v, causal=True) ** 2), argnums=(0, 1, 2))
    for got, ref in zip(jax.jit(grad)(q, k, v), want(q, k, v)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_launch_parameters_come_from_the_config(monkeypatch):
    """On a GPU the Triton num_warps / num_stages are the cached ones, else the head-dim defaults."""
    pl_triton = pytest.importorskip("jax.experimental.pallas.triton")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    got = kernel._compiler_params(128, False, 2, 3)
    assert isinstance(got, pl_triton.CompilerParams) and (got.num_warps, got.num_stages) == (2, 3)
    got = kernel._compiler_params(128, False)
    assert (got.num_warps, got.num_stages) == (8, 2)
    assert (kernel._compiler_params(64, False).num_warps, kernel._compiler_params(256, False).num_stages) == (4, 1)
    assert kernel._compiler_params(128, True, 2, 3) is None  # interpret mode: no Triton


def test_sweep_drops_wrong_and_failing_candidates():
    calls = []

    def build(config, metric):
        calls.append(config)
        if config["block_q"] == 64:
            raise RuntimeError("does not compile")
        value = jnp.float32(config["block_q"])
        return jax.jit(lambda x: x * 0 + value), (jnp.float32(1.0),)

    problem = tune.Problem(
        kernel="flash_attention",
        shape_class=(),
        shape={},
        stages=[("fwd", [{"block_q": 16}, {"block_q": 32}, {"block_q": 64}])],
        build=build,
        error=lambda out, metric: 0.0 if float(out) == 32 else 1.0,  # 16 is "wrong"
        tolerance=0.01,
    )
    args = tune.parse_args(["--kernel", "flash_attention"])
    args.repeats, args.min_time = 1, 0.0
    entry = tune.sweep(problem, args, log=lambda *a: None)
    assert entry["config"] == {"block_q": 32} and (entry["candidates"], entry["dropped"]) == (3, 2)
    problem.error = lambda out, metric: 1.0
    assert tune.sweep(problem, args, log=lambda *a: None) is None


def test_sweep_refuses_without_a_gpu(capsys):
    assert tune.main(["--kernel", "flash_attention"]) == 2
    assert "--interpret --smoke" in capsys.readouterr().err
    assert tune.main(["--kernel", "quantized_matmul", "--interpret"]) == 2
    assert tune.main(["--kernel", "flash_attention", "--interpret", "--smoke"]) == 2  # no --out


def test_sweep_smoke_writes_a_valid_file_whose_winner_is_correct(tmp_path, monkeypatch):
    out = tmp_path / "cpu.json"
    keep = "head_dim=99,dtype=float32,causal=False,t_bucket=16"  # an entry the merge must keep
    _write(tmp_path, "cpu", {"flash_attention": {keep: {"block_q": 16}}})
    seen = []  # the configurations flash attention was traced with during the sweep
    real_lookup = tuning.lookup
    monkeypatch.setattr(tuning, "lookup", lambda *a, **kw: seen.append(real_lookup(*a, **kw)) or seen[-1])
    assert tune.main(["--kernel", "flash_attention", "--interpret", "--smoke", "--out", str(out)]) == 0
    monkeypatch.setattr(tuning, "lookup", real_lookup)
    assert {"block_q": 16, "block_k": 16} in seen and {"block_q": 32, "block_k": 16} in seen
    data = tuning.read_file(str(out))
    assert data["device_kind"] == tuning.current_device_kind() == "cpu"
    assert {"jax", "date", "command"} <= set(data["header"]) and "--smoke" in data["header"]["command"]
    entries = data["kernels"]["flash_attention"]
    smoke_cls = tuning.flash_attention_class(head_dim=16, dtype=jnp.float32, causal=True, seq_len=32)
    entry = entries[tuning.shape_key(smoke_cls)]
    assert keep in entries
    assert entry["candidates"] == 2 and entry["dropped"] == 0 and entry["time_ms"] > 0
    winner = tuning.validate_config("flash_attention", entry["config"])
    assert winner in ({"block_q": 16, "block_k": 16}, {"block_q": 32, "block_k": 16})
    # the file as an override directory: flash attention runs the winner and matches the reference
    monkeypatch.setenv(tuning.ENV_DIR, str(tmp_path))
    tuning.clear_cache()
    assert tuning.lookup("flash_attention", smoke_cls) == winner
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 32, 2, 16)), jnp.float32) for _ in range(3))
    fwd = lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=True)
    assert _grids(fwd, q, k, v)["flash_attention_fwd"] == {(32 // winner["block_q"], 1, 2)}
    np.testing.assert_allclose(
        np.asarray(fwd(q, k, v)), np.asarray(reference_attention(q, k, v, causal=True)), rtol=1e-5, atol=1e-5
    )
    # a file of another device kind is not merged into
    (tmp_path / "other.json").write_text(out.read_text().replace('"device_kind": "cpu"', '"device_kind": "X"'))
    with pytest.raises(ValueError, match="not this"):
        tune.merge(str(tmp_path / "other.json"), "cpu", "flash_attention", {}, {})
    before = (tmp_path / "other.json").read_text()
    assert (
        tune.main(["--kernel", "flash_attention", "--interpret", "--smoke", "--out", str(tmp_path / "other.json")]) == 2
    )
    assert (tmp_path / "other.json").read_text() == before


def test_sweep_candidates_are_valid_and_include_the_defaults():
    for h in (64, 128, 256):
        stages = tune.flash_stages(h)
        assert [metric for metric, _ in stages] == ["fwd", "fwd_bwd", "fwd_bwd"]
        for _, candidates in stages:
            for c in candidates:
                tuning.validate_config("flash_attention", c)
                assert h <= 64 or c.get("block_k", 0) <= kernel.GPU_MAX_BLOCK_K_WIDE_HEADS
        default_tiles = {"block_q": 128, "block_k": 128 if h <= 64 else 64}
        assert default_tiles in stages[0][1]
        warps, num_stages = kernel._default_launch(h)
        assert {"num_warps": warps, "num_stages": num_stages} in stages[2][1]
    for kind in tuning.QUANTIZED_KINDS:
        for m in (1, 16, 128):
            tiles, launch = tune.quant_stages(kind, m)
            for c in tiles[1] + launch[1]:
                tuning.validate_config("quantized_matmul", c)
            assert all(c["block_m"] <= max(16, m) for c in tiles[1])
            assert all(("block_k" in c) == (kind not in ("w4a16", "w4ax")) for c in tiles[1])
            assert {"num_warps": 4, "num_stages": 3} in launch[1]  # Triton's defaults


def test_candidate_checks_catch_wrong_outputs():
    """The forward-only check of flash attention (output and lse) and the quantized matmul's check
    pass the kernel's own output and fail a perturbed one."""
    args = tune.parse_args(["--kernel", "flash_attention", "--interpret", "--smoke"])
    problem = tune.flash_problem(32, 16, True, args, dtype=jnp.float32, smoke=True)
    with tuning.use_config("flash_attention", {"block_q": 16, "block_k": 16}):
        fn, inputs = problem.build({}, "fwd")
        o, lse = fn(*inputs)
    assert problem.error((o, lse), "fwd") < 1e-5
    assert problem.error((o.at[0, 5, 0, 0].add(0.1), lse), "fwd") > problem.tolerance
    assert problem.error((o, lse.at[0, 0, 7].add(0.1)), "fwd") > problem.tolerance
    args = tune.parse_args(["--kernel", "quantized_matmul", "--interpret", "--smoke"])
    args.group_size = 32
    problem = tune.quant_problem("w8a16", 4, 64, 64, args, smoke=True)
    fn, inputs = problem.build({"block_m": 16, "block_n": 32, "block_k": 32}, "call")
    out = fn(*inputs)
    assert problem.error(out, "call") <= problem.tolerance
    assert problem.error([out[0] * 1.1], "call") > problem.tolerance


def test_quantized_matmul_reads_its_tiles_from_the_cache(tmp_path, monkeypatch):
    from jaxsys.kernels.quantized_matmul import kernel as qk
    from jaxsys.kernels.quantized_matmul import reference as qr

    m, k, n = 4, 256, 64
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
    q = jax.random.randint(jax.random.key(1), (k, n), -127, 128, jnp.int32).astype(jnp.int8)
    s = jax.random.uniform(jax.random.key(2), (n,), jnp.float32, 0.01, 0.02)

    def grid(**kw):
        found = _grids(lambda x: qk.matmul_w8a16(x, q, s, interpret=True, **kw), x)
        return set().union(*found.values())

    assert grid() == {(1, 1)}  # no entry: 16 x 128 tiles (N = 64 fits one)
    key = tuning.shape_key(tuning.quantized_matmul_class(kind="w8a16", m=m, k=k, n=n))
    _override(monkeypatch, tmp_path, {"quantized_matmul": {key: dict(block_n=16, block_k=64)}})
    assert grid() == {(1, 4)}  # N / 16 column tiles
    assert grid(block_n=32) == {(1, 2)}  # an explicit tile wins
    other = tuning.shape_key(tuning.quantized_matmul_class(kind="w8a16", m=64, k=k, n=n))
    assert other != key  # another M bucket is another class: M = 4 was not looked up under it
    got = qk.matmul_w8a16(x, q, s, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(qr.matmul_w8a16(x, q, s)), rtol=1e-5, atol=1e-5)


def test_the_hopper_kernels_backward_variant_comes_from_the_cache(tmp_path, monkeypatch):
    """kernel "flash_attention_mgpu": {"backward": "fused" | "split"} per shape class, read by
    kernel_mgpu.make_config (the cache's choice, else fused); backward_variant forces one."""
    from jaxsys.kernels.flash_attention import kernel_mgpu

    assert tuning.validate_config("flash_attention_mgpu", {"backward": "split"}) == {"backward": "split"}
    for bad in ({"backward": "both"}, {"backward": 1}, {"stages": 2}):
        with pytest.raises(ValueError, match="backward|unknown key"):
            tuning.validate_config("flash_attention_mgpu", bad)
    config = lambda t: kernel_mgpu.make_config(128, t, jnp.bfloat16, scale=0.1, causal=True)
    assert config(4096).fused_dq  # no entry: fused
    cls = tuning.flash_attention_class(head_dim=128, dtype=jnp.bfloat16, causal=True, seq_len=4096)
    _override(monkeypatch, tmp_path, {"flash_attention_mgpu": {tuning.shape_key(cls): {"backward": "split"}}})
    assert not config(4096).fused_dq and config(2048).fused_dq  # the entry's shape class only
    with kernel_mgpu.backward_variant("fused"):
        assert config(4096).fused_dq


def test_sweep_smoke_chooses_the_hopper_kernels_backward(tmp_path):
    """The interpreted smoke sweep times both variants, checks them against the reference and
    stores the faster one."""
    out = tmp_path / "cpu.json"
    assert tune.main(["--kernel", "flash_attention_mgpu", "--interpret", "--smoke", "--out", str(out)]) == 0
    (entry,) = tuning.read_file(str(out))["kernels"]["flash_attention_mgpu"].values()
    assert entry["candidates"] == 2 and entry["dropped"] == 0
    assert entry["config"]["backward"] in tuning.MGPU_BACKWARDS and entry["shape"]["H"] == 64
