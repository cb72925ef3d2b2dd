"""Allreduce through HorovodCommunicator vs TorchDistributedCommunicator (2 CPU ranks, Gloo in both).

Cases: one tensor of 1e3 / 1e5 / 1e6 float32 elements, and 64 tensors of 1e4 elements in flight at once
(async allreduces, then wait; Horovod fuses them into one buffer, torch.distributed runs 64 Gloo allreduces).
Median wall time per case on rank 0 over ``--repeats`` timed calls, with a barrier before each call; the ratio
column is Horovod / torch in the same job.

    python bench/horovod_allreduce.py [--repeats 20]

Writes bench/results/horovod_allreduce.{json,csv,png}.  Needs Horovod (scripts/install-horovod.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CASES = {"1e3": (1, 1_000), "1e5": (1, 100_000), "1e6": (1, 1_000_000), "64x1e4": (64, 10_000)}


def measure(comm, repeats: int) -> dict[str, list[float]]:
    """Per case: wall seconds of each timed call (barrier first, so ranks start together)."""
    out = {}
    for name, (count, numel) in CASES.items():
        tensors = [torch.ones(numel) for _ in range(count)]
        samples = []
        for i in range(repeats + 2):
            comm.barrier()
            t0 = time.perf_counter()
            handles = [comm.allreduce(t, op="mean", async_op=True) for t in tensors]
            for h in handles:
                h.wait()
            if i >= 2:  # two warm-up calls
                samples.append(time.perf_counter() - t0)
        out[name] = samples
    return out


def _torch_worker(rank: int, world_size: int, repeats: int) -> dict[str, list[float]]:
    from lightning_hpc.distributed.comm import TorchDistributedCommunicator

    return measure(TorchDistributedCommunicator(), repeats)


def _horovod_worker(out_path: str, repeats: int) -> None:
    from lightning_hpc.distributed import get_communicator

    torch.set_num_threads(1)
    comm = get_communicator("horovod")
    result = measure(comm, repeats)
    if comm.rank == 0:
        Path(out_path).write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--horovod-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.horovod_worker:
        _horovod_worker(args.horovod_worker, args.repeats)
        return

    from harness import Report, Timing

    from lightning_hpc.distributed import run_in_processes

    out_json = REPO / "bench" / "results" / "tmp" / "horovod_allreduce_hvd.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    horovodrun = Path(sysconfig.get_path("scripts")) / "horovodrun"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [str(horovodrun), "-np", "2", "--gloo", sys.executable, __file__, "--horovod-worker", str(out_json),
         "--repeats", str(args.repeats)],
        check=True, env=env, timeout=600,
    )
    hvd = json.loads(out_json.read_text())
    ref = run_in_processes(_torch_worker, 2, args.repeats, timeout_s=600)[0]

    report = Report("horovod_allreduce")
    report.meta.update(world_size=2, repeats=args.repeats, note="2 shared CPU cores; medians of noisy timings")
    for case in CASES:
        for backend, samples in (("torch", ref[case]), ("horovod", hvd[case])):
            t = Timing(samples)
            report.add(case=case, backend=backend, label=f"{case} {backend}", median_ms=t.median * 1e3,
                       std_ms=t.std * 1e3)
    report.add_ratios("backend", "median_ms", baseline="torch", group_by=["case"])
    report.print(["case", "backend", "median_ms", "std_ms", "median_ms_vs_torch"])
    print(f"wrote {report.write()}")
    report.plot_bars("label", "median_ms", ylabel="median ms per allreduce call (rank 0)")


if __name__ == "__main__":
    main()
