"""The forward and backward hooks that capture K-FAC's statistics (step 1 of Algorithm 1, SC20).

A layer's forward hook computes the input statistics of each call (A's Gram, :meth:`LayerHandler.capture_input`)
and registers a hook on the call's output, whose gradient commits them with the output-gradient statistics (G's
Gram, :meth:`LayerHandler.capture_output_grad`). Only training forwards that will be backpropagated, on
factor-update steps, are captured, and only backward passes that give the layer's weight its gradient commit them
(a ``torch.autograd.grad`` pass of a gradient penalty leaves the calls it reaches out). A layer subclass with its
own forward is followed through the functional op it calls on its weight
(:class:`~lightning_hpc.kfac.subclasses.CallTracer`) and left to the optimizer when its weight reaches the result
any other way. With ``overlap_factor_allreduce`` the output-gradient hooks of the step's last
micro-batch launch the factor all-reduce (:mod:`.overlap`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_hpc._compat import disable_torch_function_subclass, forward_hooks
from lightning_hpc.kfac.layers import ConvHandler, LayerHandler, base_type
from lightning_hpc.kfac.subclasses import FUNCTIONAL_OPS, CallTracer, ConvGeometry

if TYPE_CHECKING:
    from lightning_hpc.kfac.preconditioner import KFACPreconditioner

__all__ = ["CaptureHooks"]


#: the attribute that marks a module hook as a :class:`CaptureHooks` hook (:meth:`CaptureHooks.refuse_hooked_layers`
#: finds another preconditioner's hooks by it, not by the hook functions' names)
_MARK = "_lightning_hpc_kfac_capture"


def _marked(fn: Callable[..., None]) -> Callable[..., None]:
    setattr(fn, _MARK, True)
    return fn


class CaptureHooks:
    """The hooks of every layer of a :class:`~lightning_hpc.kfac.preconditioner.KFACPreconditioner`, registered
    at construction, removed by :meth:`remove`."""

    def __init__(self, pre: KFACPreconditioner) -> None:
        self.pre = pre
        #: every hook returns at once (:meth:`idle`): a compiled forward whose statistics nobody captures runs
        self.suspended = False
        #: a forward hook ran since the last step (the refusal of a forward that bypassed them)
        self.forward_hooks_ran = False
        #: a call was captured since the statistics were last discarded (every statistic begins with one)
        self.captured = True
        handlers = pre.handlers
        self.handles: list[Any] = [
            h.module.register_forward_hook(_marked(self._forward_hook(i, h)))
            for i, h in enumerate(handlers) if not h.traced
        ]
        self.handles += [h.module.register_forward_pre_hook(_marked(self._pre_hook(h)))
                         for h in handlers if h.records_input]
        for i, h in enumerate(handlers):
            if h.traced:
                self.handles += self._tracer_hooks(i, h)

    @staticmethod
    def refuse_hooked_layers(handlers: list[LayerHandler]) -> None:
        """Refuse a layer that another preconditioner's hooks capture: both would precondition its gradient (the
        preconditioners of several optimizers given overlapping ``parameters``)."""
        for h in handlers:
            if any(getattr(fn, _MARK, False) for fn in forward_hooks(h.module)):
                raise ValueError(
                    f"K-FAC layer {h.name!r} ({type(h.module).__name__}) is already preconditioned by another "
                    "KFACPreconditioner, whose hooks are still registered: one preconditioner per layer. With one "
                    "preconditioner per optimizer, give each the parameters of its own optimizer (parameters=...); "
                    "to replace a preconditioner, call remove_hooks() on the old one first"
                )

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    @contextmanager
    def idle(self) -> Iterator[None]:
        """Inside, every hook returns at once (:attr:`suspended`): a compiled forward whose statistics nobody
        captures runs (:mod:`.compiled`), and the graph the compiler captures holds none of the hooks' Python."""
        before, self.suspended = self.suspended, True
        try:
            yield
        finally:
            self.suspended = before

    def capturing(self, module: nn.Module) -> bool:
        # Only training forwards that will be backpropagated, and only on factor-update steps:
        # validation, no-grad and inference-mode forwards never touch the factors.
        return module.training and torch.is_grad_enabled() and self.pre.is_factor_update_step

    @staticmethod
    def check_module(handler: LayerHandler, module: nn.Module) -> None:
        if module is not handler.module:
            # The hook runs on another module than its handler's (a layer replaced by one that took over its hook
            # dict, or a copy of the model made after the hooks were registered): its statistics would be
            # recorded for the wrong layer.
            raise RuntimeError(
                f"K-FAC layer {handler.name!r}: its hooks ran on another {type(module).__name__} than the one they "
                "were registered on (a layer replaced, or the model copied, after the K-FAC hooks were registered); "
                "create the KFACPreconditioner for the model that trains, after any change to its layers"
            )

    def _pre_hook(self, handler: LayerHandler) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple[Any, ...]) -> None:
            if self.suspended:
                return
            self.check_module(handler, module)
            handler.prepare_capture(self.capturing(module))

        return hook

    def _output_grad_hook(self, index: int, handler: LayerHandler, token: int) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:  # returns None: the gradient itself is never replaced
            if not handler.backward_gives_gradient():
                # a torch.autograd.grad pass that gives the weight no gradient (a gradient penalty at the call's
                # input): the call is the penalty's, not a sample of the loss's Fisher; left out
                handler.drop_call(token)
                return
            if self.pre.one_of_several and handler.stale_before(token):
                # zero_grad since an earlier backward pass of this layer (after this pass's forward): its
                # statistics belong to gradients no step will use
                if self.pre.overlap is not None:
                    self.pre.overlap.abandon()
                handler.discard_committed()
            committed = handler.capture_output_grad(g, token)
            overlap = self.pre.overlap
            if committed and overlap is not None and self.pre.final_micro_batch:
                overlap.armed = True
                # final once every call of the layer in this forward pass has its output gradient (a shared
                # layer's hook fires once per call)
                if not handler.stats.awaiting():
                    overlap.layer_done(index)

        return hook

    def _forward_hook(self, index: int, handler: LayerHandler) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            if self.suspended:
                return
            self.forward_hooks_ran = True  # (capturing or not: an eval-mode or no-grad forward ran the hooks too)
            self.check_module(handler, module)
            x = handler.captured_input(inputs)  # also ends the layer's recording when it records its input
            self.capture(index, handler, module, x, output)

        return hook

    def _tracer_hooks(self, index: int, handler: LayerHandler) -> list[Any]:
        """The hooks of a subclass with its own forward (:mod:`.subclasses`): a :class:`CallTracer` follows each
        forward that builds a graph, captures the calls of its base class's op on its weight, and leaves the layer to
        the optimizer when the weight reaches the result any other way."""
        module = handler.module
        op = FUNCTIONAL_OPS[base_type(module)]  # type: ignore[index]  # discovery traces these types only

        def on_call(x: torch.Tensor, output: torch.Tensor, geometry: ConvGeometry | None) -> None:
            if handler.left_out is not None:
                return
            if isinstance(handler, ConvHandler):
                handler.call_geometry = geometry  # the call's padding, stride and dilation: A of what it convolves
            try:
                self.capture(index, handler, module, x, output)
            finally:
                if isinstance(handler, ConvHandler):
                    handler.call_geometry = None

        tracer = CallTracer(module, op, on_call)

        def pre_hook(module: nn.Module, inputs: tuple[Any, ...]) -> None:
            if self.suspended:
                return
            self.check_module(handler, module)
            if handler.left_out is None and torch.is_grad_enabled():
                tracer.start()

        def hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            if self.suspended:
                return
            self.forward_hooks_ran = True
            used, reason = tracer.finish(output)
            if reason is not None:
                self.leave_out(handler, reason)
            elif used and handler.left_out is None:
                self.pre.layer_report.settle(handler.name, None)

        return [module.register_forward_pre_hook(_marked(pre_hook)),
                module.register_forward_hook(_marked(hook), always_call=True)]

    def leave_out(self, handler: LayerHandler, reason: str) -> None:
        """Leave a traced layer to the optimizer from now on: it is reported with ``reason``, said once, and keeps
        no statistics, factors or decompositions (so :meth:`KFACPreconditioner.step` no longer changes its
        gradient)."""
        if handler.left_out is not None:
            return
        handler.left_out = reason
        handler.reset_statistics()
        handler.state.clear()
        self.pre.layer_report.settle(handler.name, reason)
        self.pre.warn_once(f"left_out:{handler.name}", f"K-FAC leaves layer {handler.name!r} "
                           f"({type(handler.module).__name__}) to the optimizer: {reason}", stacklevel=4)

    def capture(self, index: int, handler: LayerHandler, module: nn.Module, x: torch.Tensor | None,
                output: Any) -> None:
        """Capture one call of the layer: ``x`` is what A is formed from, ``output`` the tensor whose gradient
        forms G (the module's, or the traced functional call's)."""
        if not self.capturing(module):
            return
        if self.pre.one_of_several and not handler.weight.requires_grad:
            # another optimizer's pass with this network frozen (toggle_optimizer): the weight takes no gradient
            # from it, so it is not a statistic of the gradient this layer's optimizer steps with
            return
        if x is None or not isinstance(output, torch.Tensor) or not output.requires_grad or not handler.captures(x):
            return
        if handler.is_stale():
            # statistics of a backward pass whose step() never ran (gradients cleared since): drop them all
            if self.pre.overlap is not None:
                self.pre.overlap.abandon()  # and whatever that backward pass launched
            for h in self.pre.handlers:
                h.discard_committed()
        self.captured = True
        token = handler.capture_input(x)
        # the raw gradient of this tensor, also for a tensor subclass that would wrap it for user hooks (a
        # spatial tile: the tiled handler expects the tile's own part)
        with disable_torch_function_subclass():
            output.register_hook(self._output_grad_hook(index, handler, token))
