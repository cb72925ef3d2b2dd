"""Lightning runs of MultigridStrategy for the spawned-process tests (module-level: picklable)."""

from __future__ import annotations

import torch

STEPS, BATCH, NUM_STEPS = 2, 8, 16
STRATEGY = dict(cfactor=4, levels=2, relaxation="F", forward_cycles=2, backward_cycles=2)


def data(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(steps * BATCH, 1, 8, 8, generator=g), torch.randint(0, 10, (steps * BATCH,), generator=g)


def train_and_save(rank: int, world_size: int, max_steps: int, save_path: str, resume_path: str | None = None) -> dict:
    """Train a 16-step ODE-ResNet with ``layer_parallel_size = world_size`` for ``max_steps`` optimizer steps
    (from ``resume_path`` if given) on fixed batches, save a checkpoint; report what the optimizer holds."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hpc import ImageClassifier, MultigridStrategy
    from lightning_hpc.models import ode_resnet
    from tests import fit_harness

    torch.manual_seed(0)
    module = ImageClassifier(
        ode_resnet(num_steps=NUM_STEPS, width=4), optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)
    )
    loader = DataLoader(TensorDataset(*data(max_steps)), batch_size=BATCH, shuffle=False)

    class Held(pl.Callback):
        """What this rank held at the end of training (before the model is handed back whole)."""

        sizes: dict = {}

        def on_train_end(self, trainer, pl_module) -> None:
            opt = trainer.optimizers[0]
            self.sizes = {
                "trunk_numel": sum(p.numel() for p in pl_module.model.steps.parameters()),
                "optimizer_numel": sum(p.numel() for g in opt.param_groups for p in g["params"]),
                "momentum_numel": sum(s["momentum_buffer"].numel() for s in opt.state.values()),
            }

    held = Held()
    trainer = fit_harness.trainer(
        devices=world_size,
        callbacks=[held],
        strategy=MultigridStrategy(layer_parallel_size=world_size, **STRATEGY),
        max_steps=max_steps,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, train_dataloaders=loader, ckpt_path=resume_path)
    trainer.save_checkpoint(save_path)  # after fit: the model and optimizer were handed back whole
    return held.sizes


# -- checkpoints: save with layer_parallel_size=2, resume on another layout ------------------------------------
EXACT = dict(cfactor=4, levels=2, relaxation="F", forward_cycles=4, backward_cycles=4)  # N/c cycles: exact solve
RESUME_BATCHES = 2  # optimizer steps per epoch


def make_optimizer(kind: str):
    """SGD with momentum (one param group), or AdamW with two param groups (decayed weights, undecayed biases)."""

    def build(params):
        params = list(params)
        if kind == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        weights, biases = [p for p in params if p.ndim > 1], [p for p in params if p.ndim <= 1]
        return torch.optim.AdamW(
            [{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1
        )

    return build


def state_by_name(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> dict[str, dict[str, object]]:
    """The optimizer's per-parameter state keyed by the parameter's name in the module (copies)."""
    names = {id(p): n for n, p in module.named_parameters()}
    return {
        names.get(id(p), f"<not in the module: {i}>"): {k: v.detach().clone() if torch.is_tensor(v) else v
                                                        for k, v in optimizer.state[p].items()}
        for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
        if p in optimizer.state
    }


def fit_resume(
    rank: int,
    world_size: int,
    layer_parallel_size: int | None,
    kind: str,
    max_epochs: int,
    save_dir: str | None = None,
    resume_path: str | None = None,
) -> dict:
    """Train the 16-step ODE-ResNet in float64 with an exact multigrid solve for ``max_epochs`` epochs of
    ``RESUME_BATCHES`` fixed batches (``layer_parallel_size=None``: a plain Trainer, no multigrid), from
    ``resume_path`` if given; with ``save_dir`` a checkpoint is written after every epoch.  Reports the local
    parameters at the end of training, and the optimizer state by parameter name after the restore and after epoch 0."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hpc import ImageClassifier, MultigridStrategy
    from lightning_hpc.models import ode_resnet
    from tests import fit_harness

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.start: dict | None = None
            self.epoch0: dict | None = None
            self.end: dict | None = None

        def on_train_start(self, trainer, pl_module) -> None:
            self.start = state_by_name(trainer.optimizers[0], pl_module)

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            if trainer.current_epoch == 0:
                self.epoch0 = state_by_name(trainer.optimizers[0], pl_module)

        def on_train_end(self, trainer, pl_module) -> None:  # before the model is handed back whole
            self.end = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    torch.manual_seed(0)
    # built in float64: Lightning loads a checkpoint's weights before "64-true" converts the module
    module = ImageClassifier(ode_resnet(num_steps=NUM_STEPS, width=4), optimizer=make_optimizer(kind)).double()
    loader = DataLoader(TensorDataset(*data(RESUME_BATCHES)), batch_size=BATCH, shuffle=False)
    record = Record()
    callbacks: list = [record]
    if save_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1))
    strategy = (
        "auto" if layer_parallel_size is None else MultigridStrategy(layer_parallel_size=layer_parallel_size, **EXACT)
    )
    trainer = fit_harness.trainer(
        devices=world_size, strategy=strategy, precision="64-true", max_epochs=max_epochs,
        enable_checkpointing=save_dir is not None, callbacks=callbacks, num_sanity_val_steps=0, limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, train_dataloaders=loader, ckpt_path=resume_path)
    return {
        "params": record.end,
        "start": record.start,
        "epoch0": record.epoch0,
        "global_step": trainer.global_step,
    }


def legacy_checkpoint(full_path: str, legacy_path: str, layer_parallel_size: int) -> None:
    """Rewrite a full checkpoint in the per-layer-rank optimizer format of earlier versions (one optimizer
    state dict per layer rank, each numbering its own parameters: opening, its steps, closing)."""
    from lightning_hpc.models import ode_resnet

    ckpt = torch.load(full_path, weights_only=False)
    serial = ["model." + n for n, _ in ode_resnet(num_steps=NUM_STEPS, width=4).named_parameters()]
    per_rank = NUM_STEPS // layer_parallel_size
    shards = []
    for r in range(layer_parallel_size):
        local = [
            i for i, n in enumerate(serial) if not n.startswith("model.steps.") or int(n.split(".")[2]) // per_rank == r
        ]
        out = []
        for full in ckpt["optimizer_states"]:
            assert len(full["param_groups"]) == 1, "one param group only"
            ids = [full["param_groups"][0]["params"][i] for i in local]
            state = {k: full["state"][i] for k, i in enumerate(ids) if i in full["state"]}
            out.append(
                {"state": state, "param_groups": [{**full["param_groups"][0], "params": list(range(len(local)))}]}
            )
        shards.append(out)
    ckpt["optimizer_states"] = [
        {
            "multigrid_layer_shards": [shards[r][o] for r in range(layer_parallel_size)],
            "layer_parallel_size": layer_parallel_size,
        }
        for o in range(len(ckpt["optimizer_states"]))
    ]
    torch.save(ckpt, legacy_path)


def save_then_resume(rank: int, world_size: int, kind: str, save_dir: str, plain_checkpoint: str) -> dict:
    """On 2 processes: the uninterrupted run (layer_parallel_size=2, 2 epochs, a checkpoint per epoch), then
    from its epoch-0 checkpoint (a) the resume with layer_parallel_size=2, (c) with layer_parallel_size=1 (data
    parallel, both ranks on the same batches), and for SGD (e) the resume from the same checkpoint rewritten in
    the per-layer-rank format of earlier versions (layer_parallel_size=2); (f) the resume of a plain one-process
    Trainer's checkpoint with layer_parallel_size=2."""
    import torch.distributed as dist

    out = {"full": fit_resume(rank, world_size, 2, kind, 2, save_dir)}
    first = f"{save_dir}/epoch=0.ckpt"
    out["lp2"] = fit_resume(rank, world_size, 2, kind, 2, None, first)
    out["lp1"] = fit_resume(rank, world_size, 1, kind, 2, None, first)
    if kind == "sgd":
        legacy = f"{save_dir}/legacy.ckpt"
        if rank == 0:
            legacy_checkpoint(first, legacy, 2)
        dist.barrier()
        out["legacy"] = fit_resume(rank, world_size, 2, kind, 2, None, legacy)
    out["from_plain"] = fit_resume(rank, world_size, 2, kind, 2, None, plain_checkpoint)
    return out


# -- the model handed back after a stage: the user's trunk, every step, on every rank -------------------------
def user_odenet() -> torch.nn.Module:
    """A LightningModule as users write one around an ODE-ResNet (float64, 16 residual steps)."""
    import lightning.pytorch as pl
    import torch.nn.functional as F

    from lightning_hpc.models import ode_resnet

    class UserODENet(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = ode_resnet(num_steps=NUM_STEPS, width=4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test_loss", F.cross_entropy(self(x), y), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    return UserODENet().double()


def serial_user_odenet(steps: int, with_optimizer: bool = False):
    """One process training ``user_odenet()`` on the same batches: its state dict (``with_optimizer``: and its
    optimizer's state by parameter name, :func:`state_by_name`)."""
    import torch.nn.functional as F

    model = user_odenet()
    opt = model.configure_optimizers()
    xs, ys = data(steps)
    for s in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(xs[s * BATCH : (s + 1) * BATCH].double()), ys[s * BATCH : (s + 1) * BATCH]).backward()
        opt.step()
    if with_optimizer:
        return model.state_dict(), state_by_name(opt, model)
    return model.state_dict()


def handed_back_odenet(rank: int, world_size: int, mode: str, steps: int, also_test: bool) -> dict:
    """``Trainer.fit`` (then ``Trainer.test`` when ``also_test``) of ``user_odenet()`` with the trunk split over
    ``world_size`` layer ranks (an exact solve for mode 'mg'); then, on this rank alone: the trunk's structure, a
    strict load of the module's state into a fresh instance, and (rank 0, after rank 1 has returned and with no
    process group left, so a collective raises) its forward."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hpc import MultigridStrategy
    from tests import fit_harness

    xs, ys = data(steps)
    loader = DataLoader(TensorDataset(xs.double(), ys), batch_size=BATCH, shuffle=False)
    module = user_odenet()
    trainer = fit_harness.trainer(
        devices=world_size, precision="64-true", max_steps=steps,
        strategy=MultigridStrategy(layer_parallel_size=world_size, mode=mode, **EXACT),
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
    )
    trainer.fit(module, train_dataloaders=loader)
    if also_test:
        trainer.test(module, dataloaders=loader, verbose=False)
    out: dict = {
        "trunk_type": type(module.model.steps).__name__,
        "steps": list(module.model.steps._modules),
        "state": {key: value.detach().clone() for key, value in module.state_dict().items()},
        "optimizer_shapes": [tuple(p.shape) for g in trainer.optimizers[0].param_groups for p in g["params"]],
    }
    # the optimizer fit rebound (and a later stage's hand-back followed): over the module's parameters, its state by
    # their names
    held = [id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]]
    out["optimizer_holds_module_parameters"] = held == [id(p) for p in module.parameters()]
    out["optimizer_state"] = state_by_name(trainer.optimizers[0], module)
    fresh = user_odenet()
    fresh.load_state_dict(module.state_dict(), strict=True)
    if rank != 0:
        return out  # rank 1 is done: whatever rank 0 does next, it does alone
    dist.destroy_process_group()  # no process group: a collective in the forward raises instead of waiting
    x = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.no_grad():
        out["logits"] = module(x)
        out["fresh_logits"] = fresh(x)
    return out


# -- LBFGS: the whole model's flat vectors on every rank -------------------------------------------------------
LBFGS_STEPS = 4  # two epochs of two batches


def lbfgs_odenet(line_search: str | None, steps_first: bool = False) -> torch.nn.Module:
    """``user_odenet()`` trained by ``torch.optim.LBFGS`` (3 iterations per step); ``steps_first``: over the
    trunk's parameters first (LBFGS keeps its state under its first parameter: then a residual step's)."""
    module = user_odenet()

    def params() -> list[torch.nn.Parameter]:
        trunk = list(module.model.steps.parameters())
        rest = [p for p in module.parameters() if all(p is not t for t in trunk)]
        return trunk + rest if steps_first else list(module.parameters())

    module.configure_optimizers = lambda: torch.optim.LBFGS(  # type: ignore[method-assign]
        params(), lr=0.5, max_iter=3, history_size=4, line_search_fn=line_search)
    return module


def serial_lbfgs_odenet(line_search: str | None, steps: int = LBFGS_STEPS,
                        steps_first: bool = False) -> tuple[dict, dict]:
    """One process training ``lbfgs_odenet`` on the same batches: its state dict and its optimizer's."""
    import torch.nn.functional as F

    from tests import lbfgs_reference

    model = lbfgs_odenet(line_search, steps_first)
    opt = model.configure_optimizers()
    xs, ys = data(2)
    batches = [(xs[s % 2 * BATCH : (s % 2 + 1) * BATCH].double(), ys[s % 2 * BATCH : (s % 2 + 1) * BATCH])
               for s in range(steps)]
    lbfgs_reference.train(model, opt, batches, F.cross_entropy)
    return model.state_dict(), opt.state_dict()


def multigrid_lbfgs(rank: int, world_size: int, line_search: str | None, ckpt_dir: str | None = None,
                    resume: str | None = None, steps_first: bool = False) -> dict:
    """``Trainer.fit`` of ``lbfgs_odenet`` with the trunk split over ``world_size`` layer ranks (mode 'pm'), two
    epochs of the same two batches; ``ckpt_dir``: a checkpoint after the first epoch (written while the trunk is
    split); ``resume``: from that checkpoint."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hpc import MultigridStrategy
    from tests import fit_harness

    xs, ys = data(2)
    loader = DataLoader(TensorDataset(xs.double(), ys), batch_size=BATCH, shuffle=False)
    module = lbfgs_odenet(line_search, steps_first)
    saving: dict = {}
    if ckpt_dir is not None:
        saving = {"callbacks": [ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1)],
                  "enable_checkpointing": True}
    trainer = fit_harness.trainer(
        devices=world_size, precision="64-true", max_epochs=2,
        strategy=MultigridStrategy(layer_parallel_size=world_size, mode="pm", **EXACT),
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, **saving,
    )
    trainer.fit(module, train_dataloaders=loader, ckpt_path=resume)
    return {"state": {key: value.detach().clone() for key, value in module.state_dict().items()},
            "steps": trainer.global_step,
            "optimizer_shapes": [tuple(p.shape) for g in trainer.optimizers[0].param_groups for p in g["params"]]}


# -- per-parameter gradient norms: every step's own, as one process's grad_norm logs them ----------------------
def grad_norm_odenet(use_lightning: bool) -> torch.nn.Module:
    """``user_odenet()`` recording, at every step, the per-parameter gradient norms and their total as Lightning's
    docs show (``self.log_dict(grad_norm(self, norm_type=2))`` in ``on_before_optimizer_step``): with Lightning's
    ``grad_norm`` (``use_lightning``) or with ``lightning_hpc.multigrid.grad_norm``."""
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

    from lightning_hpc.multigrid import grad_norm

    module = user_odenet()
    module.recorded = []  # type: ignore[attr-defined]

    def on_before_optimizer_step(optimizer) -> None:
        norms = (lightning_grad_norm if use_lightning else grad_norm)(module, norm_type=2)
        module.recorded.append({k: float(v) for k, v in norms.items()})  # type: ignore[attr-defined]
        module.log_dict(norms)

    module.on_before_optimizer_step = on_before_optimizer_step  # type: ignore[method-assign]
    return module


def serial_grad_norms(steps: int) -> list[dict[str, float]]:
    """One process's ``lightning.pytorch.utilities.grad_norm`` of ``user_odenet()`` at each of ``steps`` steps."""
    import torch.nn.functional as F
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

    model = user_odenet()
    opt = model.configure_optimizers()
    xs, ys = data(steps)
    out = []
    for s in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(xs[s * BATCH : (s + 1) * BATCH].double()), ys[s * BATCH : (s + 1) * BATCH]).backward()
        out.append({k: float(v) for k, v in lightning_grad_norm(model, norm_type=2).items()})
        opt.step()
    return out


def multigrid_grad_norms(rank: int, world_size: int, use_lightning: bool, steps: int) -> dict:
    """``Trainer.fit`` of ``grad_norm_odenet`` with the trunk split over ``world_size`` layer ranks (mode 'pm'):
    the recorded norms, or the error and whether any weight changed."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hpc import MultigridStrategy
    from lightning_hpc.distributed.partitioned import local_block
    from tests import fit_harness

    xs, ys = data(steps)
    loader = DataLoader(TensorDataset(xs.double(), ys), batch_size=BATCH, shuffle=False)
    module = grad_norm_odenet(use_lightning)
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    trainer = fit_harness.trainer(
        devices=world_size, precision="64-true", max_steps=steps,
        strategy=MultigridStrategy(layer_parallel_size=world_size, mode="pm", **EXACT),
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
    )
    try:
        trainer.fit(module, train_dataloaders=loader)
    except Exception as e:  # noqa: BLE001 - the refusal is the result under test
        after = {k: local_block(v) for k, v in module.state_dict().items()}
        changed = [k for k, v in before.items() if k in after and not torch.equal(v, after[k])]
        return {"error": str(e), "global_step": trainer.global_step, "changed": changed}
    return {"recorded": module.recorded}  # type: ignore[attr-defined]


# -- the split trunk indexed by user code while training ---------------------------------------------------
def multigrid_indexing(rank: int, world_size: int, index: int) -> dict:
    """``Trainer.fit`` of ``user_odenet()`` whose ``on_before_optimizer_step`` reads ``len(self.model.steps)`` and
    the first weight of ``self.model.steps[index]``, with the trunk split over ``world_size`` layer ranks: what it
    read, or the error and the steps taken."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hpc import MultigridStrategy
    from lightning_hpc.distributed.partitioned import local_block
    from tests import fit_harness

    xs, ys = data(1)
    loader = DataLoader(TensorDataset(xs.double(), ys), batch_size=BATCH, shuffle=False)
    module = user_odenet()
    seen: dict = {}

    def on_before_optimizer_step(optimizer) -> None:
        seen["len"] = len(module.model.steps)
        seen["weight"] = local_block(next(module.model.steps[index].parameters())).detach().clone()

    module.on_before_optimizer_step = on_before_optimizer_step  # type: ignore[method-assign]
    trainer = fit_harness.trainer(
        devices=world_size, precision="64-true", max_steps=1,
        strategy=MultigridStrategy(layer_parallel_size=world_size, mode="pm", **EXACT),
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
    )
    try:
        trainer.fit(module, train_dataloaders=loader)
    except Exception as e:  # noqa: BLE001 - the refusal is the result under test
        return {"error": str(e), "global_step": trainer.global_step}
    return seen
