"""Which modules of a model K-FAC preconditions, and why it leaves the others to the optimizer.

Only trainable parameters are preconditioned: an ``nn.Linear`` / ``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d``
or ``nn.ConvTranspose1d/2d/3d`` (grouped and depthwise ones a Kronecker block per group; a transposed
convolution's bias left to the optimizer), the affine parameters of ``nn.BatchNorm1d/2d/3d`` / ``nn.GroupNorm`` /
``nn.LayerNorm`` / ``nn.RMSNorm`` / ``nn.InstanceNorm1d/2d/3d`` (a 2x2 block per channel) or an ``nn.Embedding``
(diagonal A) whose weight trains gets a handler (:mod:`.layers`; its bias is folded in only when the bias trains).
Every other module with trainable parameters is listed with its reason: unsupported type, a family
``layer_types`` leaves out, frozen weight, ``skip_layers``, a normalisation subclass with statistics from other
ranks (``nn.SyncBatchNorm``) or tiles (declared by the spatial strategy), a sparse embedding, or a Linear that
``nn.MultiheadAttention`` uses functionally (its hooks never fire).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from lightning_hpc.kfac.layers import (
    FEATURE_NORMS,
    NORMS,
    SUPPORTED,
    EmbeddingHandler,
    LayerHandler,
    LinearHandler,
    layer_type_of,
    linear_batch_dim,
    make_handler,
)
from lightning_hpc.protocols import ShardedFullyConnected

__all__ = ["LayerReport", "find_layers", "skip_reason"]


def skip_reason(
    name: str, module: nn.Module, modules: dict[str, nn.Module], patterns: list[re.Pattern[str]],
    layer_types: Collection[str] | None = None,
) -> str | None:
    """Why ``module`` (called ``name`` in ``modules``) is not preconditioned; None if it is. ``layer_types``: the
    families of :data:`~.layers.LAYER_TYPES` to precondition (None: all)."""
    family = layer_type_of(module)
    if family is not None and layer_types is not None and family not in layer_types:
        return f"layer_types {sorted(layer_types)} leaves out {family!r}"
    if getattr(module, "kfac_split_statistics", False):
        return (f"{type(module).__name__} normalises a split activation (spatial parallelism): the per-sample "
                "gradients of its scale and shift are sums over every tile, which K-FAC's block does not gather")
    if isinstance(module, (*NORMS, nn.SyncBatchNorm)) and type(module) not in NORMS:
        return (f"{type(module).__name__} normalises with statistics of other ranks or tiles, which K-FAC's "
                "per-sample gradients of its scale and shift would not see")
    if isinstance(module, NORMS) and not isinstance(getattr(module, "weight", None), torch.Tensor):
        return "no affine parameters"
    if isinstance(module, nn.Embedding) and (module.sparse or module.scale_grad_by_freq):
        return "sparse or frequency-scaled gradient (not the Kronecker form of its factors)"
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and module.groups > 1 and \
            hasattr(module, "kfac_padded_input"):
        return f"grouped convolution (groups={module.groups}) on spatial tiles is not supported"
    if not isinstance(module, (*SUPPORTED, ShardedFullyConnected)):
        return (f"unsupported type {type(module).__name__} (K-FAC handles nn.Linear, nn.Conv1d/2d/3d, "
                "nn.ConvTranspose1d/2d/3d, nn.BatchNorm1d/2d/3d, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm, "
                "nn.InstanceNorm1d/2d/3d "
                "and nn.Embedding)")
    parent = modules.get(name.rpartition(".")[0]) if name else None
    if isinstance(parent, nn.MultiheadAttention):
        return "used functionally by nn.MultiheadAttention (its forward hooks never fire)"
    if not module.weight.requires_grad:
        return "weight frozen (requires_grad=False)"
    if any(p.search(name) or p.search(type(module).__name__) for p in patterns):
        return "matched skip_layers"
    return None


@dataclass
class LayerReport:
    """The handlers of the preconditioned layers, and ``(name, type, note / reason)`` of every module."""

    handlers: list[LayerHandler] = field(default_factory=list)
    preconditioned: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"K-FAC preconditions {len(self.preconditioned)} layer(s):"]
        lines += [f"  {n or '<root>'} ({t}){' [' + note + ']' if note else ''}" for n, t, note in self.preconditioned]
        if self.skipped:
            lines.append(f"left to the optimizer ({len(self.skipped)} module(s) with trainable parameters):")
            lines += [f"  {n or '<root>'} ({t}): {why}" for n, t, why in self.skipped]
        return "\n".join(lines)


def find_layers(model: nn.Module, patterns: list[re.Pattern[str]],
                layer_types: Collection[str] | None = None) -> LayerReport:
    """Handlers for the layers K-FAC preconditions, in model order, and the report of all modules."""
    report = LayerReport()
    modules = dict(model.named_modules())
    for name, module in modules.items():
        reason = skip_reason(name, module, modules, patterns, layer_types)
        if reason is None:
            handler = make_handler(name, module)
            assert handler is not None
            sequences = isinstance(handler, (LinearHandler, EmbeddingHandler)) or isinstance(module, FEATURE_NORMS)
            if sequences:  # layers whose leading input dimensions are a sample dimension and positions
                cast(Any, handler).batch_dim = linear_batch_dim(name, modules)
            report.handlers.append(handler)
            bias = getattr(module, "bias", None)
            note = ""
            if isinstance(bias, torch.Tensor) and not handler.has_bias:
                note = "bias left to the optimizer" if bias.requires_grad else "bias frozen: weight only"
            if sequences and cast(Any, handler).batch_dim != 0:
                note = ", ".join(filter(None, [note, "sequence-first input: samples on dim 1"]))
            note = ", ".join(filter(None, [note, handler.form_note]))
            report.preconditioned.append((name, type(module).__name__, note))
        elif any(p.requires_grad for p in module.parameters(recurse=False)):
            report.skipped.append((name, type(module).__name__, reason))
    return report
