"""``overlap_factor_allreduce``: the factor all-reduce launched from the backward hooks (KAISA, SC21) gives the
factors, preconditioned gradients and parameters of the synchronous path and of one process on the global batch
(2 and 4 gloo processes; float64), with gradient accumulation, a layer called twice per forward pass, layers
unused on some steps or on some ranks, KAISA fractions and storage dtypes; and it really launches during the
backward pass."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from kfac_checks import average_gradients_like_ddp
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.distributed.comm import TorchDistributedCommunicator
from lightning_hpc.kfac import KFACPreconditioner
from lightning_hpc.kfac.callback import KFAC
from lightning_hpc.kfac.overlap import plan_factor_buckets
from tests.fit_harness import fit

STEPS = 4
GLOBAL_BATCH = 16
DTYPE = torch.float64
TOL = 1e-12


class Net(nn.Module):
    """Conv -> Linear -> Linear (``shared``: applied twice) -> a head; ``skip`` says when ``mid`` is unused."""

    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 5 * 5, 10)
        self.mid = nn.Linear(10, 10)
        self.head = nn.Linear(10, 5)
        self.shared = shared
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(torch.relu(self.conv(x)).flatten(1)))
        if not self.skip:
            h = torch.tanh(self.mid(h))
            if self.shared:  # the same weights at a second position (KFC's weight sharing)
                h = torch.tanh(self.mid(h))
        return self.head(h)


def _data(step: int, dtype: torch.dtype = DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, 2, 5, 5, generator=g, dtype=dtype)
    return x, torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)


class EventLog(TorchDistributedCommunicator):
    """Records every factor all-reduce (op ``mean``; the "hooks fired" flags and the status are sums) among the
    test's backward-pass events, and counts its bytes."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.factor_bytes = 0

    def allreduce(self, tensor, op="mean", group=None, async_op=False):
        if op == "mean":
            self.events.append(f"factor allreduce async={async_op}")
            self.factor_bytes += tensor.numel() * tensor.element_size()
        return super().allreduce(tensor, op=op, group=group, async_op=async_op)


def _train(rank: int, world_size: int, overlap: bool, model_kind: str = "plain", micro: int = 1,
           no_sync: bool = True, skip: str = "", loss_scale: float = 1.0, float32: bool = False,
           **options) -> dict:  # fmt: skip
    """``STEPS`` K-FAC steps on this rank's share of each global batch, split into ``micro`` micro-batches.
    ``skip``: ``"step"`` leaves ``mid`` unused on every rank at steps 1 and 2, ``"rank"`` on rank 1 only.
    ``loss_scale``: the loss is multiplied by it, as a grad scaler does, and the step told so. ``float32``: a
    float32 model with the default factor and decomposition dtypes (float64 otherwise)."""
    dtype = torch.float32 if float32 else DTYPE
    model = Net(shared=model_kind == "shared").to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    events: list[str] = []
    comm = EventLog(events)
    wide = {} if float32 else {"factor_dtype": "float64", "decomposition_dtype": "float64"}
    kw = {**wide, "bucket_cap_mb": 1e-4, **options}
    pre = KFACPreconditioner(
        model, optimizer=opt, factor_update_freq=1, inv_update_freq=2, damping=0.05, kl_clip=0.01,
        communicator=comm, overlap_factor_allreduce=overlap, announce=False, **kw,
    )  # fmt: skip
    per_rank = GLOBAL_BATCH // world_size
    during_backward = []
    blocking = 0
    caught: list[str] = []
    for step in range(STEPS):
        x, y = _data(step, dtype)
        x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        model.skip = (skip == "step" and step in (1, 2)) or (skip == "rank" and rank == 1 and step >= 1)
        opt.zero_grad()
        n = per_rank // micro
        for k in range(micro):
            xs = x[k * n : (k + 1) * n].clone().requires_grad_(True)
            # the very last event of the backward pass: the gradient of the network's input
            xs.register_hook(lambda g: events.append("input grad"))
            ctx = pre.no_sync() if (no_sync and k < micro - 1) else _nothing()
            with ctx, warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                (F.cross_entropy(model(xs), y[k * n : (k + 1) * n]) * (loss_scale / micro)).backward()
            caught += [str(m.message) for m in w]
        events.append("backward returned")
        for p in model.parameters():  # a layer unused on some rank: a zero gradient, as DDP gives it
            if p.grad is None and skip == "rank":
                p.grad = torch.zeros_like(p)
        for p in model.parameters():  # unscale_
            if p.grad is not None:
                p.grad /= loss_scale
        average_gradients_like_ddp(model)  # the strategy's gradient allreduce
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            pre.step(grad_scale=loss_scale)
        caught += [str(m.message) for m in w]
        during_backward.append(_launches_before(events, "input grad"))
        blocking += sum(e == "factor allreduce async=False" for e in events)
        events.clear()
        opt.step()
    # numpy, not tensors: tensors cross the result queue through shared memory that dies with the rank
    return {
        "params": [p.detach().numpy().copy() for p in model.parameters()],
        "precond": [p.grad.numpy().copy() for p in model.parameters()],
        # float64 copies: numpy has no bfloat16 (widening is exact)
        "factors": {n: {k: v.double().numpy().copy() for k, v in f.items()} for n, f in pre.factors.items()},
        "during_backward": during_backward,
        "blocking": blocking,
        "factor_bytes": comm.factor_bytes,
        "buckets": len(pre.overlap.buckets) if pre.overlap is not None else 0,
        "launched_in_backward": pre.overlap.launched_in_backward if pre.overlap is not None else 0,
        "warnings": caught,
    }


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _launches_before(events: list[str], mark: str) -> int:
    """Factor all-reduces launched before the first ``mark`` of the step's last backward pass."""
    last = max((i for i, e in enumerate(events) if e == mark), default=len(events))
    return sum(1 for e in events[:last] if e.startswith("factor allreduce"))


def _close(got: dict, want: dict, what: str, tol: float = TOL) -> None:
    for key in ("params", "precond"):
        for a, b in zip(got[key], want[key]):
            torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=tol, atol=tol,
                                       msg=lambda m: f"{what}, {key}: {m}")  # fmt: skip
    assert set(got["factors"]) == set(want["factors"]), what
    for name, f in want["factors"].items():
        for k, v in f.items():
            torch.testing.assert_close(torch.from_numpy(got["factors"][name][k]), torch.from_numpy(v), rtol=tol,
                                       atol=tol, msg=lambda m: f"{what}, factor {name}.{k}: {m}")  # fmt: skip


CASES = {
    "plain": {},
    "accumulation": {"micro": 2},
    "shared": {"model_kind": "shared"},
    "unused on some steps": {"skip": "step"},
    "layer_wise": {"placement": "layer_wise"},
    "loss scale 2^10": {"loss_scale": 1024.0},
    "round_robin, fraction 1/2, inverse": {"placement": "round_robin", "grad_worker_fraction": 0.5,
                                           "compute_method": "inverse"},
    "full matrices, large buckets": {"symmetric_allreduce": False, "bucket_cap_mb": 25.0},
    "float32": {"float32": True},
    "bfloat16 factor storage": {"factor_dtype": "bfloat16"},
}  # fmt: skip


def _run_cases(rank: int, world_size: int) -> dict:
    return {(name, overlap): _train(rank, world_size, overlap, **kw) for name, kw in CASES.items()
            for overlap in (False, True)}  # fmt: skip


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: slow tier
def test_overlap_equals_the_synchronous_path_and_one_process(world_size):
    results = run_in_processes(_run_cases, world_size, timeout_s=600, collective_timeout_s=120)
    for name, kw in CASES.items():
        # one process on the global batch (no accumulation: micro-batches are exact, docs/kfac.md)
        single = {k: v for k, v in kw.items() if k not in ("micro", "grad_worker_fraction")}
        ref = _train(0, 1, False, **single)
        for rank, out in enumerate(results):
            sync, over = out[(name, False)], out[(name, True)]
            what = f"{world_size} ranks, {name}, rank {rank}"
            # 2 ranks: the same additions in the same order, bitwise; 4: gloo may sum in another order
            tol = 1e-5 if kw.get("float32") else TOL
            _close(over, sync, f"{what}: overlap vs synchronous", tol=0.0 if world_size == 2 else tol)
            if "factor_dtype" not in kw:  # bfloat16 storage rounds the ranks' mean and the one-process sum apart
                _close(over, ref, f"{what}: overlap vs one process", tol=tol)
            assert not any("overlap" in w or "launched" in w for w in over["warnings"]), over["warnings"]
            # every bucket launched during the backward pass of every step (all layers are used on every rank)
            if name != "unused on some steps":
                assert over["during_backward"] == [over["buckets"]] * STEPS, (what, over["during_backward"])
                assert over["launched_in_backward"] == over["buckets"] * STEPS
            else:  # 'mid' unused at steps 1 and 2: its bucket and the later ones wait for the step
                assert over["during_backward"][0] == over["during_backward"][3] == over["buckets"]
                assert over["during_backward"][1] < over["buckets"], over["during_backward"]
            assert over["buckets"] > 1 or name.startswith("full")
            # the synchronous path launches nothing before the backward pass ends
            assert sync["during_backward"] == [0] * STEPS
            # none of the launches waits for its collective, and the overlap sends the bytes the step would
            assert over["blocking"] == 0
            if name != "unused on some steps":  # there it sends zeros for the unused layer instead of leaving it out
                assert over["factor_bytes"] == sync["factor_bytes"] > 0, (over["factor_bytes"], sync["factor_bytes"])


def _run_rank_unused(rank: int, world_size: int) -> dict:
    return {overlap: _train(rank, world_size, overlap, skip="rank") for overlap in (False, True)}


def test_layer_unused_on_one_rank_is_skipped_alike_and_nothing_hangs():
    results = run_in_processes(_run_rank_unused, 2, timeout_s=300, collective_timeout_s=60)
    for rank, out in enumerate(results):
        _close(out[True], out[False], f"rank {rank}", tol=0.0)
        # 'mid' fired on rank 0 only from step 1 on: not updated after step 0, with the same warning
        assert any("'mid'" in w and "did not fire" in w for w in out[True]["warnings"]), out[True]["warnings"]
    # rank 0 launched mid's bucket in its backward pass, rank 1 at the step: the group's order still matched
    assert results[0][True]["during_backward"][1] > results[1][True]["during_backward"][1]


def _run_accumulation_without_no_sync(rank: int, world_size: int) -> dict:
    return {overlap: _train(rank, world_size, overlap, micro=2, no_sync=False) for overlap in (False, True)}


def test_accumulation_without_no_sync_keeps_every_micro_batch():
    results = run_in_processes(_run_accumulation_without_no_sync, 2, timeout_s=300, collective_timeout_s=60)
    ref = _train(0, 1, False)
    for rank, out in enumerate(results):
        _close(out[True], out[False], f"rank {rank}", tol=0.0)
        _close(out[True], ref, f"rank {rank} vs one process")
        assert sum("launched" in w for w in out[True]["warnings"]) == 1, out[True]["warnings"]


def _run_nonfinite(rank: int, world_size: int) -> dict:
    out = {}
    for overlap in (False, True):
        model = Net().to(DTYPE)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pre = KFACPreconditioner(model, optimizer=opt, factor_update_freq=1, inv_update_freq=1, damping=0.05,
                                 factor_dtype="float64", bucket_cap_mb=1e-4, overlap_factor_allreduce=overlap,
                                 announce=False)  # fmt: skip
        for step in range(3):
            x, y = _data(step)
            x, y = x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8]
            if step == 1 and rank == 1:
                x[0, 0, 0, 0] = float("nan")  # one rank's batch: every rank must drop the step
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            for p in model.parameters():
                p.grad = torch.nan_to_num(p.grad)  # the optimizer side is not under test
            average_gradients_like_ddp(model)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pre.step()
            if step == 0:
                after_first = {n: {k: v.clone() for k, v in f.items()} for n, f in pre.factors.items()}
            if step == 1:
                kept = all(torch.equal(pre.factors[n][k], f[k]) for n, f in after_first.items() for k in f)
        out[overlap] = (pre.dropped_statistics_steps, kept,
                        {n: {k: v.numpy().copy() for k, v in f.items()} for n, f in pre.factors.items()})  # fmt: skip
    return out


def test_non_finite_statistics_are_dropped_with_overlap():
    for rank, out in enumerate(run_in_processes(_run_nonfinite, 2, timeout_s=300, collective_timeout_s=60)):
        for overlap in (False, True):
            dropped, kept, _ = out[overlap]
            assert dropped == 1 and kept, (rank, overlap, dropped, kept)
        for name, f in out[False][2].items():
            for k, v in f.items():
                assert (out[True][2][name][k] == v).all()


class SyncOnly(TorchDistributedCommunicator):
    async_collectives = False


def _run_sync_only(rank: int, world_size: int) -> bool:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pre = KFACPreconditioner(Net(), communicator=SyncOnly(), overlap_factor_allreduce=True, announce=False)
    return pre.overlap is None and any("synchronously" in str(m.message) for m in w)


def test_a_communicator_without_async_collectives_falls_back_with_a_warning():
    assert all(run_in_processes(_run_sync_only, 2, timeout_s=120, collective_timeout_s=60))


def test_buckets_are_fixed_by_shapes_in_reverse_order():
    pre = KFACPreconditioner(Net(), announce=False)
    handlers = pre.handlers  # conv (37 x 4), fc (101 x 10), mid (11 x 10), head (11 x 5)
    tri = [sum(n * (n + 1) // 2 for n in (h.a_dim, h.g_dim)) for h in handlers]
    one_each = plan_factor_buckets(handlers, 1, symmetric=True)
    assert [b.layers for b in one_each] == [[3], [2], [1], [0]]
    cap = (tri[3] + tri[2]) * 4  # float32: head and mid fit together, fc does not fit beside them
    plan = plan_factor_buckets(handlers, cap, symmetric=True)
    assert [b.layers for b in plan] == [[3, 2], [1], [0]]
    assert [b.numel for b in plan] == [tri[3] + tri[2], tri[1], tri[0]]
    wide = KFACPreconditioner(Net().double(), announce=False).handlers
    assert all(b.dtype == torch.float64 for b in plan_factor_buckets(wide, cap, symmetric=True))
    assert [b.layers for b in plan_factor_buckets(wide, cap, symmetric=True)] == [[3], [2], [1], [0]]


def _run_spatial(rank: int, world_size: int) -> dict:
    """A spatially tiled network (each sample split over the 2 ranks): its tiles' partial factors are summed in
    the same buckets (``partition_size`` scaling at launch)."""
    from lightning_hpc.spatial.dispatch import split_tensor
    from lightning_hpc.spatial.dispatch.kfac_contract import declare_tiled_convolutions
    from lightning_hpc.spatial.layout.gradients import reduce_model_gradients
    from lightning_hpc.spatial.layout.tiling import create_hybrid_layout, tile_slices

    layout = create_hybrid_layout((1, 2))
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(4, 3, 9, 10, generator=g), torch.randint(0, 5, (4,), generator=g)
    rs, cs = tile_slices((9, 10), layout.grid.parts, layout.grid.index)
    out = {}
    for overlap in (False, True):
        torch.manual_seed(6)
        net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, stride=2, padding=1),
                            nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5))  # fmt: skip
        model = net  # unchanged: its ops on the split input run on tiles (the op dispatch)
        layers = declare_tiled_convolutions(model, layout.grid.size, layout.grid)
        layout.grid.tile_params.clear()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        pre = KFACPreconditioner(model, optimizer=opt, factor_update_freq=1, inv_update_freq=2, damping=0.01,
                                 kl_clip=0.01, bucket_cap_mb=1e-4, overlap_factor_allreduce=overlap,
                                 announce=False, tiled_layers=layers)  # fmt: skip
        tiled = [h.partition_size for h in pre.handlers]
        xt = split_tensor(x[..., rs, cs], layout.grid, x.shape)
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(xt), y).backward()
            reduce_model_gradients(model, layout.num_sample_groups, layout.grid.tile_params)
            pre.step()
            opt.step()
        out[overlap] = {
            "params": [p.detach().numpy().copy() for p in model.parameters()],
            "precond": [p.grad.numpy().copy() for p in model.parameters()],
            "factors": {n: {k: v.numpy().copy() for k, v in f.items()} for n, f in pre.factors.items()},
            "tiled": tiled,
        }
    return out


def test_spatially_tiled_layers_sum_their_partial_factors_with_overlap():
    for rank, out in enumerate(run_in_processes(_run_spatial, 2, timeout_s=300, collective_timeout_s=60)):
        assert out[True]["tiled"] == [2, 2, 1]  # two tiled convolutions and the replicated head
        _close(out[True], out[False], f"rank {rank}", tol=0.0)


def _run_skipped_steps(rank: int, world_size: int) -> dict:
    """Step 1 is dropped, by the user (``stale``: gradients cleared without ``step()``) or by
    ``discard_statistics`` (what the callback does on an AMP overflow), while ``mid`` is unused on rank 1: rank 0
    launched more buckets in its backward pass than rank 1, and the next step must still pair every collective."""
    return {(drop, overlap): _skip_one_step(rank, drop, overlap) for drop in ("stale", "discard")
            for overlap in (False, True)}  # fmt: skip


def _skip_one_step(rank: int, drop: str, overlap: bool) -> dict:
    model = Net().to(DTYPE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = KFACPreconditioner(model, optimizer=opt, factor_update_freq=1, inv_update_freq=1, damping=0.05,
                             factor_dtype="float64", decomposition_dtype="float64", bucket_cap_mb=1e-4,
                             overlap_factor_allreduce=overlap, announce=False)  # fmt: skip
    caught: list[str] = []
    for step in range(5):
        x, y = _data(step)
        x, y = x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8]
        model.skip = rank == 1 and step == 1
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if step == 1:
            if drop == "discard":
                pre.discard_statistics()
            continue  # else the next forward pass finds the gradients cleared: statistics stale
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        average_gradients_like_ddp(model)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            pre.step()
        caught += [str(m.message) for m in w]
        opt.step()
    return {
        "params": [p.detach().numpy().copy() for p in model.parameters()],
        "precond": [p.grad.numpy().copy() for p in model.parameters()],
        "factors": {n: {k: v.numpy().copy() for k, v in f.items()} for n, f in pre.factors.items()},
        "steps": pre.steps,
        "warnings": caught,
    }


def test_dropped_steps_leave_no_collective_unpaired():
    for rank, out in enumerate(run_in_processes(_run_skipped_steps, 2, timeout_s=300, collective_timeout_s=60)):
        for drop in ("stale", "discard"):
            over, sync = out[(drop, True)], out[(drop, False)]
            assert over["steps"] == sync["steps"] == 4
            # nothing of a dropped step reaches the next one (it would show as statistics arriving after the launch)
            assert not any("launched" in w for w in over["warnings"]), (drop, over["warnings"])
            _close(over, sync, f"rank {rank}, {drop}", tol=0.0)


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net().to(DTYPE)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class _Marks(Callback):
    """``final_micro_batch`` as the backward pass of each batch sees it."""

    def __init__(self, kfac: KFAC) -> None:
        self.kfac, self.marks = kfac, []

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        assert self.kfac.preconditioner is not None
        self.marks.append(self.kfac.preconditioner.final_micro_batch)


def _ddp_accumulation_run(rank: int, world_size: int) -> dict:
    """DDP, 5 micro-batches per rank and epoch with ``accumulate_grad_batches=2`` (the last group is short)."""
    x, y = _data(0)
    data = DataLoader(TensorDataset(x[rank * 5 : (rank + 1) * 5], y[rank * 5 : (rank + 1) * 5]), batch_size=1)
    out = {}
    for overlap in (False, True):
        module = _Module()
        kfac = KFAC(factor_update_freq=1, inv_update_freq=2, damping=0.05, kl_clip=0.01, factor_dtype="float64",
                    decomposition_dtype="float64", bucket_cap_mb=1e-4, overlap_factor_allreduce=overlap)  # fmt: skip
        marks = _Marks(kfac)
        run = fit(module, data, devices=world_size, strategy="ddp", accumulate_grad_batches=2, max_epochs=2,
                  callbacks=[kfac, marks], use_distributed_sampler=False)
        pre = kfac.preconditioner
        assert pre is not None
        out[overlap] = {
            "params": [p.numpy() for p in run.params],
            "precond": [p.grad.numpy().copy() if p.grad is not None else None for p in module.parameters()],
            "factors": {n: {k: v.numpy().copy() for k, v in f.items()} for n, f in pre.factors.items()},
            "marks": marks.marks,
            "steps": pre.steps,
            "in_backward": pre.overlap.launched_in_backward if pre.overlap is not None else 0,
            "buckets": len(pre.overlap.buckets) if pre.overlap is not None else 0,
        }
    return out


def test_lightning_ddp_with_accumulation_marks_the_last_micro_batch():
    for rank, out in enumerate(run_in_processes(_ddp_accumulation_run, 2, timeout_s=600, collective_timeout_s=120)):
        over, sync = out[True], out[False]
        # 5 batches per epoch, accumulating 2: steps after batches 2, 4 and the short group's 5
        assert over["marks"] == [False, True, False, True, True] * 2, over["marks"]
        assert over["steps"] == sync["steps"] == 6
        # every step's buckets launched in its last backward pass
        assert over["in_backward"] == 6 * over["buckets"] > 0, (over["in_backward"], over["buckets"])
        over["precond"] = sync["precond"] = []  # Lightning clears the gradients after the step
        _close(over, sync, f"rank {rank}", tol=0.0)
