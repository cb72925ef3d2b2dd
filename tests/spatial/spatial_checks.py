"""Helpers shared by the spatial tests: compare a layer on one rank's split tile (through the op dispatch) with the
serial layer on the whole input."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpc.spatial.dispatch import SpatialTensor, split_tensor
from lightning_hpc.spatial.kernels import convolution
from lightning_hpc.spatial.layout.tiling import tile_slices

TOL = 1e-5


def tile_of(t: torch.Tensor, grid) -> torch.Tensor:
    rs, cs = tile_slices((t.shape[-2], t.shape[-1]), grid.parts, grid.index)
    return t[..., rs, cs]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference relative to the reference's magnitude (when that exceeds 1)."""
    a, b = a.detach(), b.detach()
    if not a.numel():
        return 0.0
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def compare_layer(ref: torch.nn.Module, x_full: torch.Tensor, grid, *, seed: int = 0) -> dict[str, float]:
    """Run ``ref`` on the whole input and a copy of it on this rank's tile, wrapped as a split activation so the op
    dispatch routes every op to its tile kernel; return the max abs differences of the output tile (the whole
    output where the layer's output is replicated, e.g. after a global pooling), the input-gradient tile and the
    parameter gradients (those the dispatch recorded as used on tiles summed over the spatial group first, as the
    strategy does)."""
    ref = copy.deepcopy(ref)
    sp = copy.deepcopy(ref)
    x = x_full.clone().requires_grad_(True)
    y = ref(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 17), dtype=y.dtype)
    (y * g).sum().backward()

    grid.tile_params.clear()
    xt = tile_of(x_full, grid).clone().requires_grad_(True)
    yt = sp(split_tensor(xt, grid, x_full.shape))
    (yt * g).sum().backward()  # the plain g is cut to the tile; the sum runs over the whole sample
    split = isinstance(yt, SpatialTensor)
    out, expected = (yt.local(), tile_of(y.detach(), grid)) if split else (yt, y)
    errs = {"out": max_err(out, expected), "dx": max_err(xt.grad, tile_of(x.grad, grid))}
    if list(out.shape) != list(expected.shape):
        errs["shape"] = float("inf")
    for (name, p_ref), p_sp in zip(ref.named_parameters(), sp.parameters()):
        gsp = p_sp.grad.clone()
        if grid.group is not None and id(p_sp) in grid.tile_params:
            dist.all_reduce(gsp, group=grid.group)
        errs["d" + name] = max_err(gsp, p_ref.grad)
    return errs


@contextlib.contextmanager
def conv_paths() -> Iterator[dict[str, int]]:
    """Within the block, count the convolution kernel's paths (``'tile'``: the in-place tile convolution,
    ``'box'``: the tile copied into a box with its halo); a convolution that exchanges no halo on any tile (a
    pointwise one, a 1-wide strided one on stride-aligned tiles) takes neither: it is the native op."""
    counts = {"tile": 0, "box": 0}
    functions = {"tile": convolution._TileConv, "box": convolution._BoxConv}
    for path, fn in functions.items():
        def counted(*args, path=path, original=fn.apply):
            counts[path] += 1
            return original(*args)

        fn.apply = staticmethod(counted)  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        for fn in functions.values():
            del fn.apply  # the inherited autograd.Function.apply again


class TileDataModule(pl.LightningDataModule):
    """Serves ``(x, y)`` and reads only its tile once ``set_spatial_tile`` was called (the interface the mesh data
    module implements); ``input_shape`` lets the strategy validate the partition at setup."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> None:
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size
        self.input_shape = tuple(x.shape[1:])
        self.tile = None
        self.spatial_tiles = (0, 1)  # both read as tiles

    def set_spatial_tile(self, tile_index, parts) -> None:
        self.tile = (tuple(tile_index), tuple(parts))

    def train_dataloader(self):
        x, y = self.x, self.y
        if self.tile is not None:
            rs, cs = tile_slices((x.shape[-2], x.shape[-1]), self.tile[1], self.tile[0])
            x, y = x[..., rs, cs].contiguous(), y[..., rs, cs].contiguous()
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=False)


def serial_sgd_fit(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, compute_loss, batch: int, *,
                   step_seed: int | None = None) -> dict:
    """One process's reference for the Trainer-level spatial tests: SGD (lr 0.1, momentum 0.9) over ``(x, y)`` in
    order, in batches of ``batch``; ``step_seed``: ``torch.manual_seed(step_seed + step)`` before each step (so
    dropout masks match the module's).  Returns the last loss, the first step's gradients, the final parameters
    and buffers, and the eval-mode output on all of ``x``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first, loss = None, None
    for step, (xb, yb) in enumerate(DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)):
        if step_seed is not None:
            torch.manual_seed(step_seed + step)
        opt.zero_grad()
        loss = compute_loss(model, xb, yb)
        loss.backward()
        if first is None:
            first = [p.grad.detach().clone() for p in model.parameters()]
        opt.step()
    model.eval()
    with torch.no_grad():
        out = model(x)
    return {"loss": float(loss), "grads": first, "params": [p.detach().clone() for p in model.parameters()],
            "buffers": [b.clone() for b in model.buffers()], "out": out}
