"""Gradient-norm clipping over replicated parameters and shards (``distributed/clip.py``): on 3 ranks that hold the
same replicated gradients and one shard each (uneven shards), the norm and the clipped gradients equal
``torch.nn.utils.clip_grad_norm_`` over the whole model on one process, for the 1-, 2- and infinity norms, with and
without clipping."""

import math

import torch

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.distributed.clip import clip_grad_norm_, global_grad_norm

NORMS = (1.0, 2.0, math.inf)
SHARD_ROWS = (3, 1, 2)


def _whole() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The replicated gradients and every rank's shard (float64). Rank 1's shard holds the largest entry, so the
    infinity norm is one rank's alone and the others' must not be added to it."""
    g = torch.Generator().manual_seed(0)
    replicated = [torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(5, generator=g,
                                                                                   dtype=torch.float64)]
    shards = [torch.randn(r, 3, generator=g, dtype=torch.float64) for r in SHARD_ROWS]
    shards[1][0, 1] = 25.0
    return replicated, shards


def _params(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    out = []
    for grad in grads:
        p = torch.nn.Parameter(torch.zeros_like(grad))
        p.grad = grad.clone()
        out.append(p)
    return out


def _one_process(norm_type: float, max_norm: float) -> tuple[float, list[torch.Tensor]]:
    replicated, shards = _whole()
    params = _params(replicated + shards)
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    return float(total), [p.grad for p in params]


def _rank(rank: int, world: int) -> dict[tuple[float, float], tuple[float, float, list[torch.Tensor]]]:
    out = {}
    for norm_type in NORMS:
        for max_norm in (1.0, 1e9):  # clipped, and left as it is
            replicated, shards = _whole()
            rep, mine = _params(replicated), _params([shards[rank]])
            norm = float(global_grad_norm(rep, mine, norm_type=norm_type))
            total = float(clip_grad_norm_(rep, mine, max_norm, norm_type=norm_type))
            out[(norm_type, max_norm)] = (norm, total, [p.grad for p in rep + mine])
    return out


def test_clip_grad_norm_over_shards_equals_one_process():
    results = run_in_processes(_rank, len(SHARD_ROWS))
    for (norm_type, max_norm), _ in results[0].items():
        total, grads = _one_process(norm_type, max_norm)
        for rank, res in enumerate(results):
            norm, clipped_total, got = res[(norm_type, max_norm)]
            assert math.isclose(norm, total, rel_tol=1e-12), (rank, norm_type, norm, total)
            assert math.isclose(clipped_total, total, rel_tol=1e-12), (rank, norm_type)
            # the replicated gradients, then this rank's shard (the one-process list: replicated, then shards)
            expected = grads[:2] + [grads[2 + rank]]
            for a, b in zip(got, expected, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
        if max_norm == 1.0:
            assert total > 1.0, "the clipped case must clip"
