"""Two ranks sharing one GPU, wherever gloo runs the strategy's collectives on CUDA tensors.

NCCL refuses two ranks on one device, so the two ranks talk over gloo: each is a "node" of one device
(``num_nodes=2, devices=1``, started as a cluster launcher would, ``LOCAL_RANK=0``), both on GPU 0.  Which
collectives gloo runs on CUDA tensors is probed first (``gloo_device_probe.py``); a strategy whose collectives
are all supported trains its conformance case on the two ranks, and its final parameters must equal the same case
on two CPU processes (which the conformance matrix proves equal to one process).  A strategy that needs a
collective gloo lacks on CUDA is skipped, naming the collective: it needs two GPUs and NCCL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import DEVICE, HERE, largest_difference, load_conformance

from lightning_hpc.distributed import find_free_port

launch = load_conformance("launch")

#: the collectives each strategy's code issues on the model's device (read from the package: ``lightning_hpc``'s
#: calls of torch.distributed, beside the communicator's all-reduce / broadcast; barriers carry no tensor)
NEEDS: dict[str, set[str]] = {
    "ddp:sgd": {"all_reduce", "broadcast"},
    "kfac_ddp:sgd": {"all_reduce", "broadcast"},
    "layered_sgd:sgd": {"all_reduce", "broadcast", "reduce"},
    "hybrid_fc:sgd": {"all_reduce", "broadcast", "all_gather", "all_to_all_single", "reduce_scatter_tensor",
                      "gather"},
    "spatial:sgd": {"all_reduce", "broadcast", "all_gather", "all_to_all_single", "isend_irecv"},
    "multigrid_pm:odenet": {"all_reduce", "broadcast", "all_gather", "send_recv", "isend_irecv"},
    # StochasticWeightAveraging keeps its copy on the host (its default) beside the model on the GPU: the split
    # copy's blocks travel through the GPU when gathered (checkpoints, the hand-back after the stage)
    "hybrid_fc:swa": {"all_reduce", "broadcast", "all_gather", "all_to_all_single", "reduce_scatter_tensor",
                      "gather"},
    "multigrid_pm:odenet_swa": {"all_reduce", "broadcast", "all_gather", "send_recv", "isend_irecv"},
}


def _env(rank: int, port: int, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in launch.LAUNCH_VARS and not k.startswith("SLURM_")}
    env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), PYTHONPATH=str(launch.REPO), OMP_NUM_THREADS="1", **extra)
    return env


def _start_pair(cmd: list[str], cwd: Path, extra: dict[str, str]) -> list[subprocess.Popen[str]]:
    port = find_free_port()
    return [subprocess.Popen(cmd, cwd=cwd, env=_env(r, port, extra), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for r in range(2)]


def _finish_pair(procs: list[subprocess.Popen[str]], timeout: float) -> str:
    """Both ranks' output; a pair still running after ``timeout`` seconds is killed and its log says so (a hang
    then costs one launch's limit and names the launch, instead of the tier's whole budget)."""
    logs = []
    try:
        for p in procs:
            try:
                out, _ = p.communicate(timeout=timeout)
                logs.append(f"exit code {p.returncode}\n{out[-6000:]}")
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                logs.append(f"TIMED OUT after {timeout:.0f} s (killed)\n{(out or '')[-6000:]}")
    finally:
        for p in procs:
            p.kill()
    return "\n--- rank\n".join(logs)


def _aborted(log: str) -> str:
    """The first line of a rank's log that says why it ended (gloo's abort names its transport error)."""
    for line in log.splitlines():
        if "what():" in line or "Error" in line or "Exception" in line:
            return line.strip()
    return log.strip().splitlines()[0] if log.strip() else "no output"


@pytest.fixture(scope="module")
def gloo_on_device(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("probe")
    names = sorted({n for needs in NEEDS.values() for n in needs} | {"gather", "reduce_scatter_tensor", "send_recv"})
    # one pair of processes per collective (a gloo abort ends only that pair), all pairs at once
    pairs = {name: _start_pair([sys.executable, str(HERE / "gloo_device_probe.py"), DEVICE, name,
                                str(out / f"{name}.json")], out, {}) for name in names}
    found: dict[str, str] = {}
    deadline = time.monotonic() + 90
    for name, procs in pairs.items():
        log = _finish_pair(procs, timeout=max(5.0, deadline - time.monotonic()))
        answer = out / f"{name}.json"
        found[name] = json.loads(answer.read_text())[name] if answer.exists() else f"aborted: {_aborted(log)}"
    print(f"gloo on {DEVICE} tensors: {found}")
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, gloo_on_device: dict[str, str]) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("shared_gpu")
    supported = [item for item, needs in NEEDS.items() if all(gloo_on_device.get(n) == "ok" for n in needs)]
    if not supported:
        return {}
    extra = {"CONFORMANCE_ACCELERATOR": DEVICE, "CONFORMANCE_NUM_NODES": "2", "CONFORMANCE_PG_BACKEND": "gloo",
             "PYTHONWARNINGS": "ignore"}
    # One launch per strategy, each in its own folder, all started together, each with its own limit: a hang
    # names its strategy and costs the slowest launch's time, not the sum.
    folders = {item: root / "shared" / item.replace(":", "_") for item in supported}
    started = {}
    for item, folder in folders.items():
        folder.mkdir(parents=True)
        started[item] = _start_pair([sys.executable, str(launch.SCRIPT), "1", str(folder), "2", item], folder, extra)
    cpu_log = launch.launch(2, root / "cpu", supported, data_parallel=2, log_name="cpu.log")
    deadline = time.monotonic() + 150  # the launches run together: one limit for all of them
    shared = {item: (folders[item], _finish_pair(procs, timeout=max(5.0, deadline - time.monotonic())))
              for item, procs in started.items()}
    return {"shared": shared, "cpu": (root / "cpu", cpu_log)}


@pytest.mark.parametrize("item", list(NEEDS))
def test_two_ranks_on_one_gpu_equal_two_cpu_processes(item: str, gloo_on_device: dict[str, str],
                                                      runs: dict[str, Any]) -> None:
    missing = sorted(n for n in NEEDS[item] if gloo_on_device.get(n) != "ok")
    if missing:
        pytest.skip(f"{item}: gloo has no {DEVICE} {', '.join(missing)} here ({gloo_on_device[missing[0]]}); "
                    "two ranks of this strategy need two GPUs and NCCL")
    strategy, case = item.split(":")
    (shared_out, shared_log), (cpu_out, cpu_log) = runs["shared"][item], runs["cpu"]
    shared = launch.read(shared_out, strategy, case, shared_log, world=2)
    cpu = launch.read(cpu_out, strategy, case, cpu_log, world=2)
    assert shared.error is None, f"{item} on two ranks sharing {DEVICE}:\n{shared.error}"
    assert cpu.error is None, f"{item} on two CPU processes:\n{cpu.error}"
    assert shared.ranks[0]["steps"] == cpu.ranks[0]["steps"] > 0
    diff, scale = largest_difference(shared.params(), cpu.params())
    assert diff <= 1e-9 * max(scale, 1.0), f"{item}: two ranks on {DEVICE} vs two CPU processes differ by {diff:.3e}"


def test_probe_checks_results(gloo_on_device: dict[str, str]) -> None:
    """The probe answers for every collective, and gloo's documented CUDA pair (all_reduce, broadcast) works."""
    assert set(gloo_on_device) >= {n for needs in NEEDS.values() for n in needs}
    assert gloo_on_device["all_reduce"] == gloo_on_device["broadcast"] == "ok"
    if DEVICE == "cpu":  # gloo runs every one of them on CPU tensors: the probe must say so
        assert set(gloo_on_device.values()) == {"ok"}, gloo_on_device
