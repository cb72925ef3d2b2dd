"""The handler table and the dispatch entry.

Handler modules register a function for the torch ops they compute on tiles with :func:`_handles`, which names the
signature the calls are bound against; :func:`_torch_function` (installed here as
:meth:`SpatialTensor.__torch_function__`) binds the call's arguments once and runs the registered handler with
them, or routes attribute reads (``x.shape``, ``x.grad``), metadata queries, hook registrations and the
element-wise ops (:mod:`.elementwise`); whatever is left, or what a handler declines (``NotImplemented``), goes to
the gather path (:mod:`.fallback`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lightning_hpc.spatial.dispatch.calls import _is_inplace, bind_call
from lightning_hpc.spatial.dispatch.elementwise import _elementwise
from lightning_hpc.spatial.dispatch.fallback import _fallback
from lightning_hpc.spatial.dispatch.state import _STATE
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _layout, _plain, _wrap_like

_HANDLERS: dict[Any, tuple[Callable, Callable | None]] = {}


def _handles(*funcs, signature: Callable | None = None, windows: Callable | None = None):
    """Register the decorated ``handler(func, a, args, kwargs)`` for the ops ``funcs``, ``a`` the call's arguments
    by name (:func:`bind_call` against ``signature``, a stub with a builtin op's parameter names and defaults, else
    the op's own).  A call that does not bind, or that the handler declines (``NotImplemented``), goes to the
    gather path.  Returns the handler itself, which may be registered again with another signature.

    ``windows(a, extents)``: for an op whose output tile reads its neighbours' rows, the input window of each
    output per spatial dimension (from the bound call and the input's spatial extents; ``ValueError`` for a call
    without a tiled form), the function its handler's kernel uses.  Registered with the handler in
    :data:`OP_WINDOWS`, from which the setup check and the planner (:mod:`lightning_hpc.spatial.dispatch.windows`) read
    the halo of whatever layer calls the op: no second table to keep."""
    def deco(fn):
        for f in funcs:
            if f is not None:
                if f in _ELEMENTWISE:  # _dispatch routes those before the handler table
                    raise ValueError(f"{f} is an element-wise op: it has no handler of its own")
                _HANDLERS[f] = (fn, signature)
                if windows is not None:
                    OP_WINDOWS[f] = (signature if signature is not None else f, windows)
        return fn
    return deco


#: per op whose tile reads its neighbours' rows: (the signature its calls bind against, its window function), as
#: registered with its handler by :func:`_handles`
OP_WINDOWS: dict[Callable, tuple[Callable, Callable]] = {}


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


#: the element-wise ops, each with whether it changes its first operand in place (read from its name once)
_ELEMENTWISE: dict[Any, bool] = {f: _is_inplace(f) for f in _resolve(" ".join(_UNARY + _BINARY))}


_NO_TENSOR_OUT = set(_resolve("backward retain_grad register_post_accumulate_grad_hook"))


_META = set(_resolve("dim ndimension is_contiguous is_floating_point is_complex element_size get_device data_ptr "
                     "is_signed storage_offset"))


def run_registered(entry: tuple[Callable, Callable | None], func, args, kwargs):
    """A registered ``(handler, signature)`` on one call: the call bound against the signature, the handler's
    result, or ``NotImplemented`` where the call does not bind or the handler declines."""
    handler, signature = entry
    a = bind_call(func if signature is None else signature, args, kwargs)
    return NotImplemented if a is None else handler(func, a, args, kwargs)


def _torch_function(cls, func, types, args=(), kwargs=None):
    """:meth:`SpatialTensor.__torch_function__`: every op on a split tensor.  The route is read from two tables
    (the element-wise ops' in-place flags, the handlers), one lookup each, in the method itself: a Python call
    saved per op, and nothing re-derived on a repeated call."""
    kwargs = kwargs or {}
    _STATE.depth += 1  # the ops the handlers run on local tensors are the dispatch's own (parameter_check)
    try:
        # the element-wise ops first: they are most of a network's ops (the tables are disjoint)
        inplace = _ELEMENTWISE.get(func)
        if inplace is not None:
            out = _elementwise(func, args, kwargs, inplace)
            return _fallback(func, args, kwargs) if out is NotImplemented else out
        entry = _HANDLERS.get(func)
        if entry is not None:
            handler, signature = entry  # (run_registered, inline)
            a = bind_call(func if signature is None else signature, args, kwargs)
            if a is not None:
                out = handler(func, a, args, kwargs)
                if out is not NotImplemented:
                    return out
        elif getattr(func, "__name__", None) == "__get__":
            return _property(func, args, kwargs)
        elif func in _META:
            return func(*[_plain(a) if isinstance(a, SpatialTensor) else a for a in args], **kwargs)
        elif func in _NO_TENSOR_OUT:  # on the tensor itself (a hook on an alias would never fire)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        return _fallback(func, args, kwargs)
    finally:
        _STATE.depth -= 1


def _property(func, args, kwargs):
    owner = getattr(func, "__self__", None)
    name = getattr(owner, "__name__", "")
    t = args[0]  # a descriptor's __get__(instance, owner): the instance is always passed first, positionally
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


# (tensor.py cannot import this module: the handler modules import it)
SpatialTensor.__torch_function__ = classmethod(_torch_function)  # type: ignore[method-assign,assignment]
