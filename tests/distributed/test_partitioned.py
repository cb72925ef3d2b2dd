"""Blocks that know their partition (``distributed/partitioned.py``): on 3 ranks holding uneven row blocks of one
float64 tensor, every reduction over all elements (of the parameter, its gradient and element-wise results of
them) equals the whole tensor's on one process, the gradient of a penalty over the whole tensor is the whole
tensor's gradient restricted to the block, reductions along a dimension are the whole tensor's where the blocks'
layout is known (rows, columns or stacked blocks: a per-class ``w.norm(dim=1)`` penalty) and refused where it is
not, and the layer's own math (``F.linear``, optimizers, deep copies) sees the block."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.distributed.partitioned import STACKED, BlockTensor, as_block_parameter, local_block

ROWS, COLS = 7, 4  # blocks of 3, 2, 2 rows over 3 ranks (torch.chunk would give 3, 3, 1)


def _full() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, COLS, generator=g, dtype=torch.float64), torch.randn(5, COLS, generator=g,
                                                                                  dtype=torch.float64)


def _reductions(w: torch.Tensor) -> dict[str, float]:
    """What user code asks of a parameter and its gradient (plain floats)."""
    g = w.grad
    assert g is not None
    values = {
        "grad.norm": g.norm(),
        "grad.data.norm(1)": g.data.norm(1),
        "vector_norm(grad, 3)": torch.linalg.vector_norm(g, 3),
        "linalg.norm(grad)": torch.linalg.norm(g),
        "grad inf-norm": torch.linalg.vector_norm(g, float("inf")),
        "pow(2).sum": w.pow(2).sum(),
        "(grad * w).sum": (g * w).sum(),
        "mean": w.mean(),
        "max": w.max(),
        "amin": w.amin(),
        "detach().clone().abs().sum": w.detach().clone().abs().sum(),
        "sum(dtype=float32)": w.sum(dtype=torch.float32),
        # Lightning's grad_norm (torch.tensor over the per-parameter norms) and torch's clipping (nothing clipped)
        "lightning grad_norm total": _lightning_grad_norm(w),
        "clip_grad_norm_": torch.nn.utils.clip_grad_norm_([w], max_norm=1e9),
    }
    return {k: float(v.detach()) if isinstance(v, torch.Tensor) else v for k, v in values.items()}


def _lightning_grad_norm(w: nn.Parameter) -> torch.Tensor:
    from lightning.pytorch.utilities import grad_norm

    holder = nn.Module()
    holder.w = w
    return grad_norm(holder, 2)["grad_2.0_norm_total"]


def _one_process() -> tuple[dict[str, float], torch.Tensor]:
    full, x = _full()
    w = nn.Parameter(full.clone())
    F.linear(x, w).pow(2).sum().backward()
    values = _reductions(w)
    w.grad = None
    (w.pow(2).sum() * 0.5).backward()  # the penalty's gradient
    return values, w.grad


def _ranks(rank: int, world: int) -> dict:
    full, x = _full()
    a, b = block_bounds(ROWS, world)[rank]
    w = as_block_parameter(nn.Parameter(full[a:b].clone()), None, dim=0)
    out = F.linear(x, w)
    assert type(out) is torch.Tensor  # the layer's product is the plain block's
    out.pow(2).sum().backward()  # each rank's block of the output: its rows' gradient, as on one process
    assert isinstance(w.grad, BlockTensor) and isinstance(w.grad.data, BlockTensor)
    values = _reductions(w)
    w.grad = None
    penalty = w.pow(2).sum() * 0.5
    assert type(penalty) is torch.Tensor
    penalty.backward()
    refused = []
    unknown = as_block_parameter(nn.Parameter(full[a:b].clone()), None)  # a partition whose layout is not given
    for name, call in (("sum(0), layout unknown", lambda: unknown.sum(0)), ("max(dim=0)", lambda: w.max(0)),
                       ("matrix 2-norm", lambda: torch.linalg.norm(w, 2)), ("std", lambda: w.std())):
        with pytest.raises(RuntimeError, match="local_block"):
            call()
        refused.append(name)
    clone = copy.deepcopy(w)
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    opt.step()
    return {"values": values, "penalty_grad": local_block(w.grad).clone(), "rows": (a, b), "refused": refused,
            "copy": (type(clone).__name__, isinstance(clone, nn.Parameter), clone._partition is w._partition),
            "momentum": type(opt.state[w]["momentum_buffer"]).__name__,
            "plain_norm": float(local_block(w.grad).norm())}


def test_whole_tensor_reductions_on_uneven_blocks():
    expected, penalty_grad = _one_process()
    out = run_in_processes(_ranks, 3)
    for rank, got in enumerate(out):
        for name, value in expected.items():
            assert got["values"][name] == pytest.approx(value, rel=1e-12, abs=1e-12), (rank, name)
        a, b = got["rows"]
        assert torch.allclose(got["penalty_grad"], penalty_grad[a:b], rtol=0, atol=1e-15)
        assert got["copy"] == ("BlockTensor", True, True)
        assert got["momentum"] == "BlockTensor"
        assert len(got["refused"]) == 4
    # the control: the plain block's norm is not the whole tensor's (the test can tell them apart)
    assert out[0]["plain_norm"] < expected["pow(2).sum"] ** 0.5 - 1e-3


def test_follow_split_points_compiled_modules_at_the_module_now_in_their_place():
    """``torch.compile(m)`` binds its forward to ``m`` when made; a strategy that replaces the compiled module's
    module (or puts the user's back) makes it follow, and compiles again for the module now in place."""
    from torch._dynamo.utils import counters

    from lightning_hpc.distributed.partitioned import follow_split

    torch._dynamo.reset()
    user, split = nn.Linear(3, 2), nn.Linear(3, 2)
    holder = nn.Module()
    holder.model = torch.compile(user, backend="eager")
    x = torch.randn(4, 3)
    holder.model._orig_mod = split  # what a strategy does to the module inside
    assert torch.equal(holder.model(x), user(x))  # without following: the replaced module still runs
    assert follow_split(holder) == ["model"]
    assert torch.equal(holder.model(x), split(x))
    counters.clear()
    follow_split(holder)
    holder.model(torch.randn(5, 3))
    assert counters["frames"]["total"] >= 1  # compiled again afterwards


# -- reductions along a dimension: every layout against the whole tensor on one process ------------------------------
def _along(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """What user code reduces along a dimension, each summed: on the ranks the result is a block of the whole
    result (its sum the whole sum) or the whole result itself (the same on every rank)."""
    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.sum()

    return {
        "per-class norm penalty": (w.norm(dim=1) - 1).pow(2).sum(),
        "norm(dim=0)": whole(w.norm(dim=0)),
        "vector_norm(ord=3, dim=1, keepdim)": whole(torch.linalg.vector_norm(w, 3, dim=1, keepdim=True)),
        "linalg.norm(dim=-1) inf": whole(torch.linalg.norm(w, float("inf"), dim=-1)),
        "sum(0)": whole(w.sum(0)),
        "mean(1)": whole(w.mean(1)),
        "mean(0, keepdim)": whole(w.mean(0, keepdim=True)),
        "amax(1) sum": whole(w.amax(1)),
        "amin(0)": whole(w.amin(0)),
        "sum((0, 1))": whole(w.sum((0, 1))),
    }


def _along_ranks(rank: int, world: int, layout: str) -> dict:
    full, _ = _full()
    if layout == "stacked":  # steps i of every rank's share: the whole tensor is their stack along a new dimension
        w = as_block_parameter(nn.Parameter(full[rank].clone().reshape(1, COLS)), None, dim=STACKED)
    elif layout == "rows":
        a, b = block_bounds(ROWS, world)[rank]
        w = as_block_parameter(nn.Parameter(full[a:b].clone()), None, dim=0)
    else:
        a, b = block_bounds(COLS, world)[rank]
        w = as_block_parameter(nn.Parameter(full[:, a:b].clone()), None, dim=1)
    values = _along(w)
    values["per-class norm penalty"].backward()
    return {"values": {k: v.detach() for k, v in values.items()}, "grad": local_block(w.grad).clone()}


@pytest.mark.parametrize("layout", ["rows", "columns", "stacked"])
def test_reductions_along_a_dimension_are_the_whole_tensors(layout):
    full, _ = _full()
    world = 3
    whole_tensor = full[:world].reshape(world, 1, COLS) if layout == "stacked" else full
    out = run_in_processes(_along_ranks, world, layout)
    if layout == "stacked":  # each step reduced alone, then summed over the steps
        steps = [nn.Parameter(whole_tensor[i].clone()) for i in range(world)]
        per_step = [_along(s) for s in steps]
        expected = {k: sum(p[k] for p in per_step) for k in per_step[0]}
        sum(p["per-class norm penalty"] for p in per_step).backward()
        grads = [s.grad for s in steps]
    else:
        w = nn.Parameter(whole_tensor.clone())
        expected = _along(w)
        expected["per-class norm penalty"].backward()
        grads = [w.grad[a:b] if layout == "rows" else w.grad[:, a:b]
                 for a, b in block_bounds(ROWS if layout == "rows" else COLS, world)]
    for rank, got in enumerate(out):
        for name, value in expected.items():
            torch.testing.assert_close(got["values"][name], value.detach(), rtol=1e-12, atol=1e-12,
                                       msg=lambda m, rank=rank, name=name: f"rank {rank}, {name}: {m}")
        torch.testing.assert_close(got["grad"], grads[rank], rtol=1e-12, atol=1e-12)
    # the control: this rank's block alone gives another per-class penalty (the test can tell them apart)
    block = full[:3] if layout == "rows" else full[:, :2]
    assert abs(float((block.norm(dim=1) - 1).pow(2).sum()) - float(expected["per-class norm penalty"])) > 1e-3
