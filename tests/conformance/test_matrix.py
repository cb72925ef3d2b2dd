"""The drop-in conformance matrix (cells in ``cells.py``): users' modules and Lightning's own demo modules with the
Lightning features people use, under every strategy and the KFAC callback, through ``Trainer`` on 2 processes.

Each cell is one of:

* exact: the final parameters equal one process on the global batch (float64, 1e-9), and so do what the case
  observes besides: the metrics ``trainer.validate`` / ``trainer.test`` return (logged with ``sync_dist=True``,
  torchmetrics objects), the epoch and step EarlyStopping stopped at, every prediction of ``trainer.predict``
  (each sample once, over the ranks' unequal shards), training resumed from a checkpoint (on 2 processes, or
  on 1 from a 2-process checkpoint);
* equal to DDP: for modules that make DDP itself differ from one process (a summed loss, dropout);
* bounded: bf16-mixed, within a quarter of bf16's own effect (see :func:`test_bounded`);
* exact on micro-batches: reduced precision (bf16-mixed; 16-mixed with K-FAC's plugin), equal to one process
  that accumulates the ranks' batches as micro-batches, each rounded as its rank rounds it
  (:func:`test_equal_one_process_on_micro_batches`);
* refused: an error before the first optimizer step whose message names the fix.
"""

from __future__ import annotations

import re

import pytest
import torch
from cells import (
    BOUNDED,
    DATA_PARALLEL,
    EQUAL_DDP,
    ERRORS,
    EXACT,
    MICRO_BATCHES,
    REFERENCE_DDP,
    REFUSED,
    kfac_reference,
    micro_batch_reference,
)
from launch import CaseResult

#: float64 cells: a wrong reduction, a stale weight or a skipped step moves the weights by ~1e-2 or more
TOL64 = 1e-9
#: float32 cells (LightningTransformer) against DDP: the same float32 operations, equal to rounding
TOL32 = 1e-6
#: reduced precision against one process on the ranks' micro-batches: float32 summation order only (measured:
#: 0 without K-FAC, 6e-8 with it; rounding the global batch at once instead: 1.2e-4, with K-FAC 4e-2)
TOL_MICRO = 1e-6


def _params(cells):
    """Cells as pytest params, the horovod ones marked ``horovod`` like the rest of the Horovod tests."""
    return [pytest.param(*c, id=f"{c[0]}-{c[1]}", marks=[pytest.mark.horovod] if c[0] == "horovod" else [])
            for c in cells]


def _max_diff(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert got.keys() == ref.keys()
    return max((got[k].double() - ref[k].double()).abs().max().item() for k in ref)


def _trained(result: CaseResult, what: str) -> None:
    assert result.error is None, f"{what} raised:\n{result.error}\n{result.log}"
    for rank, r in enumerate(result.ranks):
        assert r["steps"] > 0, f"{what}: rank {rank} took no optimizer step"


def _run(runs, strategy: str, case: str) -> CaseResult:
    return runs.resumed_on_one(strategy, case) if case.endswith("_2_to_1") else runs.two(strategy, case)


def _same_observations(got: CaseResult, ref: CaseResult, what: str, data_parallel: int) -> None:
    for key in ("validate", "test"):
        if key in ref.ranks[0]:
            for r in got.ranks:  # every rank returns the synced metrics
                g, e = r[key][0], ref.ranks[0][key][0]
                assert g.keys() == e.keys(), what
                for name in e:
                    assert abs(g[name] - e[name]) < TOL64, f"{what}: {key} {name} = {g[name]}, one process {e[name]}"
    if "early_stopping" in ref.path.name:
        assert ref.ranks[0]["global_step"] < 12, "the reference did not stop early: the cell would prove nothing"
        for r in got.ranks:
            assert (r["epoch"], r["global_step"]) == (ref.ranks[0]["epoch"], ref.ranks[0]["global_step"]), what
    preds = sorted(got.path.glob("pred_rank*.pt"))
    if (ref.path / "pred_rank0.pt").exists():
        assert len(preds) == len(got.ranks), f"{what}: predictions of {len(preds)} ranks"
        expected = _predictions([ref.path / "pred_rank0.pt"], what)
        # data-parallel ranks predict disjoint shards; ranks of one layer chain (multigrid_pm) predict every sample
        for files in [preds] if data_parallel > 1 else [[f] for f in preds]:
            merged = _predictions(files, what)
            assert merged.keys() == expected.keys(), f"{what}: predicted samples differ from one process's"
            worst = max((merged[i] - expected[i]).abs().max().item() for i in expected)
            assert worst < TOL64, f"{what}: predictions differ from one process by {worst:.3g}"


def _predictions(files, what: str) -> dict[int, torch.Tensor]:
    merged: dict[int, torch.Tensor] = {}
    for f in files:
        for index, logits in torch.load(f, weights_only=False):
            for i, row in zip(index.tolist(), logits):
                assert i not in merged, f"{what}: sample {i} predicted twice"
                merged[i] = row
    return merged


@pytest.mark.parametrize(("strategy", "case"), _params(EXACT))
def test_two_processes_equal_one(strategy, case, runs):
    what = f"{strategy} x {case}"
    got = _run(runs, strategy, case)
    _trained(got, what)
    dp = DATA_PARALLEL.get(strategy, 2)
    ref = runs.one(case.replace("_2_to_1", ""), dp, kfac=kfac_reference(strategy))
    _trained(ref, f"one process x {case}")
    worst = _max_diff(got.params(), ref.params())
    assert worst < TOL64, f"{what}: final parameters differ from one process by {worst:.3g}"
    _same_observations(got, ref, what, dp)


@pytest.mark.parametrize(("strategy", "case"), _params(EQUAL_DDP))
def test_equal_ddp(strategy, case, runs):
    what = f"{strategy} x {case}"
    got = runs.two(strategy, case)
    _trained(got, what)
    ref = runs.two(REFERENCE_DDP[(strategy, case)], case)
    _trained(ref, f"ddp x {case}")
    params = got.params()
    tol = TOL64 if all(p.dtype == torch.float64 for p in params.values()) else TOL32
    worst = _max_diff(params, ref.params())
    assert worst < tol, f"{what}: final parameters differ from DDP by {worst:.3g}"


@pytest.mark.parametrize(("strategy", "case"), _params(BOUNDED))
def test_bounded(strategy, case, runs):
    """bf16-mixed (float32 module, SGD lr 0.05): each rank rounds its half-batch activations and gradients to bf16
    where one process rounds the whole batch's, so the 2-process weights differ from one bf16 process by
    rounding: measured 5% of the distance between one process in bf16-mixed and in float32 (bf16's own effect),
    for DDP, layered_sgd and hybrid_fc alike.  The bound is 25% of it; a wrong reduction (a sum, a missing
    average, a stale step) moves the weights by ~10x bf16's effect."""
    what = f"{strategy} x {case}"
    got = runs.two(strategy, case)
    _trained(got, what)
    dp = DATA_PARALLEL.get(strategy, 2)
    kfac = kfac_reference(strategy)
    ref16, ref32 = runs.one(case, dp, kfac), runs.one(case.replace("bf16_mixed", "fp32_for_bf16"), dp, kfac)
    bf16_effect = _max_diff(ref16.params(), ref32.params())
    assert bf16_effect > 0, "bf16-mixed changed nothing: the bound would be vacuous"
    worst = _max_diff(got.params(), ref16.params())
    assert worst <= 0.25 * bf16_effect, (
        f"{what}: final parameters differ from one bf16-mixed process by {worst:.3g}, more than 25% of bf16's own "
        f"effect ({bf16_effect:.3g})"
    )


@pytest.mark.parametrize(("strategy", "case"), _params(MICRO_BATCHES))
def test_equal_one_process_on_micro_batches(strategy, case, runs):
    """Reduced precision with the rounding taken out: one process accumulating the ranks' batches as
    micro-batches rounds each exactly as its rank does, so the 2-process weights must equal it up to float32
    summation order (the gradient average, the factors' all-reduce).  A wrong reduction, a loss scale left in
    K-FAC's G factor, or a skipped step moves them by far more; so does rounding the global batch at once (one
    process on the global batch must be far outside the tolerance, or the test could not tell)."""
    what = f"{strategy} x {case}"
    got = runs.two(strategy, case)
    _trained(got, what)
    dp, kfac = DATA_PARALLEL.get(strategy, 2), kfac_reference(strategy)
    ref = runs.one(micro_batch_reference(case), dp, kfac)
    _trained(ref, f"one process x {micro_batch_reference(case)}")
    rounding = _max_diff(runs.one(case, dp, kfac).params(), ref.params())
    assert rounding > 10 * TOL_MICRO, f"{case}: the global batch's rounding ({rounding:.3g}) is too small to test"
    worst = _max_diff(got.params(), ref.params())
    assert worst < TOL_MICRO, (
        f"{what}: final parameters differ from one process on micro-batches by {worst:.3g} (rounding the global "
        f"batch at once: {rounding:.3g})"
    )


@pytest.mark.parametrize(("strategy", "case", "message"), _params(REFUSED))
def test_refused_before_training_with_the_fix_named(strategy, case, message, runs):
    got = _run(runs, strategy, case)
    assert got.error is not None, f"{strategy} x {case}: expected a refusal, it trained"
    assert re.search(message, got.error, re.S), got.error[-3000:]
    for rank, r in enumerate(got.ranks):
        assert r["steps"] == 0, f"rank {rank} refused after {r['steps']} optimizer steps"
    assert not (got.path / "final.ckpt").exists(), "the refusal came after training ended"


@pytest.mark.parametrize(("strategy", "case", "message"), _params(ERRORS))
def test_error_names_this_strategys_fix(strategy, case, message, runs):
    got = runs.two(strategy, case)
    assert got.error is not None and re.search(message, got.error, re.S), got.error or got.log
