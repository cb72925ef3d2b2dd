"""``lightning-hpc mesh-data``: generate a mesh-tangling data set in LBANN's layout, with a progress bar.

    lightning-hpc mesh-data --size 1024 --samples 16 --out DIR [--seed 0] [--start 0] [--suffix ""] [--threads 1]
                            [--workers 1|N|auto]

Samples are independent (sample ``i`` depends on the seed and ``i`` only) and each is written to its own files, so
``--workers N`` generates N of them at once, each in its own process of ``--threads`` threads (``auto``: one per
``--threads`` of the CPU cores the process may run on): the files are the same bytes as one worker's. More workers
than cores is slower than one per core (8 samples of 1024^2 on a 2-core VM: 2 workers 1.59x one worker's speed, 4
workers 1.22x; ``bench/mesh_generator.py --workers``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed

from lightning_hpc.data.mesh_tangling.generator import (
    CHANNELS,
    DEFAULT_LOOKAHEAD,
    DEFAULT_STEPS,
    TARGET,
    generate_sample,
)
from lightning_hpc.data.mesh_tangling.layout import (
    MAX_SAMPLES,
    write_meta,
    write_sample,
)

__all__ = ["main", "planned_bytes", "REFERENCE_SECONDS_PER_CELL_STEP"]

#: Generation time per cell and time step of one sample, measured on one thread of a 2-core x86 CPU VM
#: (16 samples of 1024^2 at 36 steps: 66 s). The estimate printed up front scales it by size^2 x steps; the
#: progress bar then shows the rate of the machine at hand.
REFERENCE_SECONDS_PER_CELL_STEP = 66.0 / (16 * 1024 * 1024 * DEFAULT_STEPS)


def planned_bytes(size: int, samples: int) -> int:
    """Bytes the samples take on disk: every input channel and the label, raw float32 (``layout.write_sample``)."""
    return (len(CHANNELS) + 1) * size * size * 4 * samples


def _human(nbytes: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:,.0f} {unit}" if unit == "B" else f"{nbytes:,.1f} {unit}"
        nbytes /= 1000
    raise AssertionError("unreachable")


#: ``--workers auto``, resolved by :func:`main` once ``--threads`` is known
AUTO_WORKERS = -1


def _worker_count(value: str) -> int:
    """``--workers``: a number, or ``auto`` (:data:`AUTO_WORKERS`)."""
    if value == "auto":
        return AUTO_WORKERS
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number or 'auto', got {value!r}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-hpc mesh-data", description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1024, help="cells per side (samples are size x size)")
    p.add_argument("--samples", type=int, default=16, help="number of samples to write")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="base seed (sample i depends on seed and i only)")
    p.add_argument("--start", type=int, default=0, help="index of the first sample (to extend a data set)")
    p.add_argument("--suffix", default="", help="suffix of the channel directories (<channel><suffix>/)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="time steps before the snapshot")
    p.add_argument("--lookahead", type=int, default=DEFAULT_LOOKAHEAD, help="steps the label looks ahead")
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1 avoids oversubscribing shared nodes)"
    )
    p.add_argument(
        "--workers", type=_worker_count, default=1,
        help="samples generated at once, each in its own process of --threads threads; 'auto': one per --threads of "
             "the CPU cores this process may run on",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    if args.workers == AUTO_WORKERS and args.threads >= 1:
        # the CPU cores this process may run on (its affinity, which a batch scheduler's allocation sets), a worker of
        # --threads threads on every --threads of them
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        args.workers = max(1, cores // args.threads)
    if args.size < 2 or args.samples < 1 or args.start < 0 or args.workers < 1 or args.threads < 1:
        print("mesh-data: --size must be >= 2, --samples, --workers and --threads >= 1 and --start >= 0",
              file=sys.stderr)
        return 2
    if args.start + args.samples > MAX_SAMPLES:
        print(f"mesh-data: indices are 4 digits: --start + --samples must be <= {MAX_SAMPLES}", file=sys.stderr)
        return 2
    # Said before any work: a 1024^2 data set of 16 samples is 1.3 GB and about a minute (2048^2: four times both).
    nbytes = planned_bytes(args.size, args.samples)
    estimate = REFERENCE_SECONDS_PER_CELL_STEP * args.size * args.size * args.steps * args.samples
    workers = min(args.workers, args.samples)
    at_once = f" ({workers} workers at once: about {max(estimate / workers, 1):,.0f} s on {workers} such cores)" \
        if workers > 1 else ""
    print(
        f"mesh-data: {args.samples} samples of {len(CHANNELS) + 1} x {args.size} x {args.size} float32 "
        f"({len(CHANNELS)} channels and the label) = {nbytes:,} bytes ({_human(nbytes)}) to {args.out}; "
        f"about {max(estimate, 1):,.0f} s at one thread of a 2-core x86 CPU{at_once}",
        flush=True,
    )
    from tqdm import tqdm

    write_meta(
        args.out, height=args.size, width=args.size, samples=args.start + args.samples, seed=args.seed,
        steps=args.steps, lookahead=args.lookahead, channels=list(CHANNELS), target=TARGET, suffix=args.suffix,
    )
    positives, t0 = 0.0, time.perf_counter()
    indices = range(args.start, args.start + args.samples)
    for share in tqdm(
        _written(args, indices, workers), total=args.samples, desc=f"mesh-data {args.size}x{args.size}",
        unit="sample", disable=args.quiet, file=sys.stderr,
    ):
        positives += share
    elapsed = time.perf_counter() - t0
    print(
        f"wrote {args.samples} samples of 18 x {args.size} x {args.size} to {args.out} "
        f"({elapsed / args.samples:.2f} s/sample, {100 * positives / args.samples:.3f}% cells labelled tangling)"
    )
    return 0


def _write_one(args: argparse.Namespace, index: int) -> float:
    """Generate and write sample ``index``; its share of cells labelled tangling."""
    sample = generate_sample(args.seed, index, args.size, args.steps, args.lookahead)
    write_sample(args.out, index, sample, args.suffix)
    return float(sample[TARGET].mean())


def _start_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _written(args: argparse.Namespace, indices: range, workers: int) -> Iterator[float]:
    """Each sample's share of tangling cells as it is written: in this process, or by ``workers`` processes (fresh
    interpreters: a fork would copy torch's thread pools) as they finish; a worker's error is raised here."""
    if workers == 1:
        _start_worker(args.threads)
        for index in indices:
            yield _write_one(args, index)
        return
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
                             initargs=(args.threads,)) as pool:
        futures = [pool.submit(_write_one, args, index) for index in indices]
        try:
            for future in as_completed(futures):
                yield future.result()
        finally:
            for future in futures:
                future.cancel()
