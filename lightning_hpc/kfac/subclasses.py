"""Layer subclasses with a ``forward`` of their own (model zoos' ``Conv2dSame``, ``StdConv2d``, ``LayerNorm2d``,
``BatchNormAct2d``, ...): K-FAC preconditions one only when its statistics are provably those of what it computes.

A subclass that keeps its base class's forward is its base class (its handler is the base's). One with its own
``forward`` (or, for a convolution, its own ``_conv_forward``) may pad its input first, permute it, transform its
weight, or apply an activation to the result, so neither the module's input nor its output gradient need be the
statistics of the layer's weight (KFC's A and G, Grosse & Martens 2016, section 3.1, are those of the convolution
the weight takes part in). Such a layer is followed through the functional op its base class calls (``F.linear``,
``F.conv1d/2d/3d``, ``F.batch_norm``, ``F.layer_norm``, ``F.group_norm``, ``F.instance_norm``, ``F.rms_norm``):
while its forward runs, a :class:`CallTracer` (a ``TorchFunctionMode``) sees every call of that op, and a call
that passes the module's own weight (and its own trainable bias) is captured with the call's input, its
arguments (a convolution's stride, padding and dilation; a norm's are checked to be the module's) and the gradient
of the call's output. So a ``Conv2dSame``-style layer gets A from its padded input, a ``LayerNorm2d`` its
statistics in NHWC layout and a ``BatchNormAct2d`` G before its activation.

The layer is exact only if its weight reaches the forward's result through the captured calls alone. After each
forward that builds a graph, :meth:`CallTracer.finish` walks the autograd nodes the forward created (those with a
sequence number from the forward's start on) from its outputs: an edge into the weight's (or trainable bias's)
accumulator from a node that no captured call created is another use of it (``StdConv2d``'s standardised weight, a
weight scaled or reshaped before the op, a custom autograd function on it), and the layer is then left to the
optimizer with that reason, as it is when a call's arguments differ from the module's. Since this is known only
once the forward has run, the setup report lists such layers as decided at their first forward with gradients.

A weight that is not a parameter of the module (``torch.nn.utils.parametrizations.weight_norm`` or any
parametrization, the older ``weight_norm`` hook) is known at setup: its gradient goes to other parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_hpc._compat import autograd_sequence_nr

__all__ = [
    "FUNCTIONAL_OPS",
    "CallTracer",
    "ConvGeometry",
    "FunctionalOp",
    "computed_weight",
    "has_own_forward",
    "trainable_bias",
]

#: the methods a subclass overrides to compute something else than its base class
OWN_FORWARD_METHODS = ("forward", "_conv_forward")


def has_own_forward(module: nn.Module, base: type[nn.Module]) -> bool:
    """Whether a class between ``type(module)`` and the torch class ``base`` defines its own forward."""
    mro = type(module).__mro__
    return any(name in vars(cls) for cls in mro[: mro.index(base)] for name in OWN_FORWARD_METHODS)


def trainable_bias(module: nn.Module) -> torch.Tensor | None:
    """The module's bias when it is a parameter of the module that trains, else None (absent, frozen, or computed
    from other parameters by a parametrization: its gradient then goes to those)."""
    bias = module._parameters.get("bias")
    return bias if isinstance(bias, nn.Parameter) and bias.requires_grad else None


def computed_weight(module: nn.Module) -> str | None:
    """Why ``module.weight`` is not a parameter K-FAC can precondition (None: it is one): a weight computed in the
    forward from other parameters (a parametrization, the ``weight_norm`` hook) takes no gradient of its own."""
    if isinstance(module._parameters.get("weight"), nn.Parameter):
        return None
    others = [n for n, p in module.named_parameters() if n != "bias" and p.requires_grad]
    return (f"its weight is computed from other parameters ({', '.join(others[:4]) or 'none'}; a parametrization "
            "or weight_norm): the gradient goes to those, which K-FAC's factors of the computed weight do not "
            "describe")


@dataclass(frozen=True)
class ConvGeometry:
    """What a convolution does to its input besides the weight: stride, dilation and padding (``F.pad``'s order,
    reversed dimensions, both sides) in ``mode``."""

    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    padding: tuple[int, ...]
    mode: str = "zeros"

    @classmethod
    def of_module(cls, m: nn.Module) -> ConvGeometry:
        """The geometry of ``nn.ConvNd.forward``."""
        return cls(tuple(m.stride), tuple(m.dilation), tuple(m._reversed_padding_repeated_twice),  # type: ignore
                   str(m.padding_mode))

    @classmethod
    def of_call(cls, kernel: Sequence[int], stride: Any, padding: Any, dilation: Any) -> ConvGeometry:
        """The geometry of ``F.convNd(x, w, b, stride, padding, dilation)`` with a ``kernel``-sized weight: zero
        padding, ``'same'`` split as ``nn.ConvNd`` splits it (the odd element on the far side)."""
        def tup(v: Any) -> tuple[int, ...]:  # an int or one per dimension, as torch takes them
            return tuple(int(e) for e in v) if isinstance(v, (tuple, list)) else (int(v),) * len(kernel)

        dil = tup(dilation)
        if padding == "valid":
            pads: tuple[int, ...] = (0,) * 2 * len(kernel)
        elif padding == "same":
            flat: list[int] = []
            for d, k in zip(reversed(dil), reversed(tuple(kernel))):
                total = d * (k - 1)
                flat += [total // 2, total - total // 2]
            pads = tuple(flat)
        else:
            pads = tuple(p for p in reversed(tup(padding)) for _ in range(2))  # F.pad's order: last dim first
        return cls(tup(stride), dil, pads)


@dataclass(frozen=True)
class FunctionalOp:
    """A functional op a base class's forward calls: its argument names and defaults (how a call is bound), and
    how a call's arguments are checked against the module's (:meth:`mismatch`)."""

    funcs: tuple[Callable[..., Any], ...]
    names: tuple[str, ...]
    defaults: tuple[tuple[str, Any], ...]

    @property
    def label(self) -> str:
        return f"F.{getattr(self.funcs[0], '__name__', '?')}"

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = dict(self.defaults)
        bound.update(zip(self.names, args))
        bound.update(kwargs)
        return bound

    def mismatch(self, module: nn.Module, call: dict[str, Any]) -> str | None:
        """Why the call does not compute the base class's op on the module's parameters (None: it does)."""
        m: Any = module
        bias = trainable_bias(module)
        if bias is not None and call.get("bias") is not bias:
            return f"its forward calls {self.label} with a bias other than its trainable bias"
        checks: list[tuple[str, Any, Any]] = []
        if "groups" in call:
            checks.append(("groups", call["groups"], m.groups))
        for key in ("eps", "num_groups"):
            if key in call:
                checks.append((key, call[key], getattr(m, key)))
        if "normalized_shape" in call:
            shape = call["normalized_shape"]
            checks.append(("normalized_shape", tuple(shape) if not isinstance(shape, int) else (shape,),
                           tuple(m.normalized_shape)))
        # the handlers recompute training-mode (per-batch or per-sample) statistics; only training forwards are
        # captured
        for key in ("training", "use_input_stats"):
            if key in call and module.training:
                checks.append((key, bool(call[key]), True))
        for key, got, want in checks:
            if got != want:
                return f"its forward calls {self.label} with {key}={got!r}, not the module's {want!r}"
        return None


_CONV = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_DEFAULTS = (("bias", None), ("stride", 1), ("padding", 0), ("dilation", 1), ("groups", 1))
_BATCH_NORM = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_NORM_DEFAULTS = (("weight", None), ("bias", None), ("eps", 1e-5))

#: the op each base class's forward calls with its weight
FUNCTIONAL_OPS: dict[type[nn.Module], FunctionalOp] = {
    nn.Linear: FunctionalOp((F.linear,), ("input", "weight", "bias"), (("bias", None),)),
    nn.Conv1d: FunctionalOp((F.conv1d,), _CONV, _CONV_DEFAULTS),
    nn.Conv2d: FunctionalOp((F.conv2d,), _CONV, _CONV_DEFAULTS),
    nn.Conv3d: FunctionalOp((F.conv3d,), _CONV, _CONV_DEFAULTS),
    **dict.fromkeys((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d),
                    FunctionalOp((F.batch_norm,), _BATCH_NORM, (*_NORM_DEFAULTS, ("training", False)))),
    **dict.fromkeys((nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d),
                    FunctionalOp((F.instance_norm,), _BATCH_NORM[:5] + ("use_input_stats", "momentum", "eps"),
                                 (*_NORM_DEFAULTS, ("use_input_stats", True)))),
    nn.LayerNorm: FunctionalOp((F.layer_norm,), ("input", "normalized_shape", "weight", "bias", "eps"),
                               _NORM_DEFAULTS),
    nn.GroupNorm: FunctionalOp((F.group_norm,), ("input", "num_groups", "weight", "bias", "eps"), _NORM_DEFAULTS),
    nn.RMSNorm: FunctionalOp((F.rms_norm,), ("input", "normalized_shape", "weight", "eps"),
                             (("weight", None), ("eps", None))),
}  # fmt: skip


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _flat_tensors(v)]
    return []


#: ``on_call(input, output, geometry)``: a captured call of the module's op (geometry: a convolution's, else None)
OnCall = Callable[[torch.Tensor, torch.Tensor, "ConvGeometry | None"], None]


class CallTracer(TorchFunctionMode):
    """Follows one module's forward: captures the calls of its base class's op on its own weight
    (:func:`on_call`) and, at :meth:`finish`, tells whether its parameters reached the result any other way.

    Entered by the module's forward pre-hook (:meth:`start`) and left by its forward hook (:meth:`finish`,
    registered with ``always_call`` so a forward that raises leaves it too). The mode sees the calls of the
    module's own forward, its children's included; ops inside ``__torch_function__`` run with the mode off."""

    def __init__(self, module: nn.Module, op: FunctionalOp, on_call: OnCall) -> None:
        super().__init__()
        self.module = module
        self.op = op
        self.on_call = on_call
        self.active = False
        self._start = 0
        self._captured: list[tuple[int, int]] = []  # sequence-number ranges of the captured calls' nodes
        self._mismatch: str | None = None

    def params(self) -> list[torch.Tensor]:
        """The parameters whose gradients the captured calls must account for: the weight and a trainable bias."""
        bias = trainable_bias(self.module)
        return [cast(torch.Tensor, self.module.weight)] + ([bias] if bias is not None else [])

    def start(self) -> None:
        self.active = True
        self._start = autograd_sequence_nr()
        self._captured = []
        self._mismatch = None
        self.__enter__()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in self.op.funcs:
            return func(*args, **kwargs)
        call = self.op.bind(args, kwargs)
        if call.get("weight") is not self.module.weight:  # another weight (or a transformed one: see finish)
            return func(*args, **kwargs)
        mismatch = self.op.mismatch(self.module, call)
        if mismatch is not None:
            self._mismatch = self._mismatch or mismatch
            return func(*args, **kwargs)
        first = autograd_sequence_nr()
        out = func(*args, **kwargs)
        self._captured.append((first, autograd_sequence_nr()))
        x = call["input"]
        if isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor):
            geometry = None
            if "groups" in call:
                w = self.module.weight
                geometry = ConvGeometry.of_call(w.shape[2:], call["stride"], call["padding"], call["dilation"])
            self.on_call(x, out, geometry)
        return out

    def finish(self, output: Any) -> tuple[bool, str | None]:
        """Leave the mode; ``(whether a captured call used the weight, why the layer is not exact or None)`` for
        the forward that just ran (its graph: nothing to say of a forward that built none)."""
        if not self.active:
            return False, None
        self.active = False
        self.__exit__(None, None, None)
        if self._mismatch is not None:
            return bool(self._captured), self._mismatch
        return bool(self._captured), self._other_use(_flat_tensors(output))

    def _other_use(self, outputs: list[torch.Tensor]) -> str | None:
        """The autograd node through which a parameter reaches ``outputs`` other than by a captured call, as a
        reason (None: none). Only nodes created since :meth:`start` are walked (sequence numbers grow in a
        thread's forward); a parameter's accumulator has the largest sequence number and is never walked."""
        params = self.params()
        for t in outputs:
            if any(t is p for p in params):
                return f"its forward returns its parameter {tuple(t.shape)} itself"
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        seen: set[Any] = set()
        found: dict[str, list[str]] = {}  # "weight" / "bias" -> the nodes that use it outside the captured calls
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            seq = node._sequence_nr()
            inside = any(lo <= seq < hi for lo, hi in self._captured)
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                variable = getattr(nxt, "variable", None)  # a leaf's gradient accumulator
                if variable is not None:
                    if not inside and any(variable is p for p in params):
                        uses = found.setdefault("weight" if variable is params[0] else "bias", [])
                        if node.name() not in uses:
                            uses.append(node.name())
                    continue
                if nxt._sequence_nr() >= self._start:
                    stack.append(nxt)
        if not found:
            return None
        which = [k for k in ("weight", "bias") if k in found]
        nodes = sorted({n for k in which for n in found[k]})
        named = " and ".join(which)
        return (f"its forward uses its {named} other than as the {named} of an {self.op.label} call (autograd "
                f"node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)}): the statistics of the {self.op.label} "
                "calls would not be those of its parameters' gradients")
