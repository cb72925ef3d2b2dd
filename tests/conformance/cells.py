"""The conformance matrix: which (strategy, case) cells the suite runs and what each must show.

Strategies (``run_case.build_strategy``): ``ddp`` (checks the harness), ``layered_sgd``, ``hybrid_fc``
(``hybrid_fc_find_unused``: with the fix its unused-parameter error names), ``multigrid`` (mode 'mg', 2 layer
ranks, the approximate solve of ``run_case.MG_OPTIONS``; ``multigrid_cycles<k>``: the same with k cycles) and
``multigrid_pm`` (the partitioned model: layer-sharded trunk, both ranks see the same samples), ``horovod``
(under ``horovodrun``; skipped when ``horovod.torch`` is not importable), ``kfac_ddp`` / ``kfac_layered_sgd``
(the KFAC callback under that strategy; reference: KFAC on one process on the global batch).
"""

from __future__ import annotations

#: data-parallel ranks of each strategy on 2 processes (the reference's global batch is the union of theirs)
DATA_PARALLEL = {"multigrid_pm": 1, "multigrid": 1}

_FEATURES = ["sgd_step_lr", "adam", "validate_test", "fit_predict", "resume", "resume_2_to_1", "early_stopping",
             "torchmetrics", "frozen_parameters", "boring_model_f64"]

#: final parameters (and logged metrics, predictions, stopping epoch) equal one process on the global batch
EXACT = [
    ("layered_sgd", "clip_norm"),
    ("ddp", "clip_norm"),  # the harness itself: DDP is exact here
    ("hybrid_fc", "clip_norm"),
    ("hybrid_fc", "clip_value"),
    ("layered_sgd", "manual_clip"),
    ("ddp", "manual_clip"),
    ("hybrid_fc", "backbone_classifier"),
    ("hybrid_fc", "adamw"),
    ("layered_sgd", "adamw"),
    ("hybrid_fc", "accumulate_2"),
    ("layered_sgd", "accumulate_2"),
    ("hybrid_fc_find_unused", "unused_parameter"),  # the fix the error message names
    ("multigrid_pm", "odenet"),  # the trunk's steps are split over the 2 ranks; both see the same samples
    ("multigrid_pm", "odenet_clip_norm"),
    *[("ddp", f) for f in _FEATURES],
    *[("layered_sgd", f) for f in _FEATURES],
    ("layered_sgd", "two_optimizers_gan"),
    ("hybrid_fc", "manual_clip"),
    ("kfac_layered_sgd", "manual_clip"),
    ("layered_sgd", "unused_parameter"),
    *[("hybrid_fc", f) for f in ["sgd_step_lr", "adam", "validate_test", "resume", "resume_2_to_1", "early_stopping",
                                  "torchmetrics"]],
    *[("multigrid_pm", f"odenet_{f}") for f in ["sgd_step_lr", "adam", "validate_test", "fit_predict", "resume",
                                                 "resume_2_to_1", "early_stopping", "torchmetrics", "frozen_parameters",
                                                 "manual_clip"]],
    *[(k, f) for k in ("kfac_ddp", "kfac_layered_sgd") for f in [*_FEATURES, "clip_norm", "accumulate_2"]],
    ("kfac_layered_sgd", "unused_parameter"),
    *[("horovod", f) for f in ["sgd_step_lr", "adam", "clip_norm", "validate_test", "fit_predict", "resume",
                               "early_stopping", "torchmetrics", "frozen_parameters", "boring_model_f64",
                               "unused_parameter", "two_optimizers_gan", "manual_clip", "accumulate_2",
                               "resume_2_to_1"]],
]

#: modules that make DDP itself differ from one process (Lightning's DemoModel sums its loss, which DDP's mean
#: halves; LightningTransformer draws dropout masks per rank): final parameters equal DDP's (strategy -> the DDP
#: launch it is compared with)
REFERENCE_DDP = {
    ("ddp", "demo_model"): "ddp", ("ddp", "lightning_transformer"): "ddp",
    ("layered_sgd", "demo_model"): "ddp", ("layered_sgd", "lightning_transformer"): "ddp",
    ("horovod", "demo_model"): "ddp", ("horovod", "lightning_transformer"): "ddp",
    ("kfac_ddp", "demo_model"): "kfac_ddp", ("kfac_ddp", "lightning_transformer"): "kfac_ddp",
    ("kfac_layered_sgd", "demo_model"): "kfac_ddp", ("kfac_layered_sgd", "lightning_transformer"): "kfac_ddp",
}
EQUAL_DDP = [cell for cell in REFERENCE_DDP if cell[0] not in ("ddp", "kfac_ddp")]

#: bf16-mixed: within a quarter of bf16's own effect on one process (see test_matrix.test_bounded)
BOUNDED = [
    ("ddp", "bf16_mixed"), ("layered_sgd", "bf16_mixed"), ("hybrid_fc", "bf16_mixed"),
    ("multigrid_pm", "odenet_bf16_mixed"), ("horovod", "bf16_mixed"),
    # not KFAC: its preconditioner amplifies the per-rank bf16 rounding to ~70% of bf16's own effect (measured),
    # so no bound that tells a defect from rounding holds there; its bf16 cells are MICRO_BATCHES cells
]

#: mode 'mg' (an iterative solve of the trunk's forward and adjoint, approximate by design: 2 cycles of two-level
#: MGRIT, run_case.MG_OPTIONS) on the ODE-ResNet: within MG_BOUND x the distance the solve's truncation alone
#: causes from one process on the global batch, and equal to one process running the same solve (see
#: test_matrix.test_bounded_multigrid)
BOUNDED_MG = [("multigrid", f"odenet{f}") for f in ["", "_sgd_step_lr", "_adam", "_clip_norm", "_validate_test",
                                                     "_fit_predict", "_resume", "_resume_2_to_1", "_early_stopping",
                                                     "_torchmetrics", "_frozen_parameters", "_manual_clip"]]
#: the controls of BOUNDED_MG, on one process: one more cycle (must come closer to the serial result), N/c = 4
#: cycles (two-level MGRIT with F-relaxation is then exact), one cycle fewer (must break the bound)
MG_MORE_CYCLES, MG_EXACT_CYCLES, MG_FEWER_CYCLES = "multigrid_cycles3", "multigrid_cycles4", "multigrid_cycles1"

#: reduced precision, exact: final parameters equal one process that accumulates the data-parallel ranks' batches
#: as micro-batches (``accumulate_grad_batches`` = ranks), so every micro-batch is rounded as its rank rounds it;
#: what is left to differ is float32 summation order (test_matrix.test_equal_one_process_on_micro_batches).
#: ``kfac_fp16_plugin``: 16-mixed with a grad scaler through ``KFACMixedPrecision``.
MICRO_BATCHES = [
    ("ddp", "bf16_mixed"), ("layered_sgd", "bf16_mixed"), ("horovod", "bf16_mixed"),
    *[(k, c) for k in ("kfac_ddp", "kfac_layered_sgd") for c in ("bf16_mixed", "kfac_fp16_plugin")],
]


def micro_batch_reference(case: str) -> str:
    """The one-process reference case of a MICRO_BATCHES cell."""
    return f"{case}_micro_batches"

_NO_TRUNK = r"searched the layers of {}.*found none.*strategy='ddp'"
_MG_TRUNK = r"MultigridStrategy\(trunk='steps'\): the model \({}\) has no attribute 'steps'; set trunk="
REFUSED = [
    # Lightning's BoringModel is one nn.Linear: no data-parallel trunk for hybrid_fc to pair with its head
    ("hybrid_fc", "boring_model", _NO_TRUNK.format("BoringModel")),
    ("hybrid_fc", "demo_model", _NO_TRUNK.format("DemoModel")),
    ("hybrid_fc", "lightning_transformer", _NO_TRUNK.format("LightningTransformer")),
    ("hybrid_fc", "two_optimizers_gan", _NO_TRUNK.format("UserGAN")),
    # Flatten + Linear: the head is found, but nothing before it trains
    ("hybrid_fc", "flatten_linear", r"no trainable parameter outside the fully-connected head.*strategy='ddp'"),
    # a frozen trunk (fine-tuning only the head): no data-parallel part left
    (
        "hybrid_fc",
        "frozen_parameters",
        r"no trainable parameter outside the fully-connected head.*frozen.*strategy='ddp'",
    ),
    # Lightning's predict sampler gives ranks unequal batches; the sharded head needs every rank in each batch
    ("hybrid_fc", "predict", r"cannot run trainer.predict on several processes.*Trainer\(devices=1\)"),
    # autocast does not reach multigrid's batched (vmapped) steps: it crashed with a dtype mismatch
    ("multigrid", "odenet_bf16_mixed", r"mode='mg' does not support precision='bf16-mixed'.*'32-true'.*mode='pm'"),
    ("multigrid", "boring_model_f64", _MG_TRUNK.format("BoringModel")),
    ("multigrid", "demo_model", _MG_TRUNK.format("DemoModel")),
    ("multigrid", "lightning_transformer", _MG_TRUNK.format("Transformer")),
    ("multigrid_pm", "boring_model_f64", _MG_TRUNK.format("BoringModel")),
    ("multigrid_pm", "two_optimizers_gan", _MG_TRUNK.format("UserGAN")),
    ("multigrid_pm", "demo_model", _MG_TRUNK.format("DemoModel")),
    ("multigrid_pm", "lightning_transformer", _MG_TRUNK.format("Transformer")),
    # K-FAC's factors, step counter and KL clip belong to one optimizer step per training step
    ("kfac_ddp", "two_optimizers_gan", r"KFAC supports one optimizer.*parameter group per sub-network"),
    ("kfac_layered_sgd", "two_optimizers_gan", r"KFAC supports one optimizer.*parameter group per sub-network"),
]

#: errors during training (not cells of the matrix) whose message must name this strategy's fix
ERRORS = [
    # DDP's reducer finds the unused parameter at the second step; Lightning's advice would name DDP's strategies
    ("hybrid_fc", "unused_parameter", r"HybridParallelStrategy\(find_unused_parameters=True\)"),
]

ALL_CELLS = EXACT + EQUAL_DDP + BOUNDED + BOUNDED_MG + MICRO_BATCHES + [(s, c) for s, c, _ in REFUSED]


def kfac_reference(strategy: str) -> bool:
    return strategy.startswith("kfac_")
