"""Per-parameter gradient norms of a model whose residual trunk is split over a layer group.

Lightning's ``grad_norm(module, norm_type)`` logs one entry per ``module.named_parameters()`` and their total.
With the trunk split (sharded.py), a rank's ``named_parameters()`` names only its own steps, and a full reduction
of a step's parameter is the one of the tensor stacking that place of every rank's share (so sums over the
parameters cover every step once): the entries would name this rank's steps with values of several steps, and
the other ranks' steps would have none.  :func:`grad_norm` gives what one process's ``grad_norm`` gives: an entry
for every parameter of the whole model under its serial name (every step's own norm, gathered over the layer
group) and the total over them; on a model that is not split it is Lightning's.  Lightning's own ``grad_norm`` on
a split trunk is refused at its first step parameter (before the first optimizer step) naming this function
(``partitioned.refuse_per_parameter_stacked_norms``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_hpc.distributed.partitioned import local_block
from lightning_hpc.multigrid.sharded import LayerShardedTrunk

__all__ = ["grad_norm"]


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, torch.Tensor]:
    """The ``p``-norm of every parameter's gradient and their total, keyed as Lightning's
    ``lightning.pytorch.utilities.grad_norm`` keys them (``grad_{p}_norm{sep}{name}``, ``grad_{p}_norm_total``),
    with the entries of the whole model on every rank of a trunk split by ``MultigridStrategy``: each residual
    step's own norm under the step's serial name.  Collective over each split trunk's layer group (every rank
    calls it, as the strategy's ranks run the same hooks)."""
    p = float(norm_type)
    if p <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    trunks = {
        prefix: trunk for prefix, trunk in module.named_modules()
        if isinstance(trunk, LayerShardedTrunk) and trunk.chain.size > 1
    }
    norms: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for name, param in module.named_parameters():
        owner = next((t for t in trunks if name.startswith(f"{t}.") or not t), None)
        if owner is None:
            if param.grad is not None:
                norms[f"grad_{p}_norm{group_separator}{name}"] = param.grad.data.norm(p)
            continue
        if owner in done:
            continue
        done.add(owner)
        for whole_name, value in _trunk_norms(trunks[owner], p):
            norms[f"grad_{p}_norm{group_separator}{owner}{'.' if owner else ''}{whole_name}"] = value
    if norms:
        norms[f"grad_{p}_norm_total"] = torch.tensor(list(norms.values())).norm(p)
    return norms


def _trunk_norms(trunk: LayerShardedTrunk, p: float) -> list[tuple[str, torch.Tensor]]:
    """(name in the serial trunk, norm) of every step's parameters with a gradient, in step order: this rank's
    share's norms are gathered over the layer group (same parameters in every share: checked when the trunk was
    split), each rank's steps named from its first step's index."""
    local = list(trunk.named_parameters())
    if not local:
        return []
    device = local[0][1].device
    # row 0: the norms, row 1: which parameters have a gradient (Lightning leaves the others out)
    values = torch.zeros(2, len(local), dtype=torch.float64, device=device)
    for i, (_, q) in enumerate(local):
        if q.grad is not None:
            values[0, i] = local_block(q.grad).detach().norm(p).to(torch.float64)
            values[1, i] = 1.0
    shares = [torch.empty_like(values) for _ in range(trunk.chain.size)]
    dist.all_gather(shares, values, group=trunk.group)
    starts = [trunk.share(r).start for r in range(trunk.chain.size)]  # in the layer group's rank order
    dtype = local[0][1].dtype
    out: list[tuple[str, torch.Tensor]] = []
    for start, share in zip(starts, shares):
        for (name, _), value, has_grad in zip(local, share[0], share[1].tolist()):
            if not has_grad:
                continue
            step, rest = name.split(".", 1)
            index = trunk.step_names.index(step) - trunk.partition.start + start
            out.append((f"{trunk.step_names[index]}.{rest}", value.to(dtype)))
    return out

