"""Benchmark: hybrid data/model parallelism (Krizhevsky, "One weird trick") against DDP.

Part 1 (communication and step time): the one-tower AlexNet on K = 2 and 4 gloo processes; for ``ddp`` (torch
DistributedDataParallel, a comm hook counts the bucket all-reduces) and for schemes a, b, c of the hybrid head
(``fc_update=per_step``; the trunk under DDP with the head's shards excluded, as HybridParallelStrategy does), the
bytes each rank receives per step (counted at the collectives, ring-algorithm convention of
``lightning_hpc/hybrid_fc/collectives.py``) and the step time (forward + backward + SGD step).  All methods are
built in the same processes and timed in interleaved rounds (each round runs every method for ``--steps`` steps,
in a rotated order), so slow drifts of the machine hit all of them alike; a step's time is the slowest rank's.
Reported: median step time over all rounds, the median and range over rounds of the per-round ratio to ``ddp``.
Next to the measured bytes the script prints the analytic model (see :func:`analytic_bytes`): DDP, the lower
bound of the paper's schemes (trunk all-reduce + every example's last-conv activations reaching the other K-1
ranks and their gradients coming back) and the head's unavoidable internal traffic for its layout.

``--overlap``: scheme b (and c) with the exchange overlapped with the head's computation (the default) against
``overlap=False`` (each exchange fetched when needed, on the head's group), same interleaved protocol.

``--bytes-sweep``: bytes only (one step per batch size, 64x64 images; the head's input is 256x6x6 for any
image size), measured against the analytic model over a range of per-rank batch sizes, and the largest batch
for which the hybrid stays <= 0.1x DDP's bytes.

Part 2 (``--table``, a Table 1 analogue): a small conv trunk + 3-layer FC head trained on scikit-learn's digits
with K = 1, 2, 4 processes and effective batch sizes (m, n) = (K b, K b) (per_step) and (K b, b) (per_subbatch,
scheme c), reporting validation cross-entropy, top-1 error and wall time.  It shows the variable-batch-size
mechanism end to end; it is not ImageNet.

    python bench/hybrid_fc.py                       # part 1 (b=4 per rank, 224x224)
    python bench/hybrid_fc.py --batch 128 --image 64 --name hybrid_fc_b128   # the paper's batch (bytes exact;
        # times are 64x64 AlexNet times)
    python bench/hybrid_fc.py --overlap --name hybrid_fc_overlap
    python bench/hybrid_fc.py --bytes-sweep
    python bench/hybrid_fc.py --table               # part 2
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import Report
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.hybrid_fc import (
    ByteCounter,
    HeadOptimizer,
    find_hybrid_head,
    head_parameters,
    linear_layers_on_meta,
    parallelize_head,
)
from lightning_hpc.hybrid_fc.collectives import allreduce_ring_bytes
from lightning_hpc.hybrid_fc.layout import layout_cost, plan_layout
from lightning_hpc.models import alexnet_one_tower

MIB = 2**20


def _counting_allreduce_hook(counter: ByteCounter, k: int):
    """DDP comm hook: average the bucket like DDP's default hook, and count its ring all-reduce bytes."""

    def hook(state, bucket):
        buf = bucket.buffer()
        counter.add("ddp_all_reduce", allreduce_ring_bytes(buf.numel(), buf.element_size(), k))
        fut = dist.all_reduce(buf, group=state, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(k))

    return hook


def _ddp(model: nn.Module, counter: ByteCounter, k: int, ignore: list[str] = ()) -> DistributedDataParallel:
    if ignore:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(ignore))
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, _counting_allreduce_hook(counter, k))
    return ddp


def build(
    method: str, k: int, num_classes: int, fc_width: int, counter: ByteCounter, fc_update: str = "per_step"
) -> tuple[nn.Module, nn.Module]:
    """(module to call, module whose parameters the optimizer gets) for ``ddp`` or a hybrid scheme
    (``"b"``, or ``"b-nooverlap"`` for the exchange without overlap).  Hybrid heads are built on the meta device,
    so only the shards are ever allocated."""
    torch.manual_seed(0)
    if method == "ddp":
        model = alexnet_one_tower(num_classes=num_classes, fc_width=fc_width, dropout=0.0)
        return _ddp(model, counter, k), model
    scheme, _, variant = method.partition("-")
    with linear_layers_on_meta():
        model = alexnet_one_tower(num_classes=num_classes, fc_width=fc_width, dropout=0.0)
    group = dist.new_group(list(range(k)))
    model = parallelize_head(
        model,
        head="classifier",
        scheme=scheme,
        fc_update=fc_update,
        group=group,
        counter=counter,
        overlap=variant != "nooverlap",
    )
    shard_ids = {id(p) for p in head_parameters(model)}
    ignore = [n for n, p in model.named_parameters() if id(p) in shard_ids]
    return _ddp(model, counter, k, ignore), model


@functools.lru_cache
def _trunk_params(num_classes: int, fc_width: int) -> int:
    with linear_layers_on_meta():
        return sum(
            p.numel() for p in alexnet_one_tower(num_classes=num_classes, fc_width=fc_width).features.parameters()
        )


def analytic_bytes(
    k: int, b: int, num_classes: int = 1000, fc_width: int = 4096, d: int = 256 * 6 * 6, elem: int = 4
) -> dict[str, float]:
    """Bytes each rank receives per step (ring convention), one-tower AlexNet, b examples per rank.

    ``ddp``: all-reduce of every parameter, 2 (K-1)/K P.  ``trunk``: the same for the trunk's parameters only
    (section 4.1).  ``activations``: in schemes a, b and c every rank must receive every other rank's b examples'
    d = 9216 last-conv activations, (K-1) b d, and the same volume of activation gradients goes back in the
    backward pass.  ``bound = trunk + activations`` is therefore a lower bound for the paper's schemes whatever the
    head does inside.  ``head_internal``: the head's own traffic with the chosen layout (``layout.py``: for the
    9216-4096-4096-1000 head at any K, col, col, row: one all-gather of 4096 neurons and one reduce-scatter of
    the logits per example, forward, and the same backward), the minimum over the 1-D layouts given a replicated
    input.  ``model = bound + head_internal`` is what the implementation should move."""
    trunk_params = _trunk_params(num_classes, fc_width)
    widths = [d, fc_width, fc_width, num_classes]
    head_params = sum(o * i + o for i, o in zip(widths[:-1], widths[1:]))
    per_example, _ = layout_cost(plan_layout(widths, k), widths, k)
    out = {
        "ddp": allreduce_ring_bytes(trunk_params + head_params, elem, k),
        "trunk": allreduce_ring_bytes(trunk_params, elem, k),
        "activations": 2 * (k - 1) * b * d * elem,
        "head_internal": 2 * per_example * k * b * elem,
    }
    out["bound"] = out["trunk"] + out["activations"]
    out["model"] = out["bound"] + out["head_internal"]
    return out


def largest_batch_within(k: int, ratio: float, key: str, **kw) -> int:
    """Largest per-rank batch b whose analytic ``key`` bytes are <= ``ratio`` x DDP's (bytes are linear in b)."""
    b = 0
    while analytic_bytes(k, b + 1, **kw)[key] <= ratio * analytic_bytes(k, b + 1, **kw)["ddp"]:
        b += 1
    return b


def step_worker(
    rank: int,
    k: int,
    methods: list[str],
    b: int,
    image: int,
    steps: int,
    warmup: int,
    rounds: int,
    num_classes: int,
    fc_width: int,
) -> dict:
    counter = ByteCounter()
    nets = {}
    for method in methods:
        net, params_of = build(method, k, num_classes, fc_width, counter)
        opt = torch.optim.SGD(params_of.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
        nets[method] = (net, params_of, opt)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(b, 3, image, image, generator=g)
    y = torch.randint(0, num_classes, (b,), generator=g)

    def step(method: str) -> tuple[float, int]:
        net, _, opt = nets[method]
        counter.reset()
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        return time.perf_counter() - t0, counter.total

    out: dict = {m: {"times": [], "rounds": []} for m in methods}
    for method in methods:
        for _ in range(warmup):
            step(method)
    for r in range(rounds):
        order = methods[r % len(methods):] + methods[: r % len(methods)]  # rotate: no method always goes first
        for method in order:
            ts = []
            for _ in range(steps):
                dt, nbytes = step(method)
                ts.append(dt)
                out[method]["bytes"] = nbytes
                out[method]["kinds"] = counter.snapshot()
            out[method]["times"].extend(ts)
            out[method]["rounds"].append(ts)
    for method in methods:
        _, params_of, _ = nets[method]
        out[method]["params_local"] = sum(p.numel() for p in params_of.parameters())
    return out


def part1(args: argparse.Namespace) -> None:
    methods = args.methods or (
        ["ddp", "a", "b", "c"] if not args.overlap else ["ddp", "b", "b-nooverlap", "c", "c-nooverlap"]
    )
    if methods[0] != "ddp":
        raise ValueError("--methods must start with ddp (the baseline of every ratio)")
    report = Report(args.name)
    report.meta.update(
        note="quiet 2-core CPU machine (bench lock held), gloo, one intra-op thread per rank; all methods in the same "
        "processes, timed in interleaved rounds; bytes are exact",
        batch_per_rank=args.batch, image=args.image, steps_per_round=args.steps, rounds=args.rounds, warmup=args.warmup,
        num_classes=args.classes, fc_width=args.fc_width,
    )
    for k in args.ranks:
        t0 = time.perf_counter()
        out = run_in_processes(
            step_worker,
            k,
            methods,
            args.batch,
            args.image,
            args.steps,
            args.warmup,
            args.rounds,
            args.classes,
            args.fc_width,
            timeout_s=1800,
            collective_timeout_s=600,
        )
        model = analytic_bytes(k, args.batch, args.classes, args.fc_width)
        # a step ends when the slowest rank finishes: max over ranks, per step and per round
        per_step = {m: [max(o[m]["times"][i] for o in out) for i in range(len(out[0][m]["times"]))] for m in methods}
        per_round = {
            m: [
                statistics.median(max(o[m]["rounds"][r][i] for o in out) for i in range(args.steps))
                for r in range(args.rounds)
            ]
            for m in methods
        }
        for m in methods:
            mean_bytes = statistics.fmean(o[m]["bytes"] for o in out)
            kinds: dict[str, float] = {}
            for o in out:
                for kk, v in o[m]["kinds"].items():
                    kinds[kk] = kinds.get(kk, 0) + v / k
            ratios = [t / d for t, d in zip(per_round[m], per_round["ddp"])]
            report.add(
                K=k, method=m, label=f"K={k} {m}", batch=f"({k * args.batch}, {k * args.batch})",
                mbytes_per_step=mean_bytes / MIB,
                analytic_mb=(model["ddp"] if m == "ddp" else model["model"]) / MIB,
                bound_mb=None if m == "ddp" else model["bound"] / MIB,
                step_s=statistics.median(per_step[m]),
                time_vs_ddp_median=statistics.median(ratios), time_vs_ddp_min=min(ratios), time_vs_ddp_max=max(ratios),
                params_per_rank_M=out[0][m]["params_local"] / 1e6,
                **{f"mb_{kk}": v / MIB for kk, v in sorted(kinds.items())},
            )
        print(
            f"K={k}: {len(methods)} methods x {args.rounds} rounds in {time.perf_counter() - t0:.0f}s; analytic "
            "bound of the paper's schemes "
            f"{model['bound'] / MIB:.2f} MiB = {model['bound'] / model['ddp']:.3f}x DDP (trunk "
            f"{model['trunk'] / MIB:.2f} + activations "
            f"{model['activations'] / MIB:.2f}), head-internal {model['head_internal'] / MIB:.2f} MiB",
            flush=True,
        )
    report.add_ratios("method", "mbytes_per_step", "ddp", "bytes_vs_ddp", group_by=["K"])
    report.add_ratios("method", "bound_mb", "ddp", "bound_vs_ddp", group_by=["K"])
    for row in report.rows:  # bound ratio is against DDP's measured bytes
        ddp = next(r for r in report.rows if r["K"] == row["K"] and r["method"] == "ddp")
        row["bound_vs_ddp"] = None if row["bound_mb"] is None else row["bound_mb"] / ddp["mbytes_per_step"]
    report.print(
        [
            "label",
            "mbytes_per_step",
            "analytic_mb",
            "bytes_vs_ddp",
            "bound_vs_ddp",
            "step_s",
            "time_vs_ddp_median",
            "time_vs_ddp_min",
            "time_vs_ddp_max",
            "params_per_rank_M",
        ]
    )
    report.write()
    if not args.overlap:
        report.plot_bars(
            "label", "bytes_vs_ddp", title="bytes per step relative to DDP (AlexNet one tower)", ylabel="x DDP"
        )


def bytes_worker(rank: int, k: int, batches: list[int], methods: list[str]) -> dict:
    counter = ByteCounter()
    out = {}
    for method in methods:
        net, _ = build(method, k, 1000, 4096, counter)
        # DDP's bytes do not depend on b; a and b are checked against c at one batch size
        for b in batches if method == "c" else batches[-1:]:
            x = torch.randn(b, 3, 64, 64)
            y = torch.randint(0, 1000, (b,))
            counter.reset()
            F.cross_entropy(net(x), y).backward()
            out[(method, b)] = counter.total
        del net
    return out


def bytes_sweep(args: argparse.Namespace) -> None:
    report = Report("hybrid_fc_bytes_sweep")
    report.meta.update(
        note="bytes per rank per step (exact, counted at the collectives) vs the analytic model of analytic_bytes()"
    )
    batches = args.sweep_batches
    for k in args.ranks:
        out = run_in_processes(
            bytes_worker, k, batches, ["ddp", "a", "b", "c"], timeout_s=1800, collective_timeout_s=600
        )
        for b in batches:
            model = analytic_bytes(k, b)
            last = batches[-1]
            meas = {m: statistics.fmean(o[(m, b if m == "c" else last)] for o in out) for m in ("ddp", "a", "b", "c")}
            report.add(
                K=k, b=b, ddp_mb=meas["ddp"] / MIB, hybrid_mb=meas["c"] / MIB,
                a_eq_b_eq_c=(meas["a"] == meas["b"] == meas["c"]) if b == last else None,
                analytic_mb=model["model"] / MIB, bound_mb=model["bound"] / MIB, trunk_mb=model["trunk"] / MIB,
                activations_mb=model["activations"] / MIB, head_internal_mb=model["head_internal"] / MIB,
                hybrid_vs_ddp=meas["c"] / meas["ddp"], bound_vs_ddp=model["bound"] / meas["ddp"],
            )
        print(f"K={k}: <= 0.1x DDP up to b = {largest_batch_within(k, 0.1, 'model')} per rank (implementation), "
              f"b = {largest_batch_within(k, 0.1, 'bound')} (lower bound of the paper's schemes)", flush=True)
    report.print()
    report.write()


# ---- part 2: a Table 1 analogue on digits --------------------------------------------------------------------
def digits_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(1),
        nn.Linear(32 * 16, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


def table_worker(rank: int, k: int, fc_update: str, b: int, epochs: int, lr: float) -> dict:
    from lightning_hpc.data.digits import load_digits_tensors

    train, val = load_digits_tensors()
    xs, ys = train.tensors
    xv, yv = val.tensors
    model = digits_model()
    if k > 1:
        model = parallelize_head(model, scheme="c", fc_update=fc_update)
    opt = torch.optim.SGD(model.parameters(), lr=lr * k, momentum=0.9, weight_decay=5e-4)  # lr x K (section 5)
    head_opt = HeadOptimizer(opt, head_parameters(model)) if k > 1 and fc_update == "per_subbatch" else None
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    steps_per_epoch = len(xs) // (k * b)
    for _ in range(epochs):
        perm = torch.randperm(len(xs), generator=g)
        for s in range(steps_per_epoch):
            idx = perm[s * k * b : (s + 1) * k * b][rank * b : (rank + 1) * b]
            x, y = xs[idx], ys[idx]
            opt.zero_grad(set_to_none=True)
            if head_opt is not None:
                with find_hybrid_head(model).subbatch_update(y, F.cross_entropy, head_opt.step):
                    loss = F.cross_entropy(model(x), y)
            else:
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            if k > 1:
                from lightning_hpc.hybrid_fc import average_trunk_gradients

                average_trunk_gradients(model)
            opt.step()
    elapsed = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        n = len(xv) // k * k
        mine = slice(rank * (n // k), (rank + 1) * (n // k))
        logits = model(xv[:n][mine])
        ce = F.cross_entropy(logits, yv[:n][mine], reduction="sum")
        err = (logits.argmax(1) != yv[:n][mine]).sum().float()
    if k > 1:
        both = torch.stack([ce, err])
        dist.all_reduce(both)
        ce, err = both
    return {"ce": float(ce) / n, "err": float(err) / n, "time": elapsed}


def part2(args: argparse.Namespace) -> None:
    report = Report("hybrid_fc_table1")
    report.meta.update(
        note="digits (sklearn), conv trunk + 3 FC layers, scheme c, lr x K, shared 2-core CPU",
        batch_per_rank=args.table_batch,
        epochs=args.table_epochs,
    )
    b = args.table_batch
    configs = [(1, "per_step")] + [(k, u) for k in (2, 4) for u in ("per_step", "per_subbatch")]
    for k, update in configs:
        if k == 1:
            out = run_in_processes(table_worker, 1, update, b, args.table_epochs, args.table_lr, timeout_s=1800)
        else:
            out = run_in_processes(table_worker, k, update, b, args.table_epochs, args.table_lr, timeout_s=1800)
        n = b if update == "per_subbatch" else k * b
        report.add(
            GPUs_or_ranks=k,
            batch_size=f"({k * b}, {n})",
            fc_update=update,
            cross_entropy=out[0]["ce"],
            top1_error=out[0]["err"],
            time_s=max(o["time"] for o in out),
        )
        print(report.rows[-1], flush=True)
    report.print()
    report.write()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batch", type=int, default=4, help="examples per rank (the paper: 128)")
    p.add_argument("--image", type=int, default=224)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--fc-width", type=int, default=4096)
    p.add_argument("--steps", type=int, default=2, help="timed steps per method per round")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--overlap", action="store_true", help="schemes b, c with and without overlap of the exchange")
    p.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="ddp first, then any of a, b, c, b-nooverlap, c-nooverlap, a-nooverlap",
    )
    p.add_argument("--bytes-sweep", action="store_true", help="bytes only, over --sweep-batches")
    p.add_argument("--sweep-batches", type=int, nargs="+", default=[4, 16, 32, 51, 52, 64, 80, 81, 103, 104, 128])
    p.add_argument("--name", default="hybrid_fc", help="results file name under bench/results/")
    p.add_argument("--table", action="store_true", help="run part 2 (Table 1 analogue on digits) instead of part 1")
    p.add_argument("--table-batch", type=int, default=16)
    p.add_argument("--table-epochs", type=int, default=8)
    p.add_argument("--table-lr", type=float, default=0.01)
    args = p.parse_args()
    if args.table:
        part2(args)
    elif args.bytes_sweep:
        bytes_sweep(args)
    else:
        part1(args)


if __name__ == "__main__":
    main()
