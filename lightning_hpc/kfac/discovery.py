"""Which modules of a model K-FAC preconditions, and why it leaves the others to the optimizer.

Only trainable parameters are preconditioned: an ``nn.Linear`` / ``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d``
or ``nn.ConvTranspose1d/2d/3d`` (grouped and depthwise ones a Kronecker block per group; a transposed
convolution's bias left to the optimizer), the affine parameters of ``nn.BatchNorm1d/2d/3d`` / ``nn.GroupNorm`` /
``nn.LayerNorm`` / ``nn.RMSNorm`` / ``nn.InstanceNorm1d/2d/3d`` (a 2x2 block per channel) or an ``nn.Embedding``
(diagonal A) whose weight trains gets a handler (:mod:`.layers`; its bias is folded in only when the bias trains).
Every other module with trainable parameters is listed with its reason: unsupported type, a family
``layer_types`` leaves out, frozen weight, ``skip_layers``, a normalisation layer with statistics from other
ranks (``nn.SyncBatchNorm``) or tiles (named by the spatial strategy's tiled layers,
:class:`~lightning_hpc.protocols.TiledLayers`), a sparse embedding, a Linear that ``nn.MultiheadAttention`` uses
functionally (its hooks never fire), or a weight computed from other parameters (a parametrization such as
``weight_norm``).

A subclass of a handled type is handled as its base class when it keeps the base's forward; with a forward of its
own, a Linear, convolution or normalisation subclass is followed through the functional op it calls and listed as
decided at its first forward with gradients (:mod:`.subclasses`); any other is left out.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from lightning_hpc.kfac.layers import (
    SUPPORTED,
    LayerHandler,
    base_type,
    layer_type_of,
    linear_batch_dim,
    make_handler,
    refusal_of,
    supported_text,
)
from lightning_hpc.kfac.subclasses import FUNCTIONAL_OPS, computed_weight, has_own_forward
from lightning_hpc.protocols import ShardedFullyConnected, TiledLayers

__all__ = ["LayerReport", "find_layers", "skip_reason"]


def skip_reason(
    name: str, module: nn.Module, modules: dict[str, nn.Module], patterns: list[re.Pattern[str]],
    layer_types: Collection[str] | None = None, tiled: TiledLayers | None = None,
) -> str | None:
    """Why ``module`` (called ``name`` in ``modules``) is not preconditioned; None if it is. ``layer_types``: the
    families of :data:`~.layers.LAYER_TYPES` to precondition (None: all); ``tiled``: the layers a spatial strategy
    runs on tiles (:class:`~lightning_hpc.protocols.TiledLayers`), None: none."""
    family = layer_type_of(module)
    if family is not None and layer_types is not None and family not in layer_types:
        return f"layer_types {sorted(layer_types)} leaves out {family!r}"
    if tiled is not None and tiled.splits_statistics(module):
        return (f"{type(module).__name__} normalises a split activation (spatial parallelism): the per-sample "
                "gradients of its scale and shift are sums over every tile, which K-FAC's block does not gather")
    if isinstance(module, nn.SyncBatchNorm):
        return (f"{type(module).__name__} normalises with statistics of other ranks' samples too, which K-FAC's "
                "per-sample gradients of its scale and shift would not see")
    if isinstance(module, nn.utils.parametrize.ParametrizationList):
        owner, _, tensor = f".{name}".rpartition(".parametrizations.")
        return f"the parameters from which a parametrization computes {owner[1:] or '<root>'}'s {tensor!r}"
    refusal = refusal_of(module, tiled)  # what the layer type's row of the registration table refuses
    if refusal is not None:
        return refusal
    if not isinstance(module, (*SUPPORTED, ShardedFullyConnected)):
        return f"unsupported type {type(module).__name__} (K-FAC handles {supported_text()})"
    parent = modules.get(name.rpartition(".")[0]) if name else None
    if isinstance(parent, nn.MultiheadAttention):
        return "used functionally by nn.MultiheadAttention (its forward hooks never fire)"
    if isinstance(module, ShardedFullyConnected) and computed_weight(module) is not None:
        return computed_weight(module)  # a parametrized shard (hybrid_fc's weight_norm head): as one process
    base = base_type(module)
    if base is not None:
        computed = computed_weight(module)
        if computed is not None:
            return computed
        if has_own_forward(module, base):
            if base not in FUNCTIONAL_OPS:
                return (f"a subclass of nn.{base.__name__} with its own forward, which K-FAC does not follow (it "
                        "follows those of Linear, Conv1d/2d/3d and normalisation subclasses)")
            if tiled is not None and tiled.is_tiled(module):
                return "a spatially tiled convolution with its own forward, which K-FAC does not follow"
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
    #: subclasses with their own forward, preconditioned or left out once a forward with gradients has shown which
    #: (:meth:`settle`)
    pending: list[tuple[str, str, str]] = field(default_factory=list)

    def settle(self, name: str, reason: str | None) -> None:
        """Move layer ``name`` from :attr:`pending` to :attr:`preconditioned` (``reason`` None), or from either to
        :attr:`skipped` with ``reason``."""
        sources = (self.pending,) if reason is None else (self.pending, self.preconditioned)
        for source in sources:
            entry = next((e for e in source if e[0] == name), None)
            if entry is None:
                continue
            source.remove(entry)
            if reason is None:
                order = [h.name for h in self.handlers]
                self.preconditioned.append(entry)
                self.preconditioned.sort(key=lambda e: order.index(e[0]))
            else:
                self.skipped.append((entry[0], entry[1], reason))
            return

    def describe(self) -> str:
        lines = [f"K-FAC preconditions {len(self.preconditioned)} layer(s):"]
        lines += [f"  {n or '<root>'} ({t}){' [' + note + ']' if note else ''}" for n, t, note in self.preconditioned]
        if self.pending:
            lines.append(f"decided at their first forward with gradients ({len(self.pending)} subclass(es) with their "
                         "own forward: preconditioned if it uses its weight only in the op its base class calls):")
            lines += [f"  {n or '<root>'} ({t}): {note}" for n, t, note in self.pending]
        if self.skipped:
            lines.append(f"left to the optimizer ({len(self.skipped)} module(s) with trainable parameters):")
            lines += [f"  {n or '<root>'} ({t}): {why}" for n, t, why in self.skipped]
        return "\n".join(lines)


def own_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters a module contributes as one layer (a handled type's include those a parametrization
    computes its weight from; a container's, only its direct ones)."""
    return [p for p in module.parameters(recurse=base_type(module) is not None) if p.requires_grad]


def find_layers(model: nn.Module, patterns: list[re.Pattern[str]], layer_types: Collection[str] | None = None,
                tiled: TiledLayers | None = None, owned: Collection[int] | None = None) -> LayerReport:
    """Handlers for the layers K-FAC preconditions, in model order, and the report of all modules; ``tiled``: the
    layers a spatial strategy runs on tiles (they get tiled handlers, or are left out with the reason); ``owned``:
    the ``id`` of the parameters one of several optimizers steps (None: every parameter), whose layers alone are
    considered (a layer only some of whose trainable parameters are among them is left out, with the reason: its
    parameters would be stepped with gradients of different backward passes)."""
    report = LayerReport()
    modules = dict(model.named_modules())
    for name, module in modules.items():
        reason = None
        if owned is not None:
            trainable = own_parameters(module)
            held = [p for p in trainable if id(p) in owned]
            if not held:
                continue  # another optimizer's layer (or nothing to train)
            if len(held) < len(trainable):
                reason = ("only some of its trainable parameters are among the parameters this preconditioner "
                          "serves (K-FAC preconditions a layer whose weight and bias one optimizer steps)")
        reason = reason or skip_reason(name, module, modules, patterns, layer_types, tiled)
        if reason is None:
            handler = make_handler(name, module, tiled)
            assert handler is not None
            sequences = handler.sequence_input
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
            base = base_type(module)
            if base is not None and has_own_forward(module, base):
                handler.traced = True
                note = ", ".join(filter(None, [f"own forward: the statistics of its {FUNCTIONAL_OPS[base].label} "
                                               "calls on its weight", note]))
                report.pending.append((name, type(module).__name__, note))
            else:
                report.preconditioned.append((name, type(module).__name__, note))
        elif any(p.requires_grad for p in module.parameters(recurse=base_type(module) is not None)):
            # (a handled type's parameters include those a parametrization computes its weight from)
            report.skipped.append((name, type(module).__name__, reason))
    return report
