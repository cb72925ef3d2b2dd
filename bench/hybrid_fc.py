"""Benchmark: hybrid data/model parallelism (Krizhevsky, "One weird trick") against DDP.

Part 1 (communication and step time): the one-tower AlexNet on K = 2 and 4 gloo processes; for ``ddp`` (torch
DistributedDataParallel, a comm hook counts the bucket all-reduces) and for schemes a, b, c of the hybrid head
(``fc_update=per_step``; the trunk under DDP with the head's shards excluded, as HybridParallelStrategy does), the
bytes each rank moves per step (counted at the collectives, ring-algorithm convention of
``lightning_hpc/hybrid_fc/collectives.py``) and the median step time (forward + backward + SGD step).  Ratios are
against ``ddp`` at the same K.  Bytes are exact; times come from a shared 2-core CPU machine and are noisy.

Part 2 (``--table``, a Table 1 analogue): a small conv trunk + 3-layer FC head trained on scikit-learn's digits
with K = 1, 2, 4 processes and effective batch sizes (m, n) = (K b, K b) (per_step) and (K b, b) (per_subbatch,
scheme c), reporting validation cross-entropy, top-1 error and wall time.  It shows the variable-batch-size
mechanism end to end; it is not ImageNet.

    python bench/hybrid_fc.py                       # part 1 with defaults (b=4 per rank, 224x224, 4 timed steps)
    python bench/hybrid_fc.py --table               # part 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import Report
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.hybrid_fc import ByteCounter, HeadOptimizer, find_hybrid_head, head_parameters, parallelize_head
from lightning_hpc.hybrid_fc.collectives import allreduce_ring_bytes
from lightning_hpc.models import alexnet_one_tower


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


def build(method: str, k: int, num_classes: int, fc_width: int, counter: ByteCounter, fc_update: str = "per_step") -> tuple[nn.Module, nn.Module]:
    """(module to call, module whose parameters the optimizer gets) for ``ddp`` or a hybrid scheme."""
    torch.manual_seed(0)
    model = alexnet_one_tower(num_classes=num_classes, fc_width=fc_width, dropout=0.0)
    if method == "ddp":
        return _ddp(model, counter, k), model
    group = dist.new_group(list(range(k)))
    model = parallelize_head(model, head="classifier", scheme=method, fc_update=fc_update, group=group, counter=counter)
    shard_ids = {id(p) for p in head_parameters(model)}
    ignore = [n for n, p in model.named_parameters() if id(p) in shard_ids]
    return _ddp(model, counter, k, ignore), model


def step_worker(rank: int, k: int, method: str, b: int, image: int, steps: int, warmup: int, num_classes: int, fc_width: int) -> dict:
    counter = ByteCounter()
    net, params_of = build(method, k, num_classes, fc_width, counter)
    opt = torch.optim.SGD(params_of.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(b, 3, image, image, generator=g)
    y = torch.randint(0, num_classes, (b,), generator=g)
    times, per_step_bytes = [], []
    for i in range(warmup + steps):
        counter.reset()
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
            per_step_bytes.append(counter.total)
    kinds = counter.snapshot()
    n_head = sum(p.numel() for p in head_parameters(params_of)) if method != "ddp" else 0
    return {"times": times, "bytes": per_step_bytes[-1], "kinds": kinds, "head_params_local": n_head, "params_local": sum(p.numel() for p in params_of.parameters())}


def part1(args: argparse.Namespace) -> None:
    report = Report("hybrid_fc")
    report.meta.update(
        note="shared 2-core CPU machine; step times are medians over timed steps and noisy; bytes are exact",
        batch_per_rank=args.batch, image=args.image, steps=args.steps, warmup=args.warmup, num_classes=args.classes, fc_width=args.fc_width,
    )
    for k in args.ranks:
        for method in ["ddp", "a", "b", "c"]:
            t0 = time.perf_counter()
            out = run_in_processes(step_worker, k, method, args.batch, args.image, args.steps, args.warmup, args.classes, args.fc_width, timeout_s=1800, collective_timeout_s=600)
            # A step ends when the slowest rank finishes: max over ranks per step, median over steps.
            per_step = [max(o["times"][i] for o in out) for i in range(args.steps)]
            mean_bytes = statistics.fmean(o["bytes"] for o in out)
            kinds: dict[str, float] = {}
            for o in out:
                for kk, v in o["kinds"].items():
                    kinds[kk] = kinds.get(kk, 0) + v / k
            row = report.add(
                K=k, method=method, label=f"K={k} {method}", batch=f"({k * args.batch}, {k * args.batch})",
                mbytes_per_step=mean_bytes / 2**20, step_s=statistics.median(per_step),
                params_per_rank_M=out[0]["params_local"] / 1e6,
                **{f"mb_{kk}": v / 2**20 for kk, v in sorted(kinds.items())},
            )
            print(f"K={k} {method}: {row['mbytes_per_step']:.2f} MiB/step, {row['step_s']:.3f} s/step (wall {time.perf_counter() - t0:.0f}s)", flush=True)
    report.add_ratios("method", "mbytes_per_step", "ddp", "bytes_vs_ddp", group_by=["K"])
    report.add_ratios("method", "step_s", "ddp", "time_vs_ddp", group_by=["K"])
    report.print(["label", "mbytes_per_step", "bytes_vs_ddp", "step_s", "time_vs_ddp", "params_per_rank_M"])
    report.write()
    report.plot_bars("label", "bytes_vs_ddp", title="bytes per step relative to DDP (AlexNet one tower)", ylabel="x DDP")


# ---- part 2: a Table 1 analogue on digits --------------------------------------------------------------------
def digits_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(1),
        nn.Linear(32 * 16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10),
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
    report.meta.update(note="digits (sklearn), conv trunk + 3 FC layers, scheme c, lr x K, shared 2-core CPU", batch_per_rank=args.table_batch, epochs=args.table_epochs)
    b = args.table_batch
    configs = [(1, "per_step")] + [(k, u) for k in (2, 4) for u in ("per_step", "per_subbatch")]
    for k, update in configs:
        if k == 1:
            out = run_in_processes(table_worker, 1, update, b, args.table_epochs, args.table_lr, timeout_s=1800)
        else:
            out = run_in_processes(table_worker, k, update, b, args.table_epochs, args.table_lr, timeout_s=1800)
        n = b if update == "per_subbatch" else k * b
        report.add(GPUs_or_ranks=k, batch_size=f"({k * b}, {n})", fc_update=update, cross_entropy=out[0]["ce"], top1_error=out[0]["err"], time_s=max(o["time"] for o in out))
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
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--table", action="store_true", help="run part 2 (Table 1 analogue on digits) instead of part 1")
    p.add_argument("--table-batch", type=int, default=16)
    p.add_argument("--table-epochs", type=int, default=8)
    p.add_argument("--table-lr", type=float, default=0.01)
    args = p.parse_args()
    part2(args) if args.table else part1(args)


if __name__ == "__main__":
    main()
