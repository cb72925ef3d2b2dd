"""Point-to-point exchanges go out as one batch (``batch_isend_irecv``), the form NCCL needs when two ranks both
send to and receive from each other; every exchange of the package goes through it."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.distributed.p2p import exchange

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_hpc"


def _swap(rank: int, world_size: int) -> tuple[list[float], int]:
    batches = []
    real = dist.batch_isend_irecv

    def spy(ops):  # counts the batches, and checks a batch holds both directions of the pair
        batches.append(sorted(op.op.__name__ for op in ops))
        return real(ops)

    dist.batch_isend_irecv = spy
    peer = 1 - rank
    mine, theirs = torch.full((3,), float(rank + 1)), torch.zeros(3)
    extra_in, extra_out = torch.zeros(1), torch.tensor([10.0 * (rank + 1)])
    for w in exchange([(mine, peer, 5), (extra_out, peer, 6)], [(theirs, peer, 5), (extra_in, peer, 6)], None):
        w.wait()
    return [*theirs.tolist(), *extra_in.tolist()], len(batches) if batches[0] == ["irecv", "irecv", "isend",
                                                                                    "isend"] else -1


def test_two_ranks_swap_in_one_batch():
    results = run_in_processes(_swap, 2)
    assert results[0] == ([2.0, 2.0, 2.0, 20.0], 1)
    assert results[1] == ([1.0, 1.0, 1.0, 10.0], 1)


def test_the_package_posts_no_unbatched_point_to_point_with_a_reply():
    """``dist.isend`` / ``dist.irecv`` appear only in ``distributed/p2p.py`` and in multigrid's one-way chain
    (rank i sends to i + 1 and receives from i - 1: no pair both sends and receives, so NCCL cannot deadlock)."""
    allowed = {"distributed/p2p.py", "multigrid/parallel.py"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("isend", "irecv") and rel not in allowed:
                found.append(f"{rel}:{node.lineno} {node.attr}")
    assert not found, found
