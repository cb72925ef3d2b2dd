"""K-FAC and layered SGD with their collectives on Horovod, and the backend following the strategy.

- K-FAC core (every placement) on HorovodCommunicator equals K-FAC on torch.distributed (1e-5), 2 ranks.
- The K-FAC callback with ``communicator="auto"`` runs on Horovod under ``strategy="horovod"`` (training equal to
  one process: the conformance matrix's ``kfac_horovod`` cells).
- Layered SGD's core (hierarchical allreduce on Horovod process sets, postponed update) equals synchronous SGD
  in one process (1e-6, float64), 4 ranks as 2 groups x 2.
- ``LayeredSGDStrategy`` launched by ``horovodrun`` takes its ranks from Horovod, picks Horovod process sets by
  itself and equals synchronous SGD (1e-6).
"""

from __future__ import annotations

import sys

import pytest
import torch
from hvd_launch import WORKERS, requires_horovod

from lightning_hpc.distributed import run_in_processes

pytestmark = [pytest.mark.horovod, requires_horovod]

sys.path.insert(0, str(WORKERS))
import kfac_case  # noqa: E402
import layered_case  # noqa: E402
import layered_trainer  # noqa: E402


def _close(got, want, tol: float, what: str) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(
            torch.as_tensor(a), torch.as_tensor(b), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}"
        )


def test_kfac_on_horovod_equals_kfac_on_torch_distributed(two_ranks):
    hvd = two_ranks.ranks("kfac_case")
    ref = run_in_processes(kfac_case.torch_case, 2, timeout_s=300, collective_timeout_s=120)
    initial = [p.detach() for p in kfac_case.model().parameters()]
    assert set(hvd[0]) == set(ref[0]) == {*kfac_case.PLACEMENTS, "balanced+overlap"}
    for placement in ref[0]:
        assert any(not torch.allclose(torch.as_tensor(a), b) for a, b in zip(ref[0][placement], initial))
        for rank in range(2):
            _close(hvd[rank][placement], ref[rank][placement], 1e-5, f"{placement} rank {rank}")
        _close(hvd[1][placement], hvd[0][placement], 1e-6, f"{placement}: ranks differ")


def test_kfac_callback_follows_the_strategy(two_ranks):
    """Under ``strategy="horovod"`` the callback's ``communicator="auto"`` is Horovod's.  That it trains as under
    ``ddp`` is the conformance matrix's: its ``kfac_horovod`` and ``kfac_ddp`` cells each equal one K-FAC process
    (1e-9), with the callback's default communicator; ``ddp`` picking torch.distributed: test_backend_select.py."""
    runs = two_ranks.ranks("kfac_callback")
    for rank in range(2):
        assert runs[rank]["kfac_comm"] == "HorovodCommunicator"
    _close([runs[1]["params"][k] for k in sorted(runs[1]["params"])],
           [runs[0]["params"][k] for k in sorted(runs[0]["params"])], 1e-6, "ranks differ")


def test_layered_sgd_on_horovod_process_sets_equals_synchronous_sgd(four_ranks):
    hvd = four_ranks.ranks("layered_case")
    serial = layered_case.serial()
    initial = [p.detach().numpy() for p in layered_case.model().parameters()]
    assert any(not torch.allclose(torch.as_tensor(s), torch.as_tensor(i)) for s, i in zip(serial, initial))
    for rank, got in enumerate(hvd):
        assert got["intra_group"] == "ProcessSet"
        assert got["leaders_group"] == ("ProcessSet" if rank in (0, 2) else None)
        _close(got["params"], serial, 1e-6, f"rank {rank}")


def _serial_layered_trainer() -> list[torch.Tensor]:
    """Synchronous SGD in one process on the union of the ranks' batches (Lightning's DistributedSampler)."""
    from torch.utils.data import DistributedSampler

    lt = layered_trainer
    data, net = lt.dataset(), lt.net()
    opt, sched = lt.optim(net.parameters())
    shards = [list(DistributedSampler(data, lt.WORLD, r, shuffle=True, seed=0)) for r in range(lt.WORLD)]
    x, y = data.tensors
    for b in range(lt.BATCHES):
        idx = [i for shard in shards for i in shard[b * lt.LOCAL_BATCH : (b + 1) * lt.LOCAL_BATCH]]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        opt.step()
        sched.step()
    return [p.detach() for p in net.parameters()]


def test_layered_sgd_strategy_under_horovodrun_picks_horovod_process_sets(four_ranks):
    hvd = four_ranks.ranks("layered_trainer")
    serial = _serial_layered_trainer()
    for rank, got in enumerate(hvd):
        assert got["rank"] == rank and got["world_size"] == 4 and got["global_step"] == layered_trainer.BATCHES
        assert got["comm"] == "HorovodCommunicator" and got["intra_group"] == "ProcessSet"
        _close(got["params"], serial, 1e-6, f"rank {rank}")
