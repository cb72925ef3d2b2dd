"""A ``torch.compile``'d module whose inputs are split activations: compiled as one graph of tile operations.

:class:`SplitCompiledForward` takes the place of a compiled module's forward while the spatial strategy runs it.
On a call with split inputs it hands dynamo a *stand-in* for each (a tensor of the global shape over one element:
no memory, never computed on), so dynamo captures the forward on global shapes exactly as it would on one process,
with its guards over the Python around it and ``fullgraph=True`` (no code runs outside the graph, where it would
meet a stand-in).  The captured graph is not run on the stand-ins: its callable swaps the real split inputs back
in and runs the tile program traced from it for these inputs' layouts (:mod:`.tile_program`), compiled with the
module's own backend (inductor by default, or what the user passed to ``torch.compile``).  A later call replays
it: dynamo's guard check, one dictionary lookup, the compiled graph.

The strategy's check of parameter uses (a ``TorchFunctionMode``) is set aside for dynamo and sees the trace,
whose ops every replay repeats; a call under a mode of the user's runs eagerly through it.  Under K-FAC, the
forwards whose statistics K-FAC captures do not reach this forward
(:class:`~lightning_hpc.kfac.compiled.CompiledUnderKFAC` runs them eagerly); the others arrive with K-FAC's hooks
idle.
A forward that cannot be one graph (a graph break, or an op the dispatch has no traceable form for:
:class:`~lightning_hpc.spatial.layout.tracing.NotTraceable`) runs eagerly through the op dispatch from then on,
exactly, and the module says so once with the reason.  The ranks of a spatial group decide together: each
reaches one agreement (a MAX all-reduce of a refusal flag over the group) per attempt to capture and trace a new
program, before the trace's first exchange, so a forward that dynamo captures on some ranks only (Python that
branches on the rank: a ``print`` on rank 0 is a graph break there alone) runs eagerly on every rank instead of
leaving one rank in the trace's exchanges while the others run the eager ones.  A refusal inside the trace comes
from an op every rank runs, on every rank alike.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_hpc._compat import (
    compiled_backend,
    disable_torch_function_subclass,
    dynamo_error_type,
    torch_function_modes,
    torch_function_modes_suspended,
    tree_leaves,
    tree_map,
)
from lightning_hpc.spatial.compile.tile_program import TileProgram, trace_tile_program
from lightning_hpc.spatial.dispatch.parameter_check import ParameterUseCheck
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor
from lightning_hpc.spatial.layout.tracing import NotTraceable

__all__ = ["SplitCompiledForward"]


def _stand_in(t: SpatialTensor) -> torch.Tensor:
    """A tensor dynamo traces as ``t`` (global shape, dtype, device, ``requires_grad``) over one element."""
    with disable_torch_function_subclass():
        one = torch.zeros((), dtype=t.dtype, device=t.device, requires_grad=t.requires_grad)
    return one.expand(t._gshape)


class SplitCompiledForward:
    """The forward of the ``torch.compile``'d module ``compiled`` under the spatial strategy (see the module
    docstring).  ``name``: the module's place, for messages.  Counters for tests and benchmarks: ``traces`` (tile
    programs traced), ``graphs`` (forward graphs dynamo captured), ``refused`` (why it runs eagerly, or None)."""

    def __init__(self, compiled: Any, name: str = "") -> None:
        self.module: torch.nn.Module = compiled._orig_mod
        self.compiled_forward: Callable[..., Any] = compiled.forward  # the user's compiled code, for plain inputs
        self.backend = compiled_backend(compiled)
        self.name = name or type(self.module).__name__
        self.refused: str | None = None
        self.traces = 0
        self.graphs = 0
        self._real: dict[int, SpatialTensor] = {}
        self._modes: list[Any] = []
        self._agreed = False  # this call's attempt reached the spatial group's agreement (_agree)
        self._captured = torch.compile(self.module, backend=self._capture, fullgraph=True, dynamic=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves = tree_leaves((args, kwargs))
        if not any(isinstance(t, SpatialTensor) for t in leaves):
            return self.compiled_forward(*args, **kwargs)
        modes = torch_function_modes()
        if self.refused is not None or not all(isinstance(m, ParameterUseCheck) for m in modes):
            # a function mode of the user's sees every op of every step: this call runs eagerly, through it
            return self.module(*args, **kwargs)
        self._real.clear()
        self._agreed = False

        def stand(t: Any) -> Any:
            if not isinstance(t, SpatialTensor):
                return t
            s = _stand_in(t)
            self._real[id(s)] = t
            return s

        s_args, s_kwargs = tree_map(stand, (args, kwargs))
        try:
            with torch_function_modes_suspended() as self._modes:
                out = self._captured(*s_args, **s_kwargs)
            # the graph's split outputs reached dynamo's code as stand-ins too (its checks read a tensor's sizes
            # below the dispatch, where a split tensor's are its tile's): the real ones take their places
            return tree_map(lambda t: self._real.get(id(t), t) if isinstance(t, torch.Tensor) else t, out)
        except (NotTraceable, dynamo_error_type()) as e:
            # a rank whose capture failed before its trace tells the others (who wait for it before tracing)
            self._agree(next(t for t in leaves if isinstance(t, SpatialTensor)), e)
            self._refuse(e)
            return self.module(*args, **kwargs)
        finally:
            self._real.clear()

    def _agree(self, t: SpatialTensor, refusal: BaseException | None) -> None:
        """The spatial group's agreement on this attempt (module docstring): once per call, on every rank of the
        group of ``t``'s grid, by a rank about to trace (``refusal`` None) or one that refused before its trace.
        Raises :class:`NotTraceable` on a rank about to trace when another refused, so every rank runs eagerly.
        A rank that refuses later than the others agree waits here until the group's collective timeout: an
        error, not a hang."""
        group = t._grid.group
        if self._agreed or group is None:
            return
        self._agreed = True
        with disable_torch_function_subclass():
            flag = torch.tensor([0 if refusal is None else 1], dtype=torch.int32, device=t.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            refused_elsewhere = refusal is None and bool(flag.item())
        if refused_elsewhere:
            raise NotTraceable("another rank of the spatial group cannot run the forward as one compiled graph (its "
                               "warning names why; a forward that differs by rank, such as a print on one rank, is "
                               "a graph break there alone); every rank runs it eagerly")

    def _refuse(self, e: BaseException) -> None:
        self.refused = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        warnings.warn(
            f"strategy='spatial': the torch.compile'd {self.name} runs eagerly (exactly, through the op dispatch) "
            f"while the strategy runs it: its split step cannot be one compiled graph ({self.refused})",
            stacklevel=3,
        )

    def _capture(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """Dynamo's backend: the callable of one captured forward graph (see the module docstring)."""
        self.graphs += 1
        programs: dict[tuple[Any, ...], TileProgram] = {}
        real = self._real
        buffers = [b for b in self.module.buffers() if b.is_floating_point()]

        def run(*args: Any) -> Any:
            args = tuple(real.get(id(a), a) for a in args)
            key = tuple((i, id(a._grid), a._gshape, a._sdims, a.dtype, a.device, a.requires_grad)
                        for i, a in enumerate(args) if type(a) is SpatialTensor) + (torch.is_grad_enabled(),)
            program = programs.get(key)
            if program is None:
                # every rank of the group about to trace, or refusing before it, agrees first (_agree)
                split = next((a for a in args if type(a) is SpatialTensor), None)
                if split is not None:
                    self._agree(split, None)
                # the strategy's check of parameter uses sees the trace, whose ops every replay repeats
                program = programs[key] = trace_tile_program(gm, args, self.backend, self._modes)
                self.traces += 1
            results = program(args)
            for b in buffers:
                if b.grad_fn is not None:  # (a leaf buffer the user made require a gradient is left as it is)
                    # a buffer the graph updated (running statistics) gets the update's value through the compiled
                    # graph's outputs, which some torch releases (2.14) hand over with their autograd history: as
                    # after the eager update, it is a plain value (else the next capture sees a buffer that needs a
                    # gradient and batch norm refuses it)
                    b.detach_()
            outs = []
            for o in results:
                if type(o) is SpatialTensor:
                    s = _stand_in(o)
                    real[id(s)] = o
                    o = s
                outs.append(o)
            return tuple(outs)

        return run
