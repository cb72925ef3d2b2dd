"""Layer-parallel runs on 2 and 4 gloo processes against one process (float64, same cycles)."""

import copy

import pytest
import torch
import torch.distributed as dist

from mg_helpers import make_net, multigrid_run, options, rel, serial_reference
from lightning_hpc.distributed import run_in_processes
from lightning_hpc.strategies.multigrid import PartitionedODEBlock
from lightning_hpc.strategies.multigrid.parallel import average_gradients, layer_data_groups

CONFIGS = [(3, 2, "FCF", 2), (2, 4, "F", 3)]


def _full_grads(block, group):
    """Each rank holds its own steps' gradients: sum them over the layer group (others are None/zero)."""
    out = {}
    for name, p in block.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)
        out[name] = g.numpy()
    return out


def _layer_parallel_worker(rank, world_size):
    results = []
    for levels, cfactor, relaxation, cycles in CONFIGS:
        net, x = make_net(32)
        out, gx, grads, block = multigrid_run(net, x, options(levels, cfactor, cycles, relaxation), group=dist.group.WORLD)
        owned = sorted({int(n.split(".")[0]) for n, p in block.named_parameters() if p.grad is not None})
        results.append(
            dict(out=out.numpy(), gx=gx.numpy(), steps=_full_grads(block, None), fwd=block.forward_history, bwd=block.backward_history, owned=owned)
        )
    # partitioned-model baseline: serial evaluation over the same partition
    net, x = make_net(32)
    net.steps = PartitionedODEBlock(net.steps, group=dist.group.WORLD)
    xx = x.clone().requires_grad_()
    logits = net(xx)
    (logits * torch.linspace(-1, 1, logits.numel(), dtype=logits.dtype).view_as(logits)).sum().backward()
    results.append(dict(out=logits.detach().numpy(), gx=xx.grad.numpy(), steps=_full_grads(net.steps, None)))
    return results


def _worker(rank, world_size):
    out = {"layer_parallel": _layer_parallel_worker(rank, world_size)}
    if world_size == 4:  # one spawn for both 4-process checks (process start-up dominates here)
        out["mesh"] = _mesh_worker(rank, world_size)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_layer_parallel_equals_one_process(world_size):
    results = run_in_processes(_worker, world_size, timeout_s=600, collective_timeout_s=300)
    runs = [r["layer_parallel"] for r in results]
    net, x = make_net(32)
    for k, (levels, cfactor, relaxation, cycles) in enumerate(CONFIGS):
        out, gx, grads, block = multigrid_run(net, x, options(levels, cfactor, cycles, relaxation))
        for rank, res in enumerate(runs):
            r = res[k]
            assert rel(torch.from_numpy(r["out"]), out) < 1e-10
            assert rel(torch.from_numpy(r["gx"]), gx) < 1e-10
            for name, g in r["steps"].items():
                assert rel(torch.from_numpy(g), block.get_parameter(name).grad) < 1e-10, name
            assert r["fwd"] == pytest.approx(block.forward_history, rel=1e-10)
            assert r["bwd"] == pytest.approx(block.backward_history, rel=1e-10)
            per_rank = 32 // world_size  # contiguous ownership: rank r computes steps [r N/P, (r+1) N/P)
            assert r["owned"] == list(range(rank * per_rank, (rank + 1) * per_rank))
    ref = serial_reference(net, x)
    for res in runs:
        pm = res[-1]
        assert rel(torch.from_numpy(pm["out"]), ref[0]) < 1e-12 and rel(torch.from_numpy(pm["gx"]), ref[1]) < 1e-12
        for name, g in pm["steps"].items():
            assert rel(torch.from_numpy(g), ref[2]["steps." + name]) < 1e-12
    if world_size == 4:
        check_mesh([r["mesh"] for r in results])


def _mesh_worker(rank, world_size):
    """2 (data) x 2 (layer): each data row gets half of the batch; gradients averaged over the data groups."""
    from lightning_hpc.strategies.multigrid import MultigridODEBlock

    data_group, layer_group, d, _ = layer_data_groups(2)
    net, x = make_net(32)
    net.steps = MultigridODEBlock(net.steps, options(3, 2, 2, "FCF"), group=layer_group)
    xs = x[d * 3 : (d + 1) * 3]
    logits = net(xs)
    w = torch.linspace(-1, 1, 10, dtype=torch.float64).view(1, 10)
    (logits * w).sum(1).mean().backward()
    average_gradients(list(net.parameters()), data_group)
    grads = {}
    for name, p in net.named_parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        if name.startswith("steps."):
            dist.all_reduce(g, group=layer_group)  # collect the other layer rank's steps for the comparison
        grads[name] = g.numpy()
    return grads


def check_mesh(runs):
    """2 x 2 data x layer mesh, half batch per data row, against one process on the full batch."""
    net, x = make_net(32)
    from lightning_hpc.strategies.multigrid import MultigridODEBlock

    net = copy.deepcopy(net)
    net.steps = MultigridODEBlock(net.steps, options(3, 2, 2, "FCF"))
    (net(x) * torch.linspace(-1, 1, 10, dtype=torch.float64).view(1, 10)).sum(1).mean().backward()
    for res in runs:
        for name, p in net.named_parameters():
            assert rel(torch.from_numpy(res[name]), p.grad) < 1e-10, name
