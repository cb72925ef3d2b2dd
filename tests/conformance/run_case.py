"""Conformance cases, each as a user would write it, run one after another in one process group (launched by
the tests; Lightning starts the other ranks itself, ``horovodrun`` starts them for ``horovod``).

    python run_case.py DEVICES OUTDIR DATA_PARALLEL STRATEGY:CASE [STRATEGY:CASE ...]

Each item runs its case (``Trainer.fit`` and whatever the case does after it) under that strategy and writes,
under ``OUTDIR/STRATEGY/CASE/``: ``final.ckpt`` (the final checkpoint), ``result_rank<r>.json`` (optimizer steps
taken, the epoch and step it ended at, the metrics of validate / test and the error, if one was raised) and, for
predicting cases, ``pred_rank<r>.pt``.  A case that raises (a refusal) is recorded and the next case runs: our
refusals are raised on every rank alike.

The data are sharded by Lightning's own DistributedSampler (which shuffles training data with seed 0); with
``DEVICES=1`` the training batches are, step by step and epoch by epoch, the union of what the
``DATA_PARALLEL`` ranks see: the reference.  Validation / test / predict data are sharded by Lightning's
samplers too; one process sees them all.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset
from typing_extensions import override

import lightning_hpc  # noqa: F401  makes the strategy names known to Lightning

WORLD, B, N, CLIP = 2, 4, 64, 0.05
#: where the cases run (the GPU tier, tests/gpu, runs the same cases with ``cuda``); ``CONFORMANCE_NUM_NODES`` and
#: ``CONFORMANCE_PG_BACKEND`` let two ranks share one GPU (each a "node" of one device, gloo between them)
ACCELERATOR = os.environ.get("CONFORMANCE_ACCELERATOR", "cpu")
NUM_NODES = int(os.environ.get("CONFORMANCE_NUM_NODES", "1"))
PG_BACKEND = os.environ.get("CONFORMANCE_PG_BACKEND") or None
if ACCELERATOR == "cuda":  # float32 means float32 on the GPU too: the cells compare with the CPU's float32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
STEPS = 4
N_EVAL, N_PREDICT = 32, 45  # validation / test data (equal shards); predict data (unequal shards: 23 + 22)


#: the ``spatial3d`` column's cases (``volume_<case>``) run the user's CNN on volumes: 2 x 4 x 6 x 6 samples, a
#: Conv3d backbone; set by :func:`run_one` from the case name
VOLUMES = False


def images(n: int = N, seed: int = 3, dtype: torch.dtype = torch.float64) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    shape = (n, 2, 4, 6, 6) if VOLUMES else (n, 2, 6, 6)
    return TensorDataset(torch.randn(*shape, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g))


def flat_features() -> int:
    """Features after the backbone's pooling and flatten: 4 channels x 3 x 3 (x 2 for volumes)."""
    return 72 if VOLUMES else 36


def vectors(n: int = N, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Like Lightning's ``RandomDataset(32, n)`` (a batch is one tensor), float64: the demo modules' input."""
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 32, generator=g, dtype=dtype)


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = (nn.Conv3d if VOLUMES else nn.Conv2d)(2, 4, 3, padding=1)
        self.pool = (nn.MaxPool3d if VOLUMES else nn.MaxPool2d)(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(F.relu(self.conv(x))), 1)


class UserCNN(pl.LightningModule):
    """A user's classifier: the model at ``self.model``, a plain mean cross-entropy, SGD with momentum and weight
    decay; validation / test log the mean loss with ``sync_dist=True`` (and accuracy as a torchmetrics object when
    asked), predict returns the logits with the sample index."""

    def __init__(self, manual_clip: bool = False, optimizer: str = "sgd", torchmetrics: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(Backbone(), nn.Linear(flat_features(), 16), nn.ReLU(), nn.Linear(16, 3)).double()
        self.automatic_optimization = not manual_clip
        self.optimizer = optimizer
        if torchmetrics:
            import torchmetrics as tm

            self.val_acc = tm.Accuracy(task="multiclass", num_classes=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        if not self.automatic_optimization:  # manual optimization with clipping, as Lightning's docs show
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
            opt.step()
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        if hasattr(self, "val_acc"):
            self.val_acc(logits, y)
            self.log("val_acc", self.val_acc)  # the metric object: torchmetrics syncs its state itself

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, _, index = batch
        return index, self(x)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=0.01, weight_decay=1e-2)
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=0.01)
        if self.optimizer == "lbfgs":  # a closure evaluated several times per step, flat views of all parameters
            return torch.optim.LBFGS(params, lr=0.5, max_iter=3, history_size=4)
        # bf16: a smaller lr, so the bound compares one step's rounding rather than its growth over the steps
        opt = torch.optim.SGD(params, lr=0.05 if self.optimizer == "sgd_bf16" else 0.5, momentum=0.9, weight_decay=1e-3)
        if self.optimizer == "sgd_step_lr":  # the lr changes every optimizer step
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        return opt


class WideHeadCNN(UserCNN):
    """The user's CNN with a 3-layer head of width 64 (float32, bf16's SGD): the hybrid_fc strategy shards every
    head layer, so its column and row shards' partial products meet in cross-rank sums (bf16-mixed's rounding)."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd_bf16")
        torch.manual_seed(0)
        self.model = nn.Sequential(Backbone(), nn.Linear(flat_features(), 64), nn.ReLU(), nn.Linear(64, 64),
                                   nn.ReLU(), nn.Linear(64, 3)).float()


class AdamCNN(UserCNN):
    """The same module trained with AdamW (adaptive: any gradient difference is amplified, not averaged away)."""

    def __init__(self) -> None:
        super().__init__(optimizer="adamw")


class BackboneClassifier(UserCNN):
    """The same network as ``self.backbone`` + ``self.classifier`` (no ``.model`` attribute)."""

    def __init__(self) -> None:
        super().__init__()
        del self.model
        torch.manual_seed(0)
        self.backbone = Backbone().double()
        self.classifier = nn.Sequential(nn.Linear(flat_features(), 16), nn.ReLU(), nn.Linear(16, 3)).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.backbone(x))


class UserGAN(pl.LightningModule):
    """A GAN as Lightning's docs write one: manual optimization, two optimizers (generator, discriminator), each
    stepped after its own ``manual_backward``.  The latent code is taken from the batch (random noise would differ
    between the ranks and one process)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 72)).double()
        self.discriminator = nn.Sequential(nn.Linear(72, 16), nn.ReLU(), nn.Linear(16, 1)).double()
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        real = batch[0].flatten(1)
        z = real[:, :8]
        g_opt, d_opt = self.optimizers()
        fake = self.generator(z)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), torch.ones(len(z), 1, dtype=z.dtype))
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        ones, zeros = torch.ones(len(z), 1, dtype=z.dtype), torch.zeros(len(z), 1, dtype=z.dtype)
        d_loss = 0.5 * (F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
                        + F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros))
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return [torch.optim.Adam(self.generator.parameters(), lr=1e-2, betas=(0.5, 0.999)),
                torch.optim.Adam(self.discriminator.parameters(), lr=1e-2, betas=(0.5, 0.999))]


def boring_model() -> pl.LightningModule:
    from lightning.pytorch.demos.boring_classes import BoringModel

    torch.manual_seed(0)
    return BoringModel()


def boring_model_double() -> pl.LightningModule:
    """Lightning's ``BoringModel`` unchanged but for float64 (its own data: ``RandomDataset(32, 64)``)."""
    return boring_model().double()


def with_optimizer(module: pl.LightningModule, name: str) -> pl.LightningModule:
    """The module trained with ``name`` ('adam' / 'adamw', lr 0.01) instead of its own optimizer."""
    kind = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    module.configure_optimizers = lambda: kind(module.parameters(), lr=0.01)  # type: ignore[method-assign]
    return module


def demo_model() -> pl.LightningModule:
    """Lightning's ``DemoModel`` (Linear + ReLU, loss ``output.sum()``, Adam), float64."""
    from lightning.pytorch.demos.boring_classes import DemoModel

    torch.manual_seed(0)
    return DemoModel().double()


def lightning_transformer() -> pl.LightningModule:
    """Lightning's ``LightningTransformer`` as its docs use it (float32, dropout 0.2), vocabulary of the synthetic
    WikiText2 file :func:`wikitext` writes (its ``prepare_data``, which downloads the real one, is a no-op)."""
    from lightning.pytorch.demos import LightningTransformer, WikiText2

    torch.manual_seed(0)
    module = LightningTransformer(vocab_size=WikiText2(download=False).vocab_size)
    module.prepare_data = lambda: None  # it downloads WikiText2; the suite writes a file of that format instead
    return module


def wikitext() -> None:
    """``./data/wikitext-2.txt`` with deterministic synthetic text, so ``WikiText2`` (and the module's
    ``prepare_data``) find it and download nothing."""
    path = Path("data") / "wikitext-2.txt"
    if path.exists():
        return
    path.parent.mkdir(exist_ok=True)
    g = torch.Generator().manual_seed(5)
    words = [f"w{i}" for i in torch.randint(0, 24, (18 * 35 + 40,), generator=g).tolist()]
    # every rank writes the same text: through a file of its own, renamed at once, so that no rank reads another's
    # half-written file (an empty vocabulary on one rank left the other training alone, waiting for it)
    part = path.with_name(f"{path.name}.{os.getpid()}")
    part.write_text("\n".join(" ".join(words[i : i + 10]) for i in range(0, len(words), 10)) + "\n")
    os.replace(part, path)


def flatten_linear() -> UserCNN:
    module = UserCNN()
    torch.manual_seed(0)
    module.model = nn.Sequential(nn.Flatten(), nn.Linear(72, 16), nn.ReLU(), nn.Linear(16, 3)).double()
    return module


def ode_net(cls: type[UserCNN] = UserCNN, **kwargs: Any) -> UserCNN:
    """A user's module (``cls``) holding a deep ODE-ResNet (the form the multigrid strategy trains) at
    ``self.model``."""
    from lightning_hpc.models import ode_resnet

    module = cls(**kwargs)
    torch.manual_seed(0)
    module.model = ode_resnet(in_channels=2, num_classes=3, input_size=(6, 6), width=4, num_steps=8).double()
    return module


def frozen(module: UserCNN) -> UserCNN:
    """The first layer frozen (``requires_grad=False``, e.g. a pretrained stem), the optimizer given only the
    trainable parameters."""
    for p in next(m for m in module.model.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))).parameters():
        p.requires_grad_(False)
    return module


def float32(module: pl.LightningModule) -> pl.LightningModule:
    return module.float()


def ode_net_unused() -> UserCNN:
    """The ODE-ResNet with a layer that takes no part in the loss (outside its residual steps)."""
    module = ode_net()
    module.model.unused = nn.Conv2d(2, 2, 1).double()
    return module


class UnusedTrunkParameter(UserCNN):
    """A trunk layer that takes no part in the loss (a common leftover in users' models)."""

    def __init__(self) -> None:
        super().__init__()
        self.model[0].unused = nn.Conv2d(4, 4, 1).double()


class ClampingCNN(UserCNN):
    """A user's ``optimizer_step`` that projects the weights after ``optimizer.step()`` (a max-norm style
    constraint): it must see the updated weights, as on one process."""

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        with torch.no_grad():
            for p in self.parameters():
                p.clamp_(-0.2, 0.2)


class ShrinkingCNN(UserCNN):
    """A user's ``optimizer_step`` that shrinks the updated weights by 1% (a smooth projection: the multigrid
    solve's truncation stays a measure the cycles converge in, which a clamp's kinks break)."""

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        with torch.no_grad():
            for p in self.parameters():
                p.mul_(0.99)


class GradNormCNN(UserCNN):
    """The gradient norm logged in ``on_before_optimizer_step``, as Lightning's docs show: each step's line must
    hold that step's norm (``Case.logger`` records the lines)."""

    @override
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.parameters() if p.grad is not None]))
        self.log("grad_norm", norm)


class L2PenaltyCNN(UserCNN):
    """An explicit L2 penalty over ``self.parameters()`` added to the loss and logged, as users write one: the
    logged penalty must be every step's whole-model value, and the weights must train as one process trains
    them (the penalty's gradient reaches every parameter once)."""

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        penalty = sum(p.pow(2).sum() for p in self.parameters())
        self.log("l2", penalty)
        return F.cross_entropy(self(x), y) + 1e-2 * penalty


class TiedCNN(UserCNN):
    """Tied weights: a trunk-side layer (``self.aux``) shares its weight with the classifier's first Linear (as
    an output layer shares an embedding's): one tensor, trained by both uses."""

    def __init__(self) -> None:
        super().__init__()
        del self.model
        torch.manual_seed(0)
        self.aux = nn.Linear(36, 16, bias=False).double()  # registered first: the classifier ends the model
        self.backbone = Backbone().double()
        self.classifier = nn.Sequential(nn.Linear(flat_features(), 16), nn.ReLU(), nn.Linear(16, 3)).double()
        self.aux.weight = self.classifier[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.backbone(x)
        h = h + 0.1 * F.linear(torch.tanh(self.aux(h)), self.aux.weight.t())
        return self.classifier(h)


def compiled(module: UserCNN) -> UserCNN:
    """``self.model = torch.compile(self.model)``, as users write it (the eager backend: graph capture without
    code generation, so the cell does not wait for a C++ compiler)."""
    module.model = torch.compile(module.model, backend="eager")
    return module


def ode_net_shared_branch() -> UserCNN:
    """The ODE-ResNet with one residual branch shared by every step (a neural ODE's single vector field)."""
    module = ode_net()
    steps = module.model.steps
    for step in list(steps)[1:]:
        step.branch = steps[0].branch
    return module


def _swa() -> list[pl.Callback]:
    """Lightning's StochasticWeightAveraging from the second epoch (of 3: two epochs averaged)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    return [StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)]


class FreezeFirstConv(pl.Callback):
    """A user's callback freezing the first convolution from the third optimizer step on (mid-epoch)."""

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == 2:
            for p in next(m for m in pl_module.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))).parameters():
                p.requires_grad_(False)


def _backbone_finetuning() -> list[pl.Callback]:
    """Lightning's BackboneFinetuning: the backbone frozen for the first epoch, unfrozen (its own parameter group)
    at the second."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    return [BackboneFinetuning(unfreeze_backbone_at_epoch=1)]


class MemoryLogger(Logger):
    """What a logger receives: (step, metrics) lines, kept in memory (rank 0 only, as Lightning logs)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    @override
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.lines.append((int(step or 0), {k: float(v) for k, v in metrics.items() if k != "epoch"}))

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


@dataclass
class Case:
    module: Callable[[], pl.LightningModule]
    trainer: dict[str, Any] = field(default_factory=dict)
    #: fit; fit_eval (fit, then validate and test); fit_predict (fit, then predict); predict (predict only);
    #: resume (fit one epoch, checkpoint, fit a second epoch from it); resume_from (the second half of resume from
    #: another run's checkpoint, e.g. on another number of processes); early_stop (validation every epoch)
    flow: str = "fit"
    #: training data: images; own (the module's train_dataloader is not used: vectors); transformer (WikiText2);
    #: images_f32 (the float32 images in the case's dtype: a float32 case's float64 twin sees the same values)
    data: str = "images"
    dtype: torch.dtype = torch.float64
    #: the one-process reference accumulates the data-parallel ranks' batches as micro-batches (one optimizer step
    #: per global batch, ``accumulate_grad_batches`` = ranks): each micro-batch is rounded as its rank rounds it
    micro_batches: bool = False
    #: Lightning plugins built per Trainer (e.g. K-FAC's mixed-precision plugin)
    plugins: Callable[[], list[Any]] | None = None
    #: user callbacks built per Trainer
    callbacks: Callable[[], list[pl.Callback]] | None = None
    #: record what a logger receives, every step (``result["logged"]``: what the feature observes)
    logger: bool = False
    #: training samples (``N``: every rank's share a multiple of the batch size)
    n: int = N
    #: K-FAC options of this case over ``KFAC_OPTIONS`` (the ``kfac_*`` columns and their one-process references)
    kfac: dict[str, Any] = field(default_factory=dict)


def _kfac_fp16_plugin() -> list[Any]:
    from lightning_hpc import KFACMixedPrecision

    return [KFACMixedPrecision("16-mixed", device=ACCELERATOR)]


EPOCH2 = {"limit_train_batches": 2, "max_epochs": 2, "max_steps": -1}  # two short epochs (resume, early stopping)

CASES: dict[str, Case] = {
    "sgd": Case(UserCNN),
    "clip_norm": Case(lambda: UserCNN(), {"gradient_clip_val": CLIP, "gradient_clip_algorithm": "norm"}),
    "clip_value": Case(lambda: UserCNN(), {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
    "manual_clip": Case(lambda: UserCNN(manual_clip=True)),
    "backbone_classifier": Case(BackboneClassifier),
    "boring_model": Case(boring_model, data="boring"),  # Lightning's own demo module, with its own data
    # the same in float64: its own data, batch size 1 (a float32 K-FAC cell's reference for the math)
    "boring_model_own_f64": Case(boring_model_double, data="boring_f64"),
    "flatten_linear": Case(flatten_linear),
    "odenet": Case(ode_net),
    "predict": Case(UserCNN, flow="predict"),  # trainer.predict with Lightning's own (unpadded) predict sampler
    "adamw": Case(AdamCNN),
    "accumulate_2": Case(lambda: UserCNN(), {"accumulate_grad_batches": 2}),
    "unused_parameter": Case(UnusedTrunkParameter),
    "odenet_bf16_mixed": Case(ode_net, {"precision": "bf16-mixed"}),
    "odenet_clip_norm": Case(ode_net, {"gradient_clip_val": CLIP, "gradient_clip_algorithm": "norm"}),
    # --- Lightning features on a user's CNN
    "sgd_step_lr": Case(lambda: UserCNN(optimizer="sgd_step_lr")),
    "adam": Case(lambda: UserCNN(optimizer="adam")),
    "two_optimizers_gan": Case(UserGAN),
    "bf16_mixed": Case(
        lambda: float32(UserCNN(optimizer="sgd_bf16")), {"precision": "bf16-mixed"}, dtype=torch.float32
    ),
    # the same on one process, accumulating the ranks' batches as micro-batches (the exact reference for bf16)
    "bf16_mixed_micro_batches": Case(
        lambda: float32(UserCNN(optimizer="sgd_bf16")),
        {"precision": "bf16-mixed"},
        dtype=torch.float32,
        micro_batches=True,
    ),
    # 16-mixed with a grad scaler through K-FAC's precision plugin (float32 module)
    "kfac_fp16_plugin": Case(
        lambda: float32(UserCNN(optimizer="sgd_bf16")), dtype=torch.float32, plugins=_kfac_fp16_plugin
    ),
    "kfac_fp16_plugin_micro_batches": Case(
        lambda: float32(UserCNN(optimizer="sgd_bf16")),
        dtype=torch.float32,
        plugins=_kfac_fp16_plugin,
        micro_batches=True,
    ),
    # a 3-layer sharded head in bf16-mixed, and its float32 yardstick (tests/hybrid_fc/test_hybrid_bf16.py)
    "bf16_mixed_wide_head": Case(WideHeadCNN, {"precision": "bf16-mixed"}, dtype=torch.float32),
    "fp32_for_bf16_wide_head": Case(WideHeadCNN, dtype=torch.float32),
    "fp32_for_bf16": Case(
        lambda: float32(UserCNN(optimizer="sgd_bf16")), dtype=torch.float32
    ),  # the bound's yardstick (reference)
    "validate_test": Case(UserCNN, flow="fit_eval"),
    "fit_predict": Case(UserCNN, flow="fit_predict"),
    "resume": Case(lambda: UserCNN(optimizer="sgd_step_lr"), EPOCH2, flow="resume"),
    "resume_2_to_1": Case(lambda: UserCNN(optimizer="sgd_step_lr"), EPOCH2, flow="resume_from"),
    "early_stopping": Case(UserCNN, {**EPOCH2, "max_epochs": 6}, flow="early_stop"),
    "torchmetrics": Case(lambda: UserCNN(torchmetrics=True), flow="fit_eval"),
    "frozen_parameters": Case(lambda: frozen(UserCNN())),
    # --- user code around the step, trainability changing mid-run
    "optimizer_step_override": Case(ClampingCNN),
    "grad_norm_logging": Case(GradNormCNN, logger=True),
    "l2_penalty_logged": Case(L2PenaltyCNN, logger=True),
    "tied_weights": Case(TiedCNN),
    # factors every second step: under kfac_spatial the split step runs its compiled graph on the other steps
    "torch_compile": Case(lambda: compiled(UserCNN()), kfac={"factor_update_freq": 2}),
    "lbfgs": Case(lambda: UserCNN(optimizer="lbfgs")),
    "swa": Case(UserCNN, {**EPOCH2, "max_epochs": 3}, callbacks=_swa),
    # 18 samples: 9 per rank of 2 in batches of 4, so each epoch ends with one sample per rank
    "last_batch_one_sample": Case(UserCNN, {"max_steps": -1, "max_epochs": 1}, n=18),
    "backbone_finetuning": Case(BackboneClassifier, EPOCH2, callbacks=_backbone_finetuning),
    "freeze_mid_run": Case(UserCNN, callbacks=lambda: [FreezeFirstConv()]),
    # --- Lightning's own demo modules
    "boring_model_f64": Case(boring_model_double, data="vectors"),
    "demo_model": Case(demo_model, data="vectors"),
    "lightning_transformer": Case(lightning_transformer, {"max_steps": 3}, data="transformer", dtype=torch.float32),
    # the same in float64 (hybrid_fc: its head's products over the gathered sub-batches round otherwise than DDP's
    # per-rank ones, and 3 steps through the transformer amplify that float32 rounding to 5e-6)
    "lightning_transformer_f64": Case(lambda: lightning_transformer().double(), {"max_steps": 3}, data="transformer"),
    # --- the same features on the ODE-ResNet the multigrid strategy trains
    "odenet_sgd_step_lr": Case(lambda: ode_net(optimizer="sgd_step_lr")),
    "odenet_adam": Case(lambda: ode_net(optimizer="adam")),
    "odenet_validate_test": Case(ode_net, flow="fit_eval"),
    "odenet_fit_predict": Case(ode_net, flow="fit_predict"),
    "odenet_resume": Case(lambda: ode_net(optimizer="sgd_step_lr"), EPOCH2, flow="resume"),
    "odenet_resume_2_to_1": Case(lambda: ode_net(optimizer="sgd_step_lr"), EPOCH2, flow="resume_from"),
    "odenet_early_stopping": Case(ode_net, {**EPOCH2, "max_epochs": 6}, flow="early_stop"),
    "odenet_torchmetrics": Case(lambda: ode_net(torchmetrics=True), flow="fit_eval"),
    "odenet_frozen_parameters": Case(lambda: frozen(ode_net())),
    "odenet_manual_clip": Case(lambda: ode_net(manual_clip=True)),
    "odenet_adamw": Case(lambda: ode_net(optimizer="adamw")),
    "odenet_clip_value": Case(ode_net, {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
    "odenet_accumulate_2": Case(ode_net, {"accumulate_grad_batches": 2}),
    "odenet_predict": Case(ode_net, flow="predict"),
    "odenet_unused_parameter": Case(ode_net_unused),
    # K-FAC + adaptive optimizers in float32, 8 steps (and their float64 twins: the same data, the math)
    "adam_f32": Case(lambda: float32(UserCNN(optimizer="adam")), {"max_steps": 8}, dtype=torch.float32),
    "adamw_f32": Case(lambda: float32(UserCNN(optimizer="adamw")), {"max_steps": 8}, dtype=torch.float32),
    "boring_adam_f32": Case(lambda: with_optimizer(boring_model(), "adam"), {"max_steps": 8}, data="boring"),
    "boring_adam_f32_twin_f64": Case(lambda: with_optimizer(boring_model_double(), "adam"), {"max_steps": 8},
                                     data="boring_f64"),
    "adam_f32_twin_f64": Case(lambda: UserCNN(optimizer="adam"), {"max_steps": 8}, data="images_f32"),
    "adamw_f32_twin_f64": Case(lambda: UserCNN(optimizer="adamw"), {"max_steps": 8}, data="images_f32"),
    "odenet_optimizer_step_override": Case(lambda: ode_net(ShrinkingCNN)),
    "odenet_grad_norm_logging": Case(lambda: ode_net(GradNormCNN), logger=True),
    "odenet_l2_penalty_logged": Case(lambda: ode_net(L2PenaltyCNN), logger=True),
    "odenet_tied_weights": Case(ode_net_shared_branch),
    "odenet_torch_compile": Case(lambda: compiled(ode_net())),
    "odenet_lbfgs": Case(lambda: ode_net(optimizer="lbfgs")),
    "odenet_swa": Case(ode_net, {**EPOCH2, "max_epochs": 3}, callbacks=_swa),
    "odenet_last_batch_one_sample": Case(ode_net, {"max_steps": -1, "max_epochs": 1}, n=18),
    "odenet_freeze_mid_run": Case(ode_net, callbacks=lambda: [FreezeFirstConv()]),
    "odenet_fp32_for_bf16": Case(lambda: float32(ode_net(optimizer="sgd_bf16")), dtype=torch.float32),
}
#: the same cases on volumes (the spatial3d column): the case is the same object, VOLUMES switches its data and
#: backbone (:func:`run_one`)
CASES.update({f"volume_{name}": case for name, case in list(CASES.items()) if not name.startswith("odenet")})
CASES["odenet_bf16_mixed"].dtype = torch.float32
CASES["odenet_bf16_mixed"].module = lambda: float32(ode_net(optimizer="sgd_bf16"))

#: mode 'mg' as the bounded cells run it on the 8-step ODE-ResNet: two levels, coarsening factor 2 (4 coarse
#: steps), F-relaxation, ``MG_CYCLES`` (2, the strategy's default) forward and adjoint cycles: an approximation;
#: ``multigrid_cycles<k>`` is the same solve with k cycles; k = N/c = 4 is exact (two-level MGRIT with F-relaxation
#: makes one more coarse interval exact per cycle)
MG_OPTIONS = {"cfactor": 2, "levels": 2, "relaxation": "F"}
MG_CYCLES = 2

#: K-FAC as the tests run it: every step updates factors, every second one decomposes, float64 decompositions.
#: CONFORMANCE_KFAC_DECOMPOSITION_DTYPE / CONFORMANCE_KFAC_FACTOR_DTYPE change the decompositions' / factors'
#: dtype for a measurement (docs/kfac.md, "Float32 with Adam / AdamW"); the matrix runs without them
KFAC_OPTIONS = {
    "factor_update_freq": 1,
    "inv_update_freq": 2,
    "damping": 0.01,
    "kl_clip": 0.01,
    "decomposition_dtype": os.environ.get("CONFORMANCE_KFAC_DECOMPOSITION_DTYPE", "float64"),
}
if os.environ.get("CONFORMANCE_KFAC_FACTOR_DTYPE"):
    KFAC_OPTIONS["factor_dtype"] = os.environ["CONFORMANCE_KFAC_FACTOR_DTYPE"]


class ReportSteps(pl.Callback):
    """Counts the optimizer steps of each rank, so a test can tell a refusal before the first
    step from a failure during training.  It only counts: layered SGD may run it with its postponed update."""

    postponed_update_safe = True

    def __init__(self) -> None:
        self.steps = 0

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: object) -> None:
        self.steps += 1


class CompiledForwards(pl.Callback):
    """What each ``torch.compile``d submodule's forward did under the spatial strategy (its compiled split step,
    :class:`~lightning_hpc.spatial.compile.SplitCompiledForward`): graphs captured, tile programs traced, or why it
    ran eagerly; read when training ends, before the strategy hands the modules back."""

    def __init__(self) -> None:
        self.state: dict[str, dict[str, Any]] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_hpc.kfac.compiled import CompiledUnderKFAC
        from lightning_hpc.spatial.compile import SplitCompiledForward

        for name, module in pl_module.named_modules():
            forward = module.__dict__.get("forward")
            eager_calls = 0
            if isinstance(forward, CompiledUnderKFAC):  # K-FAC's route over the split step
                forward, eager_calls = forward.inner, forward.eager_calls
            if isinstance(forward, SplitCompiledForward):
                self.state[name] = {"graphs": forward.graphs, "traces": forward.traces,
                                    "eager_calls": eager_calls, "refused": forward.refused}


def broken_layered_sgd() -> Any:
    """The negative control of the rows about user code around the step and trainability changes: layered SGD that
    always postpones the update and never rebuilds its buckets (what it did before it learned to do otherwise)."""
    from lightning_hpc.layered_sgd.strategy import LayeredSGDStrategy

    class BrokenLayeredSGD(LayeredSGDStrategy):
        @override
        def setup(self, trainer: pl.Trainer) -> None:
            super().setup(trainer)
            self.observers = []

        @override
        def _follow_trainability(self) -> None:
            pass

    return BrokenLayeredSGD()


def hybrid_fc_plain_blocks() -> Any:
    """The negative control of the rows about reductions over the model's parameters: hybrid_fc whose head
    parameters are plain blocks (what they were before they learned their partition), so a norm or a penalty
    over ``self.parameters()`` sees this rank's block of the head only."""
    from torch import nn

    from lightning_hpc import HybridParallelStrategy
    from lightning_hpc.distributed.partitioned import local_block
    from lightning_hpc.hybrid_fc.parallel import find_hybrid_head

    class PlainBlocks(HybridParallelStrategy):
        @override
        def _parallelize(self, device: torch.device | None = None) -> None:
            super()._parallelize(device)
            for shard in find_hybrid_head(self._search_root()).shards:
                for name in ("weight", "bias"):
                    if getattr(shard, name) is not None:
                        setattr(shard, name, nn.Parameter(local_block(getattr(shard, name)).detach().clone()))

    return PlainBlocks(process_group_backend=PG_BACKEND)


def multigrid_pm_plain_blocks() -> Any:
    """The same negative control for the layer-sharded trunk: mode 'pm' whose local steps' parameters are plain
    tensors (a norm or a penalty over ``self.parameters()`` sees this rank's steps only)."""
    from torch import nn

    from lightning_hpc import MultigridStrategy
    from lightning_hpc.distributed.partitioned import local_block

    class PlainSteps(MultigridStrategy):
        @override
        def _wrap_model(self) -> None:
            fresh = self.block is None
            super()._wrap_model()
            if fresh and self._sharded() is not None:
                for module in self.block.modules():
                    for name, p in list(module.named_parameters(recurse=False)):
                        setattr(module, name, nn.Parameter(local_block(p).detach().clone()))

    return PlainSteps(mode="pm", log_residuals=False, process_group_backend=PG_BACKEND)


def build_strategy(name: str, kfac_options: dict[str, Any] | None = None) -> tuple[Any, list[pl.Callback]]:
    """A strategy by name, and the callbacks it implies: ``kfac_<strategy>`` is ``<strategy>`` with the KFAC
    callback; ``multigrid``: mode 'mg' with ``MG_OPTIONS`` and ``MG_CYCLES`` cycles (``multigrid_cycles<k>``: k
    cycles); ``multigrid_pm``: the multigrid strategy's partitioned model (layer-sharded trunk, serial
    evaluation: exact); ``hybrid_fc_find_unused``: the strategy with the fix its unused-parameter error names."""
    if name.startswith("kfac_"):
        from lightning_hpc import KFAC

        strategy, callbacks = build_strategy(name[len("kfac_"):])
        return strategy, [*callbacks, KFAC(**{**KFAC_OPTIONS, **(kfac_options or {})})]
    if name == "spatial3d":  # sub-volumes: D split in two
        from lightning_hpc import SpatialParallelStrategy

        return SpatialParallelStrategy(spatial_parts=(2, 1, 1), process_group_backend=PG_BACKEND), []
    if name in ("spatial", "spatial_1x1"):  # spatial_1x1: the strategy's own path with one tile (one device)
        from lightning_hpc import SpatialParallelStrategy

        parts = (1, 1) if name == "spatial_1x1" else (2, 1)
        return SpatialParallelStrategy(spatial_parts=parts, process_group_backend=PG_BACKEND), []
    if name == "ddp_find_unused":
        return "ddp_find_unused_parameters_true", []
    if name == "ddp" and PG_BACKEND is not None:
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend=PG_BACKEND), []
    if name == "layered_sgd" and PG_BACKEND is not None:
        from lightning_hpc import LayeredSGDStrategy

        return LayeredSGDStrategy(process_group_backend=PG_BACKEND), []
    if name == "hybrid_fc" and PG_BACKEND is not None:
        from lightning_hpc import HybridParallelStrategy

        return HybridParallelStrategy(process_group_backend=PG_BACKEND), []
    if name == "hybrid_fc_find_unused":
        from lightning_hpc import HybridParallelStrategy

        return HybridParallelStrategy(find_unused_parameters=True, process_group_backend=PG_BACKEND), []
    if name == "multigrid" or name.startswith("multigrid_cycles"):
        from lightning_hpc import MultigridStrategy

        cycles = int(name[len("multigrid_cycles"):]) if name != "multigrid" else MG_CYCLES
        return MultigridStrategy(mode="mg", **MG_OPTIONS, forward_cycles=cycles, backward_cycles=cycles,
                                 log_residuals=False, process_group_backend=PG_BACKEND), []
    if name == "multigrid_pm":
        from lightning_hpc import MultigridStrategy

        return MultigridStrategy(mode="pm", log_residuals=False, process_group_backend=PG_BACKEND), []
    if name == "layered_sgd_broken":
        return broken_layered_sgd(), []
    if name == "hybrid_fc_plain_blocks":
        return hybrid_fc_plain_blocks(), []
    if name == "multigrid_pm_plain_blocks":
        return multigrid_pm_plain_blocks(), []
    if name == "horovod":
        from lightning_hpc import HorovodStrategy

        return HorovodStrategy(), []
    return name, []


class UnionBatches(Sampler[list[int]]):
    """One process's batches: batch b of epoch e is the union of batch b of every data-parallel rank under
    Lightning's ``DistributedSampler(shuffle=True, seed=0)`` at epoch e (Lightning calls ``sampler.set_epoch``).
    With ``micro_batches``, the ranks' batches b come one after the other instead (for gradient accumulation)."""

    def __init__(self, n: int, ranks: int, batch: int, micro_batches: bool = False) -> None:
        self.n, self.ranks, self.batch, self.micro_batches = n, ranks, batch, micro_batches
        self.sampler = self  # Lightning looks for set_epoch on batch_sampler.sampler
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _shards(self) -> list[list[int]]:
        shards = []
        for r in range(self.ranks):
            s = DistributedSampler(range(self.n), self.ranks, r, shuffle=True, seed=0)
            s.set_epoch(self.epoch)
            shards.append(list(s))
        return shards

    def __iter__(self) -> Iterator[list[int]]:
        shards = self._shards()
        for b in range(self._batches()):
            batches = [shard[b * self.batch : (b + 1) * self.batch] for shard in shards]
            if self.micro_batches:
                yield from batches
            else:
                yield [i for batch in batches for i in batch]

    def _batches(self) -> int:
        # a last batch shorter than the others comes too (DataLoader's drop_last=False), as on the ranks
        return math.ceil(math.ceil(self.n / self.ranks) / self.batch)

    def __len__(self) -> int:
        return self._batches() * (self.ranks if self.micro_batches else 1)


def train_loader(case: Case, devices: int, data_parallel: int) -> DataLoader:
    if case.data == "transformer":
        from lightning.pytorch.demos import WikiText2

        data: Any = WikiText2(download=False)
        batch = 2
    else:
        data = vectors() if case.data == "vectors" else images(case.n, dtype=case.dtype)
        if case.data == "images_f32":
            x, y = images(dtype=torch.float32).tensors
            data = TensorDataset(x.to(case.dtype), y)
        batch = B
    if devices == 1:  # the reference: global batch b = the union of every data-parallel rank's batch b
        return DataLoader(data, batch_sampler=UnionBatches(len(data), data_parallel, batch, case.micro_batches))
    return DataLoader(data, batch_size=batch)


def eval_loader(case: Case, n: int, with_index: bool = False, seed: int = 4) -> DataLoader:
    data = images(n, seed=seed, dtype=case.dtype)
    if with_index:
        data = TensorDataset(*data.tensors, torch.arange(n))
    return DataLoader(data, batch_size=B)  # Lightning shards it (its samplers); one process sees it all


def run_one(strategy_name: str, case_name: str, devices: int, out: Path, data_parallel: int) -> None:
    global VOLUMES
    VOLUMES = case_name.startswith("volume_")
    case = CASES[case_name]
    world = devices * NUM_NODES  # the processes of the run (two "nodes" of one device share a GPU in tests/gpu)
    out.mkdir(parents=True, exist_ok=True)
    if case.data == "transformer":
        wikitext()
    steps, compiled = ReportSteps(), CompiledForwards()
    result: dict[str, Any] = {"rank": int(os.environ.get("RANK", os.environ.get("HOROVOD_RANK", 0)))}

    def trainer(**extra: Any) -> pl.Trainer:
        # a spatial checkpoint resumes on one process as the plain model (one process cannot hold 2 x 1 tiles)
        base = strategy_name.removeprefix("kfac_")
        one_process = base in ("spatial", "spatial3d") and world == 1
        name = strategy_name.replace(base, "auto") if one_process else strategy_name
        strategy, callbacks = build_strategy(name, case.kfac)
        kwargs = {"max_steps": STEPS, **case.trainer, **extra}
        if case.plugins is not None:
            kwargs["plugins"] = case.plugins()
        if case.micro_batches and world == 1:
            kwargs["accumulate_grad_batches"] = data_parallel
        if case.callbacks is not None:
            callbacks = [*callbacks, *case.callbacks()]
        if case.logger:
            kwargs.update(logger=MemoryLogger(), log_every_n_steps=1)
        return pl.Trainer(
            accelerator=ACCELERATOR,
            devices=devices,
            num_nodes=NUM_NODES,
            strategy=strategy,
            logger=kwargs.pop("logger", False),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[steps, compiled, *callbacks, *kwargs.pop("callbacks", [])],
            num_sanity_val_steps=0,
            use_distributed_sampler=world > 1,
            **kwargs,
        )

    t: pl.Trainer | None = None
    try:
        module = case.module()
        loader = None if case.data.startswith("boring") else train_loader(case, world, data_parallel)
        if case.data == "boring_f64":  # the module's own data (drawn as it draws them), in float64
            loader = DataLoader(module.train_dataloader().dataset.data.double())
        if case.data.startswith("boring") and world == 1:  # the module's own data, the union of the ranks' batches
            own = loader if loader is not None else module.train_dataloader()
            loader = DataLoader(own.dataset, batch_sampler=UnionBatches(len(own.dataset), data_parallel,
                                                                        own.batch_size or 1))
        if case.flow == "predict":
            t = trainer()
            preds = t.predict(module, eval_loader(case, N_PREDICT, with_index=True))
            torch.save(preds, out / f"pred_rank{t.global_rank}.pt")
        elif case.flow in ("resume", "resume_from"):
            mid = out / "epoch1.ckpt"
            if case.flow == "resume_from":  # the first epoch ran in another process group (see the tests)
                mid = (
                    Path(os.environ["CONFORMANCE_RESUME_FROM"])
                    / strategy_name
                    / case_name.replace("_2_to_1", "")
                    / "epoch1.ckpt"
                )
            else:
                t = trainer(max_epochs=1)
                t.fit(module, loader)
                t.save_checkpoint(mid)
                module = case.module()
            t = trainer()
            t.fit(module, train_loader(case, world, data_parallel), ckpt_path=mid)
        elif case.flow == "early_stop":
            from lightning.pytorch.callbacks import EarlyStopping

            stop = EarlyStopping(monitor="val_loss", min_delta=0.02, patience=0, mode="min")
            t = trainer(callbacks=[stop])
            t.fit(module, loader, eval_loader(case, N_EVAL // 2))
        else:
            t = trainer()
            t.fit(module, loader)
        if case.flow == "fit_eval":
            result["validate"] = t.validate(module, eval_loader(case, N_EVAL))
            result["test"] = t.test(module, eval_loader(case, N_EVAL, seed=5))
        if case.flow == "fit_predict":
            preds = t.predict(module, eval_loader(case, N_PREDICT, with_index=True))
            torch.save(preds, out / f"pred_rank{t.global_rank}.pt")
        if case.flow != "predict":
            t.save_checkpoint(out / "final.ckpt")
        result.update(global_step=t.global_step, epoch=t.current_epoch)
        if isinstance(t.logger, MemoryLogger):
            result["logged"] = t.logger.lines
    except Exception as e:  # a refusal: recorded, and the next case runs
        result["error"] = "".join(traceback.format_exception(e))
        if t is not None:  # the optimizer steps completed before the error
            result["global_step"] = t.global_step
        print(f"CASE {strategy_name}:{case_name} raised {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    result["steps"] = steps.steps
    if compiled.state:
        result["compiled"] = compiled.state
    rank = t.global_rank if t is not None else result["rank"]
    (out / f"result_rank{rank}.json").write_text(json.dumps(result, default=str))


def main(devices: int, outdir: str, data_parallel: int, items: list[str]) -> None:
    import time

    # one thread per rank, set here and not at import: test_matrix.py imports this module for CASES, and the test
    # process keeps its own threads
    torch.set_num_threads(1)
    for item in items:
        strategy, case = item.split(":")
        if "torch._dynamo" in sys.modules:
            # each case compiles (torch.compile) from scratch, as in a process of its own: run after
            # horovod x torch_compile in the same launch, kfac_horovod x torch_compile would reuse the code compiled
            # without K-FAC's hooks (which K-FAC refuses)
            sys.modules["torch._dynamo"].reset()
        t0 = time.perf_counter()
        run_one(strategy, case, devices, Path(outdir) / strategy / case, data_parallel)
        print(f"CASE {item} DONE {time.perf_counter() - t0:.2f}", flush=True)


if __name__ == "__main__":
    # the stock-DDP reference runs leave gloo's group alive; without this a finished run may abort at exit
    from lightning_hpc.distributed.exit import destroy_process_group_at_exit

    destroy_process_group_at_exit()
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:])
