"""Which collectives gloo runs on a device's tensors (two ranks started by ``test_two_ranks_share_gpu.py``).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python gloo_device_probe.py DEVICE COLLECTIVE OUT.json

One collective is tried on tensors of DEVICE and its result checked; rank 0 writes ``{name: "ok" | error}``.
One collective per pair of processes: gloo refuses some unsupported devices with a Python error, but on CUDA
tensors some of its transports abort the process (``writev ... Bad address`` from a device pointer on an H100),
which the launcher then records as that collective's answer.
"""

from __future__ import annotations

import datetime
import json
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist


def probes(device: torch.device, rank: int) -> dict[str, Callable[[], bool]]:
    def t(*values: float) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    def all_reduce() -> bool:
        x = t(rank + 1.0)
        dist.all_reduce(x)
        return float(x) == 3.0

    def broadcast() -> bool:
        x = t(rank + 5.0)
        dist.broadcast(x, src=0)
        return float(x) == 5.0

    def reduce() -> bool:
        x = t(rank + 1.0)
        dist.reduce(x, dst=0)
        return rank != 0 or float(x) == 3.0

    def all_gather() -> bool:
        out = [t(0.0), t(0.0)]
        dist.all_gather(out, t(float(rank)))
        return [float(o) for o in out] == [0.0, 1.0]

    def all_gather_into_tensor() -> bool:
        out = t(0.0, 0.0)
        dist.all_gather_into_tensor(out, t(float(rank)))
        return out.tolist() == [0.0, 1.0]

    def reduce_scatter_tensor() -> bool:
        out = t(0.0)
        dist.reduce_scatter_tensor(out, t(1.0, 2.0))
        return float(out) == 2.0 * (rank + 1)

    def all_to_all_single() -> bool:
        out = t(0.0, 0.0)
        dist.all_to_all_single(out, t(10.0 * rank, 10.0 * rank + 1))
        return out.tolist() == [float(rank), 10.0 + rank]

    def gather() -> bool:
        out = [t(0.0), t(0.0)] if rank == 0 else None
        dist.gather(t(float(rank)), out, dst=0)
        return rank != 0 or [float(o) for o in out or []] == [0.0, 1.0]

    def send_recv() -> bool:
        x = t(7.0) if rank == 0 else t(0.0)
        if rank == 0:
            dist.send(x, 1)
        else:
            dist.recv(x, 0)
        return float(x) == 7.0

    def isend_irecv() -> bool:
        x = t(8.0) if rank == 0 else t(0.0)
        (dist.isend(x, 1) if rank == 0 else dist.irecv(x, 0)).wait()
        return float(x) == 8.0

    return {f.__name__: f for f in (all_reduce, broadcast, reduce, all_gather, all_gather_into_tensor,
                                    reduce_scatter_tensor, all_to_all_single, gather, send_recv, isend_irecv)}


def main(device_name: str, name: str, out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    device = torch.device(device_name, 0) if device_name == "cuda" else torch.device(device_name)
    try:
        answer = "ok" if probes(device, rank)[name]() else "wrong result"
    except Exception as e:  # noqa: BLE001 - recorded: the probe's answer
        answer = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({name: answer}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
