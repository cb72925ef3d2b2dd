"""Small shared harness for the ``bench/`` scripts.

Times in-process with warm-up and repeats, keeps the baseline and the candidate of one benchmark in the same
job, prints ratios against the baseline, and writes the rows as JSON and CSV (plus a PNG bar chart when
matplotlib is installed) under ``bench/results/``.
"""

from __future__ import annotations

import csv
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"

__all__ = ["Timing", "timeit", "Report", "RESULTS", "flop_counter"]


@dataclass
class Timing:
    samples: list[float]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def std(self) -> float:
        return statistics.pstdev(self.samples) if len(self.samples) > 1 else 0.0

    def __str__(self) -> str:
        return f"{self.mean * 1e3:.2f} ms +- {self.std * 1e3:.2f}"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timeit(fn: Callable[[], Any], warmup: int = 2, repeats: int = 5) -> Timing:
    """Wall time of ``fn()`` per call: ``warmup`` untimed calls, then ``repeats`` timed ones."""
    for _ in range(warmup):
        fn()
    _sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync()
        samples.append(time.perf_counter() - t0)
    return Timing(samples)


def _conv_backward_flops(grad_out_shape: Any, x_shape: Any, w_shape: Any, _bias: Any, _stride: Any, _padding: Any,
                         _dilation: Any, transposed: bool, _output_padding: Any, _groups: Any, output_mask: Any,
                         out_shape: Any = None, **kwargs: Any) -> int:
    """A convolution's backward FLOPs: each gradient it computes (input, weight) costs its forward's FLOPs.
    torch's own formula (``torch.utils.flop_counter.conv_backward_flop``, torch 2.13) leaves out the groups and
    counts a depthwise layer's backward as a dense layer's: 1153x its forward for 1152 channels."""
    from torch.utils.flop_counter import conv_flop_count

    forward = conv_flop_count(x_shape, w_shape, grad_out_shape, transposed)
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def flop_counter() -> Any:
    """``torch.utils.flop_counter.FlopCounterMode`` (no display) with grouped convolutions' backward counted right
    (:func:`_conv_backward_flops`)."""
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False,
                           custom_mapping={torch.ops.aten.convolution_backward: _conv_backward_flops})


def force_kfac_step_kind(pre: Any, factors: bool, decompose: bool) -> None:
    """Make the next ``pre.step()`` of a ``KFACPreconditioner`` update the factors (``factors``) and decompose them
    (``decompose``), whatever its schedule: through the step counter and the intervals (step 0 is a multiple of
    every interval, step 1 only of an interval of 1; a factor-only step at step 0 would decompose too). The K-FAC
    benchmarks time or count each kind of step this way."""
    pre.steps = 0 if decompose else 1
    pre.schedule = pre.schedule.__class__(damping=pre.schedule.damping, factor_update_freq=1 if factors else 2,
                                          inv_update_freq=1 if decompose else 2)


@dataclass
class Report:
    """Rows of one benchmark; ``ratio`` columns are computed against a named baseline row."""

    name: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, **row: Any) -> dict[str, Any]:
        self.rows.append(row)
        return row

    def add_ratios(
        self, key: str, value: str, baseline: str, ratio_name: str | None = None, group_by: Sequence[str] = ()
    ) -> None:
        """Add ``value / value[baseline]`` to each row; the baseline is the row whose ``key`` equals ``baseline``
        among rows with the same ``group_by`` values."""
        ratio_name = ratio_name or f"{value}_vs_{baseline}"
        for row in self.rows:
            group = tuple(row.get(g) for g in group_by)
            base = next(
                (r for r in self.rows if r.get(key) == baseline and tuple(r.get(g) for g in group_by) == group), None
            )
            if base is not None and base.get(value):
                row[ratio_name] = row[value] / base[value]

    def print(self, columns: Sequence[str] | None = None) -> None:
        columns = list(columns or dict.fromkeys(k for r in self.rows for k in r))
        width = {c: max(len(c), *(len(_fmt(r.get(c))) for r in self.rows)) for c in columns}
        print(f"\n== {self.name} ==")
        print("  ".join(c.ljust(width[c]) for c in columns))
        for r in self.rows:
            print("  ".join(_fmt(r.get(c)).ljust(width[c]) for c in columns))

    def write(self, out_dir: Path | None = None) -> Path:
        out = Path(out_dir or RESULTS)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"host": platform.node(), "torch": torch.__version__, "threads": torch.get_num_threads(), **self.meta}
        (out / f"{self.name}.json").write_text(json.dumps({"meta": meta, "rows": self.rows}, indent=2, default=str))
        columns = list(dict.fromkeys(k for r in self.rows for k in r))
        with open(out / f"{self.name}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, columns)
            writer.writeheader()
            writer.writerows(self.rows)
        return out / f"{self.name}.json"

    def plot_bars(
        self, label: str, value: str, title: str | None = None, ylabel: str | None = None, out_dir: Path | None = None
    ) -> Path | None:
        """Bar chart of ``value`` per row labelled by ``label``; returns the PNG path (None without matplotlib)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not installed (pip install 'lightning_hpc[bench]'): no plot written")
            return None
        out = Path(out_dir or RESULTS)
        out.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(max(4, 0.8 * len(self.rows)), 3.2))
        ax.bar([str(r[label]) for r in self.rows], [r[value] for r in self.rows])
        ax.set_title(title or self.name)
        ax.set_ylabel(ylabel or value)
        plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
        fig.tight_layout()
        path = out / f"{self.name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
