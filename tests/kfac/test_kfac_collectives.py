"""Symmetry-aware factor all-reduce: the upper triangles only, about half the bytes at the collective, the same
factors and parameters as reducing the full matrices (2 gloo processes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kfac_checks import average_gradients_like_ddp
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.distributed.comm import TorchDistributedCommunicator
from lightning_hpc.kfac import KFACPreconditioner


class ByteCounter(TorchDistributedCommunicator):
    """Counts the bytes K-FAC hands to allreduce."""

    def __init__(self) -> None:
        self.allreduce_bytes = 0

    def allreduce(self, tensor, op="mean", group=None, async_op=False):
        if op == "mean":  # the factor average (not the per-layer "hooks fired" flags, a sum)
            self.allreduce_bytes += tensor.numel() * tensor.element_size()
        return super().allreduce(tensor, op=op, group=group, async_op=async_op)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 5 * 5, 12), nn.ReLU(), nn.Linear(12, 4)
    )


def _run(rank: int, world_size: int) -> dict:
    out = {}
    for symmetric in (True, False):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        comm = ByteCounter()
        pre = KFACPreconditioner(
            model,
            optimizer=opt,
            factor_update_freq=1,
            inv_update_freq=2,
            damping=0.05,
            kl_clip=0.01,
            communicator=comm,
            symmetric_allreduce=symmetric,
            announce=False,
        )
        for step in range(4):
            g = torch.Generator().manual_seed(step * 10 + rank)
            x, y = torch.randn(8, 2, 5, 5, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            average_gradients_like_ddp(model)  # the strategy's gradient allreduce
            pre.step()
            opt.step()
        out[symmetric] = (
            comm.allreduce_bytes,
            {n: {k: v.numpy().copy() for k, v in f.items()} for n, f in pre.factors.items()},
            [p.detach().numpy().copy() for p in model.parameters()],
        )
    return out


def test_upper_triangle_allreduce_halves_the_bytes_and_changes_nothing():
    results = run_in_processes(_run, 2, timeout_s=180, collective_timeout_s=60)
    for res in results:
        (sym_bytes, sym_factors, sym_params), (full_bytes, full_factors, full_params) = res[True], res[False]
        sides = [v.shape[0] for f in full_factors.values() for v in f.values()]
        # 4 factor steps: n (n + 1) / 2 of n^2 float32 elements per factor
        assert full_bytes == 4 * 4 * sum(n * n for n in sides)
        assert sym_bytes == 4 * 4 * sum(n * (n + 1) // 2 for n in sides)
        assert sym_bytes < 0.56 * full_bytes
        for name in full_factors:
            for k in full_factors[name]:
                torch.testing.assert_close(
                    torch.from_numpy(sym_factors[name][k]),
                    torch.from_numpy(full_factors[name][k]),
                    rtol=1e-6,
                    atol=1e-7,
                )
        for a, b in zip(sym_params, full_params):
            torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-5, atol=1e-6)
