"""A layer-sharded trunk's full state (model and optimizer, gathered by the shared full-state gather) saved on 2
layer ranks is the serial model's: it loads into one process (the plain model and optimizer, strict) and onto 4
layer ranks, whose gathered state is the same again."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.models.ode_resnet import ode_resnet
from lightning_hpc.multigrid.checkpoint import full_optimizer_state, local_optimizer_state
from lightning_hpc.multigrid.sharded import LayerShardedTrunk, full_model_state_dict

NUM_STEPS = 8


def _model(seed: int, sharded: bool) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = ode_resnet(num_steps=NUM_STEPS, width=4).double()
    if sharded:
        model.steps = LayerShardedTrunk(model.steps, dist.group.WORLD, cfactor=2, levels=2)
    return model


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, count: int) -> None:
    """``count`` optimizer steps with gradients that depend only on the parameter's (serial) name."""
    for step in range(count):
        for name, p in model.named_parameters():
            seed = sum(ord(c) * (i + 1) for i, c in enumerate(name)) + 7919 * step
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed), dtype=p.dtype)
        opt.step()


def _save(rank: int, world_size: int, path: str) -> None:
    model = _model(0, sharded=True)
    opt = _optimizer(model)
    _steps(model, opt, 2)
    state = {"model": full_model_state_dict(model, dst=0), "optimizer": full_optimizer_state(opt, model, dst=0)}
    if rank == 0:
        torch.save(state, path)
    dist.barrier()


def _load(rank: int, world_size: int, path: str) -> dict:
    saved = torch.load(path, weights_only=False)
    model = _model(1, sharded=True)  # another initialisation: everything must come from the file
    opt = _optimizer(model)
    _steps(model, opt, 1)  # state of its own, to be replaced
    model.load_state_dict(saved["model"])
    opt.load_state_dict(local_optimizer_state(saved["optimizer"], opt, model))
    local_steps = len(model.steps.local_blocks)  # len() is the whole trunk's, as on one process
    state = {"model": full_model_state_dict(model, dst=0), "optimizer": full_optimizer_state(opt, model, dst=0)}
    return {"local_steps": local_steps, **(state if rank == 0 else {})}


def _assert_equal(got, want, where: str = "") -> None:
    if isinstance(want, dict):
        assert sorted(got, key=str) == sorted(want, key=str), where
        for key in want:
            _assert_equal(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_equal(a, b, f"{where}[{i}]")
    elif torch.is_tensor(want):
        assert torch.equal(got, want), where
    else:
        assert got == want, where


def test_saved_on_2_layer_ranks_loads_on_1_and_4(tmp_path):
    path = str(tmp_path / "trunk.pt")
    run_in_processes(_save, 2, path)
    saved = torch.load(path, weights_only=False)
    # the serial model trained the same way writes the same checkpoint, and loads it strictly
    serial = _model(0, sharded=False)
    serial_opt = _optimizer(serial)
    _steps(serial, serial_opt, 2)
    _assert_equal(dict(saved["model"]), dict(serial.state_dict()), "model")
    _assert_equal(saved["optimizer"], serial_opt.state_dict(), "optimizer")
    plain = _model(1, sharded=False)
    plain_opt = _optimizer(plain)
    plain.load_state_dict(saved["model"], strict=True)
    plain_opt.load_state_dict(saved["optimizer"])
    _assert_equal(plain_opt.state_dict(), serial_opt.state_dict(), "loaded into one process")
    # 4 layer ranks hold 2 steps each and gather the same checkpoint back
    back = run_in_processes(_load, 4, path)
    assert [b["local_steps"] for b in back] == [NUM_STEPS // 4] * 4
    _assert_equal(dict(back[0]["model"]), dict(saved["model"]), "model on 4")
    _assert_equal(back[0]["optimizer"], saved["optimizer"], "optimizer on 4")
