"""The worker side of ``bench/layered_sgd.py``: the model, the JPEG data, one rank's plain-loop training
(``--worker``) and one rank of ``Trainer(strategy=ddp | layered_sgd)`` (``--lightning-worker``).

A worker runs inside its simulated node (``lightning_hpc.testing.SimNodes``) when the link is shaped; leaders
set their own node's egress rate (``LSGD_VETH`` names the node's link, ``LSGD_QUEUE_MS`` the tbf queue).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch import nn

IMAGE = 192  # JPEG side length
#: tbf queue length in milliseconds of data at the shaped rate (a long queue delays every small message that
#: arrives behind a bulk transfer); set with --queue-ms, passed to workers through the environment
QUEUE_MS = int(os.environ.get("LSGD_QUEUE_MS", "500"))
#: layered SGD gradient bucket size in MB for every bucket (0: DDP's defaults, 1 MB first bucket then 25 MB)
BUCKET_MB = float(os.environ.get("LSGD_BUCKET_MB", "0"))

def write_jpegs(folder: Path, count: int) -> list[Path]:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{i:04d}.jpg" for i in range(count)]
    if all(p.exists() for p in paths):
        return paths
    g = torch.Generator().manual_seed(0)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, IMAGE), torch.linspace(0, 1, IMAGE), indexing="ij")
    for i, p in enumerate(paths):
        f = torch.rand(3, 2, generator=g) * 12
        smooth = torch.stack([torch.sin(f[c, 0] * xx + f[c, 1] * yy) for c in range(3)], -1)
        img = ((smooth * 0.35 + 0.5 + 0.15 * torch.rand(IMAGE, IMAGE, 3, generator=g)).clamp(0, 1) * 255).byte()
        Image.fromarray(img.numpy()).save(p, quality=90)
    return paths


class Net(nn.Module):
    """Small conv trunk + wide FC head: little compute, ~8 MB of gradients (an inter-node allreduce that
    matters on a slow link)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(16 * 16 * 16, width), nn.ReLU(), nn.Linear(width, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


class JpegLoader:
    """Decodes ``batch`` JPEG files per call (Pillow), the real work the paper's workers do meanwhile."""

    def __init__(self, paths: list[Path], batch: int, rank: int, world: int) -> None:
        self.paths, self.batch, self.i = paths, batch, rank * batch
        self.stride = world * batch
        self.times: list[float] = []

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        t0 = time.perf_counter()
        xs = []
        for k in range(self.batch):
            p = self.paths[(self.i + k) % len(self.paths)]
            with Image.open(p) as im:
                arr = torch.frombuffer(bytearray(im.convert("RGB").tobytes()), dtype=torch.uint8)
            xs.append(arr.view(IMAGE, IMAGE, 3).permute(2, 0, 1).float().div_(255))
        self.i += self.stride
        x = nn.functional.adaptive_avg_pool2d(torch.stack(xs), 32)
        y = torch.randint(0, 10, (self.batch,))
        self.times.append(time.perf_counter() - t0)
        return x, y



def _shape(rank: int, per_node: int, rate_mbit: float | None) -> None:
    """Leaders set their own node's egress rate (each direction of the link is shaped by its sender); the
    worker runs inside its node, whose link is ``LSGD_VETH``."""
    if rank % per_node != 0:
        return
    dev = os.environ["LSGD_VETH"]
    subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
    if rate_mbit is not None:
        burst_kb = max(32, int(rate_mbit * 1e6 / 8 / 100 / 1024))  # >= one 10 ms timer tick of data
        subprocess.run(["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
                        "burst", f"{burst_kb}kb", "latency", f"{QUEUE_MS}ms"], check=True, capture_output=True)

def _link_rate_mbit(rank: int, per_node: int) -> float:
    """Measure rank 0 -> first rank of node 1 and back with an 8 MB tensor; returns the mean rate."""
    import torch.distributed as dist

    peer = per_node
    t = torch.zeros(2 * 1024 * 1024)
    dist.barrier()
    t0 = time.perf_counter()
    if rank == 0:
        dist.send(t, peer)
        dist.recv(t, peer)
    elif rank == peer:
        dist.recv(t, 0)
        dist.send(t, 0)
    dt = torch.tensor([time.perf_counter() - t0])
    dist.broadcast(dt, 0)
    return 2 * t.numel() * 4 * 8 / dt.item() / 1e6


def _train(mode: str, rank: int, world: int, per_node: int, loader: JpegLoader, steps: int, warmup: int,
           width: int) -> dict:
    import torch.distributed as dist

    from lightning_hpc.layered_sgd.hierarchical import HierarchicalAllreduce, build_layered_groups
    from lightning_hpc.layered_sgd.postponed_update import PostponedUpdate

    torch.manual_seed(0)
    model = Net(width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    loader.times.clear()
    inter: list[float] = []
    if mode == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model

        def step(x, y):
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            return loader()
        finish = lambda: None  # noqa: E731
    else:
        groups = build_layered_groups(per_node, timeout_s=600)
        reducer = HierarchicalAllreduce(groups, timeout_s=600)
        # for comparison, "layered_post": the whole reduction starts after backward (no gradient hooks);
        # "layered_sync": ... and is waited for before loading (what the single-group case did before the
        # hooks: a blocking allreduce)
        caps = dict(bucket_cap_mb=BUCKET_MB, first_bucket_mb=BUCKET_MB) if BUCKET_MB else {}
        update = PostponedUpdate(model.parameters(), reducer, overlap_backward=mode == "layered", **caps)

        def step(x, y):
            if update.apply(opt.step) and groups.is_leader and groups.num_groups > 1:
                inter.append(reducer.last_inter_seconds)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            update.begin([opt])
            if mode == "layered_sync":  # no overlap at all: wait for the whole reduction before loading
                update.apply(opt.step)
            return loader()  # Algorithm 3 line 8: load while the leaders allreduce
        finish = lambda: update.apply(opt.step)  # noqa: E731
    batch = loader()
    for _ in range(warmup):
        batch = step(*batch)
    finish()
    loader.times.clear()
    inter.clear()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        batch = step(*batch)
    finish()
    dist.barrier()
    elapsed = time.perf_counter() - t0
    if mode != "ddp":
        reducer.close()
        update.close()
    stats = torch.tensor([statistics.median(loader.times), statistics.median(inter) if inter else 0.0])
    dist.all_reduce(stats)  # (leaders only report inter times; divide by the number of reporters)
    n_leaders = world // per_node if world // per_node > 1 else 1
    return {
        "mode": mode,
        "throughput": world * loader.batch * steps / elapsed,
        "step_s": elapsed / steps,
        "load_s": stats[0].item() / world,
        "inter_allreduce_s": stats[1].item() / n_leaders if world // per_node > 1 and mode != "ddp" else None,
    }


def _world_allreduce_s(width: int) -> float:
    import torch.distributed as dist

    n = sum(p.numel() for p in Net(width).parameters())
    buf = torch.zeros(n)
    dist.barrier()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=900))
    paths = sorted(Path(args.jpegs).glob("*.jpg"))
    loader = JpegLoader(paths, args.batch, rank, world)
    rates = ([None] + [float(r) for r in args.rates.split(",") if r]) if args.shaped else [None]
    rows = []
    for repeat in range(args.repeats):
        for rate in rates:
            if args.shaped:
                _shape(rank, args.per_node, rate)
            dist.barrier()
            link = _link_rate_mbit(rank, args.per_node) if args.shaped else None
            allreduce_s = _world_allreduce_s(args.width) if world > 1 else 0.0
            modes = args.modes.split(",")
            for mode in modes if repeat % 2 == 0 else modes[::-1]:  # alternate the order: machine load drifts
                row = _train(mode, rank, world, args.per_node, loader, args.steps, args.warmup, args.width)
                row.update(repeat=repeat, layout=args.layout, world=world, procs_per_node=args.per_node,
                           link_rate_mbit=rate if args.shaped else None, shaped=bool(args.shaped and rate),
                           measured_link_mbit=link, world_allreduce_s=allreduce_s)
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
    if args.shaped:
        _shape(rank, args.per_node, None)
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- Lightning check
def lightning_worker_main(args: argparse.Namespace) -> None:
    """One rank of ``Trainer(strategy="ddp" | LayeredSGDStrategy)`` on the shaped link: the strategies themselves,
    with Lightning's data fetching (JPEG decoding in the main process, ``num_workers=0``)."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    from lightning_hpc.layered_sgd.strategy import LayeredSGDStrategy

    torch.set_num_threads(1)
    paths = sorted(Path(args.jpegs).glob("*.jpg"))

    class Jpegs(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 10_000

        def __getitem__(self, i: int):
            from PIL import Image

            with Image.open(paths[i % len(paths)]) as im:
                arr = torch.frombuffer(bytearray(im.convert("RGB").tobytes()), dtype=torch.uint8)
            x = arr.view(IMAGE, IMAGE, 3).permute(2, 0, 1).float().div_(255)
            return nn.functional.adaptive_avg_pool2d(x, 32), i % 10

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = Net(args.width)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Jpegs(), batch_size=args.batch, num_workers=0)

    class Clock(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *a) -> None:
            self.starts.append(time.perf_counter())

    rows = []
    for repeat in range(args.repeats):
        modes = args.modes.split(",")
        for mode in modes if repeat % 2 == 0 else modes[::-1]:
            clock = Clock()
            strategy = (LayeredSGDStrategy(procs_per_node=args.per_node, overlap_backward=mode == "layered")
                        if mode in ("layered", "layered_post") else "ddp")
            trainer = pl.Trainer(accelerator="cpu", devices=args.per_node, num_nodes=args.world // args.per_node,
                                 strategy=strategy, max_steps=args.warmup + args.steps + 1, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 callbacks=[clock])
            trainer.fit(Module())
            # batch starts warmup .. warmup+steps: each interval contains exactly one full step
            dt = torch.tensor([clock.starts[args.warmup + args.steps] - clock.starts[args.warmup]])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            row = {"mode": mode, "throughput": args.world * args.batch * args.steps / dt.item(),
                   "step_s": dt.item() / args.steps, "repeat": repeat}
            rows.append(row)
            if dist.get_rank() == 0:
                print(json.dumps(row), flush=True)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(rows))
