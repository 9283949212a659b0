"""Launching under SLURM, tested on localhost: the environment srun gives the tasks of a job step,
written by hand, is enough for `python -m jaxsys.train` to start jax.distributed with no
JAX_COORDINATOR_ADDRESS and no config.distributed settings (JAX's own SLURM detection, through
`jaxsys.mesh.maybe_initialize_distributed`).

- 2 tasks x 4 CPU devices on one node train exactly like 1 process x 8 (data=2, fsdp=2, tensor=2:
  with devices sorted by process, the two `data` rows are the two processes, as in
  tests/test_multiprocess.py);
- a single-task job runs as one process (it is the reference run);
- scripts/launch/slurm.sbatch, run as the batch script of a "2 nodes x 1 task" job with a stand-in
  srun, adds --config.dcn.data=2 (a hybrid mesh, one granule per process) and trains the same;
- a half environment fails at once with an error that names the variable and the fix.

What this cannot check: real sbatch/srun (their variables are set by hand here), several machines
(host names, the network), GPUs (which GPU each task drives; there is none here).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxsys.config import ConfigError, base_config
from jaxsys.mesh import distributed_plan
from tests.helpers import subprocess_env

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300
CONFIG = "configs/tiny.py:test"
OVERRIDES = [
    "--config.mesh.data=2",
    "--config.mesh.fsdp=2",
    "--config.mesh.tensor=2",
    "--config.model.n_kv_heads=2",
]  # tiny has n_heads=8; n_kv_heads=2: both divide tensor=2
ARGS = ["--config", CONFIG, *OVERRIDES]
DETECTED = "jaxsys: jax.distributed initialised from SLURM"
# JAX's SlurmCluster: the coordinator listens on the step's first node at 61440 + SLURM_JOB_ID % 4096.
PORT_BASE, PORT_SPAN = 65535 - 2**12 + 1, 2**12


def _slurm_port_and_job_id() -> tuple[int, int]:
    """A free port in SLURM's coordinator range (above Linux's ephemeral ports) and a job id that
    JAX maps to it."""
    for port in range(PORT_BASE + os.getpid() % 1000, PORT_BASE + PORT_SPAN):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port, 7 * PORT_SPAN + (port - PORT_BASE)  # a job id as large as a real one
    raise RuntimeError("no free port in 61440..65535")


def slurm_task_env(job_id: int, ntasks: int, procid: int) -> dict[str, str]:
    """What srun sets in task `procid` of a job step of `ntasks` tasks, all on node `localhost`."""
    return {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOBID": str(job_id),
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NODELIST": "localhost",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_NNODES": "1",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NPROCS": str(ntasks),
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_TASKS_PER_NODE": str(ntasks),
        "SLURM_STEP_TASKS_PER_NODE": str(ntasks),
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(procid),
        "SLURM_NODEID": "0",
    }


def _env(devices: int, slurm: dict[str, str]) -> dict[str, str]:
    # Nothing from a SLURM job that runs this test may leak into the simulated one.
    env = {k: v for k, v in subprocess_env(devices).items() if not k.startswith("SLURM_")}
    env.pop("JAX_COORDINATOR_PORT", None)
    return {**env, **slurm}


def _run(envs: list[dict[str, str]], workdir: Path, logdir: Path, expect_ok: bool = True, command=None):
    """Start one `jaxsys.train` (or `command`) per env, all at once; wait for all. Returns [(exit code,
    stdout, stderr)]. With expect_ok, fails with every log unless all exit 0; kills the rest on a
    failure."""
    logdir.mkdir(parents=True, exist_ok=True)
    command = command or [sys.executable, "-m", "jaxsys.train", *ARGS, "--workdir", str(workdir)]
    procs, logs = [], []
    try:
        for i, env in enumerate(envs):
            out, err = open(logdir / f"p{i}.out", "w+"), open(logdir / f"p{i}.err", "w+")
            logs.append((out, err))
            procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in procs):
            # One that failed leaves the other blocked in jax.distributed or a collective: stop early.
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        timed_out = time.monotonic() > deadline
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for code, (out, err) in zip(codes, logs):
        out.seek(0), err.seek(0)
        results.append((code, out.read(), err.read()))
        out.close(), err.close()
    if expect_ok and codes != [0] * len(procs):
        why = f"timed out after {TIMEOUT_S}s" if timed_out else "failed"
        report = "\n".join(
            f"--- process {i}: exit {'killed' if c is None else c}\n[stdout]\n{o}\n[stderr]\n{e}"
            for i, (c, o, e) in enumerate(results)
        )
        pytest.fail(f"jaxsys.train {why}:\n{report}")
    return results


def _losses(workdir: Path) -> list[dict]:
    with open(workdir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """The reference: a single-task SLURM job with 8 devices, which runs as one process."""
    tmp = tmp_path_factory.mktemp("single")
    _, job_id = _slurm_port_and_job_id()
    [(_, out, _)] = _run([_env(8, slurm_task_env(job_id, 1, 0))], tmp / "run", tmp / "logs")
    # (c) no jax.distributed, and all 8 devices in this one process
    assert "jax.distributed" not in out and "mesh data=2 fsdp=2 tensor=2" in out, out
    return tmp / "run"


@pytest.mark.slow
def test_two_slurm_tasks_detect_the_cluster_and_train_like_one_process(tmp_path, single):
    port, job_id = _slurm_port_and_job_id()

    # (a) 2 tasks x 4 devices, nothing set but what srun would set: JAX finds the coordinator
    # (localhost, the port from SLURM_JOB_ID) and the process ids; only process 0 prints.
    multi = tmp_path / "multi"
    (_, out0, _), (_, out1, _) = _run(
        [_env(4, slurm_task_env(job_id, 2, i)) for i in range(2)], multi, tmp_path / "logs_multi"
    )
    line = next((l for l in out0.splitlines() if l.startswith(DETECTED)), None)
    assert line == f"{DETECTED}: 2 processes, 8 devices, coordinator localhost:{port}", out0
    assert "mesh data=2 fsdp=2 tensor=2" in out0, out0
    assert "jaxsys: " not in out1, f"process 1 printed process 0's lines:\n{out1}"

    # (b) The same losses as one process: the same program and batches; only the cross-process
    # reductions (gloo over TCP instead of in-process) may sum in another order, a few float32 ulps.
    ref, got = _losses(single), _losses(multi)
    assert [r["step"] for r in ref] == [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (a, b)
    assert ref[0]["loss"] > ref[-1]["loss"]  # it trained


# A stand-in for srun on one machine: starts SLURM_NTASKS copies of its command, each with the
# variables srun gives task i when the job has SLURM_NTASKS_PER_NODE tasks on each node, and waits.
FAKE_SRUN = """#!{python}
import os, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args.pop(0)
n, per_node = int(os.environ["SLURM_NTASKS"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
step = {{"SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": os.environ["SLURM_JOB_NODELIST"],
        "SLURM_STEP_NUM_NODES": os.environ["SLURM_JOB_NUM_NODES"], "SLURM_STEP_NUM_TASKS": str(n)}}
procs = [subprocess.Popen(args, env={{**os.environ, **step, "SLURM_PROCID": str(i),
                                     "SLURM_LOCALID": str(i % per_node), "SLURM_NODEID": str(i // per_node)}})
         for i in range(n)]
codes = [p.wait() for p in procs]
sys.exit(max(codes))
"""


@pytest.mark.slow
def test_sbatch_script_one_process_per_node_sets_dcn_and_trains_the_same(tmp_path, single):
    port, job_id = _slurm_port_and_job_id()

    # The batch script of `sbatch --nodes=2 --ntasks-per-node=1`: two "nodes" (both this machine),
    # one task each with 4 devices. srun is the stand-in above.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "srun").chmod(0o755)
    batch = {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "localhost,127.0.0.1",
        "SLURM_NODELIST": "localhost,127.0.0.1",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_SUBMIT_DIR": str(REPO),
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
    }
    env = {
        **_env(4, batch),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "JAXSYS_PYTHON_BIN": sys.executable,
    }
    multi = tmp_path / "multi"
    [(_, out, err)] = _run(
        [env],
        multi,
        tmp_path / "logs_sbatch",
        command=["bash", str(REPO / "scripts/launch/slurm.sbatch"), CONFIG, str(multi), *OVERRIDES],
    )
    assert "jaxsys launch: job" in out and "2 node(s) x 1 process(es)" in out, out
    assert out.count(DETECTED) == 1, out  # process 0 only
    assert f"{DETECTED}: 2 processes, 8 devices, coordinator localhost:{port}" in out, out
    assert json.loads((multi / "config.json").read_text())["dcn"]["data"] == 2  # added by the script
    for a, b in zip(_losses(single), _losses(multi), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)


@pytest.mark.slow
def test_a_batch_script_without_srun_fails_with_the_fix(tmp_path):
    # What `python -m jaxsys.train` sees when run straight from an `#SBATCH --ntasks=2` script.
    slurm = {k: v for k, v in slurm_task_env(4242, 2, 0).items() if not k.startswith("SLURM_STEP")}
    [(code, out, err)] = _run([_env(8, slurm)], tmp_path / "w", tmp_path / "logs", expect_ok=False)
    assert code == 2, (code, out, err)
    assert "SLURM_STEP_NODELIST is not set" in err and "srun" in err, err
    assert not (tmp_path / "w").exists()  # it failed before writing anything


# ---- the decision alone (no processes started) ---------------------------------------------------

CFG = base_config().distributed
STEP = slurm_task_env(123456, 2, 1)


def test_plan_single_process_outside_slurm_and_for_one_task():
    assert distributed_plan(CFG, {}) is None
    assert distributed_plan(CFG, slurm_task_env(123456, 1, 0)) is None
    # salloc/sbatch with one task and no step at all
    assert distributed_plan(CFG, {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "1"}) is None
    # the way out of a multi-task step on purpose (independent runs under one srun)
    assert distributed_plan(CFG, {**slurm_task_env(123456, 4, 2), "SLURM_NTASKS": "1"}) is None


def test_plan_slurm_step_uses_jax_detection_and_the_gpu_of_each_task():
    source, kwargs = distributed_plan(CFG, STEP)
    assert source == "SLURM"
    # No coordinator, count or id: JAX reads them from SLURM. One task per GPU, each seeing all the
    # node's GPUs: JAX's default (GPU number SLURM_LOCALID).
    assert kwargs == {"cluster_detection_method": "slurm", "local_device_ids": None}
    # One task per node (2 nodes, 2 tasks): all the node's GPUs, not JAX's default GPU 0 only.
    per_node = {**STEP, "SLURM_STEP_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_LOCALID": "0"}
    assert distributed_plan(CFG, per_node)[1]["local_device_ids"] == []
    # srun --gpus-per-task=1 left one GPU visible: use it (there is no GPU number SLURM_LOCALID=1).
    assert distributed_plan(CFG, {**STEP, "CUDA_VISIBLE_DEVICES": "5"})[1]["local_device_ids"] == []
    assert distributed_plan(CFG, {**STEP, "CUDA_VISIBLE_DEVICES": "0,1"})[1]["local_device_ids"] is None
    # JAX_LOCAL_DEVICE_IDS is the user's: JAX reads it when local_device_ids is None.
    assert distributed_plan(CFG, {**per_node, "JAX_LOCAL_DEVICE_IDS": "0"})[1]["local_device_ids"] is None


def test_plan_matches_what_jax_reads_from_slurm(monkeypatch):
    from jax._src.clusters import SlurmCluster

    for k in [k for k in os.environ if k.startswith("SLURM_")] + ["JAX_COORDINATOR_PORT"]:
        monkeypatch.delenv(k, raising=False)
    for k, v in {**STEP, "SLURM_STEP_NODELIST": "gpu[007-008],gpu010"}.items():
        monkeypatch.setenv(k, v)
    assert distributed_plan(CFG, os.environ)[0] == "SLURM"
    assert SlurmCluster.is_env_present()
    assert SlurmCluster.get_coordinator_address(None, None) == f"gpu007:{PORT_BASE + 123456 % PORT_SPAN}"
    assert (SlurmCluster.get_process_count(), SlurmCluster.get_process_id()) == (2, 1)


def test_plan_explicit_settings_win_over_slurm():
    explicit = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    source, kwargs = distributed_plan(CFG, {**STEP, **explicit})
    assert source == "JAX_COORDINATOR_ADDRESS" and kwargs["coordinator_address"] == "10.0.0.1:1234"
    assert (kwargs["num_processes"], kwargs["process_id"]) == (2, 1)
    # ... even over a half SLURM environment, which alone is an error.
    source, _ = distributed_plan(CFG, {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2", **explicit})
    assert source == "JAX_COORDINATOR_ADDRESS"
    cfg = base_config().distributed
    cfg.coordinator_address, cfg.num_processes, cfg.process_id = "h:1", 2, 0
    assert distributed_plan(cfg, {**STEP, **explicit})[0] == "config.distributed"


@pytest.mark.parametrize(
    "env, names",
    [
        # a batch script or salloc shell with 2 tasks: not started by srun
        ({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2"}, ["SLURM_STEP_NODELIST", "srun", "SLURM_NTASKS=1"]),
        ({k: v for k, v in STEP.items() if k != "SLURM_PROCID"}, ["SLURM_PROCID is not set", "srun"]),
        (
            {k: v for k, v in STEP.items() if k not in ("SLURM_LOCALID", "SLURM_NTASKS")},
            ["SLURM_NTASKS, SLURM_LOCALID are not set"],
        ),  # the step's count from SLURM_STEP_NUM_TASKS
        ({**STEP, "SLURM_PROCID": "2"}, ["SLURM_PROCID=2 is not in 0..1"]),
        ({**STEP, "SLURM_NTASKS": "two"}, ["SLURM_NTASKS='two' is not an integer"]),
        ({**STEP, "SLURM_NTASKS": "4"}, ["SLURM_NTASKS=4 but SLURM_STEP_NUM_TASKS=2"]),
        # explicit but half: a coordinator with no process count or id
        ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, ["JAX_NUM_PROCESSES", "JAX_PROCESS_ID"]),
        (
            {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "x"},
            ["JAX_PROCESS_ID='x' is not an integer"],
        ),
    ],
)
def test_plan_half_environment_names_the_variable_and_the_fix(env, names):
    with pytest.raises(ConfigError) as e:
        distributed_plan(CFG, env)
    for name in names:
        assert name in str(e.value), str(e.value)


def test_plan_cloud_tpu_pod_and_multislice_use_jax_detection(monkeypatch):
    # A GKE TPU host (JAX's GkeTpuCluster reads TPU_WORKER_HOSTNAMES and MEGASCALE_NUM_SLICES from the
    # environment; no metadata server is asked). Single host: one process; 2 hosts x 2 slices: 4.
    from jax._src import cloud_tpu_init
    from jax._src.clusters import cloud_tpu_cluster

    monkeypatch.setattr(cloud_tpu_init, "running_in_cloud_tpu_vm", True)
    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", True)
    monkeypatch.setenv("TPU_WORKER_ID", "0")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host0")
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "1")
    assert distributed_plan(CFG, {}) is None
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host0,host1")
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "2")
    assert distributed_plan(CFG, {}) == ("Cloud TPU (gketpu)", {"cluster_detection_method": "gketpu"})
    assert cloud_tpu_cluster.GkeTpuCluster.get_process_count() == 4
