"""The conformance matrix: every (strategy, feature) cell, what it must show, or why it does not apply.

Columns (``run_case.build_strategy``): ``ddp`` (Lightning's own DDPStrategy: the harness, and the reference of
the ``= ddp`` cells), ``layered_sgd``, ``horovod`` (under ``horovodrun``; skipped when ``horovod.torch`` is not
importable), ``hybrid_fc``, ``spatial`` (``spatial_parts=(2, 1)``: both processes hold tiles of the same
samples), ``multigrid_pm`` (the partitioned model: layer-sharded trunk, both ranks see the same samples),
``multigrid`` (mode 'mg', 2 layer ranks, the approximate solve of ``run_case.MG_OPTIONS``;
``multigrid_cycles<k>``: the same with k cycles), and the ``KFAC`` callback under ``ddp``, ``layered_sgd`` and
``horovod`` (``kfac_<strategy>``; reference: KFAC on one process on the global batch).  A column may run a cell
with the fix its own error names (``<column>_find_unused``: ``find_unused_parameters=True``): the matrix shows
both results.

Rows (``FEATURES``) are Lightning features on a user's CNN and Lightning's own demo modules.  The multigrid
columns train the deep ODE-ResNet their strategy is for: a feature ``f`` runs as case ``odenet_f`` there (``sgd``:
``odenet``); the modules that are not ODE-ResNets run as they are (and are refused with the fix).

Every cell of ``COLUMNS`` x ``FEATURES`` is in ``MATRIX``: a verdict tested by ``test_matrix.py``, or
``NotApplicable`` with the reason the documentation prints (``test_matrix.test_every_cell_has_a_verdict``).
"""

from __future__ import annotations

from dataclasses import dataclass

COLUMNS = ("ddp", "layered_sgd", "horovod", "hybrid_fc", "spatial", "spatial3d", "multigrid_pm", "multigrid",
           "kfac_ddp", "kfac_layered_sgd", "kfac_horovod", "kfac_spatial", "kfac_hybrid_fc")

FEATURES = (
    "sgd", "sgd_step_lr", "adam", "adamw", "clip_norm", "clip_value", "accumulate_2", "manual_clip",
    "two_optimizers_gan", "bf16_mixed", "kfac_fp16_plugin", "validate_test", "torchmetrics", "fit_predict", "predict",
    "resume", "resume_2_to_1", "early_stopping", "frozen_parameters", "unused_parameter", "backbone_classifier",
    "flatten_linear", "boring_model", "boring_model_f64", "demo_model", "lightning_transformer",
    "optimizer_step_override", "grad_norm_logging", "backbone_finetuning", "freeze_mid_run", "adam_f32",
    "boring_adam_f32", "l2_penalty_logged", "tied_weights", "torch_compile", "lbfgs", "swa", "last_batch_one_sample",
)

#: columns whose cells run in the slow tier (their own CI step), so that the default suite stays under ten minutes on
#: a small machine: the second spatial layout and K-FAC over it and over hybrid_fc, each a launch of its own on top
#: of its strategy's column (with their one-process references); the Horovod columns, whose ``horovodrun`` launch
#: costs seconds to start (tests/horovod keeps the strategy's own checks in the default tier); mode 'mg' of the
#: multigrid strategy, whose bound needs three more one-process solves per case (tests/multigrid keeps its own bound
#: tests in the default tier; ``multigrid_pm``, the exact mode, stays)
SLOW_COLUMNS = {"spatial3d", "kfac_spatial", "kfac_hybrid_fc", "horovod", "kfac_horovod", "multigrid"}

#: the row whose cells are in the torch-range subset (pytest marker ``torch_range``): one fit per strategy, each
#: against one process; ``-m torch_range`` launches that row's cases only (conftest.py)
TORCH_RANGE_ROW = "sgd"

#: data-parallel ranks of each strategy on 2 processes (the reference's global batch is the union of theirs)
DATA_PARALLEL = {"multigrid_pm": 1, "multigrid": 1, "spatial": 1, "spatial3d": 1, "kfac_spatial": 1,
                 "multigrid_pm_plain_blocks": 1}

#: features that are modules of their own (not the user's CNN with a Lightning feature): the multigrid columns run
#: them as they are (no trunk of residual steps: the strategy trains them data parallel over both ranks)
_OWN_MODULES = {"two_optimizers_gan", "backbone_classifier", "flatten_linear", "boring_model", "boring_model_f64",
                "demo_model", "lightning_transformer", "backbone_finetuning", "adam_f32", "boring_adam_f32"}


#: features whose data are not the user's images (the spatial3d column runs them as they are)
_NOT_IMAGES = {"two_optimizers_gan", "flatten_linear", "boring_model", "boring_model_f64", "demo_model",
               "lightning_transformer", "boring_adam_f32"}


def data_parallel(strategy: str, case: str) -> int:
    """The data-parallel ranks of a cell on 2 processes (its reference's global batch is the union of theirs): the
    multigrid columns' modules without a trunk of residual steps train data parallel over both ranks."""
    if strategy.startswith("multigrid") and not case.startswith("odenet"):
        return 2
    return DATA_PARALLEL.get(strategy, 2)


def case_of(column: str, feature: str) -> str:
    """The case (``run_case.CASES``) a column runs for a feature."""
    if column.startswith("multigrid") and feature not in _OWN_MODULES:
        return "odenet" if feature == "sgd" else f"odenet_{feature}"
    if column == "spatial3d" and feature not in _NOT_IMAGES:
        return f"volume_{feature}"
    if column.endswith("hybrid_fc") and feature == "lightning_transformer":
        # float64: the sharded head's products over gathered sub-batches round otherwise than DDP's per-rank ones,
        # and 3 steps through the transformer amplify float32's rounding to 5.2e-6 (float64: 3.9e-15)
        return "lightning_transformer_f64"
    return feature


@dataclass(frozen=True)
class Exact:
    """Final parameters (and what the feature observes) equal one process on the global batch."""


@dataclass(frozen=True)
class EqualDDP:
    """Equal to ``reference`` on 2 processes: modules that make DDP itself differ from one process (Lightning's
    DemoModel sums its loss, which DDP's mean halves; LightningTransformer draws dropout masks per rank)."""

    reference: str


@dataclass(frozen=True)
class Bounded:
    """bf16-mixed: within ``bound`` x bf16's own effect on one process (``test_matrix.test_bounded``); with
    ``micro_batches`` also exact against one process on the ranks' micro-batches."""

    micro_batches: bool = True
    bound: float = 0.25


@dataclass(frozen=True)
class MicroBatches:
    """Reduced precision, exact against one process that accumulates the ranks' batches as micro-batches only
    (K-FAC amplifies the per-rank rounding: no bound against the global batch tells a defect from rounding)."""


@dataclass(frozen=True)
class BoundedMG:
    """Mode 'mg' (approximate by design): within ``MG_BOUND`` x its own truncation of one process on the global
    batch, and equal to one process running the same solve (``test_matrix.test_bounded_multigrid``)."""


@dataclass(frozen=True)
class Refused:
    """An error before the first optimizer step whose message matches ``message`` (it names the fix); with
    ``fixed``: the column ``<column>_find_unused`` (the fix applied) is exact."""

    message: str
    fixed: bool = False


@dataclass(frozen=True)
class RefusedAt:
    """Trainability changed mid-run: an error whose message matches ``message`` before the optimizer step that
    would apply unreduced gradients, on every rank after exactly ``global_step`` steps (those before the change)."""

    message: str
    global_step: int


@dataclass(frozen=True)
class RoundingBounded:
    """A float32 module under K-FAC, whose preconditioner amplifies float32 rounding: the same module in float64
    (``twin``, same data) is exact, and the float32 run is within ``bound`` x float32's own effect (one process in
    float32 against one process on ``twin``) of one process (``test_matrix.test_rounding_bounded``)."""

    twin: str
    #: in units of float32's own effect; 2 unless measured otherwise (then the measurement is named beside it)
    bound: float = 2.0


@dataclass(frozen=True)
class Differs:
    """A known difference from one process, tested to still be one (``test_matrix.test_known_difference``): the
    cell becomes exact or refused when it is fixed; ``why`` is printed in docs/compatibility.md."""

    why: str


@dataclass(frozen=True)
class NotApplicable:
    """No test: ``why`` is printed in docs/compatibility.md."""

    why: str


@dataclass(frozen=True)
class ExactWithFix:
    """The column as the user runs it raises the underlying library's own error (not ours) naming the fix; with the
    fix (``<column>_find_unused``) it is exact."""

    why: str


Verdict = (
    Exact | EqualDDP | Bounded | MicroBatches | BoundedMG | Refused | NotApplicable | ExactWithFix | RoundingBounded
    | RefusedAt | Differs
)

_KFAC_PLUGIN = NotApplicable("`KFACMixedPrecision` is K-FAC's precision plugin: it needs the KFAC callback")
_DDP_REFERENCE = NotApplicable(
    "the reference run of this row's `= ddp` cells (`ddp` for the columns without K-FAC, `kfac_ddp` for the K-FAC "
    "columns), which equal it"
)
_DDP_UNUSED = ExactWithFix("DDP's own error at the second step names `find_unused_parameters=True`")
#: BackboneFinetuning unfreezes the backbone at the second epoch (after 2 steps); the callback freezing the first
#: convolution does so before the third step
_CHANGED = r"{}: parameters of {}.* {}: .*refused before it is taken.*between two trainer.fit calls"


def _trainability_refused(strategy: str) -> dict[str, Verdict]:
    return {"backbone_finetuning": RefusedAt(_CHANGED.format(strategy, "BackboneClassifier", "became trainable"), 2),
            "freeze_mid_run": RefusedAt(_CHANGED.format(strategy, "UserCNN", "were frozen"), 2)}


_DDP_TRAINABILITY = {
    "backbone_finetuning": NotApplicable(
        "Lightning's `DDPStrategy` reduces only the parameters trainable when it wrapped the model: the unfrozen "
        "backbone is never averaged and the ranks drift apart (no error); `layered_sgd` reduces it from that step"),
    "freeze_mid_run": NotApplicable(
        "Lightning's `DDPStrategy` leaves the bucket of a parameter frozen mid-run unreduced, takes that step on the "
        "bucket's local gradients and raises at the next forward (`find_unused_parameters=True` avoids it)"),
}


#: layered SGD's postponed update cannot re-evaluate a closure (its own refusal, before the first step)
_LAYERED_LBFGS = Refused(r"strategy='layered_sgd' postpones the optimizer step and cannot re-evaluate the closure "
                         r"that LBFGS needs")


def _data_parallel(column: str, kfac_reference_ddp: str) -> dict[str, Verdict]:
    cells: dict[str, Verdict] = {f: Exact() for f in FEATURES}
    if column.endswith("layered_sgd"):
        cells["lbfgs"] = _LAYERED_LBFGS
    cells.update(adam_f32=_KFAC_ROUNDING_ONLY, boring_adam_f32=_KFAC_ROUNDING_ONLY)
    cells["bf16_mixed"] = Bounded()
    cells["kfac_fp16_plugin"] = _KFAC_PLUGIN
    for f in ("demo_model", "lightning_transformer"):
        cells[f] = _DDP_REFERENCE if column == "ddp" else EqualDDP(kfac_reference_ddp)
    if column == "ddp":
        cells["two_optimizers_gan"] = cells["unused_parameter"] = _DDP_UNUSED
        cells.update(_DDP_TRAINABILITY)
    if column == "horovod":
        cells.update(_trainability_refused("strategy='horovod'"))
    return cells


#: K-FAC's float32 rounding rows (Adam, 8 steps): the user's CNN (measured 0.39x float32's own effect under
#: kfac_ddp) and Lightning's BoringModel, one sample per rank, whose 33 x 33 input factor has rank 2: the float32
#: rounding of the factor statistics (one process sums the global batch's outer products in one product, two
#: processes their own and then all-reduce) lands in its null space, where the damped inverse amplifies it by up to
#: (eigenvalue / damping) ~ 3e3, and Adam normalises it per coordinate: measured 2.9x float32's own effect (7.0e-6
#: against 2.4e-6; float32 decompositions 3.1x), hence a bound of 4x. With factor_dtype='float64' it is 0.32x.
_KFAC_ROUNDING = {"adam_f32": RoundingBounded("adam_f32_twin_f64"),
                  "boring_adam_f32": RoundingBounded("boring_adam_f32_twin_f64", bound=4.0)}
_KFAC_ROUNDING_ONLY = NotApplicable(
    "K-FAC's float32 rounding rows (Adam, float32, 8 steps): without K-FAC nothing amplifies float32 rounding (2 "
    "processes against one under `ddp`: 4.5e-8 for the CNN, 1.5e-8 for `BoringModel`); the float64 `adam` / `adamw` "
    "rows prove the method under every strategy")


def _kfac(column: str) -> dict[str, Verdict]:
    cells = _data_parallel(column, "kfac_ddp")
    cells.update(_KFAC_ROUNDING)
    cells.update(bf16_mixed=MicroBatches(), kfac_fp16_plugin=MicroBatches(),
                 boring_model=RoundingBounded("boring_model_own_f64"))
    if column == "kfac_ddp":
        cells.update(demo_model=_DDP_REFERENCE, lightning_transformer=_DDP_REFERENCE, unused_parameter=_DDP_UNUSED,
                     two_optimizers_gan=_DDP_UNUSED)
        cells.update(_trainability_refused("KFAC"))
    if column == "kfac_horovod":  # the strategy's own check comes first (after the backward pass)
        cells.update(_trainability_refused("strategy='horovod'"))
    return cells


def _kfac_spatial() -> dict[str, Verdict]:
    """The KFAC callback under the spatial strategy (2x1 tiles): the convolution's factors are each tile's share of
    KFC's sums (from the padded box the tile kernel records), summed over the tiles; the Linear layers after the
    gathered Flatten see replicated features.  Reference: KFAC on one process on the same samples."""
    cells = _spatial()
    cells.update(_KFAC_ROUNDING)
    cells.update(boring_model=RoundingBounded("boring_model_own_f64"))
    cells.update(_trainability_refused("KFAC"))
    cells["kfac_fp16_plugin"] = NotApplicable(
        "no test yet: with one sample group the micro-batch reference is the global batch, and the tiles' float16 "
        "rounding of the convolution's gradients needs a bound of its own (as `bf16_mixed` has under `spatial`)")
    cells["lightning_transformer"] = Differs(
        "its batches hold no image, so both ranks run the whole model on the same samples, each with its own "
        "dropout masks; K-FAC averages the two ranks' factors, one process has one mask (measured 3.5e-2)")
    return cells


def _hybrid_fc() -> dict[str, Verdict]:
    """hybrid_fc (2 ranks, scheme c, per-step head update).  Modules without a convolution, pooling or flatten
    (Lightning's demo modules, the GAN) have their last linear layers as the head; a trunk with nothing to train
    at the start (Flatten + Linear, a frozen stem, BackboneFinetuning's frozen backbone) is averaged by the strategy
    instead of DDP; a head layer tied to a trunk layer stays in the trunk; weight averaging's copy of the module is
    split as the model is; LBFGS's flat vectors are the whole model's on every rank (the head's blocks gathered).
    Refused as DDP refuses it: trainability changed mid-run under DDP's reducer, an unused trunk parameter."""
    cells: dict[str, Verdict] = {f: Exact() for f in FEATURES}
    cells.update(adam_f32=_KFAC_ROUNDING_ONLY, boring_adam_f32=_KFAC_ROUNDING_ONLY)
    cells.update(
        bf16_mixed=Bounded(micro_batches=False),
        kfac_fp16_plugin=_KFAC_PLUGIN,
        # the head found is the discriminator, whose last layer has one output: nothing to split over 2 ranks
        two_optimizers_gan=Refused(r"layer 'discriminator.2' \(16 -> 1\) is too small to split over 2 ranks.*"
                                   r"strategy='ddp'"),
        # DemoModel sums its loss (DDP's average halves it), LightningTransformer draws dropout masks per rank
        demo_model=EqualDDP("ddp"),
        lightning_transformer=EqualDDP("ddp"),
        unused_parameter=Refused(r"took no part in the loss.*HybridParallelStrategy\(find_unused_parameters=True\)",
                                 fixed=True),
        freeze_mid_run=_trainability_refused("strategy='hybrid_fc'")["freeze_mid_run"],
    )  # swa: the callback's copy of the module is split alike
    return cells


def _kfac_hybrid_fc() -> dict[str, Verdict]:
    """The KFAC callback under hybrid_fc (2 ranks, scheme c, per-step head update): the trunk's layers as under DDP,
    each sharded head layer as the whole layer (factors over its whole input and output from every sample, the
    whole gradient preconditioned; ``lightning_hpc.kfac.layers.ShardedLinearHandler``), so every layer is
    preconditioned as by KFAC on one process on the global batch (the reference).  The strategy's refusals come
    first (its setup runs before K-FAC hooks the layers; its trainability check before K-FAC's)."""
    cells = _hybrid_fc()
    cells.update(_KFAC_ROUNDING)
    cells.update(boring_model=RoundingBounded("boring_model_own_f64"), demo_model=EqualDDP("kfac_ddp"))
    # the transformer's head (its decoder) takes (batch, tokens, features), whose rows the head's sub-batches cut
    # without regard to samples: K-FAC counts rows / positions as the samples (6.6e-2 from kfac_ddp when it counted
    # the rows)
    cells["lightning_transformer"] = EqualDDP("kfac_ddp")
    # reduced precision: the head's sub-batches mix the ranks' samples, so no one-process run rounds as the ranks
    # do (no micro-batch reference); bounded against one process on the global batch instead.  bf16: measured 0.48x
    # bf16's own effect (kfac_ddp: 0.48x as well), bound 1x; the head left to the optimizer (what this column did
    # before the sharded layers were preconditioned) is 8.9x.  16-mixed through K-FAC's plugin (grad scaler), the
    # same amplification of the per-rank rounding, bound 1x as well: measured 0.01x float16's own effect on an Intel
    # CPU and 0.55x on an AMD EPYC one (the same code; no step skipped in either run, so rounding alone)
    cells["bf16_mixed"] = Bounded(micro_batches=False, bound=1.0)
    cells["kfac_fp16_plugin"] = Bounded(micro_batches=False, bound=1.0)
    return cells


def _spatial() -> dict[str, Verdict]:
    """Both processes hold tiles of the same samples (``spatial_parts=(2, 1)``): the user's CNN runs on 3-row tiles
    of its 6 x 6 images (halo convolutions, tiled pooling, a gathered Flatten); modules whose batches hold no
    N x C x H x W tensor compute the same on both ranks, and one process on the same batch is the reference."""
    cells: dict[str, Verdict] = {f: Exact() for f in FEATURES}
    cells.update(adam_f32=_KFAC_ROUNDING_ONLY, boring_adam_f32=_KFAC_ROUNDING_ONLY)
    # bf16: each tile's convolution weight gradient is rounded to bf16 before the sum over tiles (one process rounds
    # the whole sample's once), measured 0.86x bf16's own effect; a missing or doubled tile sum moves the weights
    # by more than 10x it
    cells.update(bf16_mixed=Bounded(micro_batches=False, bound=2.0), kfac_fp16_plugin=_KFAC_PLUGIN)
    # (l2_penalty_logged: a penalty over the convolution's weight uses it outside the split activations too; each
    # rank's penalty gets 1/P of its gradient, spatial.dispatch.parameter_check: exact)
    return cells


def _spatial3d() -> dict[str, Verdict]:
    """Both processes hold sub-volumes of the same samples (``spatial_parts=(2, 1, 1)``): the user's CNN on 2 x 4 x
    6 x 6 volumes (a Conv3d backbone: a halo exchange along D, tiled 3-D max pooling, a gathered Flatten); the
    features as for images, the modules without images (GAN, flatten, Lightning's demo modules) as they are."""
    return _spatial()


def _multigrid(column: str) -> dict[str, Verdict]:
    mode_mg = column == "multigrid"
    cells: dict[str, Verdict] = {f: BoundedMG() if mode_mg else Exact() for f in FEATURES}
    cells["kfac_fp16_plugin"] = _KFAC_PLUGIN
    cells.update(adam_f32=_KFAC_ROUNDING_ONLY, boring_adam_f32=_KFAC_ROUNDING_ONLY)
    cells["bf16_mixed"] = (
        # autocast does not reach mode 'mg''s batched (vmapped) steps: it crashed with a dtype mismatch
        Refused(r"mode='mg' does not support precision='bf16-mixed'.*'32-true'.*mode='pm'") if mode_mg
        else Bounded(micro_batches=False)
    )
    # the modules without a trunk of residual steps train data parallel over both ranks, as DDP does (a warning
    # says nothing is layer-parallel); no reducer: the GAN needs no find_unused_parameters, trainability may change
    cells.update({f: Exact() for f in _OWN_MODULES if f not in ("adam_f32", "boring_adam_f32")})
    cells.update(demo_model=EqualDDP("ddp"), lightning_transformer=EqualDDP("ddp"))
    cells.update(
        # on the ODE-ResNet, tied weights are one residual branch shared by every step
        tied_weights=Refused(r"steps '0' and '1' of the trunk share one parameter.*copy.deepcopy.*"
                             r"layer_parallel_size=1"),
    )  # swa: the callback's copy of the module is split alike
    return cells


MATRIX: dict[tuple[str, str], Verdict] = {
    (column, feature): verdict
    for column, cells in (
        ("ddp", _data_parallel("ddp", "ddp")),
        ("layered_sgd", _data_parallel("layered_sgd", "ddp")),
        ("horovod", _data_parallel("horovod", "ddp")),
        ("hybrid_fc", _hybrid_fc()),
        ("spatial", _spatial()),
        ("spatial3d", _spatial3d()),
        ("multigrid_pm", _multigrid("multigrid_pm")),
        ("multigrid", _multigrid("multigrid")),
        ("kfac_ddp", _kfac("kfac_ddp")),
        ("kfac_layered_sgd", _kfac("kfac_layered_sgd")),
        ("kfac_horovod", _kfac("kfac_horovod")),
        ("kfac_spatial", _kfac_spatial()),
        ("kfac_hybrid_fc", _kfac_hybrid_fc()),
    )
    for feature, verdict in cells.items()
}


def _cells(kind: type) -> list[tuple[str, str]]:
    return [(s, case_of(s, f)) for (s, f), v in MATRIX.items() if isinstance(v, kind)]


def _fixed_column(column: str) -> str:
    return f"{column}_find_unused"


#: final parameters (and logged metrics, predictions, stopping epoch) equal one process on the global batch
EXACT = _cells(Exact) + [
    (_fixed_column(s), case_of(s, f)) for (s, f), v in MATRIX.items()
    if isinstance(v, ExactWithFix) or (isinstance(v, Refused) and v.fixed)
]

#: float32 cells under K-FAC (see RoundingBounded): strategy x case -> its float64 twin (an EXACT cell too)
ROUNDING_BOUNDED = {(s, case_of(s, f)): v.twin for (s, f), v in MATRIX.items() if isinstance(v, RoundingBounded)}
ROUNDING_BOUND = {(s, case_of(s, f)): v.bound for (s, f), v in MATRIX.items() if isinstance(v, RoundingBounded)}
EXACT += [(s, twin) for (s, _), twin in ROUNDING_BOUNDED.items()]

#: strategy x case -> the 2-process launch it is compared with
REFERENCE_DDP = {(s, case_of(s, f)): v.reference for (s, f), v in MATRIX.items() if isinstance(v, EqualDDP)}
EQUAL_DDP = list(REFERENCE_DDP)

#: bf16-mixed (or 16-mixed through K-FAC's plugin): within a fraction of the reduced precision's own effect on one
#: process (see test_matrix.test_bounded; the yardstick is :func:`float32_reference`)
BOUNDED = _cells(Bounded)
BF16_BOUND = {(s, case_of(s, f)): v.bound for (s, f), v in MATRIX.items() if isinstance(v, Bounded)}

#: mode 'mg' (an iterative solve of the trunk's forward and adjoint, approximate by design: 2 cycles of two-level
#: MGRIT, run_case.MG_OPTIONS) on the ODE-ResNet: within MG_BOUND x the distance the solve's truncation alone
#: causes from one process on the global batch, and equal to one process running the same solve (see
#: test_matrix.test_bounded_multigrid)
BOUNDED_MG = _cells(BoundedMG)
#: the controls of BOUNDED_MG, on one process: one more cycle (must come closer to the serial result), N/c = 4
#: cycles (two-level MGRIT with F-relaxation is then exact), one cycle fewer (must break the bound)
MG_MORE_CYCLES, MG_EXACT_CYCLES, MG_FEWER_CYCLES = "multigrid_cycles3", "multigrid_cycles4", "multigrid_cycles1"

#: reduced precision, exact: final parameters equal one process that accumulates the data-parallel ranks' batches
#: as micro-batches (``accumulate_grad_batches`` = ranks), so every micro-batch is rounded as its rank rounds it;
#: what is left to differ is float32 summation order (test_matrix.test_equal_one_process_on_micro_batches).
#: ``kfac_fp16_plugin``: 16-mixed with a grad scaler through ``KFACMixedPrecision``.
MICRO_BATCHES = _cells(MicroBatches) + [
    (s, case_of(s, f)) for (s, f), v in MATRIX.items() if isinstance(v, Bounded) and v.micro_batches
]

#: (strategy, case, the message, a regular expression)
REFUSED = [(s, case_of(s, f), v.message) for (s, f), v in MATRIX.items() if isinstance(v, Refused)]
#: (strategy, case, the message, the steps taken before the refused one)
REFUSED_AT = [(s, case_of(s, f), v.message, v.global_step) for (s, f), v in MATRIX.items() if isinstance(v, RefusedAt)]

#: cells that differ from one process (see Differs)
DIFFERS = _cells(Differs)

#: cells that must fail: layered SGD without the update at once and the bucket rebuild (``run_case.broken_layered_sgd``)
#: on the rows that caught those defects (``test_matrix.test_negative_control``)
NEGATIVE_CONTROLS = [("layered_sgd_broken", f) for f in ("optimizer_step_override", "grad_norm_logging",
                                                         "backbone_finetuning")]
#: hybrid_fc with plain head blocks (``run_case.hybrid_fc_plain_blocks``: a norm or a penalty over the parameters
#: sees this rank's block of the head) on the rows about reductions over the model's parameters
NEGATIVE_CONTROLS += [("hybrid_fc_plain_blocks", f) for f in ("grad_norm_logging", "l2_penalty_logged")]
#: the same for the layer-sharded trunk (``run_case.multigrid_pm_plain_blocks``: plain step parameters)
NEGATIVE_CONTROLS += [("multigrid_pm_plain_blocks", f"odenet_{f}") for f in ("grad_norm_logging", "l2_penalty_logged")]

ALL_CELLS = [*NEGATIVE_CONTROLS, *DIFFERS, *EXACT, *ROUNDING_BOUNDED, *EQUAL_DDP, *BOUNDED, *BOUNDED_MG, *MICRO_BATCHES]
ALL_CELLS += [(s, c) for s, c, _ in REFUSED] + [(s, c) for s, c, _, _ in REFUSED_AT]


def float32_reference(case: str) -> str:
    """The one-process float32 run of a BOUNDED cell's module and data: the reduced precision's own effect is the
    distance between it and one process in that precision."""
    return case.replace("bf16_mixed", "fp32_for_bf16").replace("kfac_fp16_plugin", "fp32_for_bf16")


def micro_batch_reference(case: str) -> str:
    """The one-process reference case of a MICRO_BATCHES cell."""
    return f"{case}_micro_batches"


def kfac_reference(strategy: str) -> bool:
    return strategy.startswith("kfac_")


def under_horovodrun(strategy: str) -> bool:
    """Cells of this strategy run under ``horovodrun`` (and are skipped where Horovod is not installed)."""
    return strategy.removesuffix("_find_unused").endswith("horovod")
