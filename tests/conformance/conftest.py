"""Launches shared by the conformance tests: every cell of one strategy runs in one 2-process launch (the
strategies under ``horovodrun`` share one), every one-process reference of one kind in one launch (see
``launch.py``); launches run once per pytest run, when a test first needs them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cells import (
    ALL_CELLS,
    BOUNDED,
    BOUNDED_MG,
    DATA_PARALLEL,
    DIFFERS,
    EXACT,
    MG_EXACT_CYCLES,
    MG_FEWER_CYCLES,
    MG_MORE_CYCLES,
    MICRO_BATCHES,
    REFERENCE_DDP,
    REFUSED,
    REFUSED_AT,
    ROUNDING_BOUNDED,
    SLOW_COLUMNS,
    TORCH_RANGE_ROW,
    float32_reference,
    kfac_reference,
    micro_batch_reference,
    under_horovodrun,
)
from cells import data_parallel as data_parallel_of
from launch import CaseResult, horovod_importable, launch, launch_forked, read


class Runs:
    def __init__(self, root: Path, skip_columns: frozenset[str] = frozenset(), only: str | None = None) -> None:
        self.root = root
        self.logs: dict[str, str] = {}
        #: columns whose cells are deselected (the slow ones in the default tier): their references and resumed
        #: runs are not launched either
        self.skip_columns = skip_columns
        #: the rows the launches run (``f1,f2``; None: ``CONFORMANCE_FEATURES``, else every row), see _selected
        self.only = only

    def _ensure(self, key: str, outdir: str, devices: int, items: list[str], data_parallel: int, horovod: bool = False,
                env: dict[str, str] | None = None) -> str:
        if key not in self.logs:
            if horovod:
                self.logs[key] = launch(devices, self.root / outdir, items, data_parallel, horovod=True,
                                        env_extra=env, log_name=f"{key}.log", processes=devices)
            else:  # forked ranks: no interpreter start, no import of Lightning per launch
                self.logs[key] = launch_forked(devices, self.root / outdir, items, data_parallel, env_extra=env,
                                               log_name=f"{key}.log")
        return self.logs[key]

    def two(self, strategy: str, case: str) -> CaseResult:
        """The case under ``strategy`` on 2 processes (the launch runs every cell of that strategy; the strategies
        under ``horovodrun`` share one launch, which costs seconds to start)."""
        horovod = under_horovodrun(strategy)
        if horovod and not horovod_importable():
            print("horovod.torch is not importable: build it with scripts/install-horovod.sh")
            pytest.skip("horovod.torch is not importable (scripts/install-horovod.sh builds it)")
        strategies = HOROVODRUN_STRATEGIES if horovod else (strategy,)
        data_parallel = {DATA_PARALLEL.get(s, 2) for s in strategies}
        assert len(data_parallel) == 1, f"strategies {strategies} of one launch differ in data-parallel size"
        items = sorted(((s, c) for s in strategies for c in _two_process_cases(s) if _selected(c, self.only)),
                       key=_refusals_last)
        log = self._ensure("two_horovodrun" if horovod else f"two_{strategy}", "two", 2,
                           [f"{s}:{c}" for s, c in items], data_parallel.pop(), horovod=horovod)
        return read(self.root / "two", strategy, case, log, 2)

    def one(self, case: str, data_parallel: int, kfac: bool = False) -> CaseResult:
        """One process on the global batch of ``data_parallel`` ranks (with the KFAC callback: ``kfac``)."""
        strategy = "kfac_auto" if kfac else "auto"
        cells = [*EXACT, *DIFFERS, *ROUNDING_BOUNDED, *BOUNDED, *BOUNDED_MG]
        cells += [(s, float32_reference(c)) for s, c in BOUNDED]
        cells += MICRO_BATCHES + [(s, micro_batch_reference(c)) for s, c in MICRO_BATCHES]
        cases = sorted({_reference_case(c) for s, c in cells if data_parallel_of(s, c) == data_parallel
                        and kfac_reference(s) == kfac and _selected(c, self.only)
                        and s.removesuffix("_find_unused") not in self.skip_columns})
        key = f"one_{strategy}_dp{data_parallel}"
        log = self._ensure(key, key, 1, [f"{strategy}:{c}" for c in cases], data_parallel)
        return read(self.root / key, strategy, case, log, 1)

    def one_multigrid(self, strategy: str, case: str) -> CaseResult:
        """The case under mode 'mg' (``strategy``: the bounded cells' solve, or a control's number of cycles) on
        one process, which holds every step: the multigrid solve with nothing distributed (all in one launch)."""
        mode_mg = [c for s, c in [*BOUNDED_MG, *DIFFERS] if s == "multigrid"]
        cases = sorted({_reference_case(c) for c in mode_mg if _selected(c, self.only)})
        items = [f"{s}:{c}" for c in cases for s in ("multigrid", MG_MORE_CYCLES, MG_EXACT_CYCLES)]
        items.append(f"{MG_FEWER_CYCLES}:odenet")
        log = self._ensure("one_multigrid", "one_multigrid", 1, items, DATA_PARALLEL["multigrid"])
        return read(self.root / "one_multigrid", strategy, case, log, 1)

    def resumed_on_one(self, strategy: str, case: str) -> CaseResult:
        """The second epoch of ``case`` on one process, from the checkpoint the 2-process run wrote after its
        first epoch (all strategies in one launch)."""
        # a Horovod strategy's one process is a Horovod world of size 1 (hvd.init() without a launcher): forked
        # like the others, so no horovodrun -np 1 to start
        horovod = under_horovodrun(strategy)
        # the one process reads the union of the data-parallel ranks' batches: one launch per data-parallel size
        dp = DATA_PARALLEL.get(strategy, 2)
        items = [f"{s}:{c}" for s, c in ALL_CELLS
                 if c.endswith("_2_to_1") and under_horovodrun(s) == horovod and DATA_PARALLEL.get(s, 2) == dp
                 and s.removesuffix("_find_unused") not in self.skip_columns]
        for item in items:
            s, c = item.split(":")
            self.two(s, _reference_case(c))  # the first epochs
        key = ("resumed_on_one_horovod" if horovod else "resumed_on_one") + f"_dp{dp}"
        log = self._ensure(key, key, 1, items, dp, env={"CONFORMANCE_RESUME_FROM": str(self.root / "two")})
        return read(self.root / key, strategy, case, log, 1)


def _selected(case: str, only: str | None = None) -> bool:
    """With ``only`` (``f1,f2``) or else ``CONFORMANCE_FEATURES=f1,f2`` set, the launches run only those rows'
    cases (and their references), so a few rows can be checked without the whole matrix; unset, everything runs."""
    only = only or os.environ.get("CONFORMANCE_FEATURES")
    if not only:
        return True
    base = case.removeprefix("odenet_").removeprefix("volume_").removesuffix("_micro_batches").removesuffix("_2_to_1")
    return (base if case != "odenet" else "sgd") in only.split(",")


def _reference_case(case: str) -> str:
    return case.replace("_2_to_1", "")


#: the strategies whose cells run under ``horovodrun`` (one 2-process launch for all of them)
HOROVODRUN_STRATEGIES = tuple(sorted({s for s, _ in ALL_CELLS if under_horovodrun(s)}))
_REFUSED = {(s, c) for s, c, _ in REFUSED} | {(s, c) for s, c, _, _ in REFUSED_AT}


def _two_process_cases(strategy: str) -> set[str]:
    """The cases a 2-process launch runs under ``strategy``: its cells, and the cells whose DDP reference it is."""
    return ({c for s, c in ALL_CELLS if s == strategy and not c.endswith("_2_to_1")}
            | {c for (s, c), reference in REFERENCE_DDP.items() if strategy in (s, reference)})


def _refusals_last(item: tuple[str, str]) -> tuple[bool, str, str]:
    """Cases that raise run after those that train (in a shared launch, after every strategy's training cases)."""
    return (item in _REFUSED, *item)


@pytest.fixture(scope="session")
def runs(tmp_path_factory, request) -> Runs:
    root = tmp_path_factory.mktemp("conformance")
    # what the run selected (after -m / -k), not how the expression is spelt ("slow or not slow" selects both)
    here = Path(__file__).parent
    selected = [item for item in request.session.items if item.path.parent == here]
    slow_deselected = not any(item.get_closest_marker("slow") for item in selected)
    # the torch-range subset (-m torch_range) selects one row's cells: its launches run that row alone
    torch_range = bool(selected) and all(item.get_closest_marker("torch_range") for item in selected)
    return Runs(root, frozenset(SLOW_COLUMNS) if slow_deselected else frozenset(),
                only=TORCH_RANGE_ROW if torch_range else None)
