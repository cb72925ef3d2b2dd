"""Tensors that are one rank's block of a tensor partitioned over a process group, with the whole tensor's
reductions (model-parallel parameters as user code sees them), and what the strategies that split the model
share about it.

A model-parallel strategy keeps on each rank only a block of some parameters (hybrid_fc's sharded head,
Krizhevsky, "One weird trick", section 4).  User code that reduces over ``self.parameters()`` (a gradient norm
logged in ``on_before_optimizer_step``, Lightning's ``grad_norm``, an L2 penalty added to the loss,
``torch.nn.utils.clip_grad_norm_``) would see this rank's blocks only.  :class:`BlockTensor` gives those
reductions the whole tensor's value:

* a reduction over *all* elements (``sum``, ``mean``, ``norm`` / ``torch.linalg.vector_norm`` /
  ``torch.linalg.norm`` (vector norms and Frobenius), ``max`` / ``min`` / ``amax`` / ``amin``) is reduced over
  the group and returns a plain tensor holding the whole tensor's value, the same on every rank.  They are
  differentiable: each rank's block gets the gradient of the whole value with respect to it (the all-reduce's
  adjoint on a loss every rank computes alike is the identity; for ``max`` / ``min`` the ranks holding the
  extremum get it), so a penalty over the whole tensor trains each block as one process trains that part of the
  tensor;
* element-wise arithmetic whose other operands are blocks of the same partition, Python numbers or one-element
  tensors (``p.pow(2)``, ``p.grad * p``, ``p - p0``, ``p.detach().clone()``, ``zeros_like``) stays a
  :class:`BlockTensor`, so a reduction after it is still the whole tensor's; ``.grad`` and ``.data`` of a block
  parameter are blocks;
* everything else (the layer's own ``F.linear``, collectives, optimizers' in-place updates, shape, ``numel``,
  indexing, flattening, element-wise arithmetic with a plain tensor of several elements) gives plain tensors;
* a reduction along some dimensions (``sum`` / ``mean`` / ``amax`` / ``amin`` / vector norms with ``dim=``: a
  per-class ``w.norm(dim=1)`` penalty) is the whole tensor's too where the partition knows where its blocks lie
  (:class:`Partition` ``dim``): along dimensions the blocks are not split over, each rank's result is its block
  of the whole result (a block again, so a reduction after it is the whole one's); along the split dimension,
  the ranks' partial results are all-reduced into the whole result (plain, the same on every rank).  Blocks
  stacked along a new dimension (``Partition.dim == STACKED``: multigrid's residual steps, step ``i`` of every
  rank's share) are never split along their own dimensions;
* a reduction along a dimension of a partition whose layout is not known, ``max`` / ``min`` along a dimension
  (their indices are the block's), a matrix norm other than Frobenius, and the reductions whose whole value
  is not a sum, maximum or minimum of the blocks' (``std``, ``var``, ``prod``, ``median``, ``dot``, ``vdot``,
  ``argmax``, ``argmin``, ``logsumexp``, ``count_nonzero``, ``nansum``, an explicit ``torch._foreach_norm``)
  raise: its value over the whole tensor is not this block's, and guessing would be silently wrong.
  :func:`local_block` gives the plain block for code that means it.  Lightning's ``grad_norm``, whose entries
  are named by ``named_parameters()``, is refused over stacked blocks (a rank's step would be named with the
  norm of its place in every share: :func:`refuse_per_parameter_stacked_norms`).

A block pickles (``torch.save``) as its plain block, since the partition is this run's process group; a deep copy
(``AveragedModel``, an EMA's copy) is a block of the same partition.

:func:`follow_split` points ``torch.compile``'d submodules at the modules a strategy put in their place.
Optimizers that view every parameter as one flat vector (``LBFGS``) see the whole model's through
:mod:`lightning_hpc.distributed.whole_flat`.

Why not torch's ``DTensor`` with ``Shard`` placements on the head's mesh: the results of user reductions must be
plain tensors, since user code mixes them with the data-parallel trunk's plain tensors and hands them to
Lightning (``grad_norm`` builds ``torch.tensor(list_of_norms)``, which fails on DTensors; a ``Partial`` DTensor
loss or logged value would travel through Lightning's result collection), and the blocks follow
:func:`lightning_hpc.distributed.partition.block_bounds` (the first ``n % K`` blocks one larger), where a
``Shard`` placement assumes ``torch.chunk``'s sizes (10 over 4: 3, 3, 3, 1 against 3, 3, 2, 2).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Function

from lightning_hpc._compat import compiled_module_type, disable_torch_function_subclass

__all__ = [
    "BlockTensor",
    "refuse_per_parameter_stacked_norms",
    "Partition",
    "STACKED",
    "as_block_parameter",
    "local_block",
    "is_block",
    "follow_split",
]


#: ``Partition.dim`` of blocks stacked along a new leading dimension (each rank's block a whole tensor)
STACKED = "stacked"


class Partition:
    """The process group a tensor is partitioned over (``None``: the world) and where its blocks lie: ``dim``,
    the dimension the whole tensor is split along (``STACKED``: the blocks are stacked along a new one; ``None``:
    not known, so reductions along a dimension are refused).  A copy of a block is a block of the same partition,
    so copying shares it (a process group cannot be copied)."""

    def __init__(self, group: dist.ProcessGroup | None, dim: int | str | None = None) -> None:
        self.group = group
        self.dim = dim
        self._after: dict[int | str | None, Partition] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> Partition:
        return self

    def splits(self, dims: Sequence[int]) -> bool:
        """Whether reducing along ``dims`` reduces across the ranks' blocks (else each rank reduces its own)."""
        if self.dim is None:
            raise _refuse("a reduction along a dimension (the blocks' layout is not known)")
        return self.dim != STACKED and self.dim in dims

    def after(self, dims: Sequence[int], keepdim: bool) -> Partition:
        """The partition of a block's reduction along ``dims`` (not the split dimension): the same blocks, one
        result per remaining element, so the split dimension moves down past the reduced ones before it."""
        if self.dim == STACKED or keepdim or not isinstance(self.dim, int):
            return self
        moved = self.dim - sum(d < self.dim for d in dims)
        if moved == self.dim:
            return self
        if moved not in self._after:  # one object per layout: blocks of one partition combine element-wise
            self._after[moved] = Partition(self.group, moved)
        return self._after[moved]

    @property
    def distributed(self) -> bool:
        return dist.is_initialized() and dist.get_world_size(self.group) > 1


class _AllReduce(Function):
    """Sum / max / min of a scalar over the partition's group.  Backward of the sum: identity (every rank holds
    the same whole value, and its block's share of it is its own); of max / min: the gradient goes to the ranks
    whose value is the extremum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, part: Partition, op: Any) -> torch.Tensor:  # type: ignore[override]
        y = x.detach().clone()
        if part.distributed:
            dist.all_reduce(y, op=op, group=part.group)
        ctx.op = op
        if op != dist.ReduceOp.SUM:
            ctx.save_for_backward(x.detach() == y)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        if ctx.op == dist.ReduceOp.SUM:
            return g, None, None
        (hit,) = ctx.saved_tensors
        return g * hit.to(g.dtype), None, None


def _all_reduce(x: torch.Tensor, part: Partition, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    return _AllReduce.apply(x, part, op)  # type: ignore[no-any-return]


def _vector_norm(x: torch.Tensor, part: Partition, p: float, dtype: torch.dtype | None) -> torch.Tensor:
    """The ``p``-norm of the whole tensor from this rank's block ``x`` (plain)."""
    if dtype is not None:
        x = x.to(dtype)
    if math.isinf(p):
        local = x.abs().amax() if x.numel() else x.new_zeros(())
        return _all_reduce(local, part, dist.ReduceOp.MAX if p > 0 else dist.ReduceOp.MIN)
    if p == 0:
        return _all_reduce((x != 0).sum().to(x.dtype), part)
    return _all_reduce(x.abs().pow(p).sum(), part).pow(1.0 / p)


def _no_dims(dim: Any) -> bool:
    return dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0)


def _dims(x: torch.Tensor, dim: Any) -> tuple[int, ...]:
    """``dim`` (an int or a sequence) as sorted non-negative dimensions of ``x``."""
    given = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted({d % max(x.dim(), 1) for d in given}))


def _count(x: torch.Tensor, dims: Sequence[int], part: Partition) -> torch.Tensor:
    """The number of the whole tensor's elements each result along ``dims`` reduces (the split one among them)."""
    count = torch.tensor(float(math.prod(x.shape[d] for d in dims)), dtype=torch.float64, device=x.device)
    if part.distributed:
        dist.all_reduce(count, group=part.group)
    return count


def _arg(args: Sequence[Any], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


class BlockTensor(torch.Tensor):
    """This rank's block of a tensor partitioned over ``_partition`` (see the module's docstring)."""

    _partition: Partition

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickled (torch.save of a state dict that keeps a rank's own entries) as the plain block: the partition
        # is this run's process group, which neither pickles nor means anything in another process
        with disable_torch_function_subclass():
            return self.as_subclass(torch.Tensor).detach().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> BlockTensor:
        # a copy of a block (AveragedModel, an EMA's copy of the model) is a block of the same partition
        if id(self) in memo:
            return memo[id(self)]  # type: ignore[no-any-return]
        with disable_torch_function_subclass():
            data = self.as_subclass(torch.Tensor).detach().clone()
        out = _wrap(data, self._partition)
        if isinstance(self, nn.Parameter):  # a block made a parameter keeps its type (the copy must too)
            out = nn.Parameter(out, requires_grad=self.requires_grad)  # type: ignore[assignment]
        memo[id(self)] = out
        return out

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        leaves = _leaves(args, kwargs)
        part = next(a._partition for a in leaves if isinstance(a, BlockTensor))
        name = getattr(func, "__name__", "")
        reduce = _REDUCTIONS.get(name)
        if reduce is not None:
            with disable_torch_function_subclass():
                return reduce(func, part, args, kwargs, name)
        with disable_torch_function_subclass():
            out = func(*args, **kwargs)
        if func in _BLOCK_GETTERS or (name in _ELEMENTWISE and _same_partition(leaves, part)):
            if isinstance(out, torch.Tensor) and type(out) is not cls:
                return _wrap(out, part)
        return out


def _leaves(args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The operands, one level into lists and tuples (``torch.stack([...])``, ``torch.where(c, a, b)``)."""
    out: list[Any] = []
    for a in (*args, *kwargs.values()):
        out.extend(a if isinstance(a, (list, tuple)) else (a,))
    return out


def _same_partition(leaves: Sequence[Any], part: Partition) -> bool:
    """Every tensor operand is a block of ``part`` or a single value (broadcast alike on every rank)."""
    for a in leaves:
        if isinstance(a, BlockTensor):
            if a._partition is not part:
                return False
        elif isinstance(a, torch.Tensor) and a.numel() != 1:
            return False
    return True


def _wrap(t: torch.Tensor, part: Partition) -> BlockTensor:
    with disable_torch_function_subclass():
        out = t.as_subclass(BlockTensor)
    out._partition = part
    return out


def _refuse(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} of a model-parallel parameter (or of its gradient or a tensor computed from it element-wise): this "
        "rank holds one block of it, and the whole tensor's result is not this block's. Reductions over all "
        "elements (sum, mean, norm, max, min) are the whole tensor's; for this block alone, use "
        "lightning_hpc.distributed.partitioned.local_block(tensor)"
    )


def _reduce_sum(
    func: Any, part: Partition, args: Sequence[Any], kwargs: dict[str, Any], name: str
) -> torch.Tensor:
    x = args[0]
    dim = _arg(args, kwargs, 1, "dim", None)
    dtype = kwargs.get("dtype")
    if not _no_dims(dim):
        dims, keepdim = _dims(x, dim), bool(_arg(args, kwargs, 2, "keepdim", False))
        part_sum = x.sum(dims, keepdim=keepdim, dtype=dtype)
        if part.splits(dims):
            whole = _all_reduce(part_sum, part)
            return whole / _count(x, dims, part).to(whole.dtype) if name == "mean" else whole
        mean = part_sum / math.prod(x.shape[d] for d in dims) if name == "mean" else part_sum
        return _wrap(mean, part.after(dims, keepdim))
    local = x.sum(dtype=dtype) if dtype is not None else x.sum()
    total = _all_reduce(local, part)
    if name == "mean":
        count = torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
        if part.distributed:
            dist.all_reduce(count, group=part.group)
        return total / count.to(total.dtype)
    return total


def _reduce_extremum(
    func: Any, part: Partition, args: Sequence[Any], kwargs: dict[str, Any], name: str
) -> torch.Tensor:
    x = args[0]
    second = _arg(args, kwargs, 1, "dim", None)
    if isinstance(second, torch.Tensor):  # torch.max(a, b): element-wise, a block if b is one
        with disable_torch_function_subclass():
            out = getattr(torch, name)(*args, **kwargs)
        return _wrap(out, part) if _same_partition([x, second], part) else out
    op = dist.ReduceOp.MAX if name in ("max", "amax") else dist.ReduceOp.MIN
    if not _no_dims(second):
        if name in ("max", "min"):  # values and indices: the indices would be the block's
            raise _refuse(f"{name} along a dimension")
        dims, keepdim = _dims(x, second), bool(_arg(args, kwargs, 2, "keepdim", False))
        local_along = x.amax(dims, keepdim) if op == dist.ReduceOp.MAX else x.amin(dims, keepdim)
        if part.splits(dims):
            return _all_reduce(local_along, part, op)
        return _wrap(local_along, part.after(dims, keepdim))
    local = x.amax() if op == dist.ReduceOp.MAX else x.amin()
    return _all_reduce(local, part, op)


def _reduce_norm(
    func: Any, part: Partition, args: Sequence[Any], kwargs: dict[str, Any], name: str
) -> torch.Tensor:
    x = args[0]
    if part.dim == STACKED:
        refuse_per_parameter_stacked_norms()
    if name == "linalg_vector_norm":
        p: Any = _arg(args, kwargs, 1, "ord", 2)
    elif name == "linalg_norm":
        p = _arg(args, kwargs, 1, "ord", None)
        given = _arg(args, kwargs, 2, "dim", None)
        over_two = (x.dim() == 2 and given is None) or (given is not None and len(_dims(x, given)) == 2)
        if over_two and p not in (None, "fro"):  # a matrix norm (spectral, nuclear, max row / column sum)
            raise _refuse(f"torch.linalg.norm(ord={p!r})")
    else:  # torch.norm / Tensor.norm
        p = _arg(args, kwargs, 1, "p", "fro")
    dim = _arg(args, kwargs, 2, "dim", None)
    if p is None or p == "fro":
        p = 2.0
    if isinstance(p, str):
        raise _refuse(f"the norm {p!r}")
    if not _no_dims(dim):
        dims, keepdim = _dims(x, dim), bool(_arg(args, kwargs, 3, "keepdim", False))
        return _vector_norm_along(x, part, float(p), kwargs.get("dtype"), dims, keepdim)
    return _vector_norm(x, part, float(p), kwargs.get("dtype"))


#: modules whose per-parameter norms name each parameter: Lightning's ``grad_norm`` (both package names)
_PER_PARAMETER_NORMS = {"lightning.pytorch.utilities.grads", "pytorch_lightning.utilities.grads"}


def refuse_per_parameter_stacked_norms(depth: int = 8) -> None:
    """Refuse Lightning's ``grad_norm`` over blocks stacked along a new dimension (multigrid's residual steps).

    Its entries are keyed by ``named_parameters()``: on a rank holding steps ``i..j`` of a split trunk each entry
    would name one of this rank's steps with the norm of that place in every rank's share, and the other ranks'
    steps would have no entry (its total is right).  Called from such a norm, inside ``grad_norm`` (found by the
    caller's module among the few frames above, which a call from anywhere else does not match); it runs in the
    first ``on_before_optimizer_step``, before the first optimizer step."""
    frame = sys._getframe(1)
    for _ in range(depth):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return
        if frame.f_globals.get("__name__") in _PER_PARAMETER_NORMS:
            raise RuntimeError(
                "Lightning's grad_norm(...) over a model whose residual trunk is split over ranks "
                "(strategy='multigrid' with layer_parallel_size > 1): its entries are named by this rank's "
                "parameters, so each step's entry would hold the norm of that place in every rank's share and the "
                "other ranks' steps would have none. Use lightning_hpc.multigrid.grad_norm(module, norm_type) "
                "instead (the same keys, one per parameter of the whole model, every step's own norm, and the "
                "total), or log only a total over self.parameters(), which covers every step once"
            )


def _vector_norm_along(
    x: torch.Tensor, part: Partition, p: float, dtype: torch.dtype | None, dims: tuple[int, ...], keepdim: bool
) -> torch.Tensor:
    """The ``p``-norms along ``dims`` of the whole tensor from this rank's block ``x``: a block of them, or the
    whole result where ``dims`` include the split dimension."""
    if dtype is not None:
        x = x.to(dtype)
    if not part.splits(dims):
        return _wrap(torch.linalg.vector_norm(x, p, dims, keepdim), part.after(dims, keepdim))
    if math.isinf(p):
        local = x.abs().amax(dims, keepdim) if p > 0 else x.abs().amin(dims, keepdim)
        return _all_reduce(local, part, dist.ReduceOp.MAX if p > 0 else dist.ReduceOp.MIN)
    if p == 0:
        return _all_reduce((x != 0).sum(dims, keepdim).to(x.dtype), part)
    return _all_reduce(x.abs().pow(p).sum(dims, keepdim), part).pow(1.0 / p)


def _refused(
    func: Any, part: Partition, args: Sequence[Any], kwargs: dict[str, Any], name: str
) -> torch.Tensor:
    raise _refuse(name)


_REDUCTIONS: dict[str, Callable[[Any, Partition, Sequence[Any], dict[str, Any], str], torch.Tensor]] = {
    "sum": _reduce_sum,
    "mean": _reduce_sum,
    "nansum": _refused,
    "max": _reduce_extremum,
    "min": _reduce_extremum,
    "amax": _reduce_extremum,
    "amin": _reduce_extremum,
    "norm": _reduce_norm,
    "linalg_vector_norm": _reduce_norm,
    "linalg_norm": _reduce_norm,
    "linalg_matrix_norm": _refused,
    "_foreach_norm": _refused,
    "std": _refused,
    "var": _refused,
    "prod": _refused,
    "median": _refused,
    "dot": _refused,
    "vdot": _refused,
    "argmax": _refused,
    "argmin": _refused,
    "logsumexp": _refused,
    "count_nonzero": _refused,
}
#: element-wise functions and methods (out-of-place and in-place; dunders included): a block in, a block out
_ELEMENTWISE = {
    *(f"{op}{suffix}" for op in (
        "add", "sub", "mul", "div", "true_divide", "pow", "abs", "neg", "square", "sqrt", "rsqrt", "exp", "log",
        "sign", "clamp", "clip", "lerp", "addcmul", "addcdiv", "maximum", "minimum", "reciprocal", "sin", "cos",
        "tanh", "sigmoid", "relu", "where", "masked_fill", "copy", "zero", "fill", "mul_", "sgn",
    ) for suffix in ("", "_")),
    "detach", "clone", "contiguous", "to", "float", "double", "half", "bfloat16", "type_as", "cpu", "cuda",
    "new_empty", "new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "empty_like", "full_like",
    "rand_like", "randn_like", "requires_grad_",
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__", "__imul__",
    "__truediv__", "__rtruediv__", "__itruediv__", "__pow__", "__rpow__", "__ipow__", "__neg__", "__abs__",
}
#: ``.grad`` and ``.data`` of a block are blocks of the same partition
_BLOCK_GETTERS = {torch.Tensor.grad.__get__, torch.Tensor.data.__get__}  # type: ignore[union-attr, attr-defined]


def is_block(t: Any) -> bool:
    return isinstance(t, BlockTensor)


def local_block(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor of this rank's block (sharing storage and autograd history): what the layer computes
    with, and what code that means the block alone reduces."""
    if not isinstance(t, BlockTensor):
        return t
    with disable_torch_function_subclass():
        return t.as_subclass(torch.Tensor)


def as_block_parameter(
    param: nn.Parameter, group: dist.ProcessGroup | None, dim: int | str | None = None
) -> nn.Parameter:
    """``param`` (this rank's block) as a parameter whose reductions are the whole tensor's over ``group``;
    ``dim``: the dimension the whole tensor is split along, ``STACKED`` for blocks stacked along a new one
    (``None``: reductions along a dimension are refused)."""
    block = _wrap(param.detach(), Partition(group, dim))
    out = nn.Parameter(block, requires_grad=param.requires_grad)
    assert isinstance(out, BlockTensor)
    return out


def follow_split(module: nn.Module, parallel: Sequence[nn.Module] = ()) -> list[str]:
    """Point every ``torch.compile``'d submodule of ``module`` at the module now in its place, after a strategy
    replaced layers inside it (or put the user's back): ``OptimizedModule`` binds its forward to its module's call
    when it is made, so without this it would keep calling the module the strategy replaced.  Dynamo compiles
    lazily on the first call, so the graph it captures is that of the split model; the strategy's ``parallel``
    modules (the hybrid head, the layer-parallel trunk: collectives, and a head updated inside its forward, which
    a dynamo graph trained 0.14 off one process) are excluded from tracing (``torch.compiler.disable`` on their
    forward) and run eagerly between the compiled parts.  (The spatial strategy compiles a split step its own way:
    :mod:`lightning_hpc.spatial.compile`.)  Returns the compiled modules' names (``""``: ``module`` itself); with
    none, nothing is changed (and the compiler is not imported)."""
    if "torch._dynamo" not in sys.modules:  # nothing was compiled in this process
        return []
    names = []
    for name, m in module.named_modules():
        if isinstance(m, compiled_module_type()):
            compiled: Any = m
            compiled._initialize()  # binds forward to the current _orig_mod, as torch.compile did
            names.append(name)
    if names:
        for part in parallel:
            if "forward" not in part.__dict__:  # once per module (its class's forward, wrapped on the instance)
                part.forward = torch.compiler.disable(part.forward)  # type: ignore[method-assign]
    return names
