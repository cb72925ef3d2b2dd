"""A split step as one graph of tile operations: what ``torch.compile`` compiles under the spatial strategy.

Dynamo captures the user's forward as a graph of torch-level calls on *global* shapes (its guards cover the
Python around it; :mod:`.split_module`).  :func:`trace_tile_program` runs that graph once on this rank's tiles
through the op dispatch (:mod:`lightning_hpc.spatial.dispatch`) while ``make_fx`` records the aten operations
the dispatch issues: the tile kernels, the halo exchanges and the sums over the group as the custom operators of
:mod:`lightning_hpc.spatial.kernels.graph_ops`.  Every per-op decision of the dispatch (the windows, the
exchanges, the layouts) is made once, at the trace; the recorded graph holds only tile-level work, which the
user's backend compiles (its backward derived by AOTAutograd through the operators' adjoints).  A later call
with the same layouts replays the compiled graph: no Python per op, no graph break per convolution.

What the dispatch cannot put into a graph refuses the trace (:class:`~lightning_hpc.spatial.layout.tracing.
NotTraceable`, naming the op): random draws on tiles, values read back to the host, a grad-mode change, K-FAC's
statistics of tiled convolutions.  The caller then runs the step eagerly, exactly as before.  An op with no tiled
form is computed on the whole activation as in eager mode, gathered by an operator of the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from lightning_hpc._compat import graph_tracer
from lightning_hpc.spatial.dispatch.state import state
from lightning_hpc.spatial.dispatch.tensor import SpatialTensor, _alias
from lightning_hpc.spatial.kernels import graph_ops  # noqa: F401  (registers the operators the trace records)
from lightning_hpc.spatial.layout.tracing import NotTraceable, Trace

__all__ = ["TileProgram", "trace_tile_program", "refused_node"]

Layout = tuple[Any, tuple[int, ...], tuple[int, ...]]  # (grid, global shape, split dims)

#: aten operations a tile graph may not hold: random draws (a compiled graph draws from its own generator, not
#: from the stream one process uses) and torch.distributed's own (non-functional) collectives, whose completion a
#: graph does not order.  (A value read back to the host stops the trace itself: make_fx refuses it.)
_RANDOM = frozenset({
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "bernoulli", "bernoulli_",
    "uniform_", "normal", "normal_", "exponential_", "geometric_", "log_normal_", "cauchy_", "random_", "multinomial",
    "native_dropout", "poisson",
})


def refused_node(gm: torch.fx.GraphModule) -> str | None:
    """What in a recorded tile graph cannot be replayed from a compiled graph, or None."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        name = getattr(target, "__name__", str(target))
        ns = getattr(target, "namespace", "")
        base = name.split(".")[0]
        if ns == "c10d":
            return f"a torch.distributed collective ({name})"
        if ns == "aten" and base in _RANDOM:
            return f"a random draw ({name}): dropout or a random tensor in the forward"
    return None


def _grad_mode_change(graph: Any) -> str | None:
    """A grad-mode change inside dynamo's graph (``torch.no_grad()`` in the forward), which the recorded tile
    graph would not keep."""
    for node in getattr(getattr(graph, "graph", None), "nodes", ()):
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "_set_grad_enabled":
            return "a grad-mode change inside the forward (torch.no_grad() / torch.enable_grad())"
    return None


@dataclass
class TileProgram:
    """A traced split step for one set of input layouts: ``run`` (the compiled tile graph) takes the arguments
    with each split input replaced by its tile and returns plain tiles, which :meth:`__call__` lays out again.
    ``gathers`` / ``gathered_bytes``: the whole activations the graph gathers per call (its ops with no tiled
    form), which every call adds to the dispatch's counters (``spatial.dispatch.state()``) as an eager step would;
    the trace itself counts nothing."""

    run: Callable[..., Any]
    split_positions: tuple[int, ...]
    out_layouts: tuple[Layout | None, ...]
    graph: torch.fx.GraphModule
    gathers: int = 0
    gathered_bytes: int = 0

    def __call__(self, args: Sequence[Any]) -> tuple[Any, ...]:
        flat = list(args)
        for i in self.split_positions:
            flat[i] = flat[i].local()
        if self.gathers:
            counters = state()
            counters.gathers += self.gathers
            counters.gathered_bytes += self.gathered_bytes
        outs = self.run(*flat)
        return tuple(o if lay is None else SpatialTensor.wrap(o, *lay, fresh=True)
                     for o, lay in zip(outs, self.out_layouts))


def _layout(t: SpatialTensor) -> Layout:
    return (t._grid, t._gshape, t._sdims)


def trace_tile_program(graph: Callable[..., Any], args: Sequence[Any], backend: Any,
                       modes: Sequence[Any] = ()) -> TileProgram:
    """Trace ``graph`` (dynamo's graph of the forward, global shapes) on ``args`` (split inputs as
    :class:`SpatialTensor`) into a tile graph, compiled with ``backend`` (the user's ``torch.compile`` backend).
    The trace runs the step once for real on copies of every argument that is not a parameter (the running
    statistics, the inputs: the step the caller then runs changes them once) with the random state put back, so
    the step that follows is the first.  ``modes``: ``TorchFunctionMode`` objects the trace runs under (outermost
    first).  Raises :class:`NotTraceable` naming what has no traceable form."""
    changed = _grad_mode_change(graph)
    if changed is not None:  # known from dynamo's graph alone: refused before the step is run for the trace
        raise NotTraceable(changed)
    split = tuple(i for i, a in enumerate(args) if isinstance(a, SpatialTensor))
    layouts = {i: _layout(args[i]) for i in split}
    out_layouts: list[Layout | None] = []

    def tile_step(*flat: Any) -> list[torch.Tensor]:
        wrapped = list(flat)
        for i in split:
            wrapped[i] = SpatialTensor.wrap(flat[i], *layouts[i])
        with ExitStack() as stack:  # the modes see the forward's ops, not the tracer's own work
            for mode in modes:
                stack.enter_context(mode)
            outs = graph(*wrapped)
        out_layouts.clear()
        plain = []
        for o in outs if isinstance(outs, (tuple, list)) else (outs,):
            if not isinstance(o, torch.Tensor):
                raise NotTraceable(f"a forward returning {type(o).__name__} beside tensors")
            if isinstance(o, SpatialTensor):
                out_layouts.append(_layout(o))
                plain.append(_alias(o))
            else:
                out_layouts.append(None)
                plain.append(o)
        return plain

    def copy(i: int, a: Any) -> Any:
        if i in split:
            return a.local().clone()
        if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter):
            return a.clone()
        return a

    trace_args = [copy(i, a) for i, a in enumerate(args)]
    devices = sorted({a.device for a in trace_args if isinstance(a, torch.Tensor) and a.device.type != "cpu"},
                     key=str)
    counters = state()
    counted = (counters.gathers, counters.gathered_bytes)
    Trace.active = True
    try:
        # under the caller's grad mode: the dispatch decides by ``requires_grad`` (a replicated value meeting tiles
        # gets its gradient completed over the group only when it has one)
        with torch.random.fork_rng(devices=devices):
            gm = graph_tracer()(tile_step, tracing_mode="real")(*trace_args)
    except RuntimeError as e:
        if "get value out of a tracing tensor" in str(e):  # make_fx refuses a value read back to the host
            raise NotTraceable("a value read back to the host (x.item(), int(x), a Python branch on a tensor)") from e
        raise
    finally:
        Trace.active = False
        # the trace's gathers are the program's per call, counted by each call (TileProgram.__call__)
        gathers, gathered_bytes = counters.gathers - counted[0], counters.gathered_bytes - counted[1]
        counters.gathers, counters.gathered_bytes = counted
    refused = refused_node(gm)
    if refused is not None:
        raise NotTraceable(refused)
    run = torch.compile(gm, backend=backend, fullgraph=True, dynamic=False)
    return TileProgram(run, split, tuple(out_layouts), gm, gathers, gathered_bytes)
