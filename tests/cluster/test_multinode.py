"""Two simulated nodes x 2 processes train to the same parameters as 1 node x 4 processes, for every strategy
and launcher, using the launch files of ``examples/cluster/`` (the ones docs/cluster.md shows) unchanged.

Each job is the digits recipe for 3 steps (one epoch of 3 batches, no validation); the final parameters are
read from ``checkpoints/last.ckpt`` and compared bitwise with the same job run as 1 node x 4 processes by
torchrun on one node.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.cluster.launch import EXAMPLES, next_port, node_env

#: every job: 3 steps, no validation, no loggers, only the last.ckpt callback (the parameters compared)
SHORT = [
    "trainer.max_epochs=1", "+trainer.limit_train_batches=3", "+trainer.limit_val_batches=0",
    "trainer.enable_progress_bar=false", "+trainer.enable_model_summary=false", "logger=none",
    "~callbacks.lr_monitor", "~callbacks.checkpoint",
]
STEPS = 3

#: strategy -> overrides.  Multigrid trains its layer-parallel ODE-ResNet recipe (2 ranks per layer chain, so
#: 2 data-parallel chains on 4 ranks); spatial splits each 8x8 digit in 2 tiles (2 sample groups on 4 ranks).
STRATEGIES = {
    "ddp": ["strategy=ddp"],
    "layered_sgd": ["strategy=layered_sgd"],
    "hybrid_fc": ["strategy=hybrid_fc"],
    "spatial": ["strategy=spatial"],
    "multigrid": ["recipe=digits_odenet", "strategy.forward_cycles=1", "strategy.backward_cycles=1"],
}

#: extra overrides of the 1 node x 4 reference: layered SGD simulates the two nodes there (contiguous groups of
#: 2 ranks), so the reduction order, and hence the result bits, are those of the 2-node job
REFERENCE_EXTRA = {"layered_sgd": ["strategy.procs_per_node=2"]}

#: a launch must finish in this time (startup of 4 ranks on a 2-core machine included)
JOB_TIMEOUT = 240


def _args(strategy: str, *extra: str) -> list[str]:
    return [*STRATEGIES[strategy], *SHORT, *extra]


def _final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == STEPS, f"{run_dir}: global_step {ckpt['global_step']}, expected {STEPS}"
    return ckpt["state_dict"]


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors that are not bitwise equal (or missing on one side)."""
    out = sorted(set(a) ^ set(b))
    for name in sorted(set(a) & set(b)):
        if a[name].shape != b[name].shape or not torch.equal(a[name], b[name]):
            diff = (
                (a[name].double() - b[name].double()).abs().max().item() if a[name].shape == b[name].shape else "shape"
            )
            out.append(f"{name} (max |diff| {diff})")
    return out


def _wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    rcs = []
    for proc in procs:
        try:
            rcs.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            tails = "\n".join(f"== {log}\n{log.read_text(errors='replace')[-3000:]}" for log in logs)
            raise AssertionError(f"launch did not finish within {timeout:.0f}s:\n{tails}") from None
    return rcs


def _check_ok(rcs: list[int], logs: list[Path]) -> None:
    if any(rcs):
        tails = "\n".join(
            f"== {log} (rc {rc})\n{log.read_text(errors='replace')[-4000:]}" for rc, log in zip(rcs, logs)
        )
        raise AssertionError(f"launch failed: {rcs}\n{tails}")


def torchrun_nodes(nodes, workdir: Path, script: str, job: str, per_node_args, *, env_extra=None,
                   timeout: float = JOB_TIMEOUT) -> tuple[list[int], list[Path]]:
    """Run ``examples/cluster/<script>`` on both nodes (node i gets ``per_node_args(i)``)."""
    port = next_port()
    procs, logs = [], []
    for node in nodes:
        log = workdir / f"{job}.{node.hostname}.log"
        env = node_env(HEAD=nodes[0].hostname, PORT=str(port), JOB_ID=job, NODE_RANK=str(node.index),
                       NNODES="2", NPROC="2", **(env_extra or {}))
        procs.append(node.popen(["bash", str(EXAMPLES / script), *per_node_args(node.index)], env=env, cwd=workdir,
                                stdout=open(log, "w")))
        logs.append(log)
    return _wait_all(procs, logs, timeout), logs


_REFERENCES: dict[str, dict[str, torch.Tensor]] = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("multinode")


@pytest.fixture
def reference(sim_nodes, workdir):
    """The job as 1 node x 4 processes (torchrun --standalone on node 0), once per strategy."""

    def get(strategy: str) -> dict[str, torch.Tensor]:
        if strategy not in _REFERENCES:
            job = f"ref-{strategy}"
            log = workdir / f"{job}.log"
            proc = sim_nodes[0].popen(
                [
                    "torchrun",
                    "--standalone",
                    "--nproc-per-node=4",
                    "-m",
                    "lightning_hpc",
                    "train",
                    "recipe=digits",
                    "trainer.devices=4",
                    "trainer.num_nodes=1",
                    f"hydra.run.dir=outputs/{job}",
                    *_args(strategy, *REFERENCE_EXTRA.get(strategy, [])),
                ],
                env=node_env(),
                cwd=workdir,
                stdout=open(log, "w"),
            )
            _check_ok(_wait_all([proc], [log], JOB_TIMEOUT), [log])
            _REFERENCES[strategy] = _final_state(workdir / "outputs" / job)
        return _REFERENCES[strategy]

    return get


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_torchrun_c10d_two_nodes_equal_one_node(strategy, sim_nodes, workdir, reference):
    job = f"c10d-{strategy}"
    rcs, logs = torchrun_nodes(sim_nodes, workdir, "torchrun_c10d.sh", job, lambda i: _args(strategy))
    _check_ok(rcs, logs)
    assert differences(_final_state(workdir / "outputs" / job), reference(strategy)) == []


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_torchrun_static_node_rank_two_nodes_equal_one_node(strategy, sim_nodes, workdir, reference):
    job = f"static-{strategy}"
    rcs, logs = torchrun_nodes(sim_nodes, workdir, "torchrun_static.sh", job, lambda i: _args(strategy))
    _check_ok(rcs, logs)
    assert differences(_final_state(workdir / "outputs" / job), reference(strategy)) == []


def test_the_comparison_fails_when_one_node_trains_differently(sim_nodes, workdir, reference):
    # Node 1 draws another train/validation split (seed=1): its gradients differ, so the averaged update and
    # the final parameters differ from the reference, and the comparison must say so.
    job = "c10d-ddp-other-seed"
    rcs, logs = torchrun_nodes(sim_nodes, workdir, "torchrun_c10d.sh", job,
                               lambda i: _args("ddp", *(["seed=1"] if i == 1 else [])))
    _check_ok(rcs, logs)
    diff = differences(_final_state(workdir / "outputs" / job), reference("ddp"))
    assert diff and any(name.startswith("model.") for name in diff), diff


def _srun(local_slurm, workdir: Path, job: str, args: list[str], extra_srun: str = "") -> Path:
    log = workdir / f"{job}.log"
    env = node_env(JOB_ID=job, NNODES="2", NPROC="2", EXTRA_SRUN_ARGS=extra_srun)
    proc = local_slurm.popen(["bash", str(EXAMPLES / "srun.sh"), *args], env=env, cwd=workdir, stdout=open(log, "w"))
    try:
        _check_ok(_wait_all([proc], [log], JOB_TIMEOUT), [log])
    except AssertionError as e:
        raise AssertionError(f"{e}\n{local_slurm.logs(15)}") from None
    return log


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_srun_two_nodes_equal_one_node(strategy, local_slurm, workdir, reference):
    job = f"srun-{strategy}"
    _srun(local_slurm, workdir, job, _args(strategy))
    assert differences(_final_state(workdir / "outputs" / job), reference(strategy)) == []


def test_srun_cyclic_distribution_layered_sgd_groups_follow_the_hosts(local_slurm, workdir, reference):
    # --distribution=cyclic puts ranks 0 and 2 on node0, 1 and 3 on node1: the node groups of layered SGD must
    # be {0, 2} and {1, 3} (contiguous blocks {0, 1}, {2, 3} would each span both nodes).
    job = "srun-cyclic-layered_sgd"
    log = _srun(local_slurm, workdir, job, _args("layered_sgd"), "--distribution=cyclic")
    groups = re.findall(r"layered SGD node groups: (\[.*\])", log.read_text())
    assert groups and groups[0] == "[[0, 2], [1, 3]]", groups
    # Same gradients, summed in another order ((g0 + g2) + (g1 + g3)): equal up to float rounding.
    final, ref = _final_state(workdir / "outputs" / job), reference("layered_sgd")
    assert set(final) == set(ref)
    for name in ref:
        torch.testing.assert_close(final[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_sbatch_script(local_slurm, workdir, reference):
    res = local_slurm.run(["sbatch", "--parsable", f"--chdir={workdir}", str(EXAMPLES / "train.sbatch"),
                           *_args("ddp")], env=node_env(), timeout=30)
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip().split(";")[0]
    state = local_slurm.wait_job(job_id, JOB_TIMEOUT)
    out = workdir / f"slurm-{job_id}.out"
    assert state == "COMPLETED", f"sbatch job {job_id}: {state}\n{out.read_text()[-4000:] if out.exists() else ''}"
    assert differences(_final_state(workdir / "outputs" / f"slurm-{job_id}"), reference("ddp")) == []


def test_submitit_sweep_two_values(local_slurm, workdir, reference):
    pytest.importorskip(
        "hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[slurm]' for the submitit launcher"
    )
    sweep = workdir / "sweep"
    log = workdir / "submitit.log"
    proc = local_slurm.popen(["bash", str(EXAMPLES / "submitit_sweep.sh"), *_args("ddp"), f"hydra.sweep.dir={sweep}"],
                             env=node_env(LRS="0.05,0.1"), cwd=workdir, stdout=open(log, "w"))
    _check_ok(_wait_all([proc], [log], 2 * JOB_TIMEOUT), [log])
    first, second = _final_state(sweep / "0"), _final_state(sweep / "1")
    assert differences(first, reference("ddp")) == [], "lr=0.05 is the recipe's own value: equal to the reference"
    assert differences(second, reference("ddp")), "lr=0.1 must train differently"


def test_srun_with_ntasks_only_is_rejected_with_a_hint(local_slurm, workdir):
    # Documented caveat: Lightning needs --ntasks-per-node; `srun -N2 -n4` fails on every rank with a hint.
    log = workdir / "srun-ntasks.log"
    proc = local_slurm.popen(
        ["srun", "--nodes=2", "--ntasks=4", "--kill-on-bad-exit=1", "python", "-m", "lightning_hpc", "train",
         "recipe=digits", "trainer.devices=2", "trainer.num_nodes=2", "hydra.run.dir=outputs/srun-ntasks", *SHORT],
        env=node_env(), cwd=workdir, stdout=open(log, "w"))
    (rc,) = _wait_all([proc], [log], JOB_TIMEOUT)
    assert rc != 0
    assert "HINT: Use `--ntasks-per-node" in log.read_text(), log.read_text()[-3000:]
