"""Op dispatch on spatially split activations: every op on a tile either has an exact tiled form, is computed
exactly on the gathered whole activation (with a one-time warning naming the op, the module and the bytes),
or is refused with an error naming the op, the module and what to do.  Nothing runs tile-local by accident.

:class:`SpatialTensor` is a ``torch.Tensor`` subclass holding one tile of an activation blocked over the
spatial grid along two of its dimensions (``hdim``, ``wdim``; :func:`lightning_hpc.distributed.partition.
block_bounds` over each).  Like DTensor's ``Shard`` placements it reports the *global* shape (``x.shape``,
``x.size()``), so user code that derives sizes, paddings, crops or coordinates from shapes computes what one
process computes.  ``__torch_function__`` routes each op:

* **local**: element-wise ops (with broadcasting; a plain operand that spans the whole split extent is cut to
  this tile), ops along dimensions that are not split (softmax/log_softmax, ``F.linear`` on the last dimension,
  ``F.layer_norm`` over unsplit dimensions, ``F.prelu``, ``cat``/``chunk``/``split``/indexing over unsplit
  dimensions, ``permute``/``transpose``), type and device conversions;
* **tiled kernels**: ``F.conv2d`` (halo exchange, :mod:`conv`), ``F.max_pool2d``/``F.avg_pool2d`` incl.
  ``ceil_mode`` (:mod:`pooling`), ``F.batch_norm`` (statistics over the whole sample, :mod:`batchnorm`),
  ``F.interpolate`` nearest/bilinear (:mod:`upsample`), ``F.adaptive_avg_pool2d`` / ``F.adaptive_max_pool2d``
  (window sums / maxima over the group, replicated result), ``F.group_norm``/``F.instance_norm``/
  ``F.layer_norm`` over the split dimensions (statistics over the whole sample, :mod:`groupnorm`),
  ``F.conv_transpose2d`` (halo exchange, :mod:`convtranspose`), ``F.pad`` reflect/replicate/circular and
  ``F.pixel_shuffle``/``F.pixel_unshuffle`` (rows moved between tiles, :mod:`remap`);
* **global reductions**: ``sum``/``mean`` over the split dimensions and the losses (``cross_entropy``,
  ``nll_loss``, ``binary_cross_entropy[_with_logits]``, ``mse_loss``, ``l1_loss``, ``smooth_l1_loss``,
  ``huber_loss``) with ``reduction="mean"``/``"sum"`` are summed over the spatial group and divided by the
  global count, so an unchanged mean loss equals one process's loss;
* **random**: ``F.dropout``/``F.dropout2d`` and ``rand_like``/``randn_like`` draw the whole activation's values
  from the (same) global stream on every rank and keep this tile's part: the masks equal one process's;
* **anything else** (flips, rolls, crops and constant ``F.pad`` on split dimensions, views that merge split
  dimensions, softmax over positions, ...): the split operands are gathered, the op
  runs on the whole activation exactly as on one process, and a result with the same number of dimensions is
  split again.  With ``on_unsupported="error"`` this raises instead.  In-place ops that cannot be done on a tile
  are always refused.

Gradient convention: the gradient of a tile is that tile's part; the gradient of a plain (replicated) tensor is
complete on every rank.  Ops where a replicated tensor that needs a gradient meets a tile (a squeeze-and-
excitation gate, a weight computed by a parametrization) all-reduce that gradient (:class:`_CompleteGrad`);
leaf parameters used directly by a tile op are recorded (:attr:`DispatchState.tile_params`): their gradients
are partial sums over the tiles and the strategy sums them over the spatial group.  A parameter used both on
tiles and on replicated values is refused (:meth:`DispatchState.check_parameters`).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode

from lightning_hpc._compat import enable_torch_function
from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.spatial.collectives import all_reduce_replicated
from lightning_hpc.spatial.halo_exchange import PartitionError
from lightning_hpc.spatial.tiling import SpatialGrid

__all__ = ["SpatialTensor", "SpatialDispatchError", "DispatchState", "split_tensor", "gather_tensor", "local_tile", "state"]


class SpatialDispatchError(RuntimeError):
    """An op on a spatially split activation that cannot be computed exactly (or gathering was disabled)."""


# ------------------------------------------------------------------------------------------------------------
# state shared by the dispatcher and the strategy
# ------------------------------------------------------------------------------------------------------------
class DispatchState:
    """Per-process state: the active module names (for messages), the warnings already given, the policy for
    ops without a tiled form and the parameters met on tiles."""

    def __init__(self) -> None:
        self.on_unsupported = "gather"
        self.module_stack: list[tuple[str, str]] = []
        self.warned: set[tuple[str, str]] = set()
        self.tile_params: dict[int, nn.Parameter] = {}
        self.depth = 0  # > 0 inside a handler: the ops it runs on local tensors are ours
        self.gathers = 0
        self.gathered_bytes = 0

    def where(self) -> str:
        if not self.module_stack:
            return "the LightningModule's step (outside any module)"
        name, cls = self.module_stack[-1]
        return f"module '{name}' ({cls})"

    def module_hooks(self, root: nn.Module, prefix: str = "") -> list[Any]:
        """Hooks keeping :attr:`module_stack` (the module names in error and warning messages)."""
        handles = []
        for name, m in root.named_modules(prefix=prefix):
            entry = (name or type(m).__name__, type(m).__name__)

            def pre(mod, args, entry=entry):
                self.module_stack.append(entry)

            def post(mod, args, out, entry=entry):
                if self.module_stack and self.module_stack[-1] == entry:
                    self.module_stack.pop()

            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post, always_call=True))
        return handles

    def note_params(self, tensors: Sequence[Any]) -> None:
        for t in tensors:
            if isinstance(t, nn.Parameter):
                self.tile_params[id(t)] = t


_STATE = DispatchState()


def state() -> DispatchState:
    return _STATE


class ParameterUseCheck(TorchFunctionMode):
    """Records parameters used by ops outside the tile dispatch (on replicated values).  A parameter whose
    gradient is a partial sum over tiles (:attr:`DispatchState.tile_params`) that is also used on replicated
    values would get that part counted once per tile: :meth:`raise_if_mixed` refuses it."""

    def __init__(self, names: dict[int, str] | None = None) -> None:
        super().__init__()
        self.replicated: dict[int, tuple[nn.Parameter, str, str]] = {}
        self.names = names or {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.autograd.grad:
            self._refuse_tile_parameter_grad(args, kwargs)
            return func(*args, **kwargs)
        # only uses that give the parameter a gradient: not under no_grad (an optimizer's update), not a read of
        # or a write of an attribute (``p.grad``, ``p.grad = None``)
        if (_STATE.depth == 0 and torch.is_grad_enabled() and getattr(func, "__name__", None) not in ("__get__", "__set__", "__delete__")
                and not any(issubclass(t, SpatialTensor) for t in types)):
            for t in _flat(args, kwargs):
                if isinstance(t, nn.Parameter) and id(t) not in self.replicated:
                    self.replicated[id(t)] = (t, _op_name(func), _STATE.where())
        return func(*args, **kwargs)

    def _refuse_tile_parameter_grad(self, args, kwargs) -> None:
        inputs = args[1] if len(args) > 1 else kwargs.get("inputs", ())
        for t in (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs):
            if isinstance(t, nn.Parameter) and id(t) in _STATE.tile_params:
                raise SpatialDispatchError(
                    f"spatial: torch.autograd.grad with respect to parameter '{self.names.get(id(t), '?')}' in "
                    f"{_STATE.where()} would return this tile's part of its gradient (the strategy sums the tiles "
                    f"after the backward pass). Read the reduced gradients (p.grad) after self.manual_backward(loss) "
                    f"or in on_before_optimizer_step instead, or train this module with spatial_parts=(1, 1)"
                )

    def raise_if_mixed(self, named: dict[int, str]) -> None:
        for pid in _STATE.tile_params:
            if pid in self.replicated:
                _, op, where = self.replicated[pid]
                raise SpatialDispatchError(
                    f"spatial: parameter '{named.get(pid, '?')}' is used on split activations and, by {op} in {where}, "
                    f"on a value replicated over the spatial group; its gradient cannot be reduced exactly. Use separate "
                    f"parameters for the two uses, or spatial_parts=(1, 1)"
                )


# ------------------------------------------------------------------------------------------------------------
# autograd pieces
# ------------------------------------------------------------------------------------------------------------
class _CompleteGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the spatial group (a replicated value that met tiles
    received only this tile's part of its gradient)."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, g):  # type: ignore[override]
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def _tile_index(shape: Sequence[int], hdim: int, wdim: int, grid: SpatialGrid) -> tuple:
    (h0, h1), (w0, w1) = block_bounds(shape[hdim], grid.parts[0])[grid.index[0]], block_bounds(shape[wdim], grid.parts[1])[grid.index[1]]
    idx = [slice(None)] * len(shape)
    idx[hdim], idx[wdim] = slice(h0, h1), slice(w0, w1)
    return tuple(idx)


class _ScatterTile(torch.autograd.Function):
    """This tile of a replicated whole tensor; backward: the tile's gradient placed in a zero tensor and summed
    over the group (the complete gradient of the replicated tensor)."""

    @staticmethod
    def forward(ctx, x, grid, hdim, wdim):  # type: ignore[override]
        ctx.args, ctx.shape = (grid, hdim, wdim), x.shape
        return x[_tile_index(x.shape, hdim, wdim, grid)].clone()

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, g):  # type: ignore[override]
        grid, hdim, wdim = ctx.args
        full = g.new_zeros(ctx.shape)
        full[_tile_index(ctx.shape, hdim, wdim, grid)] = g
        dist.all_reduce(full, group=grid.group)
        return full, None, None, None


def _gather_raw(local: torch.Tensor, grid: SpatialGrid, gshape: Sequence[int], hdim: int, wdim: int) -> torch.Tensor:
    moved = local.movedim((hdim, wdim), (-2, -1)).contiguous()
    rows, cols = block_bounds(gshape[hdim], grid.parts[0]), block_bounds(gshape[wdim], grid.parts[1])
    mh, mw = max(b - a for a, b in rows), max(b - a for a, b in cols)
    padded = F.pad(moved, (0, mw - moved.shape[-1], 0, mh - moved.shape[-2])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(grid.size)]
    dist.all_gather(parts, padded, group=grid.group)
    full = moved.new_empty(*moved.shape[:-2], gshape[hdim], gshape[wdim])
    for k, part in enumerate(parts):
        (a, b), (c, d) = rows[k // grid.parts[1]], cols[k % grid.parts[1]]
        full[..., a:b, c:d] = part[..., : b - a, : d - c]
    return full.movedim((-2, -1), (hdim, wdim))


class _Gather(torch.autograd.Function):
    """The whole activation on every rank; backward keeps this tile's part of the (complete) gradient."""

    @staticmethod
    def forward(ctx, local, grid, gshape, hdim, wdim):  # type: ignore[override]
        ctx.args = (grid, tuple(gshape), hdim, wdim)
        return _gather_raw(local, grid, gshape, hdim, wdim)

    @staticmethod
    @once_differentiable  # the exchange in this backward is not itself differentiated
    def backward(ctx, g):  # type: ignore[override]
        grid, gshape, hdim, wdim = ctx.args
        return g[_tile_index(gshape, hdim, wdim, grid)].contiguous(), None, None, None, None


# ------------------------------------------------------------------------------------------------------------
# the tensor
# ------------------------------------------------------------------------------------------------------------
def _plain(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


class SpatialTensor(torch.Tensor):
    """One tile of an activation split over ``grid`` along ``hdim`` and ``wdim`` (see the module docstring)."""

    _grid: SpatialGrid
    _gshape: tuple[int, ...]
    _hdim: int
    _wdim: int

    @staticmethod
    def wrap(local: torch.Tensor, grid: SpatialGrid, gshape: Sequence[int], hdim: int, wdim: int, *,
             fresh: bool = False) -> SpatialTensor:
        """``fresh``: ``local`` is a new result nobody else holds; it becomes the SpatialTensor itself (no alias
        view, so a later in-place op on it is not an in-place op on a view, which autograd would answer with a
        whole-tensor copy in backward)."""
        if fresh and type(local) is torch.Tensor:
            local.__class__ = SpatialTensor
            t = cast(SpatialTensor, local)  # its class was just set
        else:
            with torch._C.DisableTorchFunctionSubclass():
                t = local.as_subclass(SpatialTensor)
        t._grid, t._gshape, t._hdim, t._wdim = grid, tuple(int(s) for s in gshape), hdim % local.dim(), wdim % local.dim()
        return t

    def local(self) -> torch.Tensor:
        """This rank's tile as a plain tensor (same autograd graph)."""
        return _plain(self)

    def full(self) -> torch.Tensor:
        """The whole activation on every rank (one all-gather; differentiable)."""
        return _Gather.apply(_plain(self), self._grid, self._gshape, self._hdim, self._wdim)

    @property
    def split_dims(self) -> tuple[int, ...]:
        """The dimensions actually divided among ranks (a dimension with one part is whole on every rank)."""
        return tuple(d for d, p in ((self._hdim, self._grid.parts[0]), (self._wdim, self._grid.parts[1])) if p > 1)

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        return f"SpatialTensor(global shape {tuple(self._gshape)}, split dims {(self._hdim, self._wdim)} over {self._grid.parts}, tile={_plain(self)!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _STATE.depth += 1
        try:
            return _dispatch(func, args, kwargs)
        finally:
            _STATE.depth -= 1


def split_tensor(full_or_tile: torch.Tensor, grid: SpatialGrid, gshape: Sequence[int], hdim: int = -2, wdim: int = -1) -> SpatialTensor:
    """Wrap this rank's tile (already cut) of a tensor of global shape ``gshape``."""
    return SpatialTensor.wrap(full_or_tile, grid, gshape, hdim, wdim)


def gather_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (gathered) for a split one, else ``t``."""
    return t.full() if isinstance(t, SpatialTensor) else t


def local_tile(t: torch.Tensor) -> torch.Tensor:
    """This rank's tile as a plain tensor for a split one, else ``t``: for statistics whose per-rank counts are
    summed over all ranks anyway (confusion counts of segmentation metrics), so nothing is gathered."""
    return t.local() if isinstance(t, SpatialTensor) else t


# ------------------------------------------------------------------------------------------------------------
# utilities
# ------------------------------------------------------------------------------------------------------------
def _flat(args, kwargs):
    out = []
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


def _op_name(func) -> str:
    name = getattr(func, "__name__", None) or str(func)
    if name == "__get__":
        owner = getattr(func, "__self__", None)
        return f"Tensor.{getattr(owner, '__name__', '?')}"
    mod = getattr(func, "__module__", None) or ""
    qual = getattr(func, "__qualname__", name)
    if mod.startswith("torch.nn.functional") or mod == "torch._C._nn":
        return f"F.{name}"
    if qual.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + qual.split(".", 1)[1]
    return f"torch.{name}"


def _spatials(args, kwargs) -> list[SpatialTensor]:
    return [t for t in _flat(args, kwargs) if isinstance(t, SpatialTensor)]


def _layout(t: SpatialTensor):
    return (t._grid, t._gshape, t._hdim, t._wdim)


def _wrap_like(local: torch.Tensor, ref: SpatialTensor, gshape=None, hdim=None, wdim=None) -> SpatialTensor:
    return SpatialTensor.wrap(local, ref._grid, ref._gshape if gshape is None else gshape,
                              ref._hdim if hdim is None else hdim, ref._wdim if wdim is None else wdim, fresh=True)


def _nbytes(t: torch.Tensor, shape) -> int:
    return int(math.prod(shape)) * t.element_size()


def _unsupported(func, reason: str, fix: str, spatial: list[SpatialTensor], *, inplace: bool = False) -> None:
    """Refuse, or warn once before gathering."""
    op, where = _op_name(func), _STATE.where()
    nbytes = sum(_nbytes(t, t._gshape) for t in spatial)
    if inplace or _STATE.on_unsupported == "error":
        raise SpatialDispatchError(
            f"spatial: {op} in {where} {reason}; it would compute something different on a tile than on the whole "
            f"sample. {fix}"
        )
    key = (op, where)
    if key not in _STATE.warned:
        _STATE.warned.add(key)
        warnings.warn(
            f"spatial: {op} in {where} {reason}: gathering the whole activation ({nbytes} bytes per rank per call, "
            f"{len(spatial)} all-gather(s)) and computing it exactly as one process does. {fix}",
            stacklevel=3,
        )


# ------------------------------------------------------------------------------------------------------------
# dispatch
# ------------------------------------------------------------------------------------------------------------
_HANDLERS: dict[Any, Any] = {}


def _handles(*funcs):
    def deco(fn):
        for f in funcs:
            if f is not None:
                _HANDLERS[f] = fn
        return fn
    return deco


def _resolve(names: str) -> list[Any]:
    out = []
    for name in names.split():
        for ns in (torch, torch.Tensor, F, torch._C._nn, torch.special):
            f = getattr(ns, name, None)
            if f is not None and callable(f):
                out.append(f)
    return out


_UNARY = """abs absolute neg negative exp exp2 expm1 log log2 log10 log1p sqrt rsqrt sigmoid tanh relu relu6 gelu silu
mish elu selu celu leaky_relu hardswish hardsigmoid hardtanh softplus softsign tanhshrink logsigmoid sin cos tan
asin acos atan sinh cosh asinh acosh atanh square reciprocal clamp clip clamp_min clamp_max sign sgn floor ceil
round trunc frac erf erfc erfinv nan_to_num isnan isinf isfinite logical_not bitwise_not threshold hardshrink
softshrink rrelu_ positive float double half bfloat16 int long bool to type contiguous clone detach
requires_grad_ __neg__ __abs__ __invert__ __pos__ relu_ sigmoid_ tanh_ exp_ log_ sqrt_ abs_ neg_ clamp_ clip_
clamp_min_ clamp_max_ hardtanh_ leaky_relu_ elu_ selu_ celu_ threshold_ nan_to_num_ zero_ fill_ detach_
square_ reciprocal_ floor_ ceil_ round_ trunc_ sign_ erf_ gelu_ silu_ mish_ hardswish_ hardsigmoid_ pow_
xlogy_ cpu cuda""".split()
_BINARY = """add sub subtract mul multiply div divide true_divide floor_divide remainder fmod pow float_power maximum
minimum fmax fmin eq ne lt le gt ge greater less greater_equal less_equal not_equal logical_and logical_or
logical_xor bitwise_and bitwise_or bitwise_xor atan2 hypot copysign xlogy where lerp addcmul addcdiv masked_fill
rsub __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__ __rtruediv__
__itruediv__ __div__ __rdiv__ __floordiv__ __rfloordiv__ __mod__ __rmod__ __pow__ __rpow__ __ipow__ __eq__ __ne__
__lt__ __le__ __gt__ __ge__ __and__ __or__ __xor__ __rand__ __ror__ __rxor__ add_ sub_ mul_ div_ true_divide_
masked_fill_ lerp_ addcmul_ addcdiv_ copy_ maximum minimum type_as heaviside""".split()
_ELEMENTWISE = set(_resolve(" ".join(_UNARY + _BINARY)))
_NO_TENSOR_OUT = set(_resolve("backward retain_grad register_post_accumulate_grad_hook"))
_META = set(_resolve("dim ndimension is_contiguous is_floating_point is_complex element_size get_device data_ptr "
                     "is_signed storage_offset"))


def _inplace_call(func, args, kwargs) -> bool:
    """``F.relu(x, inplace=True)`` and friends: the functional form of an in-place op."""
    if kwargs.get("inplace") is True:
        return True
    mod = getattr(func, "__module__", "") or ""
    return mod.startswith("torch.nn.functional") and len(args) > 1 and args[-1] is True


def _is_inplace(func) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in ("__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__", "__setitem__")


def _dispatch(func, args, kwargs):
    handler = _HANDLERS.get(func)
    if handler is not None:
        out = handler(func, args, kwargs)
        if out is not NotImplemented:
            return out
    elif getattr(func, "__name__", None) == "__get__":
        return _property(func, args, kwargs)
    elif func in _META:
        return func(*[_plain(a) if isinstance(a, SpatialTensor) else a for a in args], **kwargs)
    elif func in _NO_TENSOR_OUT:  # on the tensor itself (a hook on an alias would never fire)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    elif func in _ELEMENTWISE:
        out = _elementwise(func, args, kwargs)
        if out is not NotImplemented:
            return out
    return _fallback(func, args, kwargs)


def _property(func, args, kwargs):
    owner = getattr(func, "__self__", None)
    name = getattr(owner, "__name__", "")
    t = args[0]
    if name == "shape":
        return torch.Size(t._gshape)
    if name in ("data",):
        return _wrap_like(_plain(t).data, t)
    if name == "grad":  # a retained gradient is this tile's part: reductions over it stay global
        with torch._C.DisableTorchFunctionSubclass():
            g = func(*args, **kwargs)
        return g if g is None or isinstance(g, SpatialTensor) else SpatialTensor.wrap(g, *_layout(t))
    if name in ("T", "mT", "H", "mH", "real", "imag"):
        return _fallback(func, args, kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


@_handles(*_resolve("zeros_like ones_like empty_like full_like"))
def _like(func, args, kwargs):
    x = args[0]
    if not isinstance(x, SpatialTensor) or "size" in kwargs:
        return NotImplemented
    return _wrap_like(func(_plain(x), *args[1:], **kwargs), x)


@_handles(*_resolve("rand_like randn_like randint_like"))
def _random_like(func, args, kwargs):
    """Drawn for the whole activation from the global stream (as one process draws it), then cut to the tile."""
    x = args[0]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    kw = dict(kwargs)
    kw.setdefault("dtype", x.dtype)
    kw.setdefault("device", x.device)
    full = func(torch.empty(x._gshape, dtype=kw["dtype"], device=kw["device"]), *args[1:], **kw)
    return _wrap_like(full[_tile_index(full.shape, x._hdim, x._wdim, x._grid)], x)


@_handles(*_resolve("new_zeros new_ones new_empty new_full new_tensor"))
def _new(func, args, kwargs):
    """Plain tensors of the size the caller gives (sizes read from ``x.shape`` are global)."""
    return func(_plain(args[0]), *args[1:], **kwargs)


@_handles(torch.Tensor.size)
def _size(func, args, kwargs):
    t = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return torch.Size(t._gshape) if dim is None else t._gshape[dim]


@_handles(torch.Tensor.numel, torch.numel)
def _numel(func, args, kwargs):
    return int(math.prod(args[0]._gshape))


@_handles(torch.Tensor.__len__)
def _len(func, args, kwargs):
    return args[0]._gshape[0]


@_handles(torch.Tensor.__format__)
def _format(func, args, kwargs):
    return repr(args[0])


def _align_operand(t, out_ndim: int, ref: SpatialTensor, hdim: int, wdim: int):
    """A plain operand of an element-wise op: ``"broadcast"`` (size 1 or absent along both split dims), ``"full"``
    (spans the whole split extents: cut to this tile) or ``None`` (anything else)."""
    off = out_ndim - t.dim()
    sizes = []
    for d in (hdim, wdim):
        k = d - off
        sizes.append(1 if k < 0 else t.shape[k])
    gh, gw = ref._gshape[ref._hdim], ref._gshape[ref._wdim]
    ph, pw = ref._grid.parts
    ok_h = sizes[0] == 1 or ph == 1 and sizes[0] == gh
    ok_w = sizes[1] == 1 or pw == 1 and sizes[1] == gw
    if ok_h and ok_w:
        return "broadcast"
    if sizes[0] == gh and sizes[1] == gw and hdim - off >= 0 and wdim - off >= 0:
        return "full"
    return None


def _replicated_operand(t: torch.Tensor, grid: SpatialGrid) -> torch.Tensor:
    """A replicated tensor used with tiles: parameters are recorded (partial gradient, summed by the strategy),
    other tensors needing a gradient get it completed over the group."""
    if isinstance(t, nn.Parameter):
        _STATE.tile_params[id(t)] = t
        return t
    if t.requires_grad and grid.group is not None:
        return _CompleteGrad.apply(t, grid.group)
    return t


def _localize(args, kwargs, spatial: list[SpatialTensor], keep_out_dims: bool = True):
    """Local operands for an op whose output is laid out like the broadcast of its operands, or None."""
    ref = spatial[0]
    tensors = [t for t in _flat(args, kwargs) if isinstance(t, torch.Tensor)]
    out_ndim = max(t.dim() for t in tensors)
    hdim, wdim = ref._hdim + out_ndim - ref.dim(), ref._wdim + out_ndim - ref.dim()
    for s in spatial:
        off = out_ndim - s.dim()
        if s._grid is not ref._grid or s._hdim + off != hdim or s._wdim + off != wdim or \
                s._gshape[s._hdim] != ref._gshape[ref._hdim] or s._gshape[s._wdim] != ref._gshape[ref._wdim]:
            return None

    def local_of(a):
        if isinstance(a, SpatialTensor):
            return _plain(a)
        if isinstance(a, torch.Tensor):
            kind = _align_operand(a, out_ndim, ref, hdim, wdim)
            if kind is None:
                raise _NotLocal
            if kind == "full":
                off = out_ndim - a.dim()
                if a.requires_grad and ref._grid.group is not None:
                    return _ScatterTile.apply(a, ref._grid, hdim - off, wdim - off)
                return a[_tile_index(a.shape, hdim - off, wdim - off, ref._grid)]
            return _replicated_operand(a, ref._grid)
        if isinstance(a, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in a):
            return type(a)(local_of(v) for v in a)
        return a

    try:
        largs = [local_of(a) for a in args]
        lkw = {k: local_of(v) for k, v in kwargs.items()}
    except _NotLocal:
        return None
    gshapes = []
    for t in tensors:
        gshapes.append(t._gshape if isinstance(t, SpatialTensor) else tuple(t.shape))
    try:
        gshape = tuple(torch.broadcast_shapes(*gshapes))
    except RuntimeError:
        return None
    return largs, lkw, gshape, hdim, wdim


class _NotLocal(Exception):
    pass


def _elementwise(func, args, kwargs):
    spatial = _spatials(args, kwargs)
    loc = _localize(args, kwargs, spatial)
    if loc is None:
        return NotImplemented
    largs, lkw, gshape, hdim, wdim = loc
    if _is_inplace(func) and not isinstance(args[0], SpatialTensor):
        return NotImplemented  # a replicated tensor updated from tiles: gather (fallback refuses in-place)
    if getattr(func, "__name__", "") == "copy_" and not isinstance(args[1], SpatialTensor):
        return NotImplemented
    if _is_inplace(func) or (isinstance(args[0], SpatialTensor) and _inplace_call(func, args, kwargs)):
        # on the SpatialTensor itself, not on an alias of it (see SpatialTensor.wrap)
        with torch._C.DisableTorchFunctionSubclass():
            func(args[0], *largs[1:], **lkw)
        return args[0]
    out = func(*largs, **lkw)
    if isinstance(out, torch.Tensor) and out.dim() == len(gshape):
        return SpatialTensor.wrap(out, spatial[0]._grid, gshape, hdim, wdim, fresh=True)
    raise SpatialDispatchError(f"spatial: internal error: {_op_name(func)} in {_STATE.where()} gave an unexpected result")


def _fallback(func, args, kwargs):
    spatial = _spatials(args, kwargs)
    if not spatial:
        return func(*args, **kwargs)
    name = getattr(func, "__name__", "")
    if (_is_inplace(func) or _inplace_call(func, args, kwargs)) and isinstance(args[0], SpatialTensor) or \
            kwargs.get("out") is not None:
        _unsupported(func, "changes a split activation in place in a way that has no tiled form",
                     "Write it out of place (e.g. y = torch.cat(...) or y = x.clone() then edit y) so it can be computed "
                     "exactly", spatial, inplace=True)
    _unsupported(func, "has no tiled form",
                 "To avoid the gather, use an op with a tiled form (see docs/spatial.md) or pass "
                 "on_unsupported='error' to see every such op", spatial)
    _STATE.gathers += len(spatial)
    _STATE.gathered_bytes += sum(_nbytes(t, t._gshape) for t in spatial)
    ref = spatial[0]

    def full_of(a):
        if isinstance(a, SpatialTensor):
            return a.full()
        if isinstance(a, (list, tuple)) and any(isinstance(v, SpatialTensor) for v in a):
            return type(a)(full_of(v) for v in a)
        return a

    out = func(*[full_of(a) for a in args], **{k: full_of(v) for k, v in kwargs.items()})
    del name
    return _resplit(out, ref)


def _resplit(out, ref: SpatialTensor):
    """Split a result computed on whole activations again when it still has the reference's dimensions."""
    if isinstance(out, torch.Tensor) and not isinstance(out, SpatialTensor):
        ph, pw = ref._grid.parts
        if out.dim() == ref.dim() and out.shape[ref._hdim] >= ph and out.shape[ref._wdim] >= pw and \
                (out.is_floating_point() or not out.requires_grad):
            if out.requires_grad and ref._grid.group is not None:
                local = _ScatterTile.apply(out, ref._grid, ref._hdim, ref._wdim)
            else:
                local = out[_tile_index(out.shape, ref._hdim, ref._wdim, ref._grid)]
            return SpatialTensor.wrap(local, ref._grid, tuple(out.shape), ref._hdim, ref._wdim, fresh=True)
        return out
    if isinstance(out, (list, tuple)) and not hasattr(out, "_fields"):
        return type(out)(_resplit(o, ref) for o in out)
    return out


# ------------------------------------------------------------------------------------------------------------
# local ops along unsplit dimensions
# ------------------------------------------------------------------------------------------------------------
def _norm_dim(d: int, n: int) -> int:
    return d % n


@_handles(*_resolve("softmax log_softmax"))
def _softmax(func, args, kwargs):
    x = args[0]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None or _norm_dim(dim, x.dim()) in x.split_dims:
        return NotImplemented
    rest = [_plain(a) if isinstance(a, SpatialTensor) else a for a in args]
    return _wrap_like(func(*rest, **kwargs), x)


@_handles(F.linear)
def _linear(func, args, kwargs):
    x = args[0]
    params = list(args[1:]) + list(kwargs.values())
    if not isinstance(x, SpatialTensor) or (x.dim() - 1) in x.split_dims or any(isinstance(p, SpatialTensor) for p in params):
        return NotImplemented
    w = args[1] if len(args) > 1 else kwargs["weight"]
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    w = _replicated_operand(w, x._grid)
    b = _replicated_operand(b, x._grid) if b is not None else None
    out = F.linear(_plain(x), w, b)
    gshape = tuple(x._gshape[:-1]) + (out.shape[-1],)
    return _wrap_like(out, x, gshape)


@_handles(F.layer_norm)
def _layer_norm(func, args, kwargs):
    x = args[0]
    shape = args[1] if len(args) > 1 else kwargs["normalized_shape"]
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    n = len(shape)
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    w = args[2] if len(args) > 2 else kwargs.get("weight")
    b = args[3] if len(args) > 3 else kwargs.get("bias")
    eps = args[4] if len(args) > 4 else kwargs.get("eps", 1e-5)
    if any(isinstance(t, SpatialTensor) for t in (w, b)):
        return NotImplemented
    d0 = x.dim() - n
    inside = [d >= d0 for d in x.split_dims]
    if any(inside) and not all(inside) or tuple(x._gshape[d0:]) != shape:
        return NotImplemented  # split dims both normalised and not, or a wrong shape: gathered (the serial error)
    w = _replicated_operand(w, x._grid) if w is not None else None
    b = _replicated_operand(b, x._grid) if b is not None else None
    if not any(inside) or x._grid.group is None:
        return _wrap_like(F.layer_norm(_plain(x), shape, w, b, eps), x)
    # over split dimensions (LayerNorm([C, H, W])): statistics per leading index over the whole sample, and the
    # element-wise affine parameters cut to this tile (their gradients are tile parts, summed by the strategy)
    idx = [slice(None)] * n
    for d in x.split_dims:
        idx[d - d0] = _tile_index(x._gshape, x._hdim, x._wdim, x._grid)[d]
    w = w[tuple(idx)] if w is not None else None
    b = b[tuple(idx)] if b is not None else None
    local = _plain(x)
    out_dtype = _serial_norm_dtype("layer", local, w, b)
    cdt = _norm_compute_dtype(local, out_dtype)
    rows = local.to(cdt).reshape(math.prod(local.shape[:d0]), -1)
    from lightning_hpc.spatial.groupnorm import aggregated_row_norm

    y = aggregated_row_norm(rows, eps, x._grid.group)[0].reshape(local.shape)
    return _wrap_like(_affine(y, w, b, None, cdt).to(out_dtype), x)


_NORM_DTYPES: dict[tuple, torch.dtype] = {}


def _serial_norm_dtype(kind: str, x: torch.Tensor, w, b) -> torch.dtype:
    """The dtype the serial ``F.group_norm`` / ``F.instance_norm`` / ``F.layer_norm`` returns for these operand
    dtypes under the current autocast state of ``x``'s device (float32 for a bf16 input on some devices, the
    input's dtype on others): found once per combination on a tiny input on the same device."""
    dev = x.device.type
    autocast = torch.is_autocast_enabled(dev)
    key = (kind, dev, x.dtype, None if w is None else w.dtype, None if b is None else b.dtype, autocast,
           torch.get_autocast_dtype(dev) if autocast else None)
    dtype = _NORM_DTYPES.get(key)
    if dtype is None:
        shape = (2, 2, 2) if kind == "layer" else (2,)
        pw, pb = (None if t is None else torch.ones(shape, dtype=t.dtype, device=x.device) for t in (w, b))
        with torch.no_grad():
            probe = torch.arange(8, dtype=x.dtype, device=x.device).reshape(1, 2, 2, 2)
            if kind == "group":
                out = F.group_norm(probe, 1, pw, pb)
            elif kind == "instance":
                out = F.instance_norm(probe, None, None, pw, pb)
            else:
                out = F.layer_norm(probe, shape, pw, pb)
        dtype = _NORM_DTYPES[key] = out.dtype
    return dtype


def _norm_compute_dtype(x: torch.Tensor, out_dtype: torch.dtype) -> torch.dtype:
    """Normalisation on a tile in float32 (float64 when the input or the result is float64): the serial kernels
    accumulate reduced-precision inputs in float32 too."""
    return torch.float64 if torch.float64 in (x.dtype, out_dtype) else torch.float32


def _affine(y: torch.Tensor, w, b, view, dtype: torch.dtype) -> torch.Tensor:
    if w is not None:
        w = w.to(dtype)
        y = y * (w.view(view) if view is not None else w)
    if b is not None:
        b = b.to(dtype)
        y = y + (b.view(view) if view is not None else b)
    return y


def _norm_over_space(x) -> bool:
    """N x C x spatial... with the split dimensions among the spatial ones (statistics over them)."""
    return isinstance(x, SpatialTensor) and x.dim() >= 3 and min(x._hdim, x._wdim) >= 2


@_handles(F.group_norm)
def _group_norm(func, args, kwargs):
    x = args[0] if args else kwargs["input"]
    groups = _arg(args, kwargs, 1, "num_groups")
    w, b, eps = _arg(args, kwargs, 2, "weight"), _arg(args, kwargs, 3, "bias"), _arg(args, kwargs, 4, "eps", 1e-5)
    if not _norm_over_space(x) or any(isinstance(t, SpatialTensor) for t in (w, b)) or x._gshape[1] % groups:
        return NotImplemented
    w = _replicated_operand(w, x._grid) if w is not None else None
    b = _replicated_operand(b, x._grid) if b is not None else None
    local = _plain(x)
    if not x.split_dims or x._grid.group is None:
        return _wrap_like(F.group_norm(local, groups, w, b, eps), x)
    from lightning_hpc.spatial.groupnorm import aggregated_row_norm

    out_dtype = _serial_norm_dtype("group", local, w, b)
    cdt = _norm_compute_dtype(local, out_dtype)
    rows = local.to(cdt).reshape(local.shape[0] * groups, -1)
    y = aggregated_row_norm(rows, eps, x._grid.group)[0].reshape(local.shape)
    view = (1, -1) + (1,) * (x.dim() - 2)
    return _wrap_like(_affine(y, w, b, view, cdt).to(out_dtype), x)


@_handles(F.instance_norm)
def _instance_norm(func, args, kwargs):
    x = args[0] if args else kwargs["input"]
    rm, rv = _arg(args, kwargs, 1, "running_mean"), _arg(args, kwargs, 2, "running_var")
    w, b = _arg(args, kwargs, 3, "weight"), _arg(args, kwargs, 4, "bias")
    use_input_stats, momentum = _arg(args, kwargs, 5, "use_input_stats", True), _arg(args, kwargs, 6, "momentum", 0.1)
    eps = _arg(args, kwargs, 7, "eps", 1e-5)
    if not _norm_over_space(x) or any(isinstance(t, SpatialTensor) for t in (rm, rv, w, b)):
        return NotImplemented
    w = _replicated_operand(w, x._grid) if w is not None else None
    b = _replicated_operand(b, x._grid) if b is not None else None
    local = _plain(x)
    if not use_input_stats or not x.split_dims or x._grid.group is None:  # running statistics: per element
        return _wrap_like(F.instance_norm(local, rm, rv, w, b, use_input_stats, momentum, eps), x)
    from lightning_hpc.spatial.groupnorm import aggregated_row_norm

    out_dtype = _serial_norm_dtype("instance", local, w, b)
    cdt = _norm_compute_dtype(local, out_dtype)
    n, c = local.shape[:2]
    y, mean64, var64 = aggregated_row_norm(local.to(cdt).reshape(n * c, -1), eps, x._grid.group)
    if rm is not None or rv is not None:
        # as the serial op: each instance's statistics update the running ones with the momentum, averaged over
        # the batch (the variance unbiased over the whole spatial extent)
        count = math.prod(x._gshape[2:])
        with torch.no_grad():
            if rm is not None:
                rm.mul_(1 - momentum).add_(mean64.view(n, c).mean(0).to(rm.dtype), alpha=momentum)
            if rv is not None:
                unbiased = var64 * (count / max(count - 1.0, 1.0))
                rv.mul_(1 - momentum).add_(unbiased.view(n, c).mean(0).to(rv.dtype), alpha=momentum)
    view = (1, -1) + (1,) * (x.dim() - 2)
    return _wrap_like(_affine(y.reshape(local.shape), w, b, view, cdt).to(out_dtype), x)


@_handles(F.prelu)
def _prelu(func, args, kwargs):
    x, w = args[0], (args[1] if len(args) > 1 else kwargs["weight"])
    if not isinstance(x, SpatialTensor) or isinstance(w, SpatialTensor) or x._hdim == 1 or x._wdim == 1:
        return NotImplemented
    return _wrap_like(F.prelu(_plain(x), _replicated_operand(w, x._grid)), x)


@_handles(*_resolve("cat concat concatenate"))
def _cat(func, args, kwargs):
    tensors = list(args[0] if args else kwargs["tensors"])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    spatial = [t for t in tensors if isinstance(t, SpatialTensor)]
    ref = spatial[0]
    dim = _norm_dim(dim, ref.dim())
    if dim in (ref._hdim, ref._wdim):
        return NotImplemented
    locs = []
    for t in tensors:
        if isinstance(t, SpatialTensor):
            if t._grid is not ref._grid or (t._hdim, t._wdim) != (ref._hdim, ref._wdim) or t.dim() != ref.dim() or \
                    (t._gshape[t._hdim], t._gshape[t._wdim]) != (ref._gshape[ref._hdim], ref._gshape[ref._wdim]):
                return NotImplemented
            locs.append(_plain(t))
        else:
            if t.dim() != ref.dim():
                return NotImplemented
            kind = _align_operand(t, ref.dim(), ref, ref._hdim, ref._wdim)
            if kind != "full" and not (kind == "broadcast" and not ref.split_dims):
                if kind == "broadcast" and t.shape[ref._hdim] == ref._gshape[ref._hdim] and t.shape[ref._wdim] == ref._gshape[ref._wdim]:
                    kind = "full"
                else:
                    return NotImplemented
            if t.requires_grad and ref._grid.group is not None:
                locs.append(_ScatterTile.apply(t, ref._grid, ref._hdim, ref._wdim))
            else:
                locs.append(t[_tile_index(t.shape, ref._hdim, ref._wdim, ref._grid)])
    out = torch.cat(locs, dim)
    gshape = list(ref._gshape)
    gshape[dim] = out.shape[dim]
    return _wrap_like(out, ref, gshape)


@_handles(*_resolve("chunk split tensor_split unbind"))
def _chunk(func, args, kwargs):
    x = args[0]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    name = func.__name__
    if name == "unbind":
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    else:
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    dim = _norm_dim(dim, x.dim())
    if dim in (x._hdim, x._wdim):
        return NotImplemented
    parts = func(_plain(x), *args[1:], **kwargs)
    out = []
    for p in parts:
        if name == "unbind":
            hd, wd = (x._hdim - (dim < x._hdim), x._wdim - (dim < x._wdim))
            g = list(x._gshape)
            del g[dim]
            out.append(_wrap_like(p, x, g, hd, wd))
        else:
            g = list(x._gshape)
            g[dim] = p.shape[dim]
            out.append(_wrap_like(p, x, g))
    return tuple(out)


@_handles(torch.Tensor.permute, torch.permute)
def _permute(func, args, kwargs):
    x = args[0]
    dims = args[1:] if len(args) > 1 else kwargs["dims"]
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = dims[0]
    dims = [_norm_dim(d, x.dim()) for d in dims]
    out = _plain(x).permute(dims)
    return _wrap_like(out, x, [x._gshape[d] for d in dims], dims.index(x._hdim), dims.index(x._wdim))


@_handles(*_resolve("transpose swapaxes swapdims"))
def _transpose(func, args, kwargs):
    x = args[0]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    d0, d1 = (_norm_dim(d, x.dim()) for d in args[1:3])
    perm = list(range(x.dim()))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permute(func, (x, perm), {})


@_handles(*_resolve("unsqueeze"))
def _unsqueeze(func, args, kwargs):
    x = args[0]
    d = args[1] if len(args) > 1 else kwargs["dim"]
    d = d % (x.dim() + 1)
    g = list(x._gshape)
    g.insert(d, 1)
    return _wrap_like(_plain(x).unsqueeze(d), x, g, x._hdim + (d <= x._hdim), x._wdim + (d <= x._wdim))


@_handles(torch.Tensor.__getitem__)
def _getitem(func, args, kwargs):
    x, idx = args[0], args[1]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    items = idx if isinstance(idx, tuple) else (idx,)
    if not all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items):
        return NotImplemented
    n_real = sum(1 for i in items if i is not None and i is not Ellipsis)
    if items.count(Ellipsis) > 1:
        return NotImplemented
    expanded: list[Any] = []
    for i in items:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (x.dim() - n_real))
        else:
            expanded.append(i)
    while sum(1 for i in expanded if i is not None) < x.dim():
        expanded.append(slice(None))
    src, out_dim, hd, wd, g = 0, 0, None, None, []
    split = x.split_dims
    for i in expanded:
        if i is None:
            g.append(1)
            out_dim += 1
            continue
        if src in split and i != slice(None):
            return NotImplemented
        if isinstance(i, int):
            if src in (x._hdim, x._wdim):
                return NotImplemented
        else:
            if src == x._hdim:
                hd = out_dim
            if src == x._wdim:
                wd = out_dim
            g.append(len(range(*i.indices(x._gshape[src]))))
            out_dim += 1
        src += 1
    out = _plain(x)[tuple(expanded)]
    return _wrap_like(out, x, g, hd, wd)


# ------------------------------------------------------------------------------------------------------------
# global reductions and losses
# ------------------------------------------------------------------------------------------------------------
@_handles(*_resolve("sum mean nansum"))
def _reduce(func, args, kwargs):
    x = args[0]
    if not isinstance(x, SpatialTensor) or any(isinstance(a, SpatialTensor) for a in args[1:]):
        return NotImplemented
    kw = dict(kwargs)
    dim = args[1] if len(args) > 1 else kw.pop("dim", kw.pop("axis", None))
    keepdim = args[2] if len(args) > 2 else kw.pop("keepdim", False)
    if len(args) > 3:
        return NotImplemented
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        dims = list(range(x.dim()))
        dim_arg = None
    else:
        dims = [_norm_dim(d, x.dim()) for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
        dim_arg = dims
    name = func.__name__
    local = _plain(x)
    split = set(x.split_dims)
    if not split & set(dims):  # along unsplit dimensions only: stays split
        out = func(local, dim=dims if dim_arg is not None else None, keepdim=keepdim, **kw) if dim_arg is not None else None
        if out is None:
            return NotImplemented
        g, hd, wd = [], x._hdim, x._wdim
        for d in range(x.dim()):
            if d in dims:
                if keepdim:
                    g.append(1)
            else:
                g.append(x._gshape[d])
        if not keepdim:
            hd -= sum(1 for d in dims if d < x._hdim)
            wd -= sum(1 for d in dims if d < x._wdim)
        return _wrap_like(out, x, g, hd, wd)
    if not split <= set(dims):
        return NotImplemented  # partly over the split dimensions: only a subgroup would reduce
    summed = (torch.nansum if name == "nansum" else torch.sum)(local, dim=dims, keepdim=keepdim, **kw) if dim_arg is not None \
        else (torch.nansum if name == "nansum" else torch.sum)(local, **kw)
    total = all_reduce_replicated(summed, x._grid.group)
    if name == "mean":
        count = math.prod(x._gshape[d] for d in dims)
        total = total / count
    return total


@_handles(torch.norm, torch.Tensor.norm, torch.linalg.vector_norm)
def _norm(func, args, kwargs):
    """Vector p-norms (``p`` finite, ``"fro"`` = 2) as ``sum(|x|^p)^(1/p)``: the sum is the global reduction
    above, so a gradient norm taken in a hook or a logged activation norm is one process's value."""
    x = args[0]
    if not isinstance(x, SpatialTensor) or len(args) > 4:
        return NotImplemented
    kw = dict(kwargs)
    p = args[1] if len(args) > 1 else kw.pop("ord" if func is torch.linalg.vector_norm else "p", 2)
    dim = args[2] if len(args) > 2 else kw.pop("dim", None)
    keepdim = args[3] if len(args) > 3 else kw.pop("keepdim", False)
    dtype = kw.pop("dtype", None)
    if kw:
        return NotImplemented  # out=: left to the general path
    p = 2.0 if p == "fro" else p
    if not isinstance(p, (int, float)) or not math.isfinite(p) or p <= 0:
        return NotImplemented  # inf / 0 / nuclear norms: gathered
    v = x if dtype is None else x.to(dtype)
    powered = v.abs() ** p
    total = powered.sum() if dim is None else powered.sum(dim=dim, keepdim=keepdim)
    if isinstance(total, SpatialTensor):
        return NotImplemented  # along unsplit dimensions only
    return total ** (1.0 / p)


def _reduction_arg(args, kwargs, pos: int, legacy: tuple[int, int] | None) -> str | None:
    if legacy is not None:
        for p, key in zip(legacy, ("size_average", "reduce")):
            v = args[p] if len(args) > p else kwargs.get(key)
            if v is not None:
                return None
    return args[pos] if len(args) > pos else kwargs.get("reduction", "mean")


_LOSS_SIG = {
    # name: (position of reduction, legacy positions, target position)
    "cross_entropy": 5, "nll_loss": 5, "binary_cross_entropy_with_logits": 5, "binary_cross_entropy": 5,
    "mse_loss": 4, "l1_loss": 4, "smooth_l1_loss": 4, "huber_loss": 2,
}


@_handles(*_resolve("cross_entropy nll_loss binary_cross_entropy_with_logits binary_cross_entropy mse_loss l1_loss smooth_l1_loss huber_loss"))
def _loss(func, args, kwargs):
    name = func.__name__
    spatial = _spatials(args, kwargs)
    ref = spatial[0]
    inp = args[0] if args else kwargs["input"]
    target = args[1] if len(args) > 1 else kwargs["target"]
    if not isinstance(inp, SpatialTensor):
        return NotImplemented
    kw = dict(kwargs)
    args = list(args)
    if name == "huber_loss":
        red = args[2] if len(args) > 2 else kw.get("reduction", "mean")
        legacy_set = False
    else:
        legacy = (2, 3) if name in ("mse_loss", "l1_loss", "smooth_l1_loss") else (3, 4)
        if name in ("cross_entropy", "nll_loss"):
            legacy = (3, 5)
        legacy_set = any((args[p] if len(args) > p else kw.get(k)) is not None for p, k in zip(legacy, ("size_average", "reduce")))
        rpos = 6 if name in ("cross_entropy", "nll_loss") else (5 if name.startswith("binary") else 4)
        red = args[rpos] if len(args) > rpos else kw.get("reduction", "mean")
        if len(args) > rpos:
            args = args[:rpos]
    if legacy_set or red not in ("mean", "sum", "none"):
        return NotImplemented
    kw.pop("reduction", None)
    class_dim_dropped = name in ("cross_entropy", "nll_loss") and isinstance(target, torch.Tensor) and not target.is_floating_point()
    # targets laid out like the output of the per-element loss
    if class_dim_dropped:
        if inp._hdim < 1 or inp._wdim < 1:
            return NotImplemented
        out_ndim, hd, wd = inp.dim() - 1, inp._hdim - 1, inp._wdim - 1
    else:
        out_ndim, hd, wd = inp.dim(), inp._hdim, inp._wdim
    tgt_local = _as_tile(target, ref, out_ndim, hd, wd)
    if tgt_local is None:
        return NotImplemented
    largs = [_plain(inp), tgt_local] + [(_replicated_operand(a, ref._grid) if isinstance(a, nn.Parameter) else a) for a in args[2:]]
    if any(isinstance(a, SpatialTensor) for a in largs[2:]) or any(isinstance(v, SpatialTensor) for v in kw.values()):
        return NotImplemented
    if red == "none":
        out = func(*largs, reduction="none", **kw)
        g = list(inp._gshape)
        if class_dim_dropped:
            del g[1]
        return SpatialTensor.wrap(out, ref._grid, g, hd, wd, fresh=True)
    local_sum = func(*largs, reduction="sum", **kw)
    total = all_reduce_replicated(local_sum, ref._grid.group)
    if red == "sum":
        return total
    if class_dim_dropped:
        weight = args[2] if len(args) > 2 else kw.get("weight")
        ignore = args[4] if len(args) > 4 else kw.get("ignore_index", -100)
        smoothing = kw.get("label_smoothing", args[7] if len(args) > 7 else 0.0)
        if smoothing and weight is not None:
            return NotImplemented
        valid = tgt_local != ignore
        if weight is not None:
            den = (weight.detach()[tgt_local.clamp(min=0) * valid] * valid).sum().double()
        else:
            den = valid.sum().double()
    else:
        # every element counts: the global count follows from the global shape (no second all-reduce)
        count = math.prod(inp._gshape)
        if name == "cross_entropy":  # class probabilities as the target: the mean is over N x spatial
            count //= inp._gshape[1]
        return total / count
    den = den.reshape(1).to(local_sum.device)
    if ref._grid.group is not None:
        dist.all_reduce(den, group=ref._grid.group)
    return total / den.to(total.dtype)[0]


def _as_tile(t, ref: SpatialTensor, ndim: int, hd: int, wd: int):
    """This tile of a loss target (split like the loss's per-element output), or None."""
    if isinstance(t, SpatialTensor):
        if t.dim() != ndim or (t._hdim, t._wdim) != (hd, wd) or t._grid is not ref._grid:
            return None
        return _plain(t)
    if not isinstance(t, torch.Tensor):
        return None
    if t.dim() == ndim and t.shape[hd] == ref._gshape[ref._hdim] and t.shape[wd] == ref._gshape[ref._wdim]:
        return t[_tile_index(t.shape, hd, wd, ref._grid)]
    return None


# ------------------------------------------------------------------------------------------------------------
# tiled kernels
# ------------------------------------------------------------------------------------------------------------
def _nchw(x) -> bool:
    return isinstance(x, SpatialTensor) and x.dim() == 4 and (x._hdim, x._wdim) == (2, 3)


def _arg(args, kwargs, pos, name, default=None):
    return args[pos] if len(args) > pos else kwargs.get(name, default)


_KERNELS: dict[tuple, Any] = {}


def _cached(key: tuple, make):
    kern = _KERNELS.get(key)
    if kern is None:
        if len(_KERNELS) > 512:
            _KERNELS.clear()
        kern = _KERNELS[key] = make()
    return kern


def _conv_kernel(grid_id: int, grid: SpatialGrid, k, stride, padding, dilation, groups, cin, cout):
    from lightning_hpc.spatial.conv import SpatialConv2d

    def make():
        meta = nn.Conv2d(cin, cout, k, stride, padding, dilation, groups, bias=False, device="meta")
        return SpatialConv2d.from_module(meta, grid, overlap=False, name="F.conv2d")

    return _cached(("conv", grid_id, k, stride, padding, dilation, groups, cin, cout), make)


def _tuple2(v):
    return tuple(v) if isinstance(v, (list, tuple)) else (v, v)


def _partition_error(e: PartitionError, op: str) -> SpatialDispatchError:
    return SpatialDispatchError(f"spatial: {op} in {_STATE.where()}: {e}")


@_handles(F.conv2d, torch.conv2d)
def _conv2d(func, args, kwargs):
    x = args[0] if args else kwargs["input"]
    weight = _arg(args, kwargs, 1, "weight")
    if not _nchw(x) or isinstance(weight, SpatialTensor):
        return NotImplemented
    bias = _arg(args, kwargs, 2, "bias")
    stride, padding, dilation, groups = (_arg(args, kwargs, 3, "stride", 1), _arg(args, kwargs, 4, "padding", 0),
                                         _arg(args, kwargs, 5, "dilation", 1), _arg(args, kwargs, 6, "groups", 1))
    c = x._gshape[1]
    if weight.dim() != 4 or weight.shape[1] * groups != c:
        raise SpatialDispatchError(
            f"spatial: F.conv2d in {_STATE.where()}: the input has {c} channels but the weight {tuple(weight.shape)} "
            f"with groups={groups} expects {weight.shape[1] * groups}; fix the layer's in_channels"
        )
    pad = padding if isinstance(padding, str) else _tuple2(padding)
    try:
        kern = _conv_kernel(id(x._grid), x._grid, tuple(weight.shape[-2:]), _tuple2(stride), pad, _tuple2(dilation),
                            int(groups), int(c), int(weight.shape[0]))
    except ValueError as e:
        raise SpatialDispatchError(f"spatial: F.conv2d in {_STATE.where()}: {e}") from None
    h, w = x._gshape[2], x._gshape[3]
    try:
        plan = kern.halo_plan(h, w)
    except PartitionError as e:
        raise _partition_error(e, "F.conv2d") from None
    weight = _replicated_operand(weight, x._grid)
    bias = _replicated_operand(bias, x._grid) if bias is not None else None
    out = kern.tile_forward(_plain(x), weight, bias, h, w)
    return _wrap_like(out, x, (x._gshape[0], weight.shape[0], plan.rows.n_out, plan.cols.n_out))


@_handles(torch.conv_transpose2d)
def _conv_transpose2d(func, args, kwargs):
    """Halo exchange of the input rows each output tile reads, then the local kernel (:mod:`convtranspose`)."""
    from lightning_hpc.spatial.convtranspose import TransposedWindow1d, tile_conv_transpose2d, transposed_plan

    x = args[0] if args else kwargs["input"]
    weight = _arg(args, kwargs, 1, "weight")
    bias = _arg(args, kwargs, 2, "bias")
    if not _nchw(x) or isinstance(weight, SpatialTensor) or isinstance(bias, SpatialTensor) or weight.dim() != 4:
        return NotImplemented
    stride, padding, out_pad = (_tuple2(_arg(args, kwargs, 3, "stride", 1)), _tuple2(_arg(args, kwargs, 4, "padding", 0)),
                                _tuple2(_arg(args, kwargs, 5, "output_padding", 0)))
    groups, dilation = int(_arg(args, kwargs, 6, "groups", 1)), _tuple2(_arg(args, kwargs, 7, "dilation", 1))
    if x._gshape[1] != weight.shape[0]:
        return NotImplemented  # the serial op's error, from the gathered call
    wh, ww = (TransposedWindow1d(int(weight.shape[2 + k]), int(stride[k]), int(padding[k]), int(dilation[k]), int(out_pad[k]))
              for k in (0, 1))
    if not (wh.exact_on_tiles and ww.exact_on_tiles):
        return NotImplemented  # stride larger than the kernel's span: gathered
    h, w = x._gshape[2], x._gshape[3]
    try:
        plan = _cached(("convT", id(x._grid), h, w, wh, ww), lambda: transposed_plan(x._grid, h, w, wh, ww))
    except PartitionError:
        return NotImplemented  # a tile smaller than its halo: gathered (exact)
    weight = _replicated_operand(weight, x._grid)
    bias = _replicated_operand(bias, x._grid) if bias is not None else None
    out = tile_conv_transpose2d(_plain(x), weight, bias, plan, wh, ww, groups)
    return _wrap_like(out, x, (x._gshape[0], weight.shape[1] * groups, plan.rows.n_out, plan.cols.n_out))


def _pool_kernel(grid_id: int, grid: SpatialGrid, kind: str, k, s, p, d, count_include_pad, ceil_mode):
    from lightning_hpc.spatial.pooling import SpatialAvgPool2d, SpatialMaxPool2d

    def make():
        if kind == "max":
            pool = nn.MaxPool2d(k, s, p, d, ceil_mode=ceil_mode)
            return SpatialMaxPool2d.from_module(pool, grid, name="F.max_pool2d")
        pool = nn.AvgPool2d(k, s, p, ceil_mode=ceil_mode, count_include_pad=count_include_pad)
        return SpatialAvgPool2d.from_module(pool, grid, name="F.avg_pool2d")

    return _cached(("pool", grid_id, kind, k, s, p, d, count_include_pad, ceil_mode), make)


@_handles(F.max_pool2d, torch.max_pool2d, getattr(F, "_max_pool2d", None))
def _max_pool(func, args, kwargs):
    x = args[0] if args else kwargs["input"]
    if not _nchw(x):
        return NotImplemented
    k = _arg(args, kwargs, 1, "kernel_size")
    s = _arg(args, kwargs, 2, "stride", None) or k
    p, d = _arg(args, kwargs, 3, "padding", 0), _arg(args, kwargs, 4, "dilation", 1)
    if _arg(args, kwargs, 6, "return_indices", False):
        return NotImplemented
    ceil = bool(_arg(args, kwargs, 5, "ceil_mode", False))
    kern = _pool_kernel(id(x._grid), x._grid, "max", _tuple2(k), _tuple2(s), _tuple2(p), _tuple2(d), True, ceil)
    return _run_layer(kern, x, "F.max_pool2d")


@_handles(F.avg_pool2d, torch._C._nn.avg_pool2d)
def _avg_pool(func, args, kwargs):
    x = args[0] if args else kwargs["input"]
    if not _nchw(x):
        return NotImplemented
    k = _arg(args, kwargs, 1, "kernel_size")
    s = _arg(args, kwargs, 2, "stride", None) or k
    p = _arg(args, kwargs, 3, "padding", 0)
    if _arg(args, kwargs, 6, "divisor_override", None) is not None:
        return NotImplemented
    cip, ceil = _arg(args, kwargs, 5, "count_include_pad", True), bool(_arg(args, kwargs, 4, "ceil_mode", False))
    kern = _pool_kernel(id(x._grid), x._grid, "avg", _tuple2(k), _tuple2(s), _tuple2(p), (1, 1), bool(cip), ceil)
    return _run_layer(kern, x, "F.avg_pool2d")


def _run_layer(layer, x: SpatialTensor, op: str):
    """A spatial layer's tile forward with the known global extent; output wrapped with its global extent."""
    h, w = x._gshape[2], x._gshape[3]
    try:
        layer.halo_plan(h, w)
        out = layer.tile_call(_plain(x), (h, w))
    except PartitionError as e:
        raise _partition_error(e, op) from None
    wh, ww = layer.windows(h, w)
    return _wrap_like(out, x, (x._gshape[0], out.shape[1], wh.out_size(h), ww.out_size(w)))


@_handles(F.interpolate)
def _interpolate(func, args, kwargs):
    x = args[0] if args else kwargs["input"]
    if not _nchw(x):
        return NotImplemented
    size, sf = _arg(args, kwargs, 1, "size"), _arg(args, kwargs, 2, "scale_factor")
    mode, ac = _arg(args, kwargs, 3, "mode", "nearest"), _arg(args, kwargs, 4, "align_corners")
    rsf, aa = _arg(args, kwargs, 5, "recompute_scale_factor"), _arg(args, kwargs, 6, "antialias", False)
    if mode not in ("nearest", "bilinear") or rsf or aa:
        return NotImplemented
    from lightning_hpc.spatial.upsample import SpatialUpsample

    up = nn.Upsample(size=size, scale_factor=sf, mode=mode, align_corners=ac)
    kern = SpatialUpsample.from_module(up, x._grid, name="F.interpolate")
    return _run_layer(kern, x, "F.interpolate")


@_handles(F.adaptive_avg_pool2d, torch._C._nn.adaptive_avg_pool2d)
def _adaptive_avg(func, args, kwargs):
    """Size 1: the global mean.  Size ``(kh, kw)``: each window's partial sum on each tile, summed over the
    spatial group (:func:`pooling.adaptive_avg_pool_tile`); the result is replicated, like the global mean."""
    x = args[0] if args else kwargs["input"]
    if _nchw(x) and _arg(args, kwargs, 1, "output_size") in (1, (1, 1), [1, 1]):
        return _reduce(torch.mean, (x, (2, 3), True), {})
    from lightning_hpc.spatial.pooling import adaptive_avg_pool_tile

    call = _adaptive_call(args, kwargs)
    return NotImplemented if call is None else adaptive_avg_pool_tile(*call)


def _adaptive_call(args, kwargs):
    """``(tile, group, (H, W), tile origin, (kh, kw))`` of an adaptive pooling of a split N x C x H x W input, or
    None (an output size of None, keep the input's extent, or an invalid one: gathered, the serial op's error)."""
    x = args[0] if args else kwargs["input"]
    kh, kw = _tuple2(_arg(args, kwargs, 1, "output_size"))
    if not _nchw(x) or not all(isinstance(k, int) and k > 0 for k in (kh, kw)):
        return None
    h, w = x._gshape[2], x._gshape[3]
    (h0, _), (w0, _) = x._grid.tile_bounds(h, w)
    return _plain(x), x._grid.group, (h, w), (h0, w0), (kh, kw)


@_handles(F.adaptive_max_pool2d, F.adaptive_max_pool2d_with_indices, getattr(F, "_adaptive_max_pool2d", None))
def _adaptive_max(func, args, kwargs):
    """Each window's maximum over the spatial group, with the serial op's indices (the first maximum in row-major
    order); replicated like the average (:func:`pooling.adaptive_max_pool_tile`)."""
    from lightning_hpc.spatial.pooling import adaptive_max_pool_tile

    call = _adaptive_call(args, kwargs)
    if call is None:
        return NotImplemented
    out, idx = adaptive_max_pool_tile(*call)
    with_indices = func is F.adaptive_max_pool2d_with_indices or _arg(args, kwargs, 2, "return_indices", False)
    return (out, idx) if with_indices else out


def _remap2d(x: SpatialTensor, local: torch.Tensor, maps) -> torch.Tensor:
    """:func:`remap.remap` of the tile ``local`` along H, then W: ``maps`` holds per dimension
    ``(in_bounds, out_bounds, src)`` or None (that dimension stays as it is)."""
    from lightning_hpc.spatial.remap import remap

    for axis, m in enumerate(maps):
        if m is not None:
            local = remap(local, x._grid, axis, 2 + axis, *m)
    return local


@_handles(F.pad, torch._C._nn.pad)
def _pad(func, args, kwargs):
    """``F.pad`` of H and W with mode reflect / replicate / circular (the padding of ``nn.Conv2d`` with those
    ``padding_mode``s): rows moved and mirrored between tiles (:mod:`remap`), the output blocked over the padded
    extent.  Constant padding of split dimensions and padding of other dimensions are gathered."""
    from lightning_hpc.spatial.remap import PAD_MODES, blocked, pad_source

    x = args[0] if args else kwargs["input"]
    pad, mode = _arg(args, kwargs, 1, "pad"), _arg(args, kwargs, 2, "mode", "constant")
    if not _nchw(x) or mode not in PAD_MODES or len(pad) != 4:
        return NotImplemented  # (a non-constant padding of a 4-D input pads H and W: 4 numbers)
    (wl, wr, ht, hb), maps, gshape = (int(p) for p in pad), [], list(x._gshape)
    for axis, (lo, hi) in enumerate(((ht, hb), (wl, wr))):
        n = x._gshape[2 + axis]
        src = pad_source(n, lo, hi, mode)
        if src is None or n + lo + hi < x._grid.parts[axis]:
            return NotImplemented  # a padding F.pad refuses, or fewer rows than parts: gathered
        parts = x._grid.parts[axis]
        maps.append((blocked(n, parts), blocked(len(src), parts), src) if lo or hi else None)
        gshape[2 + axis] = len(src)
    return _wrap_like(_remap2d(x, _plain(x), maps), x, gshape)


@_handles(torch.pixel_shuffle)
def _pixel_shuffle(func, args, kwargs):
    """Local on each tile (its rows become ``r`` times as many), then re-blocked over the ``r``-times extent."""
    x, r = (args[0] if args else kwargs["input"]), int(_arg(args, kwargs, 1, "upscale_factor"))
    if not _nchw(x) or x._gshape[1] % (r * r):
        return NotImplemented
    from lightning_hpc.spatial.remap import blocked

    local = torch.pixel_shuffle(_plain(x), r)
    maps = [(blocked(n, p, r), blocked(n * r, p), range(n * r)) for n, p in zip(x._gshape[2:], x._grid.parts)]
    gshape = (x._gshape[0], x._gshape[1] // (r * r), x._gshape[2] * r, x._gshape[3] * r)
    return _wrap_like(_remap2d(x, local, maps), x, gshape)


@_handles(torch.pixel_unshuffle)
def _pixel_unshuffle(func, args, kwargs):
    """Re-blocked so every tile holds ``r`` times the rows of its output tile (:mod:`remap`), then local."""
    x, r = (args[0] if args else kwargs["input"]), int(_arg(args, kwargs, 1, "downscale_factor"))
    if not _nchw(x) or any(n % r or n // r < p for n, p in zip(x._gshape[2:], x._grid.parts)):
        return NotImplemented  # an extent not divisible by r (the serial error) or fewer output rows than parts
    from lightning_hpc.spatial.remap import blocked

    maps = [(blocked(n, p), blocked(n // r, p, r), range(n)) for n, p in zip(x._gshape[2:], x._grid.parts)]
    local = _remap2d(x, _plain(x), maps)
    gshape = (x._gshape[0], x._gshape[1] * r * r, x._gshape[2] // r, x._gshape[3] // r)
    return _wrap_like(torch.pixel_unshuffle(local, r), x, gshape)


@_handles(F.batch_norm)
def _batch_norm(func, args, kwargs):
    x = args[0] if args else kwargs["input"]
    if not isinstance(x, SpatialTensor) or x.dim() < 3 or 1 in (x._hdim, x._wdim) or x._hdim == 0 or x._wdim == 0:
        return NotImplemented
    rm, rv = _arg(args, kwargs, 1, "running_mean"), _arg(args, kwargs, 2, "running_var")
    weight, bias = _arg(args, kwargs, 3, "weight"), _arg(args, kwargs, 4, "bias")
    training, momentum, eps = _arg(args, kwargs, 5, "training", False), _arg(args, kwargs, 6, "momentum", 0.1), _arg(args, kwargs, 7, "eps", 1e-5)
    if any(isinstance(t, SpatialTensor) for t in (rm, rv, weight, bias)):
        return NotImplemented
    weight = _replicated_operand(weight, x._grid) if weight is not None else None
    bias = _replicated_operand(bias, x._grid) if bias is not None else None
    local = _plain(x)
    if not training or x._grid.group is None:
        return _wrap_like(F.batch_norm(local, rm, rv, weight, bias, training, momentum, eps), x)
    from lightning_hpc.spatial.batchnorm import _AggregatedBatchNorm

    moved = local if x.dim() == 4 else local
    y, mean64, var64, n = _AggregatedBatchNorm.apply(moved, weight, bias, eps, x._grid.group)
    if rm is not None and rv is not None:
        with torch.no_grad():
            unbiased = var64 * (n / max(n - 1.0, 1.0))
            rm.mul_(1 - momentum).add_(mean64.to(rm.dtype), alpha=momentum)
            rv.mul_(1 - momentum).add_(unbiased.to(rv.dtype), alpha=momentum)
    return _wrap_like(y, x)


@_handles(F.dropout, F.dropout2d)
def _dropout(func, args, kwargs):
    x = args[0] if args else kwargs["input"]
    if not isinstance(x, SpatialTensor):
        return NotImplemented
    p, training, inplace = _arg(args, kwargs, 1, "p", 0.5), _arg(args, kwargs, 2, "training", True), _arg(args, kwargs, 3, "inplace", False)
    if not training or p == 0.0:
        return x
    if func is F.dropout2d:
        if x.dim() not in (3, 4) or x.dim() == 3:
            return NotImplemented
        shape = tuple(x._gshape[:2]) + (1, 1)
        mask = F.dropout2d(torch.ones(shape, dtype=x.dtype, device=x.device), p, True)
    else:
        mask = F.dropout(torch.ones(x._gshape, dtype=x.dtype, device=x.device), p, True)
        mask = mask[_tile_index(mask.shape, x._hdim, x._wdim, x._grid)]
    if inplace:
        with torch._C.DisableTorchFunctionSubclass():
            x.mul_(mask)
        return x
    local = _plain(x)
    return _wrap_like(local * mask, x)


@_handles(torch.Tensor.register_hook)
def _register_hook(func, args, kwargs):
    """A gradient hook on a split activation sees the tile's part of the gradient as a :class:`SpatialTensor`, so
    a norm or a mean it takes is global (one process's value), and what it returns replaces the tile's part."""
    t, hook = args[0], (args[1] if len(args) > 1 else kwargs["hook"])
    if not isinstance(t, SpatialTensor):
        return NotImplemented
    layout = _layout(t)

    def on_tile(grad: torch.Tensor):
        # also when the hook fires inside torch.autograd.grad below, which runs with subclass dispatch off
        with enable_torch_function():
            out = hook(SpatialTensor.wrap(grad, *layout))
        return _plain(out) if isinstance(out, SpatialTensor) else out

    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.register_hook(t, on_tile)


@_handles(torch.autograd.grad)
def _autograd_grad(func, args, kwargs):
    """``torch.autograd.grad`` with split activations among the inputs: each gradient is the tile's part of one
    process's gradient, returned split like its input.  Differentiating twice (``create_graph=True``) would
    differentiate the halo exchanges and collectives, whose backward is not itself differentiable: refused."""
    kw = dict(kwargs)
    outputs = args[0] if args else kw.pop("outputs")
    inputs = args[1] if len(args) > 1 else kw.pop("inputs")
    ins = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    if kw.get("create_graph"):
        raise SpatialDispatchError(
            f"spatial: torch.autograd.grad(create_graph=True) in {_STATE.where()} differentiates through split "
            f"activations twice (a gradient penalty on them); the tile exchanges have no second derivative here. "
            f"Compute the penalty on a gathered tensor (lightning_hpc.spatial.dispatch.gather_tensor), or train this "
            f"module with spatial_parts=(1, 1) or strategy='ddp'"
        )
    with torch._C.DisableTorchFunctionSubclass():
        grads = torch.autograd.grad(outputs, ins, **kw)
    return tuple(SpatialTensor.wrap(g, *_layout(i)) if isinstance(i, SpatialTensor) and g is not None else g
                 for g, i in zip(grads, ins))


@contextlib.contextmanager
def on_unsupported(mode: str):
    """Temporarily set what happens to ops without a tiled form: ``"gather"`` (default) or ``"error"``."""
    if mode not in ("gather", "error"):
        raise ValueError(f"on_unsupported={mode!r}: choose 'gather' or 'error'")
    old, _STATE.on_unsupported = _STATE.on_unsupported, mode
    try:
        yield
    finally:
        _STATE.on_unsupported = old
