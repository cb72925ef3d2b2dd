"""``torch.compile``'d modules under K-FAC: their compiled code on the steps K-FAC does not capture, their own
forward, eagerly, on the steps it does.

K-FAC's statistics come from module hooks (:mod:`.hooks`) on factor-update steps only (every
``factor_update_freq``-th step; step 1 of SC20's Algorithm 1).  Traced into a compiled forward, those hooks break
the graph at every layer (dynamo runs them between graph pieces), and their reading of the step counter makes
dynamo recompile: a small CNN compiles to 28 graphs in 6 steps, where the model alone compiles to one
(``tests/kfac/test_kfac_compiled_route.py``).  :class:`CompiledUnderKFAC`
takes the place of a compiled module's forward while K-FAC trains it:

* a forward whose statistics K-FAC captures (a training forward with gradients on a factor-update step, as the
  hooks themselves decide, :meth:`CaptureHooks.capturing`) runs the module's own forward eagerly, hooks and all;
* every other forward runs the compiled code with the hooks idle (:meth:`CaptureHooks.idle`): they return at
  once, so dynamo captures one graph holding none of their Python, the graph the model compiles to without K-FAC.

Under the spatial strategy the compiled code is the strategy's compiled split step
(:class:`~lightning_hpc.spatial.compile.SplitCompiledForward`), and the eager forward runs on the tiles through
the op dispatch, whose tile kernels record the halo-padded input boxes K-FAC reads on those steps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_hpc._compat import outermost_compiled_modules

if TYPE_CHECKING:
    from lightning_hpc.kfac.preconditioner import KFACPreconditioner

__all__ = ["CompiledUnderKFAC", "attach_compiled", "detach_compiled"]


class CompiledUnderKFAC:
    """The forward of the ``torch.compile``'d module ``compiled`` while the preconditioners ``pres`` (one, or one per
    optimizer) precondition layers inside it (see the module docstring); ``inner``: the forward it replaces (the
    compiled code, or a strategy's compiled split step).  ``eager_calls`` counts the forwards run eagerly because
    K-FAC captured their statistics."""

    def __init__(self, compiled: nn.Module, pres: Sequence[KFACPreconditioner], inner: Callable[..., Any]) -> None:
        self.compiled = compiled
        self.module: nn.Module = compiled._orig_mod  # type: ignore[assignment]
        self.inner = inner
        inside = {id(m) for m in self.module.modules()}
        #: each preconditioner's hooks with the preconditioned layers this module holds (the hooks of the others run
        #: outside its forward)
        self.hooks_and_layers = [(pre.capture_hooks, layers) for pre in pres
                                 if (layers := [h.module for h in pre.handlers if id(h.module) in inside])]
        self.eager_calls = 0

    @property
    def layers(self) -> list[nn.Module]:
        """The preconditioned layers this module holds."""
        return [m for _, layers in self.hooks_and_layers for m in layers]

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # a copy of the model made while K-FAC trains it (weight averaging's) is not trained by K-FAC: it gets the
        # forward this route replaced, not a second reference to the preconditioner and its process groups
        return copy.deepcopy(self.inner, memo)

    def captures(self) -> bool:
        """Whether K-FAC captures the statistics of a layer of this module in the forward about to run."""
        return any(hooks.capturing(m) for hooks, layers in self.hooks_and_layers for m in layers)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.captures():
            self.eager_calls += 1
            return self.module(*args, **kwargs)
        with ExitStack() as idle:
            for hooks, _ in self.hooks_and_layers:
                idle.enter_context(hooks.idle())
            return self.inner(*args, **kwargs)


def attach_compiled(pres: KFACPreconditioner | Sequence[KFACPreconditioner],
                    model: nn.Module) -> list[CompiledUnderKFAC]:
    """Give every outermost ``torch.compile``'d submodule of ``model`` (``model`` itself included) that holds a
    layer one of ``pres`` preconditions (one preconditioner, or one per optimizer) a :class:`CompiledUnderKFAC`
    forward; returns them, for :func:`detach_compiled`.  The K-FAC callback does this when fitting starts; a plain
    training loop calls it after building the preconditioners (nothing is changed where nothing was compiled)."""
    pres = [pres] if not isinstance(pres, Sequence) else list(pres)
    attached: list[CompiledUnderKFAC] = []
    for _, compiled in outermost_compiled_modules(model):
        current = compiled.__dict__.get("forward", compiled.forward)
        if isinstance(current, CompiledUnderKFAC):
            continue  # already (a second fit of the same callback)
        wrapper = CompiledUnderKFAC(compiled, pres, current)
        if wrapper.layers:
            compiled.forward = wrapper
            attached.append(wrapper)
    return attached


def detach_compiled(attached: list[CompiledUnderKFAC]) -> None:
    """Give each module back the forward :func:`attach_compiled` replaced, unless something replaced the wrapper
    since (a strategy that points the compiled module at its own code again when its run ends)."""
    for wrapper in attached:
        if wrapper.compiled.__dict__.get("forward") is wrapper:
            wrapper.compiled.forward = wrapper.inner  # type: ignore[method-assign]
