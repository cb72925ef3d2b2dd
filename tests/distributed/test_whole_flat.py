"""The whole model's flat vectors LBFGS computes with under a split model (``distributed/whole_flat.py``): on 3
ranks holding uneven row blocks and column blocks of two tensors, unequal shares of stacked blocks between
replicated tensors, and a split tensor without a gradient, the flat gradient is one process's flat gradient of the
whole tensors (in its order, bit for bit), a flat update adds to every block its slice of the whole update, and
the loss is the mean of the ranks' losses."""

from __future__ import annotations

import torch
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.distributed.partitioned import STACKED, as_block_parameter, local_block

K = 3
#: one process's parameters in its order: (name, shape, how it is split: "replicated", a dim, or "stacked")
WHOLE = [("a", (3,), "replicated"), ("rows", (7, 4), 0), ("cols", (5, 7), 1),
         *[(f"step{i}.{n}", shape, STACKED) for i in range(4) for n, shape in (("w", (2, 2)), ("b", (2,)))],
         ("c", (4,), "replicated"), ("unused", (5,), 0)]
#: the steps each rank holds (unequal shares: the view does not assume equal ones)
STEPS = {0: [0, 1], 1: [2], 2: [3]}


def _whole(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g, dtype=torch.float64) for name, shape, _ in WHOLE}


def _mine(t: torch.Tensor, how: object, rank: int) -> torch.Tensor:
    if not isinstance(how, int):
        return t.clone()
    a, b = block_bounds(t.shape[how], K)[rank]
    return t.narrow(how, a, b - a).clone()


def _rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from lightning_hpc.distributed.whole_flat import WholeFlatView

    values, grads, update = _whole(0), _whole(1), torch.randn(sum(v.numel() for v in _whole(0).values()),
                                                              generator=torch.Generator().manual_seed(2),
                                                              dtype=torch.float64)
    params = []
    for name, _, how in WHOLE:
        if how == STACKED and int(name[4:name.index(".")]) not in STEPS[rank]:
            continue
        p = nn.Parameter(_mine(values[name], how, rank))
        if how != "replicated":
            p = as_block_parameter(p, dist.group.WORLD, dim=how)  # type: ignore[arg-type]
        if name != "unused":
            p.grad = _mine(grads[name], how, rank)
        params.append(p)
    view = WholeFlatView(params, None)
    flat = view.flat_grad()
    view.add(0.5, update)
    loss = view.average_loss(torch.tensor(float(rank + 1), dtype=torch.float64))
    return {"flat": flat, "params": [local_block(p).detach().clone() for p in params], "loss": float(loss)}


def test_whole_flat_gradient_update_and_loss_are_one_process_s():
    out = run_in_processes(_rank, K)
    values, grads = _whole(0), _whole(1)
    grads["unused"] = torch.zeros_like(grads["unused"])
    expected_flat = torch.cat([grads[name].reshape(-1) for name, _, _ in WHOLE])
    update = torch.randn(expected_flat.numel(), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    stepped, offset = {}, 0
    for name, shape, _ in WHOLE:  # one process's LBFGS._add_grad
        n = values[name].numel()
        stepped[name] = values[name].add(update[offset : offset + n].view(shape), alpha=0.5)
        offset += n
    for rank, got in enumerate(out):
        assert torch.equal(got["flat"], expected_flat), rank
        mine = [(name, how) for name, _, how in WHOLE
                if how != STACKED or int(name[4:name.index(".")]) in STEPS[rank]]
        assert len(got["params"]) == len(mine), rank
        for p, (name, how) in zip(got["params"], mine):
            assert torch.equal(p, _mine(stepped[name], how, rank)), (rank, name)
        assert got["loss"] == 2.0, rank
