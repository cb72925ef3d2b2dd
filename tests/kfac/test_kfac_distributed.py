"""2 and 4 gloo processes, every placement: parameters after several K-FAC steps equal one process on the same
global batch (1e-5), and steps that update nothing communicate nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kfac_checks import average_gradients_like_ddp
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.distributed.comm import TorchDistributedCommunicator
from lightning_hpc.kfac import PLACEMENTS, KFACPreconditioner

STEPS = 6
GLOBAL_BATCH = 16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 8, 3, stride=2), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 3 * 3, 12), nn.ReLU(), nn.Linear(12, 5),
    )  # fmt: skip


class VolumeThenSignal(nn.Module):
    """Conv3d layers (the second depthwise) and a ConvTranspose3d on a volume, its depth and height folded into
    channels, then a grouped Conv1d along the width."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.volume = nn.Sequential(nn.Conv3d(2, 3, 3, padding=1, padding_mode="replicate"), nn.ReLU(),
                                    nn.Conv3d(3, 3, 2, stride=(2, 2, 1), dilation=(1, 1, 2), groups=3), nn.ReLU())
        self.up = nn.ConvTranspose3d(3, 3, (1, 1, 2))  # widens 5 -> 6, as a decoder's upsampling
        self.signal = nn.Conv1d(3 * 2 * 3, 4, 3, padding=1, groups=2)
        self.head = nn.Linear(4 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.up(self.volume(x))  # (N, 3, 2, 3, 6)
        return self.head(torch.relu(self.signal(v.flatten(1, 3))).flatten(1))


def _data(step: int, volumes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    shape = (GLOBAL_BATCH, 2, 5, 7, 7) if volumes else (GLOBAL_BATCH, 2, 7, 7)
    return torch.randn(*shape, generator=g), torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)


class CountingCommunicator(TorchDistributedCommunicator):
    """Counts the collectives K-FAC issues, per optimizer step."""

    def __init__(self) -> None:
        self.calls = 0

    def allreduce(self, *a, **k):
        self.calls += 1
        return super().allreduce(*a, **k)

    def broadcast(self, *a, **k):
        self.calls += 1
        return super().broadcast(*a, **k)


def _train(rank: int, world_size: int, placement: str, method: str,
           volumes: bool = False) -> tuple[list[torch.Tensor], list[int]]:
    model = VolumeThenSignal() if volumes else _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    comm = CountingCommunicator()
    pre = KFACPreconditioner(
        model, optimizer=opt, factor_update_freq=2, inv_update_freq=4, damping=0.05, kl_clip=0.01,
        placement=placement, compute_method=method, communicator=comm,
    )  # fmt: skip
    per_rank = GLOBAL_BATCH // world_size
    calls = []
    for step in range(STEPS):
        x, y = _data(step, volumes)
        x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        average_gradients_like_ddp(model)  # the strategy's gradient allreduce
        before = comm.calls
        pre.step()
        calls.append(comm.calls - before)
        opt.step()
    return [p.detach().clone() for p in model.parameters()], calls


def _reference(method: str) -> list[torch.Tensor]:
    params, _ = _train(0, 1, "balanced", method)
    return params


def _run_all(rank: int, world_size: int, methods: tuple[str, ...]) -> dict:
    torch.set_num_threads(1)
    out = {}
    for pl in PLACEMENTS:
        for m in methods:
            params, calls = _train(rank, world_size, pl, m)
            # numpy, not tensors: tensors cross the result queue through shared memory that dies with the rank
            out[(pl, m)] = ([p.numpy() for p in params], calls)
    return out


# The inverse method shares the code paths of the eigen one except the local math: 2 ranks suffice for it.
@pytest.mark.parametrize("world_size,methods", [(2, ("eigen", "inverse")), (4, ("eigen",))])
def test_parameters_equal_single_process_for_every_placement(world_size, methods):
    refs = {m: _reference(m) for m in methods}
    results = run_in_processes(_run_all, world_size, methods, timeout_s=300, collective_timeout_s=120)
    for (placement, method), (params, calls) in results[0].items():
        for got, want in zip(params, refs[method]):
            torch.testing.assert_close(
                torch.from_numpy(got), want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{placement}/{method}: {m}"
            )
        for other in results[1:]:  # every rank holds the same parameters
            for a, b in zip(other[(placement, method)][0], params):
                torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=0, atol=1e-6)
        # step 0: factors + decompositions; step 1: nothing; 2: factors; 3: nothing; 4: both; 5: nothing
        quiet = [calls[s] for s in (1, 3, 5)]
        if placement == "layer_wise":
            assert all(c > 0 for c in quiet)  # K-FAC-lw broadcasts preconditioned gradients every step
        else:
            assert quiet == [0, 0, 0], f"{placement}/{method}: steps without updates communicated: {calls}"
            assert calls[0] > 0 and calls[2] > 0 and calls[4] > calls[2]


def _volumes(rank: int, world_size: int) -> list:
    torch.set_num_threads(1)
    return [p.numpy() for p in _train(rank, world_size, "balanced", "eigen", volumes=True)[0]]


def test_volume_signal_and_grouped_layers_equal_single_process():
    """Conv3d (padding mode, stride, dilation, depthwise), ConvTranspose3d and grouped Conv1d layers preconditioned
    on 2 processes equal one process."""
    ref, _ = _train(0, 1, "balanced", "eigen", volumes=True)
    pre = KFACPreconditioner(VolumeThenSignal(), announce=False)
    assert [h.name for h in pre.handlers] == ["volume.0", "volume.2", "up", "signal", "head"]
    for got, want in zip(run_in_processes(_volumes, 2, timeout_s=300)[0], ref):
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-5, atol=1e-5)
