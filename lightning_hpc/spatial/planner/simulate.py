"""Time per mini-batch of an assignment (Dryden et al., IPDPS 2019, section V-B).

Local costs and shuffles add up; the gradient allreduces are overlapped greedily with the rest of
backpropagation, one allreduce at a time (per layer as in the paper, one fused allreduce, or DDP's buckets); the
optimizer step is measured once and added.  Plain torch: no Lightning import.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_hpc.perfmodel import time_callable
from lightning_hpc.spatial.planner.cost import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, CostModel, _fresh
from lightning_hpc.spatial.planner.graph import Distribution, Stage


def _simulate(stages: list[Stage], assignment: dict[str, Distribution], costs: CostModel) -> dict[str, float]:
    """Time per mini-batch of an assignment (section V-B): local costs and shuffles add up; the gradient
    allreduces start when their layer's backward is done (or their bucket is full) and run one at a time,
    overlapping what is left.  With a loaded-sync calibration only the measured fraction of an allreduce that
    computation can hide (:attr:`SyncCost.overlap_fraction`) is hidden: the rest takes the cores from backward."""
    chosen = [(s, costs.stage_cost(s, assignment[s.name])) for s in stages]
    compute = sum(c.compute for _, c in chosen)
    halo = sum(c.halo + c.copies + c.bn_stats for _, c in chosen)
    sync_time = sum(c.sync_wait for _, c in chosen)
    sync_points = sum(c.sync_points for _, c in chosen)
    moves = [(s.edge_bytes.get(p, 0), assignment[p], assignment[s.name]) for s in stages for p in s.parents]
    shuffle = sum(costs.shuffle(*m) for m in moves)
    sync_points += 2 * sum(1 for nbytes, a, b in moves if nbytes and a != b)
    # Walk backward in reverse layer order: clock advances by each layer's backward; its allreduce queues.
    fwd_total = sum(c.local - sum(t for _, t in c.backward) for _, c in chosen)
    clock = fwd_total + shuffle / 2
    events: list[tuple[float, float]] = []
    bucket, bucket_cap = 0, DDP_FIRST_BUCKET_BYTES
    for s, c in reversed(chosen):
        ar = dict(c.allreduces)
        nbytes_of = {layer.name: layer.param_bytes for layer in s.layers}
        for name, bwd in reversed(c.backward):
            clock += bwd
            if costs.gradient_reduction == "per-layer" and name in ar:
                events.append((clock, ar[name]))
            elif costs.gradient_reduction == "bucketed" and nbytes_of.get(name):
                bucket += nbytes_of[name]
                if bucket >= bucket_cap:
                    events.append((clock, costs.gradient_allreduce(bucket)))
                    bucket, bucket_cap = 0, DDP_BUCKET_BYTES
    clock += shuffle / 2
    if costs.gradient_reduction == "bucketed" and bucket:
        events.append((clock, costs.gradient_allreduce(bucket)))
    if costs.gradient_reduction == "single":
        nbytes = sum(layer.param_bytes for s in stages for layer in s.layers)
        events = [(clock, costs.gradient_allreduce(nbytes))] if nbytes else []
    busy_until = 0.0
    for ready, t in events:
        busy_until = max(busy_until, ready) + t
    total_ar = sum(t for _, t in events)
    sync_points += len(events) if costs.p > 1 else 0
    hideable = 1.0 if costs.sync is None else costs.sync.overlap_fraction
    end = max(clock + (1.0 - hideable) * total_ar, busy_until)
    return {
        "compute": compute,
        "halo": halo,
        "shuffle": shuffle,
        "allreduce": total_ar,
        "exposed_allreduce": max(end - clock, 0.0),
        "end": end,
        "sync_time": sync_time,
        "sync_points": sync_points,
    }


def _optimizer_time(model: nn.Module, optimizer: str = "sgd") -> float:
    params = [torch.nn.Parameter(torch.randn_like(p, device="cpu")) for p in _fresh(model).parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9) if optimizer == "sgd" else torch.optim.AdamW(params, lr=1e-3)
    return time_callable(opt.step, warmup=1, repeats=3)
