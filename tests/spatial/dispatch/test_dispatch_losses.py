"""Mean losses on split activations equal one process's (value and gradient), with uneven tiles: the
element-wise losses and cross-entropy with class probabilities divide by the global element count (from the
global shape), cross-entropy with class indices by the counted non-ignored targets (their summed class weights
with ``weight=``); ``reduction="sum"`` is the whole sample's sum."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.dispatch import split_tensor
from lightning_hpc.spatial.layout.tiling import create_hybrid_layout, tile_slices

N, C, H, W = 2, 3, 7, 5
CLASS_WEIGHT = torch.tensor([0.5, 2.0, 3.5], dtype=torch.float64)


def _cases(x: torch.Tensor, probs: torch.Tensor, labels: torch.Tensor, binary: torch.Tensor):
    return {
        "mse": lambda a: F.mse_loss(a, binary),
        "l1": lambda a: F.l1_loss(a, binary),
        "smooth_l1": lambda a: F.smooth_l1_loss(a, binary),
        "bce_logits": lambda a: F.binary_cross_entropy_with_logits(a, binary),
        "ce_probabilities": lambda a: F.cross_entropy(a, probs),
        "ce_labels_ignore": lambda a: F.cross_entropy(a, labels, ignore_index=0),
        "ce_labels_smoothing": lambda a: F.cross_entropy(a, labels, label_smoothing=0.1),
        # class weights: the mean divides by the global sum of the weights of the non-ignored targets
        "ce_labels_weight_ignore": lambda a: F.cross_entropy(a, labels, weight=CLASS_WEIGHT, ignore_index=0),
        "nll_weight": lambda a: F.nll_loss(F.log_softmax(a, 1), labels, weight=CLASS_WEIGHT),
        # reduction="sum": the sum over the whole sample, no division
        "mse_sum": lambda a: F.mse_loss(a, binary, reduction="sum"),
        "ce_labels_sum": lambda a: F.cross_entropy(a, labels, reduction="sum"),
    }


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, C, H, W, generator=g, dtype=torch.float64)
    probs = torch.softmax(torch.randn(N, C, H, W, generator=g, dtype=torch.float64), 1)
    labels = torch.randint(0, C, (N, H, W), generator=g)
    binary = (torch.rand(N, C, H, W, generator=g) > 0.5).double()
    return x, probs, labels, binary


def _run(rank, world, parts):
    grid = create_hybrid_layout(parts).grid
    x, probs, labels, binary = _data()
    rs, cs = tile_slices((H, W), parts, grid.index)
    out = {}
    for name, loss_of in _cases(x, probs, labels, binary).items():
        tile = x[..., rs, cs].clone().requires_grad_(True)
        loss = loss_of(split_tensor(tile, grid, x.shape))
        loss.backward()
        out[name] = (float(loss), tile.grad.clone(), (rs, cs))
    return out


def test_mean_losses_on_tiles_equal_one_process():
    x, probs, labels, binary = _data()
    for parts in ((2, 1), (1, 2)):
        for res in run_in_processes(_run, 2, parts):
            for name, loss_of in _cases(x, probs, labels, binary).items():
                full = x.clone().requires_grad_(True)
                ref = loss_of(full)
                ref.backward()
                value, grad, (rs, cs) = res[name]
                assert abs(value - float(ref)) < 1e-12, (parts, name, value, float(ref))
                assert (grad - full.grad[..., rs, cs]).abs().max() < 1e-12, (parts, name)


def _run_learned_target(rank, world, parts):
    grid = create_hybrid_layout(parts).grid
    x, _, _, binary = _data()
    rs, cs = tile_slices((H, W), parts, grid.index)
    target = binary.clone().requires_grad_(True)  # whole on every rank, like a learned target or a teacher's output
    F.mse_loss(split_tensor(x[..., rs, cs].clone(), grid, x.shape), target).backward()
    return target.grad


def test_a_whole_target_that_needs_a_gradient_gets_one_process_gradient():
    """The target's gradient is the whole one on every rank (each rank's tile only holds part of it)."""
    x, _, _, binary = _data()
    target = binary.clone().requires_grad_(True)
    F.mse_loss(x, target).backward()
    for parts in ((2, 1), (1, 2)):
        for grad in run_in_processes(_run_learned_target, 2, parts):
            assert (grad - target.grad).abs().max() < 1e-12, parts
