"""Write docs/compatibility.md from the results of the conformance suite (tests/conformance).

    python scripts/compat_matrix.py            # runs the suite (2-process Trainer cells, batched per strategy)
    python scripts/compat_matrix.py --junit results.xml   # or reads a JUnit file pytest already wrote
                                                          # (with -o junit_family=xunit1 for the compiled notes)

Every cell is a test: "exact" = final parameters equal one process on the global batch (float64, 1e-9),
"= ddp" = equal to DDP (modules that make DDP itself differ from one process), "bounded" = within a tested bound,
"bounded (MG)" = the multigrid strategy's mode 'mg' (approximate by design) within a bound derived from its own
truncation error,
"refused" = the strategy stopped before the first optimizer step with the fix named, "refused at the change" =
stopped before the step after parameters changed trainability mid-run, "differs" = a documented difference from
one process, tested to still be one, "FAILS" = the test failed,
"skipped" = not run here (Horovod not installed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "compatibility.md"
CELL = re.compile(
    r"test_(two_processes_equal_one|equal_ddp|bounded_multigrid|bounded|equal_one_process_on_micro_batches"
    r"|rounding_bounded|known_difference|refused_before_the_step_that_changed_trainability"
    r"|refused_before_training_with_the_fix_named)"
    r"\[(?P<strategy>[a-z0-9_]+)-(?P<case>[a-z0-9_]+)\]"
)
KIND = {"two_processes_equal_one": "exact", "equal_ddp": "= ddp", "bounded": "bounded",
        "bounded_multigrid": "bounded (MG)",
        "equal_one_process_on_micro_batches": "exact (micro-batches)",
        "rounding_bounded": "exact in float64; float32 bounded",
        "refused_before_training_with_the_fix_named": "refused",
        "refused_before_the_step_that_changed_trainability": "refused at the change",
        "known_difference": "differs"}
#: a cell tested two ways is shown by its stronger result (bf16: bounded on the global batch, exact on micro-batches)
_RANK = {"FAILS": 3, "exact (micro-batches)": 2}


def run_suite() -> Path:
    junit = Path(tempfile.mkdtemp()) / "conformance.xml"
    subprocess.run(
        # xunit1: the family whose test cases carry the tests' recorded properties (compiled_notes)
        [sys.executable, "-m", "pytest", "-q", "tests/conformance", f"--junitxml={junit}", "-o", "junit_family=xunit1"],
        cwd=REPO, check=False,
    )
    return junit


def cells(junit: Path) -> dict[tuple[str, str], str]:
    found: dict[tuple[str, str], str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        m = CELL.search(case.get("name", ""))
        if m is None:
            continue
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        verdict = "FAILS" if failed else ("skipped" if skipped else KIND[m.group(1)])
        key = (m["strategy"], m["case"])
        if _RANK.get(verdict, 1) >= _RANK.get(found.get(key, ""), 0):
            found[key] = verdict
    return found


def compiled_notes(junit: Path) -> dict[tuple[str, str], str]:
    """How each exact cell with a ``torch.compile``d module ran under the spatial strategy (the test's ``compiled``
    property): ``"compiled"`` (its split step one compiled graph), ``"compiled, K-FAC"`` (compiled, the forwards
    whose statistics K-FAC captured run eagerly) or ``"eager: <why>"``."""
    notes: dict[tuple[str, str], str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        m = CELL.search(case.get("name", ""))
        prop = case.find("properties/property[@name='compiled']")
        if m is None or prop is None:
            continue
        state = json.loads(prop.get("value", "{}"))
        refused = [s["refused"] for s in state.values() if s["refused"]]
        eager_calls = sum(s.get("eager_calls", 0) for s in state.values())
        notes[(m["strategy"], m["case"])] = (f"eager: {refused[0]}" if refused
                                             else "compiled, K-FAC" if eager_calls else "compiled")
    return notes


def _conformance_cells() -> Any:
    """``tests/conformance/cells.py``: the matrix's columns, features and verdicts."""
    if str(REPO / "tests" / "conformance") not in sys.path:
        sys.path.insert(0, str(REPO / "tests" / "conformance"))
    import cells as conformance

    return conformance


def _verdict(c: Any, found: dict[tuple[str, str], str], column: str, feature: str, reasons: list[str],
             notes: dict[tuple[str, str], str]) -> str:
    """What the suite showed for one cell of the matrix (the fix's column merged in), or the reason it has none."""
    verdict = c.MATRIX[(column, feature)]
    if isinstance(verdict, c.NotApplicable):
        if verdict.why not in reasons:
            reasons.append(verdict.why)
        return f"n/a ({reasons.index(verdict.why) + 1})"
    case = c.case_of(column, feature)
    shown = found.get((column, case), "")
    if isinstance(verdict, c.Differs):  # the reason is printed below the table, like n/a's
        if verdict.why not in reasons:
            reasons.append(verdict.why)
        return f"{shown or 'not run'} ({reasons.index(verdict.why) + 1})"
    note = notes.get((column, case))
    if note is not None and shown:
        if note.startswith("eager: "):
            why = f"the compiled module's split step ran eagerly through the dispatch, exactly: {note[7:]}"
            if why not in reasons:
                reasons.append(why)
            shown = f"{shown}, eager ({reasons.index(why) + 1})"
        elif note == "compiled, K-FAC":
            shown = f"{shown}, compiled (K-FAC's capture steps eager)"
        else:
            shown = f"{shown}, compiled"
    fixed = found.get((f"{column}_find_unused", case), "")
    if isinstance(verdict, c.ExactWithFix):
        suffix = "" if fixed == "exact" else f" ({fixed or 'not run'})"
        return f"exact with `find_unused_parameters=True`{suffix}"
    if fixed:
        shown = f"{shown}; with `find_unused_parameters=True`: {fixed}"
    return shown or "not run"


def write(found: dict[tuple[str, str], str], notes: dict[tuple[str, str], str]) -> None:
    c = _conformance_cells()
    reasons: list[str] = []
    rows = [[_verdict(c, found, s, f, reasons, notes) for s in c.COLUMNS] for f in c.FEATURES]
    refused = [sum(row[i].startswith("refused") for row in rows) for i in range(len(c.COLUMNS))]
    skipped = any(v.startswith("skipped") for row in rows for v in row)
    counted = f"{sum(refused)} refused cells in all{', skipped cells not counted' if skipped else ''}"
    lines = [
        "# Compatibility matrix",
        "",
        f"Generated by `python scripts/compat_matrix.py` from the conformance suite (`tests/conformance/`) on "
        f"{datetime.date.today().isoformat()}. Each column's header and the last row count its refused cells "
        f"({counted}). "
        "Each cell runs a module written as a user would (plain mean loss, `self.log(..., sync_dist=True)`, SGD "
        "with momentum and weight decay unless the feature says otherwise), or one of Lightning's own demo "
        "modules, through `Trainer` on 2 CPU processes (gloo) and compares with one process on the global batch "
        "(float64, 1e-9; float32 modules 1e-6): the final parameters, and what the feature observes besides "
        "(validate / test metrics, predictions, the epoch EarlyStopping stopped at): **exact**. **= ddp**: equal "
        "to DDP, for modules that make DDP itself differ from one process (`demo_model` sums its loss, which DDP's"
        " average halves; `lightning_transformer` draws dropout masks per rank; the `ddp` / `kfac_ddp` runs of "
        "these two modules are the references; under `hybrid_fc` the cell runs `LightningTransformer` in "
        "float64, where it equals DDP to 3.9e-15: in float32 its head's products over the gathered sub-batches "
        "round otherwise than DDP's per-rank ones, 5.2e-6 apart after 3 steps). **bounded**: bf16-mixed, within "
        "25% of bf16's own effect (the distance between one process in bf16-mixed and in float32; measured 5%; "
        "under `hybrid_fc`, whose sharded head rounds where one process's autocast rounds, after the ranks' "
        "partial products are summed, 1.7% on a 3-layer head of width 64 where DDP is at 6%: "
        "`tests/hybrid_fc/test_hybrid_bf16.py`). **exact (micro-batches)**: reduced precision (`bf16_mixed`; "
        "`kfac_fp16_plugin`, 16-mixed with a grad scaler through `KFACMixedPrecision`), equal (float32, 1e-6; "
        "measured 0 without K-FAC, 6e-8 with it) to one process that accumulates the ranks' batches as "
        "micro-batches, so each is rounded as its rank rounds it; these cells are also bounded against one process"
        " on the global batch where a bound holds. **exact in float64; float32 bounded**: a float32 module under "
        "K-FAC (Lightning's `BoringModel` on its own data, one sample per rank; the user's CNN and `BoringModel` "
        "with Adam, 8 steps), whose preconditioner amplifies float32 rounding: the same module and data in float64"
        " is exact (1e-9; measured 4e-15), and the float32 weights are within a bound of float32's own effect (one"
        " process in float32 against float64) of one float32 process: 2x (measured 0.84x for `boring_model`, 0.39x"
        " for `adam_f32`) or, for `boring_adam_f32`, 4x (measured 2.9x; see docs/kfac.md). **bounded (MG)**: "
        "`MultigridStrategy(mode='mg')`, which solves the trunk's forward and adjoint by 2 multigrid cycles "
        "(two-level MGRIT, coarsening factor 2, F-relaxation, on the 8-step trunk), so it is approximate by "
        "design: the final parameters are within 2x the distance the solve's truncation alone causes (the same "
        "solve on one process; measured: the 2-rank run is that solve bit for bit) from one process on the global "
        "batch, and what the feature observes equals that one-process solve (1e-9; for `predict`, which trains "
        "nothing, the predictions of that solve). The yardstick is checked each time: one more cycle comes at "
        "least 5x closer (measured 21x to 320x), 4 cycles (N/c, where this MGRIT is exact) equal one process to "
        "1e-9, and one cycle fewer breaks the bound. **refused**: the strategy stopped before the first optimizer "
        "step (no rank took a step) with a message naming the fix (the split strategies refuse at setup what their"
        " split parameters cannot make global, by reason class (an optimizer's flat view of every parameter,"
        " `LBFGS`'s, is the whole model's on every rank, and weight averaging's copies are split alike: neither is"
        " refused): a tensor in two places (a branch "
        "shared by "
        "multigrid's steps, a named hybrid head tied to a trunk layer), a layer too small to split (a hybrid head "
        "layer with fewer inputs or outputs than ranks: the GAN's one-logit discriminator); under K-FAC, "
        "hybrid_fc's head fed `(batch, tokens, features)`, whose "
        "sub-batches split a sample's positions over the ranks where K-FAC sums them; layered SGD refuses LBFGS's "
        "repeated closure; as DDP refuses it: an"
        " unused trunk parameter, trainability changed under DDP's reducer); where the fix is a setting "
        "(`find_unused_parameters=True`), the cell also shows the run with it. **refused at the change**: "
        "parameters became trainable or frozen mid-run (after 2 steps); every rank stopped before the step that "
        "would have applied unreduced gradients, naming the parameters and the fix. **differs (k)**: a known "
        "difference from one process (reason k below the table), tested to still be one. **skipped**: Horovod is "
        "not installed where the matrix was generated. **, compiled** (after a `torch_compile` verdict under the "
        "spatial strategies): the `torch.compile`d module's split step ran as compiled graphs of tile operations "
        "(`lightning_hpc.spatial.compile`; the test checks it); **(K-FAC's capture steps eager)**: under K-FAC, the "
        "forwards whose statistics K-FAC captures (factor-update steps: every second step in this row) ran eagerly, "
        "the others as the compiled graph; **, eager (k)**: it ran eagerly through the "
        "dispatch instead, for reason k below the table. **n/a (k)**: no test, for reason k below the table. "
        "**FAILS**: the test failed where the matrix was generated.",
        "",
        "Columns: `ddp` is Lightning's own `DDPStrategy` (the harness: it checks the references); "
        "`spatial` is `SpatialParallelStrategy(spatial_parts=(2, 1))` (reference: one process on the same samples); "
        "`spatial3d` is `SpatialParallelStrategy(spatial_parts=(2, 1, 1))` with the user's CNN on volumes "
        "(2 x 4 x 6 x 6 samples, a Conv3d backbone: sub-volumes split along D; the rows whose data are not the "
        "user's images run as they are); "
        "`kfac_ddp` / `kfac_layered_sgd` / `kfac_horovod` / `kfac_spatial` / `kfac_hybrid_fc` are the `KFAC` "
        "callback under that strategy (reference: KFAC on one process on the global batch; for `kfac_spatial`, on "
        "the same samples; under `kfac_hybrid_fc` every layer is preconditioned, each sharded head layer as the "
        "whole layer, see docs/kfac.md); "
        "the `horovod`, `spatial3d`, `multigrid`, `kfac_horovod`, `kfac_spatial` and `kfac_hybrid_fc` cells run in "
        "the slow test tier; `multigrid_pm` is "
        "`MultigridStrategy(mode='pm')` (the trunk's "
        "steps split over the 2 ranks, serial evaluation), `multigrid` is mode 'mg' (an iterative solve, not exact "
        "by design: its cells are bounded (MG) or refused). The multigrid columns train a deep ODE-ResNet (the form "
        "their strategy is for) with each feature; the rows that are modules of their own (the GAN, "
        "`backbone_classifier`, `flatten_linear` and Lightning's demo modules) have no trunk of residual steps: "
        "the strategy trains them data parallel over both ranks, as DDP does, and warns that nothing is "
        "layer-parallel (their references are the data-parallel columns'). After every "
        "stage (`fit`, `validate`, `test`, `predict`) the split strategies (`hybrid_fc`, `multigrid_pm`, `multigrid`) "
        "hand the user's module back whole on every rank: the user's containers, every parameter whole (the sharded "
        "head gathered into the user's `nn.Linear` layers, every residual step present), so `state_dict()` loads "
        "strictly into the user's class and the forward runs on one rank alone "
        "(`tests/hybrid_fc/test_hybrid_handback.py`, `tests/multigrid/test_handback.py`).",
        "",
        "| feature | " + " | ".join(f"`{s}` ({n} refused)" for s, n in zip(c.COLUMNS, refused)) + " |",
        "|---|" + "---|" * len(c.COLUMNS),
    ]
    for f, row in zip(c.FEATURES, rows):
        lines.append(f"| `{f}` | " + " | ".join(row) + " |")
    label = f"refused cells ({sum(refused)}{', skipped cells not counted' if skipped else ''})"
    lines.append(f"| **{label}** | " + " | ".join(map(str, refused)) + " |")
    lines += [""] + [f"- ({k}) {why}." for k, why in enumerate(reasons, 1)] + [
        "",
        "Features: `sgd` (SGD with momentum and weight decay), "
        "`sgd_step_lr` (SGD with momentum and weight decay, a StepLR scheduler stepping every optimizer "
        "step), `adam` / `adamw`, `clip_norm` / `clip_value` (`gradient_clip_val` with each algorithm), "
        "`accumulate_2` (`accumulate_grad_batches=2`), `manual_clip` (manual optimization with `self.clip_gradients` "
        "between `manual_backward` and `step`), `two_optimizers_gan` (a GAN: manual optimization, a generator and a "
        "discriminator optimizer), `bf16_mixed` (`precision='bf16-mixed'`, float32 module), `kfac_fp16_plugin` "
        "(`plugins=[KFACMixedPrecision('16-mixed')]`, float32 module), `validate_test` (after "
        "fit, `trainer.validate` and `trainer.test` with Lightning's samplers: the returned `sync_dist` metrics), "
        "`torchmetrics` (the same with a `torchmetrics.Accuracy` logged as an object), `fit_predict` (after fit, "
        "`trainer.predict` with Lightning's unpadded predict sampler on 45 samples: every sample predicted once, "
        "equal to one process), `predict` (`trainer.predict` alone), `resume` (fit one epoch, checkpoint, resume a "
        "second epoch from it, scheduler and momentum included), `resume_2_to_1` (the second epoch on one process "
        "from the 2-process checkpoint), `early_stopping` (EarlyStopping on the synced `val_loss`: every rank stops "
        "at the epoch one process stops at), `frozen_parameters` (the first convolution `requires_grad=False`), "
        "`unused_parameter` (a trunk layer outside the loss), `backbone_classifier` (network split into "
        "`self.backbone` + `self.classifier`), `flatten_linear` (Flatten + Linear only), `boring_model` / "
        "`boring_model_f64` (Lightning's `BoringModel`, with its own data / in float64 on the suite's data), "
        "`demo_model` (Lightning's `DemoModel`), `lightning_transformer` (Lightning's `LightningTransformer`, float32, "
        "on WikiText2-format synthetic text), `optimizer_step_override` (the module's `optimizer_step` clamps the "
        "weights after `optimizer.step()`; on the ODE-ResNet it shrinks them by 1%), `grad_norm_logging` (the "
        "gradient norm logged in `on_before_optimizer_step`: every line the logger receives, step by step, equals one "
        "process's), `backbone_finetuning` (Lightning's `BackboneFinetuning` on `backbone_classifier`: the backbone "
        "frozen for the first epoch, unfrozen at the second), `freeze_mid_run` (a callback freezing the first "
        "convolution before the third step), `adam_f32` / `boring_adam_f32` (the user's CNN / `BoringModel` in "
        "float32 with Adam, 8 steps: K-FAC's float32 rounding).",
        "",
        "bf16-mixed under KFAC has no bound against one process on the global batch (K-FAC's preconditioner "
        "amplifies the per-rank bf16 rounding: the 2-process weights differ from one bf16 process by ~70% of bf16's "
        "own effect, against 5% without K-FAC); its cells are exact on micro-batches. Under `kfac_hybrid_fc`, whose "
        "head mixes the ranks' samples in its sub-batches (no micro-batch reference), bf16-mixed is bounded at 1x "
        "bf16's own effect (measured 0.48x; the head left unpreconditioned: 8.9x) and 16-mixed through "
        "`KFACMixedPrecision` at 1x float16's own effect as well (measured 1% on an Intel CPU and 55% on an AMD "
        "EPYC one, the same code, no step skipped: K-FAC amplifying the per-rank rounding, as in bf16). "
        "Not in this matrix (tested against its own tolerances in `tests/multigrid/`): the multigrid strategy's "
        "mode 'mg' with other hierarchies, cycle counts or depths than the bounded (MG) cells'.",
        "",
        "The `spatial` column runs the matrix's modules with both processes holding 3-row tiles of the same 6 x 6 "
        "images (`spatial_parts=(2, 1)`; modules whose batches hold no image train replicated). The model idioms "
        "that matter for images split over ranks have their own tests in `tests/spatial/lightning/`: "
        "`test_split_equals_one_process.py` (U-Nets with pad-to-skip and centre crops, "
        "transposed convolutions, subclasses and parametrizations, padding modes, SE blocks, per-pixel Linear, "
        "attention over positions, dropout, Flatten + Linear heads, layers registered under two names, at 2x1, "
        "1x2 and uneven tiles: exact or refused), `test_dropout_seeding.py` (U-Nets with dropout, 2-D at 2x1 and "
        "3-D at 1x1x2, after one `seed_everything` before the model is built: as one process), "
        "`test_observed_gradients_and_metrics.py` (hooks, `torch.autograd.grad`, manual optimization with "
        "`clip_gradients`, torchmetrics sums and confusion matrices, bf16-mixed bounded, 2 sample groups x 2 tiles, "
        "`trainer.predict`) and `test_lightning_features.py` (Lightning's sampler, a step scheduler, synced "
        "validation, torchmetrics, EarlyStopping, ModelCheckpoint, resuming the checkpoint on one process).",
        "",
    ]
    OUT.write_text("\n".join(lines))
    print(f"wrote {OUT.relative_to(REPO)} ({len(found)} cells)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--junit", type=Path, help="read this JUnit XML instead of running the suite")
    args = parser.parse_args()
    junit = args.junit or run_suite()
    found = cells(junit)
    if not found:
        print("no conformance results found", file=sys.stderr)
        return 1
    write(found, compiled_notes(junit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
