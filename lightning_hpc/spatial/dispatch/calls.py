"""Reading an op call: its arguments by name (bound once against the op's signature), its tensor operands, the
op's name as the user wrote it (for messages) and whether it changes its first operand in place.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

_SIGNATURES: dict[Callable, inspect.Signature] = {}


def bind_call(op: Callable, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The call's arguments by name with defaults applied (``inspect.Signature.bind``: positional and keyword forms
    alike, nothing read by index), from ``op``'s signature: torch's Python functionals (``F.batch_norm``), or a
    stub with the parameter names and defaults of a builtin op.  None when they do not fit the signature (the
    gathered call then raises the serial op's error)."""
    sig = _SIGNATURES.get(op)
    if sig is None:
        sig = _SIGNATURES[op] = inspect.signature(op)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound.arguments


def _grad_inputs(inputs) -> tuple:
    """``torch.autograd.grad``'s ``inputs``: one tensor or a sequence of them."""
    return (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)


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


def _call_with(func, args, kwargs, x, by):
    """``func`` called with its arguments as given, but ``by`` in place of the operand ``x`` (wherever it was
    passed, positionally or by name)."""
    return func(*(by if v is x else v for v in args), **{k: by if v is x else v for k, v in kwargs.items()})


def _inplace_call(kwargs) -> bool:
    """``F.relu(x, inplace=True)`` and friends: the functional form of an in-place op.  The functionals hand
    ``inplace`` to the dispatch by name, however the caller passed it."""
    return kwargs.get("inplace") is True


def _is_inplace(func) -> bool:
    """An in-place method (``x.add_(y)``, ``x[i] = v``): it changes its ``self``, which a method call always
    passes first, positionally."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in (
        "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__", "__setitem__")


def _norm_dim(d: int, n: int) -> int:
    return d % n
