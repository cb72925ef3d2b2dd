"""The check that a parameter used on tiles is not also used on replicated values.

A leaf parameter used directly by a tile op gets a gradient that is a partial sum over the tiles, which the
strategy sums over the spatial group; a use of the same parameter on a value replicated over the group would
have its part counted once per tile.  :class:`ParameterUseCheck` records the replicated uses and refuses the mix
(and ``torch.autograd.grad`` with respect to such a parameter).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_hpc.spatial.dispatch.calls import _flat, _grad_inputs, _op_name, bind_call
from lightning_hpc.spatial.dispatch.state import _STATE, OUTSIDE, ModuleTrace, SpatialDispatchError
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor


class ParameterNames(Mapping[int, str]):
    """``id(parameter) -> name`` of a module's parameters, listed at the first lookup: only a refusal's message
    needs the names, so a training step that refuses nothing does not walk the module's parameters."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._names: dict[int, str] | None = None

    def _table(self) -> dict[int, str]:
        if self._names is None:
            self._names = {id(p): n for n, p in self._module.named_parameters()}
        return self._names

    def __getitem__(self, key: int) -> str:
        return self._table()[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


class ParameterUseCheck(TorchFunctionMode):
    """Records parameters used by ops outside the tile dispatch (on replicated values).  A parameter whose
    gradient is a partial sum over tiles (``tile_params``: the grid's record, :attr:`SpatialGrid.tile_params`)
    that is also used on replicated values would get that part counted once per tile: :meth:`raise_if_mixed`
    refuses it.  ``modules``: the run's running modules, for the names in messages."""

    def __init__(self, tile_params: Mapping[int, nn.Parameter], names: Mapping[int, str] | None = None,
                 modules: ModuleTrace | None = None) -> None:
        super().__init__()
        self.tile_params = tile_params
        self.where = modules.where if modules is not None else lambda: OUTSIDE
        self.replicated: dict[int, tuple[nn.Parameter, str, str]] = {}
        self.names: Mapping[int, str] = {} if names is None else names  # (not `or`: that would list them)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.autograd.grad:
            self._refuse_tile_parameter_grad(args, kwargs)
            return func(*args, **kwargs)
        # only uses that give the parameter a gradient: not under no_grad (an optimizer's update), not a read of
        # or a write of an attribute (``p.grad``, ``p.grad = None``)
        if (_STATE.depth == 0 and torch.is_grad_enabled()
                and getattr(func, "__name__", None) not in ("__get__", "__set__", "__delete__")
                and not any(issubclass(t, SpatialTensor) for t in types)):
            for t in _flat(args, kwargs):
                if isinstance(t, nn.Parameter) and id(t) not in self.replicated:
                    self.replicated[id(t)] = (t, _op_name(func), self.where())
        return func(*args, **kwargs)

    def _refuse_tile_parameter_grad(self, args, kwargs) -> None:
        a = bind_call(torch.autograd.grad, args, kwargs)
        for t in _grad_inputs(a["inputs"]) if a is not None else ():
            if isinstance(t, nn.Parameter) and id(t) in self.tile_params:
                raise SpatialDispatchError(
                    f"spatial: torch.autograd.grad with respect to parameter '{self.names.get(id(t), '?')}' in "
                    f"{self.where()} would return this tile's part of its gradient (the strategy sums the tiles "
                    f"after the backward pass). Read the reduced gradients (p.grad) after self.manual_backward(loss) "
                    f"or in on_before_optimizer_step instead, or train this module with one tile per sample "
                    f"(spatial_parts=(1, 1), or (1, 1, 1) for volumes)"
                )

    def raise_if_mixed(self, named: Mapping[int, str]) -> None:
        for pid in self.tile_params:
            if pid in self.replicated:
                _, op, where = self.replicated[pid]
                raise SpatialDispatchError(
                    f"spatial: parameter '{named.get(pid, '?')}' is used on split activations and, by {op} in {where}, "
                    f"on a value replicated over the spatial group; its gradient cannot be reduced exactly. Use "
                    f"separate parameters for the two uses, or one tile per sample (spatial_parts=(1, 1), or "
                    f"(1, 1, 1) for volumes)"
                )
