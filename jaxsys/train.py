"""Training: the loop around the program of jaxsys/program.py (state, step, checkpoints, metrics).

    python -m jaxsys.train --config configs/tiny.py --workdir /tmp/tiny [--config.key=value ...]

or, from a notebook, `jaxsys.train.main(config, workdir)`.

The step runs inside `jax.shard_map` over every mesh axis. Per shard: forward and backward of the
model (whose collectives are the Megatron and FSDP ones of `jaxsys.parallel`), the data-parallel
gradient reduction and ZeRO update of `jaxsys.parallel.zero`, clipping by the global norm. The
program therefore contains exactly the collectives jaxsys wrote.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsys import checkpoint as checkpoint_lib
from jaxsys import compile_cache
from jaxsys import data as data_lib
from jaxsys import goodput as goodput_lib
from jaxsys import tokenizer as tokenizer_lib
from jaxsys.analysis import flops as flops_lib
from jaxsys.analysis import hardware, report
from jaxsys.checkpoint import Checkpointer
from jaxsys.checkpoint import snapshot as snapshot_lib
from jaxsys.config import ConfigError, adaptive_buckets, load_config, parse_with_overrides, profile_range, validate
from jaxsys.data import loader as loader_lib
from jaxsys.data.loader import Loader
from jaxsys.mesh import cpu_unless_accelerator, make_mesh, maybe_initialize_distributed
from jaxsys.models import adapters
from jaxsys.models import params as params_lib
from jaxsys.optim import outer as outer_lib
from jaxsys.parallel import context, expert_placement

# the program lives in jaxsys/program.py; these names stay importable from here
from jaxsys.program import Placement, Program, TrainState, build  # noqa: F401

# ----------------------------------------------------------------------------- the loop


class MetricsWriter:
    """metrics.jsonl plus TensorBoard events, written by process 0 only."""

    def __init__(self, workdir: str, enabled: bool):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.tb = None
        if enabled:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(os.path.join(workdir, "tb"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self.tb.add_scalar(key, value, record["step"])
        self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def adaptive_chunks(config):
    """The seq axis's chunk table when config.data.adaptive_cp lays rows out for it
    (data/bytescale.py), else None."""
    if not config.data.adaptive_cp:
        return None
    return context.chunk_table(int(config.mesh.seq), bool(config.model.context_load_balance))


def adaptive_batch(config) -> tuple[int, int] | None:
    """(B, D): the global batch's rows and its data shards, when config.data.adaptive_cp_buckets
    plans the train split in whole batches (data/bytescale.py `plan_batches`), else None."""
    if not (config.data.adaptive_cp and adaptive_buckets(config.data)):
        return None
    mesh = config.mesh
    return int(config.train.batch_size), int(mesh.data * mesh.fsdp * mesh.expert)


def _bucket_steps(config, mesh, compiled, state, step_args) -> list:
    """One compiled step per layout bucket (config.data.adaptive_cp_buckets), in their order; the
    bucket of adaptive_cp_local reuses `compiled`. The programs differ only in where attention
    splits each device's tokens (parallel/context.py), so they share the state and the batch."""
    shares = adaptive_buckets(config.data)
    steps = []
    for f in shares:
        if f == float(config.data.adaptive_cp_local):
            steps.append(compiled)
            continue
        other = config.copy_and_resolve_references()
        other.data.adaptive_cp_local = f
        p = build(other, mesh)
        steps.append(p.train_step_fn().lower(state, p.abstract_batch(), *step_args).compile())
    return steps


def _array(x) -> np.ndarray:
    """A replicated (P()) output of the step, on the host."""
    return np.asarray(x.addressable_data(0))


def _scalar(x) -> float:
    return float(_array(x))


def _check_finite(value: float, step: int, config, what: str = "loss") -> None:
    if not math.isfinite(value):
        raise FloatingPointError(
            f"{what} is {value} at step {step}: training stopped. Lower config.train.lr "
            f"(now {config.train.lr}), keep config.train.grad_clip > 0, or use float32 "
            "(config.model.compute_dtype) to find the cause."
        )


class ThroughputWindow:
    """The wall time of the steps logged together (tokens/s and MFU), such that it holds their
    compute. The loop reads step n's metrics while step n+1 runs: when a window closes at step n,
    step n+1 may already be computing (or, when the host was late, even be done). So a window opens
    at the later of two times that are both no later than the start of its first step's compute:
    that step's dispatch, and the moment the previous step was seen to finish (only when the loop
    waited for it; if its result was ready before it was asked for, that step ended at an unknown
    earlier time and the dispatch is the bound). The window closes when its last step is seen to
    finish. Pauses (evaluation, checkpoint saves, expert re-placement) inside an open window are
    not training time and are subtracted; a pause while no step is in flight (after a forced read)
    precedes the next window, which opens at its first dispatch."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.start: float | None = None  # None: opens at the next dispatch
        self.steps = 0
        self.paused = 0.0
        self.last_dispatched = (0, 0.0)  # (step, time)
        self.end = 0.0  # when the last step read was seen to finish
        self.seen = (0, False)  # (that step, whether the read waited for it)

    def dispatched(self, step: int) -> None:
        """Step `step` is about to be dispatched (its inputs ready)."""
        self.last_dispatched = (step, self.clock())
        if self.start is None:
            self.start = self.last_dispatched[1]

    def done(self, step: int, waited: bool) -> None:
        """Step `step`'s metrics are on the host; `waited`: the read blocked (the step was still
        running when asked for), so it finished just now."""
        self.end = self.clock()
        self.steps += 1
        self.seen = (step, waited)

    def pause(self, seconds: float) -> None:
        if self.start is not None:
            self.paused += seconds

    def close(self) -> tuple[int, float]:
        """(steps, seconds) of the window ending at the last step read; opens the next."""
        steps, elapsed = self.steps, self.end - self.start - self.paused
        step, waited = self.seen
        next_step, dispatched_at = self.last_dispatched
        if next_step > step:  # the next step is in flight: its compute began at or after both bounds
            self.start = max(dispatched_at, self.end) if waited else dispatched_at
        else:  # nothing in flight: the next window opens at the next dispatch
            self.start = None
        self.steps, self.paused = 0, 0.0
        return steps, elapsed


def evaluate(program: Program, eval_fn, params, corpus, reference=None) -> float:
    """The mean held-out loss over `train.eval_batches` batches: of their per-batch means for a
    token stream (every batch has B T tokens), of their weighted tokens for a corpus of documents
    (each batch's mean weighted by its weight sum), of the pairs for DPO. `reference`: the
    reference model's parameters (`Program.needs_reference`)."""
    return evaluate_terms(program, eval_fn, params, corpus, reference)["loss"]


def evaluate_terms(program: Program, eval_fn, params, corpus, reference=None) -> dict:
    """`evaluate` of every term `eval_fn` returns (a scalar: {"loss"}; `Program.eval_metrics_fn`'s
    dict: each of its terms), averaged over the batches alike."""
    c = program.config
    batches = [
        data_lib.global_batch(corpus, program.batch_sharding, c.seed, i, c.train.batch_size, c.data.seq_len, "eval")
        for i in range(c.train.eval_batches)
    ]
    extra = (reference,) if reference is not None else ()
    outs = [eval_fn(params, b, *extra) for b in batches]
    terms = [{k: _scalar(v) for k, v in (o.items() if isinstance(o, dict) else {"loss": o}.items())} for o in outs]
    keys = list(terms[0])
    if not isinstance(batches[0], data_lib.Batch) or c.train.objective == "dpo":  # B T tokens; B/2 pairs
        return {k: float(np.mean([t[k] for t in terms])) for k in keys}
    weight_sum = jax.jit(lambda w: jnp.sum(w), out_shardings=NamedSharding(program.mesh, P()))
    weights = [_scalar(weight_sum(b.weights)) for b in batches]
    return {k: float(np.dot([t[k] for t in terms], weights) / max(sum(weights), 1.0)) for k in keys}


def evaluate_workdir(workdir: str, overrides=(), step: int | None = None, text: str | None = None) -> dict:
    """Held-out loss and perplexity of `workdir`'s checkpoint at `step` (default: latest), on the
    mesh its saved config (with `--config.k=v` overrides) names: `evaluate` over
    `train.eval_batches` batches of the corpus's held-out split, the corpus read as the model reads
    it (`tokenizer.corpus_for`: a text corpus through the workdir's tokenizer), or of the text file
    `text` through that tokenizer. Returns {"eval_loss", "perplexity", "tokens", "step", "quant",
    "param_bytes", "mesh", ...}."""
    config, step = checkpoint_lib.saved_config(workdir, overrides, step)
    if config.train.objective == "dpo" and text is None:
        raise ConfigError(
            f"{workdir} was trained with config.train.objective='dpo' on preference pairs: its held-out DPO loss, "
            "reward margin and accuracy are in its metrics.jsonl (eval_loss, eval_dpo_*); evaluate its language "
            "model on a text file with --text FILE"
        )
    if config.train.objective == "dpo":  # --text: the language model's loss on the file
        overrides = (*overrides, "--config.train.objective=lm", "--config.data.format=text")
        config, step = checkpoint_lib.saved_config(workdir, overrides, step)
    if text is not None:
        tok = tokenizer_lib.for_config(config, workdir)
        corpus = tokenizer_lib.text_corpus(tok, text, config.data.seq_len, workdir)
    else:
        corpus = (
            loader_lib.load_corpus(config.data)
            if data_lib.is_documents(config.data)
            else tokenizer_lib.corpus_for(config, workdir, splits=("eval",))
        )
    if corpus.vocab_needed > config.model.vocab_size:
        raise data_lib.DataError(
            f"the corpus ({corpus.description}) has token ids up to {corpus.vocab_needed - 1}, outside the "
            f"model's vocabulary of {config.model.vocab_size}"
        )
    if not corpus.has_eval:
        raise data_lib.DataError(
            f"the corpus of {workdir} ({corpus.description}) has no held-out split: set --config.data.eval_fraction > 0"
        )
    program, params, c = checkpoint_lib.load(workdir, overrides, step)
    start = time.perf_counter()
    loss = evaluate(program, program.eval_loss_fn(), params, corpus)
    return {
        "workdir": workdir,
        "step": int(step),
        "eval_loss": loss,
        "perplexity": math.exp(loss),
        "tokens": c.train.eval_batches * c.train.batch_size * c.data.seq_len,
        "corpus": corpus.description,
        "quant": c.model.quant,
        "quant_group_size": c.model.quant_group_size,
        "quant_zero_point": c.model.quant_zero_point,
        "quant_rotate": c.model.quant_rotate,
        "quant_impl": c.model.quant_impl,
        "param_bytes": sum(a.nbytes for a in jax.tree.leaves(params)),
        "mesh": {a: s for a, s in program.layout.mesh_sizes.items() if s > 1},
        "seconds": time.perf_counter() - start,
    }


def main(config, workdir: str) -> list[dict]:
    """Train `config`, writing metrics.jsonl, TensorBoard events and config.json to `workdir`.
    Returns the logged records."""
    gp = goodput_lib.Goodput()  # wall time since launch, by kind (docs/goodput.md)
    cpu_unless_accelerator()
    maybe_initialize_distributed(config.distributed)
    compile_cache.use(config.compile_cache)
    if config.rl.task != "none":  # RL post-training (GRPO): its own loop over a trainer and an engine
        from jaxsys.rl import loop as rl_loop

        return rl_loop.main(config, workdir)
    validate(config)
    if config.model.quant != "none" and not adapters.enabled(config):
        raise ConfigError(
            f"config.model.quant={config.model.quant!r} describes a quantized checkpoint, which is for "
            "inference: evaluate it with `python -m jaxsys.evaluate --workdir W`; to train with int8 "
            "matmuls use config.model.quant_train='int8' with quant='none'; to train adapters over the "
            "frozen quantized weights (QLoRA) set config.lora.rank > 0 (docs/finetune.md)"
        )
    if config.model.quant != "none" and not config.checkpoint.init_from:
        raise ConfigError(
            f"config.model.quant={config.model.quant!r} with config.lora.rank={config.lora.rank} (QLoRA) trains "
            "adapters over a quantized base, which a fresh initialisation does not give: quantize a trained or "
            "converted model (`python -m jaxsys.quantize --workdir BASE --out BASE_Q --format "
            f"{config.model.quant}`) and pass config.checkpoint.init_from=BASE_Q (docs/finetune.md)"
        )
    corpus = loader_lib.load_corpus(config.data, chunks=adaptive_chunks(config), batch=adaptive_batch(config))
    if corpus.vocab_needed > config.model.vocab_size:
        raise ConfigError(
            f"the corpus has token ids up to {corpus.vocab_needed - 1} but "
            f"config.model.vocab_size={config.model.vocab_size}: raise the vocab size"
        )
    if data_lib.is_documents(config.data) and jax.process_index() == 0:
        _record_tokenizer(config, workdir)
    sn = config.train.snapshot
    watchdog = None
    if sn.every and sn.peer_timeout_s and jax.process_count() > 1:  # survivors of a lost peer exit, not hang
        watchdog = snapshot_lib.Watchdog(sn.peer_timeout_s)
        watchdog.start()
    try:
        if sn.every and sn.elastic and _resumable(config, workdir):
            _elastic_layout(config)
        mesh = make_mesh(config)
        checkpointer = Checkpointer(workdir, config.checkpoint) if config.checkpoint.enabled else None
        try:
            records = _train(config, workdir, corpus, mesh, checkpointer, gp)
        finally:  # on every exit path, so that an error ends with the error alone (no Orbax teardown noise)
            if checkpointer:
                checkpointer.close()
    except BaseException as e:
        if watchdog is None:
            raise
        if _runtime_failure(e):  # a dead peer often surfaces first as a collective's error (gloo:
            # "Connection reset by peer"): let the watchdog name it and exit
            watchdog.join(timeout=sn.peer_timeout_s + 3 * watchdog.interval)
        _exit_now(e)
    if watchdog is not None:
        watchdog.finish()
    return records


_XLA_STATUS = ("UNKNOWN:", "INTERNAL:", "UNAVAILABLE:", "ABORTED:", "DEADLINE_EXCEEDED:", "CANCELLED:")


def _runtime_failure(e: BaseException) -> bool:
    """An error of the running device program (a collective whose peer is gone): JAX raises it as
    JaxRuntimeError, or, reading a result back (`np.asarray` of the snapshot's ring), as a
    ValueError carrying XLA's status ("UNKNOWN: Gloo collective permute failed: ... Connection
    reset by peer", seen in experiments/fault_tolerance)."""
    if isinstance(e, jax.errors.JaxRuntimeError):
        return True
    return isinstance(e, ValueError) and str(e).startswith(_XLA_STATUS)


def _exit_now(e: BaseException) -> None:
    """End a process of a watched multi-process job on its own error at once, as `cli` would (exit 2
    for the errors it names, else the traceback and 1), without waiting in jax.distributed's
    shutdown barrier for peers that are blocked in a collective with it: their watchdogs see it gone
    within peer_timeout_s and exit too (docs/fault_tolerance.md)."""
    import traceback

    if isinstance(e, CLI_ERRORS):
        print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    traceback.print_exception(e)
    sys.stderr.flush()
    os._exit(1)


def _resumable(config, workdir: str) -> bool:
    """A complete snapshot or checkpoint step exists for `workdir`."""
    if snapshot_lib.complete_steps(snapshot_lib.root(config.train.snapshot, workdir)):
        return True
    ckpt = checkpoint_lib.directory(workdir)
    return os.path.isdir(ckpt) and any(n.isdigit() for n in os.listdir(ckpt))


def _elastic_layout(config) -> None:
    """A restart on a device count the configured mesh does not fit (fewer processes or devices
    after a failure): apply the planner's best layout for the devices there are (ranked by its cost
    model, none compiled), in place, and say so."""
    from jaxsys.analysis import hardware, planner
    from jaxsys.config import MESH_AXES, apply_overrides

    n = jax.device_count()
    if math.prod(config.mesh[a] for a in MESH_AXES) in (n, -1) or any(config.mesh[a] == -1 for a in MESH_AXES):
        return
    before = " ".join(f"{a}={config.mesh[a]}" for a in MESH_AXES if config.mesh[a] > 1)
    config.dcn.update({a: 1 for a in MESH_AXES})
    hw = hardware.profile(hardware.profile_name(jax.devices()[0]) or "cpu")
    winner = planner.plan(config, n, hw, top=0, log=lambda s: None)["winner"]
    apply_overrides(config, winner.override_lines())
    if jax.process_index() == 0:
        print(f"jaxsys: elastic restart on {n} devices: mesh {before} does not fit; the planner chose {winner.name}")


def _record_tokenizer(config, workdir: str) -> None:
    """Give a new workdir trained on documents the tokenizer of config.data.tokenizer (so that
    generate and serve read text); a workdir that records one already is left as it is."""
    if tokenizer_lib.record(workdir) is not None:
        return
    try:
        tokenizer_lib.attach(workdir, config.data.tokenizer, config.model.vocab_size, note="config.data.tokenizer")
    except tokenizer_lib.TokenizerError:
        pass  # e.g. bytes for a vocabulary wider than 256 ids: the model then takes ids


def _loader(config, program, corpus, saved: dict | None, resume_step: int | None) -> Loader:
    """The train batches from the resumed step on: the loader state `saved` with the checkpoint or
    snapshot (or, for a checkpoint without one, its step: the same position)."""
    t = config.train
    loader = Loader(
        corpus, program.batch_sharding, config.seed, t.batch_size, config.data.seq_len, t.steps, config.data.prefetch
    )
    if resume_step is not None:
        if saved is None:
            saved = {"grain": {"next_index": int(resume_step)}}
        if int(saved["grain"]["next_index"]) != int(resume_step):
            raise checkpoint_lib.CheckpointError(
                f"checkpoint step {resume_step} holds a loader state at step {saved['grain']['next_index']}: the "
                "checkpoint is inconsistent; restore another step"
            )
        loader.restore(saved)
    return loader


def _train(config, workdir: str, corpus, mesh, checkpointer, gp=None) -> list[dict]:
    gp = gp or goodput_lib.Goodput()
    cache_path, cache_counter = compile_cache.directory(config.compile_cache), compile_cache.Counter()
    lead = jax.process_index() == 0
    resume_step = checkpointer.latest_step() if checkpointer else None
    sn = config.train.snapshot
    snap_root = snapshot_lib.root(sn, workdir)
    logged = os.path.exists(os.path.join(workdir, "metrics.jsonl"))
    # a snapshot of this workdir's run (a stale one of a removed workdir at the same path is not)
    snap_steps = snapshot_lib.complete_steps(snap_root) if sn.every and logged else []
    snap_step = snap_steps[0] if snap_steps and (resume_step is None or snap_steps[0] >= resume_step) else -1
    # killed before its first snapshot (at most k steps logged): start again from step 0
    early = bool(sn.every) and logged and _logged_after(workdir, 0) <= sn.every
    exists = logged and resume_step is None and snap_step < 0 and not early
    if jax.process_count() > 1:  # one decision for all, so that none is left waiting
        from jax.experimental import multihost_utils

        # any process's marker means every process passed that step's barrier: with host-local
        # snapshot directories process 0's may be gone with its host
        newest = int(np.max(multihost_utils.process_allgather(np.int32(snap_steps[0] if snap_steps else -1))))
        if newest >= 0 and (resume_step is None or newest >= resume_step):
            snap_step = newest
            exists = False
        exists, snap_step = (int(v) for v in multihost_utils.broadcast_one_to_all(np.int32([exists, snap_step])))
    if exists:
        raise FileExistsError(
            f"{workdir} already holds a run (metrics.jsonl) with no checkpoint to "
            "resume from: pass a new --workdir or remove the old one; nothing was "
            "overwritten"
        )
    os.makedirs(workdir, exist_ok=True)
    if sn.every and snap_step < 0 and lead:  # a new run: snapshots left at this path are not its own
        shutil.rmtree(snap_root, ignore_errors=True)
    if lead:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))

    program = build(config, mesh)
    t, m = config.train, config.model
    tokens_per_step = program.tokens_per_step
    flops_per_step = flops_lib.step_flops_per_token(config) * tokens_per_step
    peak = config.hardware.peak_flops or hardware.job_peak_flops(m.compute_dtype)

    saved_data = None
    if snap_step >= 0:  # recovery from host memory: no Orbax read
        with gp.timed("restore"):
            state, meta, files = snapshot_lib.restore(snap_root, snap_step, program.abstract_state())
            jax.block_until_ready(state)
        resume_step, saved_data = snap_step, meta["data"]
        gp.lost_steps = _logged_after(workdir, resume_step)
        digest = snapshot_lib.fingerprint(state)  # a collective: every process
        if lead:
            print(
                f"jaxsys: resumed from in-memory snapshot step {snap_step} of {snap_root} "
                f"({', '.join(files)}) in {gp.seconds['restore']:.2f}s, saved by {meta['processes']} processes; "
                f"fingerprint {digest}",
                flush=True,
            )
        elif any("from process" in f for f in files):  # host-local snapshots: what came over the ring
            print(f"jaxsys: process {jax.process_index()} restored snapshot step {snap_step}: {', '.join(files)}")
    elif resume_step is not None:
        with gp.timed("restore"):
            state = checkpointer.restore(program.abstract_state())
        saved_data = checkpointer.data_state(resume_step)
        gp.lost_steps = _logged_after(workdir, resume_step)
        if lead:
            print(f"jaxsys: resumed from step {resume_step} of {checkpoint_lib.directory(workdir)}", flush=True)
    elif config.checkpoint.init_from:  # a new run from another run's parameters (fine-tuning)
        params, from_step, fresh = _initial_params(program, config.checkpoint.init_from)
        state = program.fresh_state(params)
        if lead:
            print(
                f"jaxsys: parameters from step {from_step} of {config.checkpoint.init_from} "
                f"(config.checkpoint.init_from){fresh}; starting at step 0 with a fresh optimizer state",
                flush=True,
            )
    else:
        with gp.timed("init"):
            state = program.init()
        if early and snap_step < 0:
            gp.lost_steps = _logged_after(workdir, 0)
    reference = _reference_params(program, config) if program.needs_reference else None
    step_args = () if reference is None else (reference,)
    start_step = int(resume_step or 0)
    loader = _loader(config, program, corpus, saved_data, resume_step)
    snapshotter = snapshot_lib.Snapshotter(sn, workdir) if sn.every else None
    start = time.perf_counter()
    with gp.timed("compile"):
        step_fn = program.train_step_fn().lower(state, program.abstract_batch(), *step_args).compile()
        bucket_steps = _bucket_steps(config, mesh, step_fn, state, step_args) if adaptive_batch(config) else None
        syncs = outer_lib.Syncs(program, state) if outer_lib.enabled(t) else None  # DiLoCo's outer steps
    eval_fn = program.eval_metrics_fn() if corpus.has_eval else None
    n_params = params_lib.count(program.specs)
    if lead:
        axes = " ".join(f"{a}={s}" for a, s in program.layout.mesh_sizes.items() if s > 1) or "1 device"
        print(
            f"jaxsys: {n_params / 1e6:.2f}M params, mesh {axes}, {corpus.description}, "
            f"compiled in {time.perf_counter() - start:.1f}s",
            flush=True,
        )
        print(report.startup_summary(program, step_fn), flush=True)

    writer = MetricsWriter(workdir, lead)
    n_moe = expert_placement.n_moe_layers(program.specs)
    routing = expert_placement.RoutingLog(n_moe, m.moe.experts, program.expert_devices) if n_moe else None
    rebalance_every, placement_notes = config.parallel.expert_rebalance_every, {}
    place_experts = program.place_experts_fn() if rebalance_every else None
    from tqdm import tqdm

    bar = tqdm(total=t.steps, initial=start_step, disable=not (lead and t.progress), dynamic_ncols=True)
    records, pending, shown = [], None, {}
    window = ThroughputWindow()

    def eval_due(step: int) -> bool:
        return eval_fn is not None and (step == t.steps or bool(t.eval_every and step % t.eval_every == 0))

    def finish(step: int, metrics, evaluated) -> None:
        """Read step `step`'s metrics (blocking), check them, log when due."""
        waited = not metrics["loss"].is_ready()
        loss = _scalar(metrics["loss"])
        window.done(step, waited)
        _check_finite(loss, step, config)
        _check_finite(_scalar(metrics["grad_norm"]), step, config, "gradient norm")
        bar.update(1)
        shown["loss"] = f"{loss:.3f}"  # this step's loss, already on the host
        if routing is not None:
            load = _array(metrics["moe_load"])
            routing.add(load, _array(metrics["moe_pairs"]))
        if step % t.log_every == 0 or step == 1 or step == t.steps or evaluated is not None:
            steps, elapsed = window.close()
            tokens_per_s = steps * tokens_per_step / elapsed
            flop_per_s = flops_per_step * steps / elapsed  # the model FLOPs of the steps (analysis/flops.py)
            record = {
                "step": step,
                "loss": loss,
                "tokens_per_s": tokens_per_s,
                "tflop_per_s": flop_per_s / 1e12,
                "mfu": flop_per_s / peak if peak else 0.0,
                "grad_norm": _scalar(metrics["grad_norm"]),
                "lr": _scalar(metrics["lr"]),
            }
            if "loss_tokens" in metrics:  # a weighted batch: the targets the loss averaged
                record["loss_tokens"] = int(_scalar(metrics["loss_tokens"]))
            record.update({k: _scalar(v) for k, v in metrics.items() if k.startswith("dpo_") or k == "mtp_loss"})
            if evaluated is not None:
                record["eval_loss"] = evaluated["loss"]
                record.update({f"eval_{k}": v for k, v in evaluated.items() if k != "loss"})
            record["goodput"] = gp.record()["goodput"]
            if routing is not None:
                record.update(
                    moe_aux_loss=_scalar(metrics["moe_aux_loss"]),
                    moe_z_loss=_scalar(metrics["moe_z_loss"]),
                    **routing.record(load, _array(metrics["moe_dropped"])),
                    **placement_notes,
                )
                placement_notes.clear()
            records.append(record)
            writer.write(record)
            shown["tok_s"] = f"{tokens_per_s:,.0f}"
        bar.set_postfix(shown)

    profiler = _Profiler(config, workdir, start_step, window)
    gp.loop_started()
    try:
        for step in range(start_step, t.steps):
            with gp.timed("data_wait"):
                tokens = next(loader)  # built ahead on the loader's thread while the last step ran
            profiler.before(step + 1, state)
            window.dispatched(step + 1)
            if bucket_steps is not None:  # the program of this batch's layout (adaptive CP buckets)
                step_fn = bucket_steps[corpus.bucket(config.seed, step)]
            with jax.profiler.StepTraceAnnotation("train", step_num=step + 1):
                state, metrics = step_fn(state, tokens, *step_args)
            if syncs is not None:
                state = syncs(state, step + 1)
            if pending is not None:  # read the previous step while this one runs
                finish(*pending)
            profiler.after(step + 1, state)
            evaluated = None
            if eval_due(step + 1):  # after `finish`, so that this step's window holds its compute
                jax.block_until_ready(state)  # the step's own compute is training time
                paused = time.perf_counter()
                evaluated = evaluate_terms(program, eval_fn, state.params, corpus, reference)
                window.pause(time.perf_counter() - paused)  # not training time
                gp.add("eval", time.perf_counter() - paused)
            pending = (step + 1, metrics, evaluated)
            if rebalance_every and (step + 1) % rebalance_every == 0 and step + 1 < t.steps:
                finish(*pending)  # the window holds this step
                pending = None
                paused = time.perf_counter()
                perm, summary = routing.rebalance(config.parallel.expert_colocate)
                state = jax.block_until_ready(place_experts(state, perm))
                window.pause(time.perf_counter() - paused)  # not training time
                placement_notes.update(summary)
                if lead and not t.progress:
                    print(f"jaxsys: experts re-placed after step {step + 1}: {summary}", flush=True)
            if checkpointer and checkpointer.due(step + 1, final=step + 1 == t.steps):
                finish(*pending)  # a state is saved only once its step's numbers are checked
                pending = None
                jax.block_until_ready(state)
                paused = time.perf_counter()
                checkpointer.save(step + 1, state, config, data=loader.state())
                window.pause(time.perf_counter() - paused)  # not training time
                gp.add("checkpoint", time.perf_counter() - paused)
            if snapshotter and snapshotter.due(step + 1):
                if pending is not None:
                    finish(*pending)  # a state is snapshotted only once its step's numbers are checked
                    pending = None
                jax.block_until_ready(state)
                paused = time.perf_counter()
                snapshotter.save(step + 1, state, loader.state())
                window.pause(time.perf_counter() - paused)  # not training time
                gp.add("snapshot", time.perf_counter() - paused)
        if pending is not None:
            finish(*pending)
        gp.loop_ended()
        _report_goodput(workdir, lead, t.steps, gp, cache_path, cache_counter)
        if snapshotter and lead:
            print(f"jaxsys: {snapshotter.line()}", flush=True)
        if routing is not None and lead:
            routing.save(os.path.join(workdir, "moe_routing.npz"))
    finally:
        profiler.close()
        bar.close()
        writer.close()
    return records


class _Profiler:
    """config.train.profile_steps "a:b": a JAX profiler trace of steps a..b (1-based) into
    {workdir}/tb/plugins/profile/<run>/ (TensorBoard's profile plugin reads it; beside it a Perfetto
    trace, perfetto_trace.json.gz). The trace starts once step a - 1 has finished and stops once
    step b has, so it holds those steps only (each step dispatch is a StepTraceAnnotation "train"
    with its step_num); both waits are pauses of the throughput window."""

    def __init__(self, config, workdir: str, start_step: int, window: ThroughputWindow):
        steps = profile_range(config)
        self.first, self.last = (max(steps[0], start_step + 1), steps[1]) if steps else (0, -1)
        self.dir = os.path.join(workdir, "tb")
        self.window, self.active = window, False
        self.enabled = jax.process_index() == 0

    def before(self, step: int, state) -> None:
        if step == self.first and step <= self.last and self.enabled:
            paused = time.perf_counter()
            jax.block_until_ready(state)  # the steps before stay out of the trace
            jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
            self.active = True
            self.window.pause(time.perf_counter() - paused)

    def after(self, step: int, state) -> None:
        if self.active and step == self.last:
            paused = time.perf_counter()
            jax.block_until_ready(state)
            self.close()
            self.window.pause(time.perf_counter() - paused)

    def close(self) -> None:
        if self.active:
            self.active = False
            jax.profiler.stop_trace()


def _initial_params(program: Program, init_from: str):
    """(parameters, step, note) for config.checkpoint.init_from: read into the program's shardings.
    With LoRA and a source without adapters (a base model, float or quantized) the base is read and
    fresh adapters attached (the run starts as the base model); a source with adapters is read whole."""
    abstract = program.abstract_state().params
    if program.lora and not _has_adapters(init_from):
        base, step = checkpoint_lib.restore_params(init_from, adapters.strip(abstract))
        return program.with_fresh_adapters(base), step, " as the frozen base, with fresh LoRA adapters"
    params, step = checkpoint_lib.restore_params(init_from, abstract)
    return params, step, ""


def _has_adapters(path: str) -> bool:
    try:
        source, _ = checkpoint_lib.saved_config(checkpoint_lib.workdir_of(path))
    except checkpoint_lib.CheckpointError:
        return False  # restore_params names the problem
    return adapters.enabled(source)


def _reference_params(program: Program, config):
    """DPO's reference model without adapters: a frozen copy of the starting parameters, those of
    config.checkpoint.init_from or of the seed's initialisation, read again (also on resume) rather
    than saved with the run's checkpoints."""
    if config.checkpoint.init_from:
        return checkpoint_lib.restore_params(config.checkpoint.init_from, program.abstract_state().params)[0]
    return program.init().params


def _logged_after(workdir: str, step: int) -> int:
    """Steps the previous launch logged after `step` (its last checkpoint): trained again now."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        steps = [json.loads(line).get("step", 0) for line in f if line.strip()]
    return max(0, max(steps, default=0) - int(step))


def _report_goodput(workdir: str, lead: bool, step: int, gp, cache_path, counter) -> None:
    """Print the launch's goodput and compile-cache lines; append them to goodput.jsonl."""
    if not lead:
        return
    cache_line = counter.line(cache_path)
    record = {"step": step, **gp.record(), "compile_cache": cache_path or ""}
    record.update(programs_compiled=counter.compiled(), programs_loaded=counter.loaded())
    with open(os.path.join(workdir, "goodput.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"jaxsys: {gp.line(record)}", flush=True)
    print(f"jaxsys: {cache_line}", flush=True)


# the errors `cli` reports as one line and exit code 2
CLI_ERRORS = (ConfigError, data_lib.DataError, checkpoint_lib.CheckpointError, FileExistsError, FloatingPointError)


def parse_args(argv):
    parser = argparse.ArgumentParser(description="Train a jaxsys config.")
    parser.add_argument("--config", required=True, help="configs/<name>.py[:arg]")
    parser.add_argument("--workdir", required=True, help="directory for metrics, events, config")
    args, overrides = parse_with_overrides(parser, argv, "--config.train.steps=10")
    return args, overrides


def cli(argv=None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(args.config, overrides)
        main(config, args.workdir)
    except CLI_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
