"""Layer-parallel runs on 2 and 4 gloo processes against one process (float64, same cycles).

Each rank holds only its own residual steps (parameters, gradients, optimizer state): the comparisons gather
the steps over the ranks (``full_model_state_dict``) and the per-rank parameter count is asserted.
"""

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mg_helpers import make_net, multigrid_run, options, rel, serial_reference

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.multigrid import MultigridODEBlock, PartitionedODEBlock, full_model_state_dict
from lightning_hpc.multigrid.parallel import average_gradients, layer_data_groups

CONFIGS = [(3, 2, "FCF", 2), (2, 4, "F", 3)]
TRAIN_STEPS = 3


def _numpy(d):
    return {k: v.detach().numpy().copy() for k, v in d.items()}


def _local_grads(module):
    """This rank's gradients by the serial model's names (each rank holds only its own steps)."""
    return {n: p.grad.numpy().copy() for n, p in module.named_parameters() if p.grad is not None}


def _layer_parallel_worker(rank, world_size):
    results = []
    for levels, cfactor, relaxation, cycles in CONFIGS:
        for threshold in (0, 1000):  # coarsest level propagated rank after rank / gathered onto every rank
            net, x = make_net(32)
            opts = dataclasses.replace(options(levels, cfactor, cycles, relaxation), coarse_gather_threshold=threshold)
            out, gx, _, block = multigrid_run(net, x, opts, group=dist.group.WORLD)
            owned = sorted({int(n.split(".")[0]) for n, _ in block.named_parameters()})
            results.append(
                dict(
                    out=out.numpy(),
                    gx=gx.numpy(),
                    steps=_local_grads(block),
                    fwd=block.forward_history,
                    bwd=block.backward_history,
                    owned=owned,
                )
            )
    # partitioned-model baseline: serial evaluation over the same partition
    net, x = make_net(32)
    net.steps = PartitionedODEBlock(net.steps, group=dist.group.WORLD)
    xx = x.clone().requires_grad_()
    logits = net(xx)
    (logits * torch.linspace(-1, 1, logits.numel(), dtype=logits.dtype).view_as(logits)).sum().backward()
    results.append(
        dict(
            out=logits.detach().numpy(),
            gx=xx.grad.numpy(),
            steps=_local_grads(net.steps),
            numel=sum(p.numel() for p in net.steps.parameters()),
        )
    )
    return results


def train_steps(net, x, steps=TRAIN_STEPS):
    """SGD with momentum (optimizer state per parameter) on a fixed batch; the optimizer sees only the
    parameters this rank holds."""
    y = torch.arange(x.shape[0]) % 10
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return opt


def _training_worker(rank, world_size, ckpt_path):
    net, x = make_net(32)
    serial_state = copy.deepcopy(net.state_dict())
    net.steps = MultigridODEBlock(net.steps, options(3, 2, 2, "FCF"), group=dist.group.WORLD)
    opt = train_steps(net, x)
    full = full_model_state_dict(net)  # every rank gets the full model
    to_zero = full_model_state_dict(net, dst=0)  # only rank 0 does
    if rank == 0:
        torch.save(to_zero, ckpt_path)
    # loading a full (serial) state dict into a partitioned model keeps this rank's steps
    other, _ = make_net(32, seed=7)
    other.steps = MultigridODEBlock(other.steps, options(3, 2, 2, "FCF"), group=dist.group.WORLD)
    other.load_state_dict(serial_state, strict=True)
    loaded_ok = all(torch.equal(p, serial_state[n]) for n, p in other.named_parameters())
    return dict(
        state=_numpy(full),
        keys=list(full),
        dst_keys=len(to_zero),
        trunk_numel=sum(p.numel() for p in net.steps.parameters()),
        optimizer_numel=sum(p.numel() for g in opt.param_groups for p in g["params"]),
        momentum_numel=sum(s["momentum_buffer"].numel() for s in opt.state.values()),
        loaded_ok=loaded_ok,
    )


def _worker(rank, world_size, ckpt_path):
    out = {
        "layer_parallel": _layer_parallel_worker(rank, world_size),
        "training": _training_worker(rank, world_size, ckpt_path),
    }
    if world_size == 4:  # one spawn for both 4-process checks (process start-up dominates here)
        out["mesh"] = _mesh_worker(rank, world_size)
    return out


def _merge(parts):
    out = {}
    for p in parts:
        assert not set(p) & set(out), "two ranks hold the same step"
        out.update(p)
    return out


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: slow tier
def test_layer_parallel_equals_one_process(world_size, tmp_path):
    ckpt = str(tmp_path / "mg_full.pt")
    results = run_in_processes(_worker, world_size, ckpt, timeout_s=600, collective_timeout_s=300)
    runs = [r["layer_parallel"] for r in results]
    net, x = make_net(32)
    n_trunk = sum(p.numel() for p in net.steps.parameters())
    for k, (levels, cfactor, relaxation, cycles) in enumerate(CONFIGS):
        out, gx, grads, block = multigrid_run(net, x, options(levels, cfactor, cycles, relaxation))
        for j in range(2):  # parallel / gathered coarsest solve
            merged = _merge([res[2 * k + j]["steps"] for res in runs])
            assert set(merged) == {n for n, _ in block.named_parameters()}
            for name, g in merged.items():
                assert rel(torch.from_numpy(g), block.get_parameter(name).grad) < 1e-10, name
            for rank, res in enumerate(runs):
                r = res[2 * k + j]
                assert rel(torch.from_numpy(r["out"]), out) < 1e-10
                assert rel(torch.from_numpy(r["gx"]), gx) < 1e-10
                assert r["fwd"] == pytest.approx(block.forward_history, rel=1e-10)
                assert r["bwd"] == pytest.approx(block.backward_history, rel=1e-10)
                per_rank = 32 // world_size  # contiguous ownership: rank r holds steps [r N/P, (r+1) N/P) only
                assert r["owned"] == list(range(rank * per_rank, (rank + 1) * per_rank))
        for rank, res in enumerate(runs):  # gathered coarsest solve = rank-after-rank coarsest solve
            a, b = res[2 * k], res[2 * k + 1]
            assert (a["out"] == b["out"]).all() and (a["gx"] == b["gx"]).all(), "gathered coarse solve differs"
            assert all((a["steps"][n] == b["steps"][n]).all() for n in a["steps"])
            assert a["fwd"] == b["fwd"] and a["bwd"] == b["bwd"]
    ref = serial_reference(net, x)
    pm_grads = _merge([res[-1]["steps"] for res in runs])
    for res in runs:
        pm = res[-1]
        assert pm["numel"] == n_trunk // world_size
        assert rel(torch.from_numpy(pm["out"]), ref[0]) < 1e-12 and rel(torch.from_numpy(pm["gx"]), ref[1]) < 1e-12
    for name, g in pm_grads.items():
        assert rel(torch.from_numpy(g), ref[2]["steps." + name]) < 1e-12
    check_training([r["training"] for r in results], world_size, ckpt)
    if world_size == 4:
        check_mesh([r["mesh"] for r in results])


def check_training(runs, world_size, ckpt):
    """Parameters after several optimizer steps equal one process; memory is 1/P; the gathered checkpoint
    loads into a plain serial model and into a one-process multigrid model."""
    net, x = make_net(32)
    plain_keys = list(net.state_dict())
    n_trunk = sum(p.numel() for p in net.steps.parameters())
    n_rest = sum(p.numel() for p in net.parameters()) - n_trunk
    one = copy.deepcopy(net)
    one.steps = MultigridODEBlock(one.steps, options(3, 2, 2, "FCF"))
    train_steps(one, x)
    reference = one.state_dict()
    for run in runs:
        assert run["trunk_numel"] == n_trunk // world_size  # each rank holds 1/P of the residual steps
        assert run["optimizer_numel"] == n_rest + n_trunk // world_size == run["momentum_numel"]
        assert run["keys"] == plain_keys  # gathered: the serial model's keys, in its order
        for key, value in reference.items():
            assert rel(torch.from_numpy(run["state"][key]), value) < 1e-10, key
        assert run["loaded_ok"]
    assert runs[0]["dst_keys"] == len(plain_keys) and runs[-1]["dst_keys"] < len(plain_keys)
    # checkpoint round trip: P ranks -> one process (plain serial model, and a one-process multigrid model)
    state = torch.load(ckpt)
    plain, _ = make_net(32, seed=3)
    plain.load_state_dict(state, strict=True)
    mg, _ = make_net(32, seed=4)
    mg.steps = MultigridODEBlock(mg.steps, options(3, 2, 2, "FCF"))
    mg.load_state_dict(state, strict=True)
    for key, value in reference.items():
        assert rel(plain.state_dict()[key], value) < 1e-10, key
    with torch.no_grad():
        assert rel(mg(x), one(x)) < 1e-10  # the same multigrid network (2 cycles) on one process


def _mesh_worker(rank, world_size):
    """2 (data) x 2 (layer): each data row gets half of the batch; gradients averaged over the data groups;
    then optimizer steps on the local parameters."""
    data_group, layer_group, d, _ = layer_data_groups(2)
    net, x = make_net(32)
    net.steps = MultigridODEBlock(net.steps, options(3, 2, 2, "FCF"), group=layer_group)
    xs = x[d * 3 : (d + 1) * 3]
    logits = net(xs)
    w = torch.linspace(-1, 1, 10, dtype=torch.float64).view(1, 10)
    (logits * w).sum(1).mean().backward()
    average_gradients(list(net.parameters()), data_group)
    grads = _local_grads(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    y = torch.arange(6)[d * 3 : (d + 1) * 3]
    for _ in range(TRAIN_STEPS):
        opt.step()
        opt.zero_grad()
        F.cross_entropy(net(xs), y).backward()
        average_gradients(list(net.parameters()), data_group)
    opt.step()
    return dict(grads=grads, state=_numpy(full_model_state_dict(net)))


def check_mesh(runs):
    """2 x 2 data x layer mesh, half batch per data row, against one process on the full batch."""
    net, x = make_net(32)
    net = copy.deepcopy(net)
    net.steps = MultigridODEBlock(net.steps, options(3, 2, 2, "FCF"))
    (net(x) * torch.linspace(-1, 1, 10, dtype=torch.float64).view(1, 10)).sum(1).mean().backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    merged = [
        _merge([runs[2 * d]["grads"], {k: v for k, v in runs[2 * d + 1]["grads"].items() if k.startswith("steps.")}])
        for d in range(2)
    ]
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    y = torch.arange(6)
    for _ in range(TRAIN_STEPS):
        opt.step()
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
    opt.step()
    for m in merged:
        for name, g in grads.items():
            assert rel(torch.from_numpy(m[name]), g) < 1e-10, name
    for res in runs:
        for key, value in net.state_dict().items():
            assert rel(torch.from_numpy(res["state"][key]), value) < 1e-10, key


def test_coarse_gather_threshold_selects_the_solver():
    """The gathered solve is used exactly when the coarsest level (over all ranks) is within the threshold."""
    from types import SimpleNamespace

    from lightning_hpc.multigrid.coarse import GatheredCoarseSolve, coarse_solver

    prop = SimpleNamespace(hierarchy=SimpleNamespace(levels=3, sizes=[16, 8, 4]))  # 4 coarsest steps per rank
    two, one = SimpleNamespace(size=2), SimpleNamespace(size=1)
    assert isinstance(coarse_solver(prop, two, 8), GatheredCoarseSolve)
    assert not isinstance(coarse_solver(prop, two, 7), GatheredCoarseSolve)
    assert not isinstance(coarse_solver(prop, two, 0), GatheredCoarseSolve)
    assert not isinstance(coarse_solver(prop, one, 100), GatheredCoarseSolve)  # one rank: nothing to gather
