"""Copies of a module a strategy splits, made by the user inside the LightningModule.

A model-averaging pattern keeps a copy of the model next to it (timm's ``ModelEmaV2``:
``self.ema = ModelEma(self.model)``, a ``copy.deepcopy`` in ``__init__``) and updates it element by element from
the model's tensors (``zip(ema.state_dict().values(), model.state_dict().values())``).  A strategy that splits a
part of the model over ranks (multigrid's residual trunk, hybrid_fc's head) must split the copy alike: a copy left
whole would be updated from this rank's part of the model, pairing tensors of other shapes or, where the shapes
happen to agree, the wrong ones.  A copy is recognised by its tensors: the same relative names, shapes and
dtypes of parameters and buffers (values and ``requires_grad`` may differ: an average is not trained)."""

from __future__ import annotations

from torch import nn

__all__ = ["copies_of", "tensor_signature"]


def tensor_signature(module: nn.Module) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """The relative names, shapes and dtypes of ``module``'s parameters and buffers, in registration order."""
    params = module.named_parameters(remove_duplicate=False)
    buffers = module.named_buffers(remove_duplicate=False)
    return tuple((name, tuple(t.shape), str(t.dtype)) for named in (params, buffers) for name, t in named)


def _nested(a: str, b: str) -> bool:
    """Whether one of two module paths is the other or inside it ("" is the root, around everything)."""
    return a == b or not a or not b or a.startswith(b + ".") or b.startswith(a + ".")


def copies_of(root: nn.Module, path: str) -> list[str]:
    """The paths in ``root`` of the copies of its submodule at ``path``: for each module on the way from ``root``
    down to ``path`` (``root`` itself excluded, ``path`` included), every module outside it with the same tensor
    signature is a copy of it, and the copy of ``path`` sits at the same place inside that one."""
    modules = dict(root.named_modules(remove_duplicate=False))
    parts = path.split(".")
    found: list[str] = []
    for depth in range(len(parts), 0, -1):
        ancestor, below = ".".join(parts[:depth]), ".".join(parts[depth:])
        signature = tensor_signature(modules[ancestor])
        if not signature:  # a module without tensors says nothing about what copies it
            continue
        for other, module in modules.items():
            if _nested(other, ancestor) or tensor_signature(module) != signature:
                continue
            copy = f"{other}.{below}" if below else other
            if copy in modules and copy not in found and not any(_nested(copy, f) for f in found):
                found.append(copy)
    return found
