"""Copies of a module a strategy splits, made by the user inside the LightningModule.

A model-averaging pattern keeps a copy of the model next to it (timm's ``ModelEmaV2``:
``self.ema = ModelEma(self.model)``, a ``copy.deepcopy`` in ``__init__``, its parameters frozen) and updates it
element by element from the model's tensors (``zip(ema.state_dict().values(), model.state_dict().values())``).
A strategy that splits a part of the model over ranks (multigrid's residual trunk, hybrid_fc's head) must split
the copy alike: a copy left whole would be updated from this rank's part of the model, pairing tensors of other
shapes or, where the shapes happen to agree, the wrong ones.

A copy of the module at ``path`` is found on the unsplit model by its tensors: a module outside ``path`` and its
ancestors, sharing no tensor with them, whose parameters and buffers have the same relative names, shapes and
dtypes, in the same order, as ``path`` or one of its ancestors (values and ``requires_grad`` may differ: an
average is not trained); the copy of ``path`` sits at the same place inside it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Copy", "copies_of", "tensor_signature"]


@dataclass(frozen=True)
class Copy:
    """``path``: the place of the copied module in the copy; ``whole``: the copy found (of ``path`` or of one of
    its ancestors), which may hold more than ``path``'s copy (an EMA of the whole model)."""

    path: str
    whole: str


def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def tensor_signature(module: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The relative names, shapes and dtypes of ``module``'s parameters then buffers, in ``state_dict`` order."""
    return [(name, tuple(t.shape), t.dtype) for name, t in _tensors(module)]


def _inside(name: str, path: str) -> bool:
    return name == path or name.startswith(path + ".")


def copies_of(root: nn.Module, path: str) -> list[Copy]:
    """The copies in ``root`` of its submodule at ``path`` (``""``, the root itself, has none), outermost
    match first: an ancestor's copy is preferred to a copy of ``path`` alone inside it."""
    parts = path.split(".") if path else []
    ancestors = {a: root.get_submodule(a) for a in (".".join(parts[:i]) for i in range(1, len(parts) + 1))}
    signatures = {a: tensor_signature(m) for a, m in ancestors.items()}
    taken = {id(t) for m in ancestors.values() for _, t in _tensors(m)}
    found: list[Copy] = []
    for name, module in root.named_modules():
        if not name or _inside(path, name) or _inside(name, path) or any(_inside(name, c.whole) for c in found):
            continue  # the root, an ancestor of path, inside path, or inside a copy already found
        signature = tensor_signature(module)
        match = next((a for a in ancestors if signature and signatures[a] == signature), None)
        if match is None or any(id(t) in taken for _, t in _tensors(module)):
            continue
        found.append(Copy(name + path[len(match):], name))
    return found
