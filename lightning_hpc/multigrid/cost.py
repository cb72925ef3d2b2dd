"""Performance model of the layer-parallel solver and of the partitioned-model baseline.

Predicts the time of one forward pass and one training step (forward + backward) on P devices from measured
per-layer times (``lightning_hpc.perfmodel.LayerTimer``) and an alpha-beta network model (calibrated with
``lightning_hpc.perfmodel.calibrate_local`` or given), following the operations the implementation performs
(fas.py): per cycle and level, F-relaxation (one boundary message), optional C + F, C-point residual, the
coarse right-hand side, the coarse solve (sequential over all ranks on the coarsest level), the closing
F-relaxation; the first F-relaxation of every cycle after the first is skipped on the fine level, as in the
code.  Each phase is bulk synchronous: it lasts as long as the slowest rank.  Within a device the layers of a
phase are charged one after the other (no credit for batching/concurrency: a conservative assumption, the
paper's GPUs got little kernel concurrency either, section IV-B).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_hpc.distributed.partition import block_bounds
from lightning_hpc.perfmodel.alphabeta import AlphaBeta, allreduce, send_recv
from lightning_hpc.perfmodel.pipeline import (
    serial_pipeline_time,
    stage_times,
)

__all__ = ["PassCost", "multigrid_pass_time", "multigrid_step_time", "partitioned_step_time"]


@dataclass
class PassCost:
    compute: float
    communication: float

    @property
    def total(self) -> float:
        return self.compute + self.communication


def _owner_table(n: int, parts: int) -> list[int]:
    owner = [0] * n
    for r, (a, b) in enumerate(block_bounds(n, parts)):
        for i in range(a, b):
            owner[i] = r
    return owner


def multigrid_pass_time(
    layer_times: Sequence[float],
    parts: int,
    cfactor: int,
    levels: int,
    cycles: int,
    relaxation: str,
    message_bytes: float,
    model: AlphaBeta,
) -> PassCost:
    """One multigrid solve (forward, or adjoint with adjoint-step times) of ``len(layer_times)`` steps on
    ``parts`` devices.  Level-l step k uses layer k c^l (and costs what that layer costs)."""
    n = len(layer_times)
    owner = _owner_table(n, parts)
    msg = send_recv(message_bytes, model) if parts > 1 else 0.0
    compute = comm = 0.0

    def phase(level: int, steps: list[int]) -> float:
        per_rank = [0.0] * parts
        stride = cfactor**level
        for k in steps:
            per_rank[owner[k * stride]] += layer_times[k * stride]
        return max(per_rank)

    def cycle(level: int, relaxed: bool) -> None:
        nonlocal compute, comm
        n_level = n // cfactor**level
        f_steps = [k for k in range(n_level) if k % cfactor != cfactor - 1]
        c_steps = [k for k in range(n_level) if k % cfactor == cfactor - 1]
        if not relaxed:
            compute += phase(level, f_steps)
            comm += msg
        if relaxation == "FCF":
            compute += phase(level, c_steps) + phase(level, f_steps)
            comm += msg
        compute += phase(level, c_steps)  # residual at the C-points
        if level == 0:
            comm += allreduce(8, parts, model) if parts > 1 else 0.0
        coarse = list(range(n_level // cfactor))
        compute += phase(level + 1, coarse)  # Phi_H for the FAS right-hand side
        if level + 1 == levels - 1:  # coarsest: sequential over every rank
            stride = cfactor ** (level + 1)
            compute += sum(layer_times[k * stride] for k in coarse)
            comm += (parts - 1) * msg
        else:
            cycle(level + 1, relaxed=False)
        compute += phase(level, f_steps)  # closing F-relaxation
        comm += msg

    if levels == 1:
        return PassCost(sum(layer_times), (parts - 1) * msg)
    for i in range(cycles):
        cycle(0, relaxed=i > 0)
    return PassCost(compute, comm)


def multigrid_step_time(
    forward_times: Sequence[float],
    backward_times: Sequence[float],
    parts: int,
    cfactor: int,
    levels: int,
    forward_cycles: int,
    backward_cycles: int,
    relaxation: str,
    message_bytes: float,
    model: AlphaBeta,
) -> dict[str, float]:
    """Forward solve + adjoint solve + the parameter-gradient pass (one batched vjp over the local layers).

    An adjoint step re-evaluates the layer and back-propagates through it: forward + backward time.
    """
    fwd = multigrid_pass_time(forward_times, parts, cfactor, levels, forward_cycles, relaxation, message_bytes, model)
    adjoint_times = [f + b for f, b in zip(forward_times, backward_times)]
    bwd = multigrid_pass_time(adjoint_times, parts, cfactor, levels, backward_cycles, relaxation, message_bytes, model)
    grads = max(stage_times(adjoint_times, parts))
    return {
        "forward": fwd.total,
        "step": fwd.total + bwd.total + grads,
        "compute": fwd.compute + bwd.compute + grads,
        "communication": fwd.communication + bwd.communication,
    }


def partitioned_step_time(
    forward_times: Sequence[float], backward_times: Sequence[float], parts: int, message_bytes: float, model: AlphaBeta
) -> dict[str, float]:
    """The partitioned-model baseline: serial forward and backward through the ranks."""
    fwd = serial_pipeline_time(forward_times, parts, message_bytes, model)
    bwd = serial_pipeline_time(backward_times, parts, message_bytes, model)
    comm = 2 * (parts - 1) * send_recv(message_bytes, model)
    return {"forward": fwd, "step": fwd + bwd, "compute": fwd + bwd - comm, "communication": comm}
