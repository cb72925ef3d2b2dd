"""Whether a split step is being traced into a graph (:mod:`lightning_hpc.spatial.compile`), and the refusal of an
op that has no traceable form.  No dependencies: the kernels and the dispatch check :attr:`Trace.active` on their
paths."""

from __future__ import annotations

__all__ = ["Trace", "NotTraceable", "refuse_trace"]


class Trace:
    """Whether a split step is being traced into a graph (:mod:`lightning_hpc.spatial.compile`), set only for the
    trace's duration.  While tracing, the kernels take their traceable forms (the operators of
    :mod:`~lightning_hpc.spatial.kernels.graph_ops` for the exchanges, no autograd Functions, whose hand-written
    backward a graph would not hold), and a tile's plain alias is made by the ``alias`` operator, which the tracer
    records (it follows tensors by their Python objects, and ``as_subclass`` makes an object it does not know).
    An op with no traceable form refuses the trace (:class:`NotTraceable`); the step then runs eagerly."""

    active = False


class NotTraceable(RuntimeError):
    """An op of the split step has no traceable form (named in the message)."""


def refuse_trace(what: str) -> None:
    """Refuse the running trace at ``what`` (an op or kernel with no traceable form); nothing when not tracing."""
    if Trace.active:
        raise NotTraceable(what)
