"""Reading an op call: its tensor operands, positional-or-keyword arguments, the op's name as the user wrote it
(for messages) and whether it changes its first operand in place.
"""

from __future__ import annotations


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


def _inplace_call(func, args, kwargs) -> bool:
    """``F.relu(x, inplace=True)`` and friends: the functional form of an in-place op."""
    if kwargs.get("inplace") is True:
        return True
    mod = getattr(func, "__module__", "") or ""
    return mod.startswith("torch.nn.functional") and len(args) > 1 and args[-1] is True


def _is_inplace(func) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in (
        "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__", "__setitem__")


def _norm_dim(d: int, n: int) -> int:
    return d % n


def _arg(args, kwargs, pos, name, default=None):
    return args[pos] if len(args) > pos else kwargs.get(name, default)
