"""Copies of the split container ("twins"): a weight average of the model kept beside it.

A model held with a frozen copy of itself, ``self.ema = ModelEmaV2(self.model)`` (timm: ``copy.deepcopy`` in
``__init__``, the copy's parameters frozen, updated element-wise with ``zip(ema.state_dict().values(),
model.state_dict().values())`` after every step, evaluated in validation), needs the copy split as the model is:
the update pairs each of the model's tensors with the copy's tensor of the same place, so the copy's head layer
must be the same block of the same layer on each rank, and its forward must run the same exchange (section 4's
schemes) to compute the whole head.  Found here on the unsplit model, before anything is split:

a *twin* is a submodule of the searched root, outside the head's container and its ancestors and not sharing a
tensor with them, whose parameters and buffers have the same relative names, shapes and dtypes, in the same order,
as the head's container or one of its ancestors, and whose parameters are all frozen (``requires_grad=False``).
Its head (the layers at the same relative place) is split alike by :func:`~lightning_hpc.hybrid_fc.parallel.
parallelize_head`: the same layouts, the same process group, the same blocks.  A copy whose parameters train is a
model of its own and stays whole in the data-parallel trunk (as an ensemble member did before)."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from lightning_hpc.distributed.copies import copies_of
from lightning_hpc.hybrid_fc.discovery import HeadSpec

__all__ = ["find_twins", "trained_original"]

def _copies(root: nn.Module, spec: HeadSpec) -> Iterator[tuple[str, nn.Module]]:
    """(the place of ``spec``'s container in the copy, the copied module) of every copy of the head's container or
    of an ancestor in ``root``, whether it trains or not (distributed/copies.py)."""
    for copy in copies_of(root, spec.parent_name):
        yield copy.path, root.get_submodule(copy.whole)


def _trains(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def find_twins(root: nn.Module, spec: HeadSpec) -> list[HeadSpec]:
    """The heads of the frozen copies of ``spec``'s container (or of an ancestor) in ``root``, each as the
    :class:`HeadSpec` of the layers at the copy's same place (see the module docstring).  Call on the unsplit
    model.  A copy whose layers at the head's place are of other types, or on the meta device, is refused here,
    before anything is split, naming it and the fix."""
    # a copy that trains is a model of its own, whole in the data-parallel trunk
    return [_twin_spec(root, spec, path) for path, module in _copies(root, spec) if not _trains(module)]


def trained_original(root: nn.Module, spec: HeadSpec) -> HeadSpec:
    """The automatically found head, or, when it is a frozen copy's (the copy registered after the model, so its
    layers come last) and a copy of it trains, the head of the one that trains: the model, whose copy is then
    its twin."""
    if any(p.requires_grad for lin in spec.linears for p in lin.parameters()):
        return spec
    # not checked here: find_twins, from the head found, names a copy that differs as the copy
    return next((_twin_spec(root, spec, path, check=False) for path, module in _copies(root, spec)
                 if _trains(module)), spec)


def _twin_spec(root: nn.Module, spec: HeadSpec, path: str, check: bool = True) -> HeadSpec:
    """The head at ``path`` (the copy's place of ``spec.parent_name``) as ``spec`` describes the original one
    (``check``: refuse a copy that cannot be split as the original is)."""
    parent = root.get_submodule(path)
    if spec.lone:
        modules = [(path.rpartition(".")[2], parent)]
    else:
        modules = [(n, parent._modules.get(n)) for n, _ in spec.modules]  # type: ignore[misc]
    same = type(parent) is type(spec.parent) and all(
        type(m) is type(o) for (_, m), (_, o) in zip(modules, spec.modules))
    if check and not same:
        raise ValueError(
            f"strategy='hybrid_fc': {path!r} has the parameters of the head's container {spec.parent_name!r} (a copy "
            "of it, e.g. an EMA), but other layers at the head's place, so it cannot be split as the head is and an "
            "element-wise update between the two would pair different blocks. Build the copy with copy.deepcopy of "
            "the model, or train with strategy='ddp'"
        )
    if check and any(t.is_meta for _, m in modules for t in m.parameters()):  # type: ignore[union-attr]
        raise ValueError(
            f"strategy='hybrid_fc': {path!r}, a copy of the head's container {spec.parent_name!r} (e.g. an EMA), was "
            "made while the head's layers were on the meta device, so it holds no values to split. Build the model "
            "with Trainer.init_module(empty_init=False) (or outside it), so the copy copies initialised weights"
        )
    return HeadSpec(parent, path, spec.start, modules)  # type: ignore[arg-type]
