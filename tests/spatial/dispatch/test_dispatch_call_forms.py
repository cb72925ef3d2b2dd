"""The op handlers read a call's arguments by name, however the caller passed them: keyword inputs and dimensions,
numpy-style ``axis``, ``permute`` with varargs or one sequence, norms' ``p``/``ord`` give on split activations
(uneven tiles, nothing gathered) what they give on one process."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.dispatch import SpatialTensor, on_unsupported, split_tensor
from lightning_hpc.spatial.layout.tiling import create_hybrid_layout, tile_slices

N, C, H, W = 2, 3, 7, 5


def _masked(x):
    y = x.clone()
    y[y > 0.5] = -1.0
    return y


def _copied(x):
    y = torch.zeros_like(input=x)
    y.copy_(other=2 * x)
    return y


CASES = {
    "torch.sum(input=x, dim=(2, 3))": lambda x: torch.sum(input=x, dim=(2, 3)),
    "torch.sum(x, 1)": lambda x: torch.sum(x, 1),
    "x.sum(axis=[2, 3], keepdim=True)": lambda x: x.sum(axis=[2, 3], keepdim=True),
    "torch.mean(input=x, dim=[1, 2, 3], keepdim=True)": lambda x: torch.mean(input=x, dim=[1, 2, 3], keepdim=True),
    "torch.nansum(x, dtype=torch.float32)": lambda x: torch.nansum(x, dtype=torch.float32),
    "torch.cat(tensors=[x, 2 * x], dim=1)": lambda x: torch.cat(tensors=[x, 2 * x], dim=1),
    "torch.concatenate([x, x], axis=0)": lambda x: torch.concatenate([x, x], axis=0),
    "x.permute((0, 1, 3, 2))": lambda x: x.permute((0, 1, 3, 2)),
    "x.permute(0, 1, 3, 2)": lambda x: x.permute(0, 1, 3, 2),
    "x.permute(dims=[1, 0, 3, 2])": lambda x: x.permute(dims=[1, 0, 3, 2]),
    "torch.permute(input=x, dims=(0, 1, 3, 2))": lambda x: torch.permute(input=x, dims=(0, 1, 3, 2)),
    "x.transpose(dim0=2, dim1=3)": lambda x: x.transpose(dim0=2, dim1=3),
    "x.swapaxes(axis0=0, axis1=1)": lambda x: x.swapaxes(axis0=0, axis1=1),
    "torch.norm(x, p=2)": lambda x: torch.norm(x, p=2),
    "torch.norm(x, 3)": lambda x: torch.norm(x, 3),
    "x.norm(p=1)": lambda x: x.norm(p=1),
    "torch.linalg.vector_norm(x, ord=3)": lambda x: torch.linalg.vector_norm(x, ord=3),
    "torch.softmax(input=x, dim=1)": lambda x: torch.softmax(input=x, dim=1),
    "F.softmax(x, dim=-3)": lambda x: F.softmax(x, dim=-3),
    "x.unsqueeze(dim=0)": lambda x: x.unsqueeze(dim=0),
    "torch.chunk(input=x, chunks=2, dim=1)": lambda x: torch.chunk(input=x, chunks=2, dim=1),
    "x.unbind(dim=0)": lambda x: x.unbind(dim=0),
    "x.narrow(dim=2, start=1, length=5)": lambda x: x.narrow(dim=2, start=1, length=5),
    "x[:, 1:, 2:6]": lambda x: x[:, 1:, 2:6],
    "x[y > 0.5] = -1": _masked,
    "y.copy_(other=2 * x)": _copied,
    "x.size(dim=2) * x": lambda x: x.size(dim=2) * x,
    "torch.randn_like(input=x, dtype=torch.float32)": lambda x: torch.randn_like(input=x, dtype=torch.float32),
    "torch.autograd.grad(outputs=(x * x).sum(), inputs=[x])": lambda x: torch.autograd.grad(
        outputs=(x * x).sum(), inputs=[x]),
}


def _data() -> torch.Tensor:
    return torch.randn(N, C, H, W, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def _whole(out):
    if isinstance(out, (tuple, list)):
        return [_whole(o) for o in out]
    return out.full().detach() if isinstance(out, SpatialTensor) else out.detach()


def _run(rank, world, parts):
    grid = create_hybrid_layout(parts).grid
    x = _data()
    rs, cs = tile_slices((H, W), parts, grid.index)
    out = {}
    for name, op in CASES.items():
        tile = x[..., rs, cs].clone().requires_grad_(True)
        torch.manual_seed(1)  # the same random values as the serial op's
        with on_unsupported("error"):  # computed on the tiles: a gather would raise
            out[name] = _whole(op(split_tensor(tile, grid, x.shape)))
    return out


def _close(got, ref) -> bool:
    if isinstance(ref, (tuple, list)):
        return len(got) == len(ref) and all(_close(g, r) for g, r in zip(got, ref))
    tol = 1e-12 if ref.dtype == torch.float64 else 1e-5  # (float32: the tiles' partial sums add in another order)
    return got.shape == ref.shape and got.dtype == ref.dtype and bool((got - ref).abs().max() <= tol * ref.abs().max())


def test_keyword_and_varargs_forms_equal_one_process():
    refs = {}
    for name, op in CASES.items():
        torch.manual_seed(1)
        refs[name] = _whole(op(_data().requires_grad_(True)))
    for parts in ((2, 1), (1, 2)):
        for res in run_in_processes(_run, 2, parts):
            bad = [name for name in CASES if not _close(res[name], refs[name])]
            assert not bad, (parts, bad)


# ops over one of two split dimensions (a 2x2 grid): along H alone or W alone only a row or column of tiles would
# reduce together, so they run gathered (and still equal one process); over both, on the tiles.  Even tiles: a
# reduction wrongly taken over the whole group then gives wrong values on every rank (with uneven ones, results of
# different sizes, which hang the collective)
H2, W2 = 8, 6
PARTIAL_CASES = {
    "x.sum(dim=3)": lambda x: x.sum(dim=3),
    "x.mean(dim=2, keepdim=True)": lambda x: x.mean(dim=2, keepdim=True),
    "F.layer_norm(x, (W2,))": lambda x: F.layer_norm(x, (W2,)),
    "F.layer_norm(x, (H2, W2))": lambda x: F.layer_norm(x, (H2, W2)),
}


def _data_2x2() -> torch.Tensor:
    return torch.randn(N, C, H2, W2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def _run_partial(rank, world):
    grid = create_hybrid_layout((2, 2)).grid
    x = _data_2x2()
    rs, cs = tile_slices((H2, W2), (2, 2), grid.index)
    return {name: _whole(op(split_tensor(x[..., rs, cs].clone(), grid, x.shape))) for name, op in PARTIAL_CASES.items()}


def test_reductions_and_layer_norm_over_one_of_two_split_dimensions_equal_one_process():
    refs = {name: op(_data_2x2()) for name, op in PARTIAL_CASES.items()}
    for res in run_in_processes(_run_partial, 4, timeout_s=300):
        bad = [name for name in PARTIAL_CASES if not _close(res[name], refs[name])]
        assert not bad, bad


def _batch_norm_refusals(rank, world, parts):
    grid = create_hybrid_layout(parts).grid
    x = _data()
    rs, cs = tile_slices((H, W), parts, grid.index)
    xs = split_tensor(x[..., rs, cs].clone(), grid, x.shape)
    stats = (torch.zeros(C, dtype=x.dtype), torch.ones(C, dtype=x.dtype))
    messages = []
    for training, eps in ((True, 0.0), (False, -1e-5)):
        try:
            F.batch_norm(xs, *stats, training=training, eps=eps)
        except ValueError as e:
            messages.append(str(e))
        else:
            messages.append(None)
    return messages


def test_batch_norm_on_several_tiles_refuses_what_the_serial_op_refuses():
    """The several-tile batch norm (statistics aggregated over the spatial group) makes ``F.batch_norm``'s checks,
    with its messages: a positive ``eps`` in training, a non-negative one otherwise."""
    serial = []
    for training, eps in ((True, 0.0), (False, -1e-5)):
        try:
            F.batch_norm(_data(), torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64),
                         training=training, eps=eps)
        except ValueError as e:
            serial.append(str(e))
    assert len(serial) == 2
    for res in run_in_processes(_batch_norm_refusals, 2, (2, 1), timeout_s=120):
        assert res == serial
