"""Reading an op call: its arguments by name (bound once against the op's signature), its tensor operands, the
op's name as the user wrote it (for messages) and whether it changes its first operand in place.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

_SIGNATURES: dict[Callable, inspect.Signature] = {}


class _Binder:
    """How every call of one op with one call shape (its number of positional arguments and its keyword names)
    binds to the op's parameters: decided once by ``inspect.Signature.bind`` (which also rejects a call that does
    not fit), then replayed with plain dict updates, so a repeated call pays no signature binding."""

    __slots__ = ("positional", "defaults", "var_positional", "var_keyword", "extra_keywords", "plain")

    def __init__(self, sig: inspect.Signature, nargs: int, keywords: tuple[str, ...]) -> None:
        params = list(sig.parameters.values())
        self.var_positional = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)
        self.var_keyword = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
        by_position = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        #: the parameters the positional arguments bind to (any further ones go to ``*args``)
        self.positional = tuple(by_position[:nargs])
        #: the keywords that only ``**kwargs`` takes
        named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        self.extra_keywords = frozenset(k for k in keywords if k not in named)
        #: what ``apply_defaults`` adds for the parameters the call leaves out (``*args`` / ``**kwargs`` are made
        #: per call: a shared empty container could be changed by a handler)
        self.defaults = {p.name: p.default for p in params if p.default is not p.empty
                         and p.name not in keywords and p.name not in self.positional}
        #: a signature without ``*args`` / ``**kwargs``: the call's names are its positional parameters, its
        #: keywords and the defaults (:func:`bind_call` builds that dict itself, without a call of its own)
        self.plain = self.var_positional is None and self.var_keyword is None

    def __call__(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        out = dict(self.defaults)
        out.update(zip(self.positional, args))
        if self.var_positional is not None:
            out[self.var_positional] = tuple(args[len(self.positional):])
        if self.extra_keywords:
            out.update((k, v) for k, v in kwargs.items() if k not in self.extra_keywords)
            out[self.var_keyword] = {k: v for k, v in kwargs.items() if k in self.extra_keywords}  # type: ignore[index]
        else:
            out.update(kwargs)
            if self.var_keyword is not None:
                out[self.var_keyword] = {}
        return out


#: per (op, number of positional arguments, keyword names): its :class:`_Binder`, or None where such a call does
#: not fit the signature
_BINDERS: dict[tuple[Callable, int, tuple[str, ...]], _Binder | None] = {}


def bind_call(op: Callable, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The call's arguments by name with defaults applied (what ``inspect.Signature.bind`` + ``apply_defaults``
    give: positional and keyword forms alike, nothing read by index), from ``op``'s signature: torch's Python
    functionals (``F.batch_norm``), or a stub with the parameter names and defaults of a builtin op.  None when
    they do not fit the signature (the gathered call then raises the serial op's error).  The binding of a call
    shape is decided once (:class:`_Binder`)."""
    key = (op, len(args), tuple(kwargs))
    binder = _BINDERS.get(key, _UNSEEN)
    if binder is not _UNSEEN and binder is not None and binder.plain:  # the usual case, first
        out = dict(zip(binder.positional, args), **binder.defaults)
        if kwargs:
            out.update(kwargs)
        return out
    if binder is _UNSEEN:
        sig = _SIGNATURES.get(op)
        if sig is None:
            sig = _SIGNATURES[op] = inspect.signature(op)
        try:
            sig.bind(*range(len(args)), **dict.fromkeys(kwargs))
        except TypeError:
            binder = None
        else:
            binder = _Binder(sig, len(args), key[2])
        _BINDERS[key] = binder
    return None if binder is None else binder(args, kwargs)  # type: ignore[operator]


_UNSEEN: Any = object()


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
