"""Parameters used both on tiles and on replicated values: their gradients made exact, and the check of what
cannot be.

A leaf parameter used directly by a tile op gets a gradient that is a partial sum over the tiles, which the
strategy sums over the spatial group; a use of the same parameter on a value replicated over the group (an L2
penalty over a convolution's weight, a Linear used per pixel and on pooled features) gets the same, complete
gradient on every rank (every replicated value's gradient is complete: :func:`~.autograd._replicated_operand`
completes the ones that meet tiles), which that sum would count once per tile.  :class:`ParameterUseCheck` gives
each replicated use a gradient of ``1/P`` (``P`` the ranks of the spatial group) of its own, decided in the
backward pass: where the parameter has also met tiles (its gradient is then summed over the group), the ``P``
ranks' shares sum to the complete gradient once; where it has not (it is averaged as a replicated parameter),
the gradient passes unchanged.  What a compiled split step's trace records cannot carry that share, so a mixed
use met in a trace is refused (:meth:`raise_if_mixed`), as is ``torch.autograd.grad`` with respect to a tile
parameter (it would return this tile's part).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_hpc.spatial.dispatch.calls import _flat, _grad_inputs, _op_name, bind_call
from lightning_hpc.spatial.dispatch.state import _STATE, OUTSIDE, ModuleTrace, SpatialDispatchError
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor
from lightning_hpc.spatial.layout.tracing import Trace


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


class _ReplicatedUse(torch.autograd.Function):
    """A parameter's use on a replicated value (identity forward).  Backward: ``1/P`` of the gradient where the
    parameter is a tile parameter by then (``tile_params``: its gradient is summed over the ``P`` ranks of the
    spatial group), the gradient itself where it is not (averaged, as every replicated parameter)."""

    @staticmethod
    def forward(ctx, p, tile_params, group_size):  # type: ignore[override]
        ctx.pid, ctx.tile_params, ctx.group_size = id(p), tile_params, group_size
        return p.view_as(p)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        if ctx.pid in ctx.tile_params:
            g = g / ctx.group_size
        return g, None, None


class ParameterUseCheck(TorchFunctionMode):
    """Gives parameters used by ops outside the tile dispatch (on replicated values) their share of the gradient
    (see the module docstring: :class:`_ReplicatedUse` per use, ``group_size`` the ranks of the spatial group) and
    records the uses it cannot share (in a compiled split step's trace): a parameter whose gradient is a partial sum
    over tiles (``tile_params``: the grid's record, :attr:`SpatialGrid.tile_params`) that is also used there is
    refused by :meth:`raise_if_mixed`.  ``modules``: the run's running modules, for the names in messages."""

    def __init__(self, tile_params: Mapping[int, nn.Parameter], names: Mapping[int, str] | None = None,
                 modules: ModuleTrace | None = None, group_size: int = 1) -> None:
        super().__init__()
        self.tile_params = tile_params
        self.group_size = int(group_size)
        self.where = modules.where if modules is not None else lambda: OUTSIDE
        self.replicated: dict[int, tuple[nn.Parameter, str, str]] = {}
        #: the parameters given their share of the gradient on a replicated use in this step (by ``id``)
        self.shared: set[int] = set()
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
            if self.group_size > 1 and not Trace.active:
                args, kwargs = _shared(args, kwargs, self.tile_params, self.group_size, self.shared)
            else:  # a compiled step's trace: the share cannot be recorded into the graph
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

    def shares_tile_parameters(self) -> bool:
        """A parameter met on tiles got a share on a replicated use in this step: the check must run at every
        step that may use it so (each such use needs its share)."""
        return any(pid in self.tile_params for pid in self.shared)

    def raise_if_mixed(self, named: Mapping[int, str]) -> None:
        """Refuse a parameter met on tiles and, in a compiled split step's trace, on a replicated value."""
        for pid in self.tile_params:
            if pid in self.replicated:
                _, op, where = self.replicated[pid]
                raise SpatialDispatchError(
                    f"spatial: parameter '{named.get(pid, '?')}' is used on split activations and, by {op} in {where}, "
                    f"on a value replicated over the spatial group inside a compiled split step, whose graph cannot "
                    f"give that use its share of the gradient. Compute the replicated use outside the compiled "
                    f"module (in training_step), use separate parameters for the two uses, or one tile per sample "
                    f"(spatial_parts=(1, 1), or (1, 1, 1) for volumes)"
                )


def _shared(args: tuple, kwargs: dict, tile_params: Mapping[int, nn.Parameter], group_size: int,
            shared: set[int]) -> tuple:
    """The call's arguments with each parameter (directly, or in a list or tuple argument) behind its
    :class:`_ReplicatedUse`; their ids added to ``shared``."""
    def share(v: object) -> object:
        if isinstance(v, nn.Parameter):
            shared.add(id(v))
            return _ReplicatedUse.apply(v, tile_params, group_size)
        if isinstance(v, (list, tuple)) and any(isinstance(t, nn.Parameter) for t in v):
            return type(v)(share(t) for t in v)
        return v

    return tuple(share(a) for a in args), {k: share(v) for k, v in kwargs.items()}
