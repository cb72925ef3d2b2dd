"""HorovodStrategy under ``horovodrun -np 2 --gloo`` against Lightning's DDP on the same data and seeds.

One Horovod run (the first case of the shared 2-process launch, conftest.py) and one DDP run (2 processes each) of
ImageClassifier(small_cnn) on digits: 2 epochs x 5 batches of 16 per rank with accumulate_grad_batches=2 (each
epoch ends on an incomplete accumulation window), SGD with momentum and weight decay, a StepLR schedule, dropout
and BatchNorm, and different initial weights on each rank (both strategies must start from rank 0's).
"""

from __future__ import annotations

import sys

import pytest
import torch
from hvd_launch import (
    DIGITS_ACCUMULATE,
    DIGITS_ARGS,
    DIGITS_BATCHES,
    DIGITS_EPOCHS,
    REPO,
    WORKERS,
    finish,
    horovodrun_command,
    requires_horovod,
    start,
)

from lightning_hpc.distributed import run_in_processes

pytestmark = [pytest.mark.horovod, requires_horovod]

EPOCHS, BATCHES, ACCUMULATE = DIGITS_EPOCHS, DIGITS_BATCHES, DIGITS_ACCUMULATE
BATCH_SIZE = 16  # train_digits.py's
SCRIPT = str(WORKERS / "train_digits.py")


def _ddp_rank(rank: int, world: int, out: str) -> None:
    sys.path.insert(0, str(WORKERS))
    import train_digits

    train_digits.main([out, "--strategy", "ddp", *DIGITS_ARGS])


@pytest.fixture(scope="module")
def runs(two_ranks, tmp_path_factory):
    """{"horovod": [rank0, rank1], "ddp": [rank0, rank1], "dir": {...}}: the Horovod run is the ``digits_vs_ddp``
    case of the shared 2-process launch (with :data:`hvd_launch.HVD_OPTIONS`); the DDP run's 2 ranks fork from the
    forkserver (Lightning imported there once) into a process group that Lightning takes as launched externally."""
    root = tmp_path_factory.mktemp("ddp_reference")
    run_in_processes(_ddp_rank, 2, str(root / "ddp"), timeout_s=420, collective_timeout_s=120,
                     env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    return {
        "horovod": two_ranks.ranks("digits_vs_ddp"),
        "ddp": [torch.load(root / "ddp" / f"rank{r}.pt", weights_only=False) for r in range(2)],
        "dir": {"horovod": two_ranks.case_dir("digits_vs_ddp"), "ddp": root / "ddp"},
    }


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def test_parameters_equal_ddp(runs):
    for rank in range(2):
        hvd, ddp = runs["horovod"][rank], runs["ddp"][rank]
        assert hvd["strategy"] == "HorovodStrategy" and ddp["strategy"] == "DDPStrategy"
        assert hvd["world_size"] == 2 and hvd["rank"] == rank
        assert _max_diff(hvd["params"], ddp["params"]) <= 1e-6
        # optimizer steps: ceil(5 / 2) = 3 per epoch, the last one on an incomplete window, as DDP
        assert hvd["global_step"] == ddp["global_step"] == EPOCHS * 3
        # the StepLR schedule followed the Horovod optimizer: 0.05 * 0.5 ** (6 // 2)
        assert hvd["lr"] == pytest.approx(ddp["lr"]) and hvd["lr"][0] == pytest.approx(0.05 * 0.5**3)
    opt = runs["horovod"][0]["hvd_optimizer"]
    assert opt["groups"] == 2 and opt["backward_passes_per_step"] == ACCUMULATE
    assert opt["fusion_threshold"] == str(1024 * 1024) and opt["cycle_time"] == "2"
    # gradients were averaged: both ranks end identical although they read different data
    assert _max_diff(runs["horovod"][0]["params"], runs["horovod"][1]["params"]) == 0.0
    # rank 0's BatchNorm statistics are broadcast before each forward, as DDP(broadcast_buffers=True)
    assert _max_diff(runs["horovod"][0]["buffers"], runs["ddp"][0]["buffers"]) <= 1e-6


def test_each_rank_reads_its_own_shard(runs):
    per_epoch = BATCHES * BATCH_SIZE
    seen = [runs["horovod"][r]["seen"] for r in range(2)]
    assert [len(s) for s in seen] == [EPOCHS * per_epoch] * 2
    for epoch in range(EPOCHS):
        shards = [set(s[epoch * per_epoch : (epoch + 1) * per_epoch]) for s in seen]
        assert len(shards[0]) == len(shards[1]) == per_epoch
        assert not shards[0] & shards[1], f"epoch {epoch}: ranks read the same samples"
    assert runs["horovod"][0]["sampler_kwargs"] == {"num_replicas": 2, "rank": 0}
    assert runs["horovod"][1]["sampler_kwargs"] == {"num_replicas": 2, "rank": 1}
    # the same shards (and order) as DDP's DistributedSampler
    for rank in range(2):
        assert runs["horovod"][rank]["seen"] == runs["ddp"][rank]["seen"]


def test_logged_metrics_and_collectives_reduce_like_ddp(runs):
    for rank in range(2):
        hvd, ddp = runs["horovod"][rank], runs["ddp"][rank]
        # val/loss: self.log(sync_dist=True) -> strategy.reduce; val/acc: torchmetrics state sync
        for key in ("val/loss", "val/acc", "val/acc_top5", "train/acc"):
            assert hvd["metrics"][key] == pytest.approx(ddp["metrics"][key], abs=1e-6), key
            assert hvd["metrics"][key] == pytest.approx(runs["horovod"][0]["metrics"][key], abs=1e-6), key
        assert hvd["reduced_rank_sum"] == 1.0
        assert hvd["gathered"] == [0.0, 1.0]
        assert hvd["broadcast"] == {"from": 1}


def test_checkpoint_written_by_rank0_only_and_loads_in_one_process(runs):
    assert runs["horovod"][0]["saves"] == runs["ddp"][0]["saves"] >= 1
    assert runs["horovod"][1]["saves"] == runs["ddp"][1]["saves"] == 0
    path = runs["dir"]["horovod"] / "ckpt" / "last.ckpt"
    assert path.exists()

    from lightning_hpc import ImageClassifier
    from lightning_hpc.models import small_cnn

    restored = ImageClassifier.load_from_checkpoint(path, model=small_cnn(1, 10), map_location="cpu")
    params = {k: v.detach() for k, v in restored.model.named_parameters()}
    assert _max_diff(params, runs["horovod"][0]["params"]) == 0.0
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == EPOCHS * 3
    plain = torch.optim.SGD(restored.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    plain.load_state_dict(ckpt["optimizer_states"][0])  # a plain torch optimizer reads Horovod's state
    assert all("momentum_buffer" in s for s in plain.state.values())
    restored.eval()
    with torch.no_grad():
        assert torch.isfinite(restored(torch.randn(4, 1, 8, 8))).all()


@pytest.mark.slow
def test_fp16_compression_stays_close_to_ddp(runs, tmp_path):
    """fp16 gradient compression (Horovod's Compression.fp16) changes rounding only: close to DDP, not equal."""
    finish(start([*horovodrun_command(2), sys.executable, SCRIPT, str(tmp_path), "--strategy", "horovod",
                  "--hvd-options", '{"compression": "fp16"}', *DIGITS_ARGS]), timeout_s=420)
    hvd = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert hvd["hvd_optimizer"]["compression"] == "FP16Compressor"
    diff = _max_diff(hvd["params"], runs["ddp"][0]["params"])
    assert 0.0 < diff <= 1e-3


@pytest.mark.slow
def test_ddp_under_horovodrun_with_horovod_environment(runs, tmp_path):
    """DDP-derived strategies run under horovodrun: HorovodEnvironment gives ranks and a torch rendezvous."""
    finish(start([*horovodrun_command(2), sys.executable, SCRIPT, str(tmp_path), "--strategy", "ddp_under_horovodrun",
                  *DIGITS_ARGS]), timeout_s=420)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert got["strategy"] == "DDPStrategy" and got["rank"] == rank and got["world_size"] == 2
        assert _max_diff(got["params"], runs["ddp"][rank]["params"]) <= 1e-6
        assert got["seen"] == runs["ddp"][rank]["seen"]
