"""Layered SGD vs DDP throughput with a slow inter-node link (Yu et al., Figs. 4-6).

Two simulated nodes x 2 processes: each node's processes run in their own network namespace, joined by a veth
pair whose two ends are shaped with ``tc tbf`` (rate only).  Every training step loads a real mini-batch by
decoding JPEG files written by this script (Pillow), so loading takes real time.  The link rate is swept so
the inter-node allreduce goes from much shorter than the loading time to longer than it.

Per run it records: throughput (samples/s), step time, loading time per step, the inter-node part of the
reduction (leaders' allreduce as the communicator thread measured it, layered only), a blocking world
allreduce of the gradient size (what DDP pays) and the link rate *measured* with a send/recv right after
shaping.  Shaped rows are only written for runs that were actually made in namespaces; where namespaces cannot
be made the script says so and runs unshaped only.

``--lightning`` instead runs ``Trainer(strategy="ddp")`` and ``Trainer(strategy=LayeredSGDStrategy(...))``
themselves on the shaped link (JPEG decoding in a Dataset, ``num_workers=0``), at the rates given.
``--queue-ms`` sets the tbf queue (its ``latency``); the default 500 ms is a long, "bufferbloated" queue.
The nodes are ``lightning_hpc.testing.SimNodes`` (the cluster test tier's); the workers live in
``layered_sgd_workers.py``.

Modes of the sweep (the same code the Lightning strategies run, in a plain loop so 2 shared CPU cores are not spent on
Lightning's per-step bookkeeping):
- ``ddp``: torch ``DistributedDataParallel`` (Algorithm 2; bucketed allreduce overlapped with backward);
- ``layered``: :class:`lightning_hpc.layered_sgd.postponed_update.PostponedUpdate` over
  :class:`lightning_hpc.layered_sgd.hierarchical.HierarchicalAllreduce` (Algorithm 3).

    sudo python bench/layered_sgd.py                      # full sweep (needs root for ip netns / tc)
    python bench/layered_sgd.py --rates 1000,300,100 --steps 10 --repeats 2
    python bench/layered_sgd.py --delay-ms 5              # refuses: tc netem is not available here
    python bench/layered_sgd.py --single 2,4 --repeats 6   # unshaped single-node overhead only (no root needed)
    python bench/layered_sgd.py --single 2,4 --lightning   # the same through Trainer(strategy=ddp | layered_sgd)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness import Report


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))

from layered_sgd_workers import IMAGE, lightning_worker_main, worker_main, write_jpegs  # noqa: E402

from lightning_hpc.testing import SimNodes, unavailable_reason  # noqa: E402

SUBNET = "10.77.0"  # the simulated nodes' private /24 (exists only inside their namespaces)


def netem_available() -> bool:
    """Whether the kernel offers the tc ``netem`` qdisc (delay shaping) inside a simulated node."""
    if unavailable_reason() is not None:
        return False
    with SimNodes(2, subnet=SUBNET) as nodes:
        res = nodes[0].run(["tc", "qdisc", "add", "dev", nodes[0].veth, "root", "netem", "delay", "5ms"])
        return res.returncode == 0


def launch_lightning(args: argparse.Namespace, nodes: SimNodes, rate: float, out: Path) -> list[dict]:
    """4 ranks as 2 simulated nodes x 2, launched like torchrun would (LOCAL_RANK / NODE_RANK set)."""
    from lightning_hpc.distributed import find_free_port

    port, per_node = str(find_free_port()), 2
    for node in nodes:
        node.shape_egress(rate, args.queue_ms)
    procs = []
    for rank in range(4):
        node = nodes[rank // per_node]
        env = dict(os.environ, NODE_RANK=str(node.index), LOCAL_RANK=str(rank % per_node), WORLD_SIZE="4",
                   MASTER_ADDR=nodes[0].address, MASTER_PORT=port, GLOO_SOCKET_IFNAME=node.veth, OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO))
        cmd = [sys.executable, __file__, "--lightning-worker", "--jpegs", args.jpegs,
               "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup), "--width",
               str(args.width), "--repeats", str(args.repeats), "--per-node", str(per_node), "--out", str(out)]
        procs.append(node.popen(cmd, env=env, stdout=subprocess.DEVNULL if rank else None, stderr=None))
    codes = [p.wait(timeout=3600) for p in procs]
    if any(codes):
        raise RuntimeError(f"Lightning run at {rate} Mbit/s: worker exit codes {codes}")
    return [dict(r, link_rate_mbit=rate) for r in json.loads(out.read_text())]


def launch_lightning_local(args: argparse.Namespace, world: int, out: Path) -> list[dict]:
    """``world`` ranks on one node over loopback (one group: ``LayeredSGDStrategy()`` with its default
    ``procs_per_node`` = the node's devices), launched like torchrun would."""
    from lightning_hpc.distributed import find_free_port

    port = str(find_free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, NODE_RANK="0", LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        cmd = [sys.executable, __file__, "--lightning-worker", "--jpegs", args.jpegs, "--batch", str(args.batch),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--width", str(args.width),
               "--repeats", str(args.repeats), "--per-node", str(world), "--world", str(world), "--out", str(out),
               "--modes", args.modes]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL if rank else None))
    codes = [p.wait(timeout=3600) for p in procs]
    if any(codes):
        raise RuntimeError(f"Lightning run, 1 node x {world}: worker exit codes {codes}")
    return [dict(r, layout=f"1 node x {world} (loopback), Lightning Trainer") for r in json.loads(out.read_text())]


def paired_ratios(raw: list[dict], key: tuple[str, ...]) -> dict[tuple, list[float]]:
    """mode/ddp throughput of the runs of the same repeat (run back to back), per ``key`` values and mode."""
    out: dict[tuple, list[float]] = {}
    for k in dict.fromkeys(tuple(r.get(f) for f in key) for r in raw):
        rs = [r for r in raw if tuple(r.get(f) for f in key) == k]
        for rep in sorted({r["repeat"] for r in rs}):
            by_mode = {r["mode"]: r["throughput"] for r in rs if r["repeat"] == rep}
            for mode, value in by_mode.items():
                if mode != "ddp" and "ddp" in by_mode:
                    out.setdefault(k + (mode,), []).append(value / by_mode["ddp"])
    return out


def single_node(args: argparse.Namespace) -> None:
    """Unshaped single-node overhead (no namespaces, loopback): ``--single 2,4`` runs 1 node x 2 and x 4,
    DDP and layered SGD alternating within each repeat; with ``--lightning`` through ``Trainer`` itself."""
    from harness import Report

    tmp = Path(args.jpegs) / "runs"
    tmp.mkdir(exist_ok=True)
    raw: list[dict] = []
    for world in [int(w) for w in args.single.split(",") if w]:
        if args.lightning:
            raw += launch_lightning_local(args, world, tmp / f"lightning_single{world}.json")
        else:
            raw += launch(args, world, world, f"1 node x {world} (loopback)", None, args.modes,
                          tmp / f"single{world}.json")
    report = Report(args.name)
    pairs = paired_ratios(raw, ("layout",))
    for key in dict.fromkeys((r["layout"], r["mode"]) for r in raw):
        rs = [r for r in raw if (r["layout"], r["mode"]) == key]
        ratios = pairs.get(key, [])
        report.add(layout=key[0], mode={"ddp": "ddp", "layered": "layered_sgd"}.get(key[1], key[1]),
                   throughput=statistics.median(r["throughput"] for r in rs),
                   step_s=statistics.median(r["step_s"] for r in rs), runs=len(rs),
                   paired_ratio_median=statistics.median(ratios) if ratios else None,
                   paired_ratio_min=min(ratios) if ratios else None,
                   paired_ratio_max=max(ratios) if ratios else None)
    report.add_ratios("mode", "throughput", "ddp", ratio_name="vs_ddp", group_by=("layout",))
    report.meta.update(batch_per_process=args.batch, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                       width=args.width, raw=raw, note="unshaped loopback; vs_ddp = ratio of median throughputs, "
                       "paired_ratio_* = layered/ddp of the two back-to-back runs of each repeat")
    report.print(["layout", "mode", "throughput", "vs_ddp", "paired_ratio_median", "paired_ratio_min",
                  "paired_ratio_max", "step_s", "runs"])
    print(f"wrote {report.write()}")


def lightning_check(args: argparse.Namespace) -> None:
    from harness import Report

    reason = unavailable_reason()
    if reason is not None:
        print(f"simulated nodes cannot be made here ({reason}): no Lightning shaped check")
        return
    raw: list[dict] = []
    with SimNodes(2, subnet=SUBNET) as nodes:
        for rate in [float(r) for r in args.rates.split(",") if r]:
            raw += launch_lightning(args, nodes, rate, Path(args.jpegs) / "runs" / f"lightning_{rate}.json")
    report = Report(args.name)
    for key in dict.fromkeys((r["link_rate_mbit"], r["mode"]) for r in raw):
        rs = [r for r in raw if (r["link_rate_mbit"], r["mode"]) == key]
        report.add(layout="2 nodes x 2 (veth), Lightning Trainer", link_mbit=key[0],
                   mode="ddp" if key[1] == "ddp" else "layered_sgd",
                   throughput=statistics.median(r["throughput"] for r in rs),
                   step_s=statistics.median(r["step_s"] for r in rs), runs=len(rs))
    report.add_ratios("mode", "throughput", "ddp", ratio_name="vs_ddp", group_by=("link_mbit",))
    report.meta.update(batch_per_process=args.batch, steps=args.steps, repeats=args.repeats, raw=raw,
                       queue_ms=args.queue_ms, note="2 CPU cores shared with other jobs; medians over repeats")
    report.print()
    print(f"wrote {report.write()}")


# --------------------------------------------------------------------------------------------- driver
def launch(args: argparse.Namespace, world: int, per_node: int, layout: str, nodes: SimNodes | None, modes: str,
           out: Path) -> list[dict]:
    """``world`` plain-loop workers: on the simulated ``nodes`` (link shaped by the workers, rates swept) or,
    with ``nodes=None``, on this machine over loopback."""
    from lightning_hpc.distributed import find_free_port

    shaped = nodes is not None
    port = str(find_free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_PORT=port, OMP_NUM_THREADS="1",
                   MASTER_ADDR=nodes[0].address if nodes is not None else "127.0.0.1", PYTHONPATH=str(REPO),
                   GLOO_SOCKET_IFNAME="lo")
        if nodes is not None:
            env["GLOO_SOCKET_IFNAME"] = env["LSGD_VETH"] = nodes[rank // per_node].veth
        cmd = [sys.executable, __file__, "--worker", "--jpegs", args.jpegs, "--batch", str(args.batch),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--width", str(args.width),
               "--repeats", str(args.repeats), "--rates", args.rates if shaped else "", "--modes", modes,
               "--per-node", str(per_node), "--layout", layout, "--out", str(out)] + (["--shaped"] if shaped else [])
        procs.append(nodes[rank // per_node].popen(cmd, env=env, stderr=None) if nodes is not None
                     else subprocess.Popen(cmd, env=env))
    codes = [p.wait(timeout=3600) for p in procs]
    if any(codes):
        raise RuntimeError(f"{layout}: worker exit codes {codes}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--lightning-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--lightning", action="store_true",
                   help="instead of the sweep: Trainer(strategy=ddp | layered_sgd) on the shaped link at --rates")
    p.add_argument("--shaped", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--per-node", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--single", default="",
                   help="only the unshaped single-node overhead for these process counts, e.g. 2,4 "
                        "(with --lightning: through Trainer)")
    p.add_argument("--modes", default="ddp,layered",
                   help="modes to compare (plain loop also: layered_post = the reduction starts after backward, no "
                        "gradient hooks; layered_sync = ... and is waited for before loading)")
    p.add_argument("--rates", default="1000,300,100,30", help="inter-node link rates to sweep, Mbit/s")
    p.add_argument("--delay-ms", type=float, default=None, help="link delay (needs tc netem: not supported here)")
    p.add_argument("--queue-ms", type=int, default=500, help="tbf queue length (latency parameter), ms")
    p.add_argument("--bucket-mb", type=float, default=0.0,
                   help="plain loop: layered SGD bucket size (MB) for every bucket; 0 = DDP's 1 MB first, then 25 MB")
    p.add_argument("--batch", type=int, default=24, help="images per process per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="repeat the sweep; medians are reported")
    p.add_argument("--width", type=int, default=512, help="hidden width of the FC head (sets the gradient size)")
    p.add_argument("--jpegs", default="/tmp/lightning_hpc_bench_jpegs")
    p.add_argument("--name", default="layered_sgd", help="results name: bench/results/<name>.{json,csv,png}")
    p.add_argument("--table-from", default="",
                   help="only write the scaling table from result files (comma-separated names in bench/results; "
                        "the first file that has a (layout, link, mode) row wins)")
    p.add_argument("--skip-scaling", action="store_true", help="skip the 1- and 2-process runs of the scaling table")
    args = p.parse_args(argv)
    os.environ["LSGD_QUEUE_MS"] = str(args.queue_ms)  # inherited by the workers, which shape the link
    os.environ["LSGD_BUCKET_MB"] = str(args.bucket_mb)
    if args.worker:
        worker_main(args)
        return 0
    if args.lightning_worker:
        lightning_worker_main(args)
        return 0

    if args.table_from:
        from harness import RESULTS, Report

        merged = Report(args.name)
        seen = set()
        for name in args.table_from.split(","):
            for row in json.loads((RESULTS / f"{name}.json").read_text())["rows"]:
                key = (row["layout"], row["link_mbit"], row["mode"])
                if key not in seen:
                    seen.add(key)
                    merged.add(**row, source=name)
        scaling_table(merged, args.name)
        return 0
    if args.delay_ms is not None and not netem_available():
        print("--delay-ms: delay shaping needs the tc 'netem' qdisc, which this kernel does not provide; "
              "delay is not supported here (rate shaping with tbf is).", file=sys.stderr)
        return 2
    if args.delay_ms is not None:
        print("--delay-ms: netem is available but this script shapes by rate only; delay not implemented.",
              file=sys.stderr)
        return 2

    from harness import Report

    write_jpegs(Path(args.jpegs), 256)
    if args.single:
        single_node(args)
        return 0
    if args.lightning:
        (Path(args.jpegs) / "runs").mkdir(exist_ok=True)
        lightning_check(args)
        return 0
    report = Report(args.name)
    tmp = Path(args.jpegs) / "runs"
    tmp.mkdir(exist_ok=True)
    raw: list[dict] = []

    # 1. single node, unshaped (loopback): overhead of the layered reduction where nothing can be hidden.
    raw += launch(args, 4, 4, "1 node x 4 (loopback)", None, args.modes, tmp / "single.json")
    # 2. two simulated nodes x 2, link swept.
    reason = unavailable_reason()
    if reason is None:
        with SimNodes(2, subnet=SUBNET) as nodes:
            raw += launch(args, 4, 2, "2 nodes x 2 (veth)", nodes, args.modes, tmp / "shaped.json")
    else:
        print(f"simulated nodes cannot be made here ({reason}): running unshaped only; no shaped result is reported.")
    # 3. scaling table (paper Fig. 6): 1 and 2 processes (one node) for the per-worker baseline.
    if not args.skip_scaling:
        raw += launch(args, 1, 1, "1 process", None, "ddp", tmp / "one.json")
        raw += launch(args, 2, 2, "1 node x 2 (loopback)", None, "ddp,layered", tmp / "two.json")

    # medians over repeats
    keyf = lambda r: (r["layout"], r["link_rate_mbit"], r["mode"])  # noqa: E731
    for key in dict.fromkeys(keyf(r) for r in raw):
        rs = [r for r in raw if keyf(r) == key]
        med = lambda k: statistics.median(r[k] for r in rs) if all(r[k] is not None for r in rs) else None  # noqa: E731
        report.add(layout=key[0], link_mbit=key[1] if key[1] is not None else "unshaped", mode=key[2],
                   measured_link_mbit=med("measured_link_mbit"), throughput=med("throughput"), step_s=med("step_s"),
                   load_s=med("load_s"), world_allreduce_s=med("world_allreduce_s"),
                   inter_allreduce_s=med("inter_allreduce_s"), runs=len(rs))
    report.add_ratios("mode", "throughput", "ddp", ratio_name="vs_ddp", group_by=("layout", "link_mbit"))
    report.meta.update(batch_per_process=args.batch, steps=args.steps, repeats=args.repeats, width=args.width,
                       queue_ms=args.queue_ms,
                       image=IMAGE, note="2 CPU cores shared with other jobs; medians over repeats",
                       raw=raw)
    report.print(["layout", "link_mbit", "measured_link_mbit", "mode", "throughput", "vs_ddp", "step_s", "load_s",
                  "world_allreduce_s", "inter_allreduce_s", "runs"])
    print(f"wrote {report.write()}")
    scaling_table(report, args.name)
    plot(report, args.name)
    return 0


def scaling_table(report: Report, name: str) -> None:
    """Scaling efficiency as in the paper's Fig. 6: throughput(N) / (N * throughput(1 process)).

    On this machine N processes share 2 CPU cores, so compute alone caps the efficiency at about 2/N; the
    last columns therefore also give throughput relative to the unshaped single-node DDP run with the same N
    (the part of the compute-bound throughput that survives the inter-node link).
    """
    one = next((r["throughput"] for r in report.rows if r["layout"] == "1 process"), None)
    if one is None:
        return
    base = {n: next((r["throughput"] for r in report.rows if r["mode"] == "ddp" and r["layout"] == lay), None)
            for n, lay in ((2, "1 node x 2 (loopback)"), (4, "1 node x 4 (loopback)"))}
    lines = ["| workers | layout | link (Mbit/s) | DDP samples/s | DDP eff. | layered samples/s | layered eff. | "
             "DDP vs 1-node | layered vs 1-node |", "|---|---|---|---|---|---|---|---|---|"]
    lines.append(f"| 1 | 1 process | - | {one:.1f} | 100% | - | - | - | - |")
    for (layout, link) in dict.fromkeys((r["layout"], r["link_mbit"]) for r in report.rows):
        if layout == "1 process":
            continue
        rows = {r["mode"]: r for r in report.rows if r["layout"] == layout and r["link_mbit"] == link}
        n = 4 if "x 4" in layout or "2 nodes" in layout else 2
        eff, rel = [], []
        for mode in ("ddp", "layered"):
            r = rows.get(mode)
            eff += [f"{r['throughput']:.1f}", f"{100 * r['throughput'] / (n * one):.0f}%"] if r else ["-", "-"]
            rel += [f"{100 * r['throughput'] / base[n]:.0f}%"] if r and base.get(n) else ["-"]
        lines.append(f"| {n} | {layout} | {link} | " + " | ".join(eff + rel) + " |")
    text = "\n".join(lines)
    print("\nScaling efficiency (paper Fig. 6 style):\n" + text)
    out = Path(__file__).parent / "results" / f"{name}_scaling.md"
    out.write_text(text + "\n")


def plot(report: Report, name: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shaped = [r for r in report.rows if r["layout"].startswith("2 nodes")]
    if not shaped:
        return
    links = list(dict.fromkeys(r["link_mbit"] for r in shaped))
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    for mode in ("ddp", "layered"):
        ys = [next((r["throughput"] for r in shaped if r["link_mbit"] == lv and r["mode"] == mode), 0) for lv in links]
        ax[0].plot([str(lv) for lv in links], ys, marker="o", label=mode)
    ax[0].set_xlabel("inter-node link (Mbit/s)")
    ax[0].set_ylabel("samples/s")
    ax[0].legend()
    ratio = [
        next((r.get("vs_ddp") for r in shaped if r["link_mbit"] == lv and r["mode"] == "layered"), 0) for lv in links
    ]
    ax[1].bar([str(lv) for lv in links], ratio)
    ax[1].axhline(1.0, color="k", lw=0.8)
    ax[1].set_xlabel("inter-node link (Mbit/s)")
    ax[1].set_ylabel("layered / ddp throughput")
    fig.suptitle("Layered SGD vs DDP, 2 nodes x 2 processes (2 shared CPU cores)")
    fig.tight_layout()
    fig.savefig(Path(__file__).parent / "results" / f"{name}.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
