"""``start_equal``: every rank ends with rank 0's parameters and buffers (mixed dtypes, a tied parameter, a
skipped shard that must stay different), in one broadcast per dtype."""

from __future__ import annotations

import torch
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.distributed.start_equal import module_state_tensors, start_equal


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(3, 3, bias=False), nn.Linear(3, 3))
    m[4].weight = m[3].weight  # tied
    m.register_buffer("steps", torch.tensor([seed], dtype=torch.int64))
    m.register_buffer("scale", torch.full((2,), float(seed), dtype=torch.float64))
    m.shard = nn.Parameter(torch.full((2,), float(seed)))  # meant to differ between ranks
    return m


def _run(rank, world):
    import torch.distributed as dist

    m = _model(100 + rank)
    calls = []
    original = dist.broadcast

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return original(*args, **kwargs)

    dist.broadcast = counting
    try:
        start_equal(module_state_tensors(m, skip=[m.shard]))
    finally:
        dist.broadcast = original
    return {k: v.clone() for k, v in m.state_dict().items()}, calls


def test_every_rank_starts_from_rank_0():
    (r0, calls0), (r1, calls1) = run_in_processes(_run, 2)
    ref = {k: v for k, v in _model(100).state_dict().items()}
    for k in ref:
        if k == "shard":
            continue
        assert torch.equal(r0[k], ref[k]) and torch.equal(r1[k], ref[k]), k
    assert torch.equal(r1["shard"], torch.full((2,), 101.0)), "a skipped tensor was overwritten"
    assert r1["4.weight"].data_ptr() != 0 and torch.equal(r1["3.weight"], r1["4.weight"])
    assert sorted(map(str, calls0)) == ["torch.float32", "torch.float64", "torch.int64"], calls0


def _generators(rank, world):
    from lightning_hpc.distributed.start_equal import start_equal_generators

    torch.manual_seed(1000 + rank)  # every rank seeded apart, as processes started without a common seed are
    start_equal_generators(torch.device("cpu"))
    return torch.rand(5, dtype=torch.float64), torch.randn(3)


def test_generators_start_from_rank_0s_state():
    """After ``start_equal_generators`` every rank draws what rank 0 would have drawn from its own seed (a model's
    dropout masks and ``rand_like`` then agree over the ranks)."""
    torch.manual_seed(1000)
    expected = torch.rand(5, dtype=torch.float64), torch.randn(3)
    for rank, (uniform, normal) in enumerate(run_in_processes(_generators, 2)):
        assert torch.equal(uniform, expected[0]) and torch.equal(normal, expected[1]), rank
