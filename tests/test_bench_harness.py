import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from harness import Report, timeit  # noqa: E402


def test_timeit_counts_repeats_and_warmup():
    calls = []
    t = timeit(lambda: calls.append(1), warmup=2, repeats=3)
    assert len(calls) == 5 and len(t.samples) == 3 and t.mean >= 0


def test_report_ratios_files_and_plot(tmp_path):
    r = Report("demo")
    r.add(method="ddp", world=2, step_s=2.0)
    r.add(method="layered", world=2, step_s=1.0)
    r.add(method="ddp", world=4, step_s=4.0)
    r.add(method="layered", world=4, step_s=3.0)
    r.add_ratios("method", "step_s", "ddp", group_by=["world"])
    assert [row["step_s_vs_ddp"] for row in r.rows] == [1.0, 0.5, 1.0, 0.75]
    path = r.write(tmp_path)
    data = json.loads(path.read_text())
    assert data["rows"][1]["step_s_vs_ddp"] == 0.5 and "torch" in data["meta"]
    assert (tmp_path / "demo.csv").read_text().splitlines()[0].startswith("method,world,step_s")
    png = r.plot_bars("method", "step_s", out_dir=tmp_path)
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"
