"""K-FAC overhead: amortized time per optimizer step with K-FAC over plain SGD (ResNet-32, batch 128, CPU).

``--model mobilenet`` times a MobileNet-v1-style net instead (depthwise-separable blocks with BatchNorm on 32x32
inputs, :func:`mobilenet`): every layer K-FAC handles is on by default (the depthwise convolutions a block per
channel, the BatchNorm layers' per-channel 2x2 blocks); ``--layer-types linear conv`` leaves the BatchNorm layers
to the optimizer, for a comparison on the same machine.

Four kinds of optimizer step are timed in the same process (median of ``--repeats`` x ``--rounds`` after warm-up;
process CPU time with one thread, since wall time on a
loaded shared machine mostly measures the other jobs; wall time is reported too):

* ``sgd``: forward, backward, ``SGD.step`` (the baseline);
* ``kfac_precondition``: + ``KFACPreconditioner.step`` that only preconditions (no update this step);
* ``kfac_factors``: + factor capture in the hooks and the running-average update;
* ``kfac_factors_decomp``: + factor update and all eigendecompositions.

The amortized K-FAC step for factor interval ``f`` and decomposition interval ``d`` (d a multiple of f) is
``(t_decomp + (d/f - 1) t_factors + (d - d/f) t_precondition) / d``, reported against ``t_sgd`` for the issue's
configuration (f=10, d=100; target <= 1.15x at the default thread count) and the paper's every-1 / every-10.

Both thread counts are measured in one run (``--threads 1,default``: one intra-op thread, then torch's default
count), each with its own SGD baseline; ratios use process CPU time at one thread and wall time at several
(CPU time then sums the threads' spinning), and both are reported. Each step kind's row also gives
``sample_range``: how far that kind's samples in this run lie apart ((max - min) / median, on the time its ratio
uses), so a figure is read against its own run's spread.

    flock LOCKFILE python bench/kfac_overhead.py [--repeats 3] [--rounds 4] [--batch 128] [--threads 1,default]

With ``--processes 2`` every step kind runs on 2 gloo processes (one thread each, the global batch split between
them, gradients averaged by ``DistributedDataParallel`` in every kind, the baseline included), so the factor
all-reduce costs real communication; ``--overlap both`` then times the factor steps with the all-reduce at the
step (``overlap_factor_allreduce=False``) and launched from the backward hooks (``True``) in the same run, and
reports both amortized steps against SGD (rows ``kfac_f10_d100`` and ``kfac_f10_d100_overlap``). Ratios use wall
time there: the ranks wait for each other, and waiting is what overlap removes.

    flock LOCKFILE python bench/kfac_overhead.py --processes 2 --overlap both [--repeats 3] [--batch 128]

(writes bench/results/kfac_overhead_2proc.{json,csv} unless ``--tag`` is given).

    flock LOCKFILE python bench/kfac_overhead.py --model mobilenet [--width 0.5] [--layer-types linear conv]

(writes bench/results/kfac_overhead_mobilenet.{json,csv} unless ``--tag`` is given).

``--spread`` adds ``kfac_factors_spread_max``: a factor step that also decomposes the heaviest phase of
``spread_decompositions=True`` at d=100 (the factors whose ``n^3`` the phases balance), i.e. the most any step
costs with the decompositions spread, against ``kfac_factors_decomp``'s stall once per interval.

Beside each K-FAC ratio, ``flop_floor`` is the FLOP floor of the eigen route (:func:`flop_floor`): ``1 + P / S``
with ``S`` the SGD step's FLOPs (torch's FLOP counter, with grouped convolutions' backward counted right:
:func:`harness.flop_counter`) and ``P`` the matrix-product FLOPs every K-FAC step must run to precondition (Eq
13-15: four products per layer). It is a ratio of FLOPs, not of times: what the amortized ratio would be if K-FAC's
products ran at the SGD step's FLOP rate and the factor steps and decompositions were free. Networks of depthwise
convolutions run their SGD step far below a product's FLOP rate, so there it is no lower bound on time;
``time_floor`` (:func:`product_rate`) is: ``1 + P / (R t_sgd)`` with ``R`` the rate the products reach on this
machine in the same run.
The inverse route's floor (two products) is printed too; it damps differently, so it is no exact cheaper route.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import Report, flop_counter, force_kfac_step_kind
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.kfac import KFACPreconditioner
from lightning_hpc.kfac.batched import PreconditionBuckets, keep_zeros
from lightning_hpc.kfac.schedules import spread_phases
from lightning_hpc.models import build_model, cifar_resnet

#: the decomposition interval ``--spread`` spreads over (the d=100 of the amortized figures)
SPREAD_INTERVAL = 100
#: factor all-reduce modes: ``overlap_factor_allreduce`` value and the suffix of their step kinds
MODES = {"sync": (False, ""), "overlap": (True, "_overlap")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--size", type=int, default=32, help="input height and width")
    ap.add_argument("--per-layer", action="store_true",
                    help="also time the precondition-only step with every layer preconditioned alone (no buckets)")
    ap.add_argument("--model", choices=["resnet", "mobilenet", "convnext", "efficientnet", "mobilenetv3"],
                    default="resnet",
                    help="CIFAR ResNet of --depth, or the MobileNet-style net of depthwise-separable blocks")
    ap.add_argument("--width", type=float, default=0.5, help="MobileNet width multiplier (channels x width)")
    ap.add_argument("--layer-types", nargs="+", default=None, metavar="TYPE",
                    help="K-FAC's layer_types (default: every family it handles)")
    ap.add_argument("--threads", default="1,default", help="comma-separated thread counts; 'default' = torch's default")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds of all step kinds (noise control)")
    ap.add_argument("--tag", default="", help="suffix of the result files (e.g. _threads2)")
    ap.add_argument("--processes", type=int, default=1,
                    help="ranks (gloo, one thread each, the batch split between them, DDP gradient averaging)")
    ap.add_argument("--overlap", choices=["off", "on", "both"], default="off",
                    help="factor all-reduce at the step (off), from the backward hooks (on), or both in one run; "
                    "needs --processes > 1")
    ap.add_argument("--spread", action="store_true",
                    help="also time kfac_factors_spread_max: a factor step with the heaviest phase of "
                    "spread_decompositions at d=100 (the worst step with the decompositions spread)")
    ap.add_argument("--unfold-a", action="store_true",
                    help="compute every convolution's A from the unfolded patches (the path before the shifted "
                    "channel correlations), for a comparison on the same machine")
    args = ap.parse_args()
    if args.overlap != "off" and args.processes < 2:
        ap.error("--overlap needs --processes 2 or more: one process has no factor all-reduce to overlap")
    modes = {"off": ["sync"], "on": ["overlap"], "both": ["sync", "overlap"]}[args.overlap]
    if args.unfold_a:
        import lightning_hpc.kfac.layers.conv as kfac_conv

        kfac_conv.SHIFTED_GRAM_MIN_WORK = 1 << 62  # no layer has that much work: every A from the patches
    default_threads = torch.get_num_threads()
    counts = [default_threads if c.strip() == "default" else int(c) for c in args.threads.split(",")]
    if args.processes > 1:
        counts = [1]  # one thread per rank (run_in_processes): the ranks share the cores
    # several processes write their own files (kfac_overhead_2proc.*) unless a tag says otherwise
    tag = args.tag or (f"_{args.processes}proc" if args.processes > 1 else "")
    if args.model != "resnet" and not args.tag:
        tag = f"_{args.model}" + tag  # its own files: the ResNet-32 results stay
    report = Report("kfac_overhead" + tag)
    report.meta.update(
        model=f"cifar_resnet{args.depth}" if args.model == "resnet" else f"mobilenet_width{args.width:g}"
        if args.model == "mobilenet" else args.model,
        size=args.size,
        layer_types=args.layer_types or "all",
        batch=args.batch,
        threads=counts,
        default_threads=default_threads,
        repeats=args.repeats * args.rounds,
        conv_a="unfolded patches" if args.unfold_a else "shifted channel correlations where they apply",
        processes=args.processes,
        factor_allreduce=modes,
    )
    floor = flop_floor(args, args.batch // args.processes)
    report.meta.update(floor)
    print(f"FLOP floor (SGD step + the every-step preconditioning products, as a ratio of the SGD step's FLOPs): "
          f"eigen {floor['floor_eigen']:.3f}x, inverse {floor['floor_inverse']:.3f}x")
    time_floors: dict[int, float] = {}
    for threads in dict.fromkeys(counts):
        if args.processes > 1:
            # rank 0's medians (every step kind synchronises the ranks through its collectives)
            t, t_wall, sample_range = run_in_processes(_measure_rank, args.processes, args, modes, timeout_s=3600,
                                                       collective_timeout_s=600)[0]  # fmt: skip
        else:
            t, t_wall, sample_range = measure(args, threads, modes)
        # waiting for the other ranks is not CPU time: with several processes only wall time counts it
        ratio_on = "cpu_s_per_step" if threads == 1 and args.processes == 1 else "wall_s_per_step"
        rate = product_rate(threads)
        sgd_s = (t if ratio_on == "cpu_s_per_step" else t_wall)["sgd"]
        time_floors[threads] = 1.0 + floor["precondition_flops_eigen"] / (rate * sgd_s)
        report.meta[f"product_gflops_threads{threads}"] = rate / 1e9
        print(f"{threads} thread(s): the preconditioning's products run at {rate / 1e9:.0f} GFLOP/s (a 1024 x 513 "
              f"layer's Eq 13-15 chain): time floor {time_floors[threads]:.3f}x")
        for k, v in t.items():
            report.add(
                threads=threads,
                config=k,
                factor_every=None,
                decomp_every=None,
                cpu_s_per_step=v,
                wall_s_per_step=t_wall[k],
                ratio_on=ratio_on,
                sample_range=sample_range[k],
            )
        for f, d in ((10, 100), (1, 10), (1, 100), (10, 1000)):
            for mode in modes:
                suffix = MODES[mode][1]
                report.add(
                    threads=threads,
                    config=f"kfac_f{f}_d{d}{suffix}",
                    factor_every=f,
                    decomp_every=d,
                    cpu_s_per_step=amortized(t, f, d, suffix),
                    wall_s_per_step=amortized(t_wall, f, d, suffix),
                    ratio_on=ratio_on,
                )
    for row in report.rows:  # the floors of the compute method timed (the default, eigen) beside each K-FAC ratio
        row["flop_floor"] = None if row["config"] == "sgd" else floor["floor_eigen"]
        row["time_floor"] = None if row["config"] == "sgd" else time_floors[row["threads"]]
    report.add_ratios("config", "cpu_s_per_step", "sgd", ratio_name="cpu_vs_sgd", group_by=["threads"])
    report.add_ratios("config", "wall_s_per_step", "sgd", ratio_name="wall_vs_sgd", group_by=["threads"])
    for row in report.rows:  # the ratio that measures the step's own work at this thread count
        row["vs_sgd"] = row.get("cpu_vs_sgd" if row["ratio_on"] == "cpu_s_per_step" else "wall_vs_sgd")
    report.print()
    report.write()


#: MobileNet v1's body (Howard et al. 2017, Table 1) for 32x32 inputs: (output channels, stride) of each
#: depthwise-separable block after the 3x3 stem of 32 channels, the first stride-2 stages kept at stride 1
MOBILENET_BLOCKS = ((64, 1), (128, 1), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1), (512, 1), (512, 1),
                    (512, 1), (512, 1), (1024, 2), (1024, 1))


def mobilenet(width: float = 1.0, classes: int = 10) -> nn.Sequential:
    """A MobileNet-v1-style classifier: a 3x3 stem, depthwise 3x3 + pointwise 1x1 blocks, each convolution followed
    by BatchNorm and ReLU, global average pooling and a Linear head."""

    def ch(c: int) -> int:
        return max(8, int(c * width))

    def conv_bn(c_in: int, c_out: int, k: int, stride: int, groups: int = 1) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True)]

    layers = conv_bn(3, ch(32), 3, 1)
    c = ch(32)
    for c_out, stride in MOBILENET_BLOCKS:
        layers += conv_bn(c, c, 3, stride, groups=c) + conv_bn(c, ch(c_out), 1, 1)
        c = ch(c_out)
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes))


def build(args: argparse.Namespace) -> nn.Module:
    """The model ``--model`` names."""
    if args.model == "resnet":
        return cifar_resnet(args.depth)
    return mobilenet(args.width) if args.model == "mobilenet" else build_model(args.model)


def flop_floor(args: argparse.Namespace, batch: int) -> dict[str, float]:
    """The FLOP floor of a K-FAC step: FLOPs of one SGD step (forward and backward of a batch of ``batch``, as
    torch's FLOP counter counts them: matrix products and convolutions) plus those of the products every K-FAC step
    must run to precondition (:meth:`~lightning_hpc.kfac.layers.LayerHandler.precondition_flops`: Eq 13-15's four
    products per layer with eigenpairs, Eq 12's two with inverses), as a ratio of the SGD step's. A lower bound on
    the amortized ratio if K-FAC's products ran at the SGD step's FLOP rate: the factor steps and the
    decompositions come on top of it. Of the two routes only the eigen one (the default, timed here) computes the
    exact damping ``(A (x) G + damping I)^-1``; the inverse route's is factored, ``(A + damping I)^-1 (x) (G +
    damping I)^-1``, so it is not an exact cheaper route to the same step."""
    from lightning_hpc.kfac.methods import make_method

    torch.manual_seed(0)
    model = build(args)
    x, y = torch.randn(batch, 3, args.size, args.size), torch.randint(0, 10, (batch,))
    with flop_counter() as counter:  # grouped convolutions' backward counted right (torch's own formula does not)
        F.cross_entropy(model(x), y).backward()
    sgd = counter.get_total_flops()
    pre = KFACPreconditioner(model, layer_types=args.layer_types, announce=False)
    out: dict[str, float] = {"sgd_step_flops": sgd}
    for name in ("eigen", "inverse"):
        flops = sum(h.precondition_flops(make_method(name)) for h in pre.handlers)
        out[f"precondition_flops_{name}"] = flops
        out[f"floor_{name}"] = 1.0 + flops / sgd
    return out


def product_rate(threads: int) -> float:
    """FLOP/s of the every-step preconditioning's products on this machine at ``threads``: Eq 13-15's chain
    (:func:`~lightning_hpc.kfac.linalg.precondition_eigen`, four products) on a float32 1024 x 513 layer, median of
    5 after a warm-up. With it, ``time_floor = 1 + P / (rate * t_sgd)``: the amortized ratio if every layer's
    products ran at that (large-layer) rate and the factor steps and decompositions were free. Unlike
    ``flop_floor``, it does not assume the products run at the SGD step's own FLOP rate, which depthwise
    convolutions keep far below a product's."""
    from lightning_hpc.kfac.linalg import precondition_eigen

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    qg = torch.linalg.qr(torch.randn(1024, 1024, generator=gen))[0].contiguous()
    qa = torch.linalg.qr(torch.randn(513, 513, generator=gen))[0].contiguous()
    grad = torch.randn(1024, 513, generator=gen)
    dg, da = torch.rand(1024, generator=gen), torch.rand(513, generator=gen)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        precondition_eigen(grad, qa, da, qg, dg, 0.01)
        times.append(time.perf_counter() - t0)
    return 4 * 1024 * 513 * (1024 + 513) / statistics.median(times[1:])


def amortized(times: dict[str, float], f: int, d: int, suffix: str = "") -> float:
    """Mean step time for factors every ``f`` and decompositions every ``d`` steps (d a multiple of f); ``suffix``
    picks the factor steps of one all-reduce mode (``""`` at the step, ``"_overlap"`` from the hooks)."""
    return (
        times[f"kfac_factors_decomp{suffix}"]
        + (d // f - 1) * times[f"kfac_factors{suffix}"]
        + (d - d // f) * times["kfac_precondition"]
    ) / d


class _PerLayer(PreconditionBuckets):
    """Every layer its own product chain, its gradient matrix built and written back on its own: the per-layer
    code that batched preconditioning replaced (the ``--per-layer`` comparison)."""

    def precondition_grads(self, handlers, weights, method, damping, dtype, kl_terms=False):  # type: ignore[no-untyped-def]
        done = []
        for h in handlers:
            g = h.grad_matrix() if h.factors and h.decompositions else None
            if g is not None:
                done.append((h, g, keep_zeros(h.preconditioned(g, method, damping, dtype), g)))
        self.last_buckets, self.last_outputs, self.last_kl_layers = [], [p for _, _, p in done], [h for h, _, _ in done]
        self.last_kl_terms = [([h.name], (p * g.to(p.dtype)).sum().reshape(1)) for h, g, p in done] if kl_terms else []
        self._done = done
        return bool(done)

    def write_back(self) -> None:
        for h, _, p in self._done:
            h.set_grad_matrix(p)


def _measure_rank(rank: int, world_size: int, args: argparse.Namespace,
                  modes: list[str]) -> tuple[dict, dict, dict]:
    return measure(args, 1, modes)


def measure(
    args: argparse.Namespace, threads: int, modes: list[str] | None = None
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Median CPU and wall seconds per step of each step kind at ``threads`` intra-op threads (on every rank of
    the process group when there is one: each rank takes its share of the batch, DDP averages the gradients)."""
    modes = modes or ["sync"]
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model0 = build(args)
    g = torch.Generator().manual_seed(rank)
    batch = args.batch // world
    x = torch.randn(batch, 3, args.size, args.size, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)

    def wrap(m: nn.Module) -> nn.Module:  # the strategy's gradient averaging, overlapped with the backward pass
        return DistributedDataParallel(m) if world > 1 else m

    # Each kind trains its own copy: K-FAC's hooks on one model would otherwise capture in the others' steps.
    sgd_model = wrap(copy.deepcopy(model0))
    sgd_opt = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    kfac: dict[str, tuple[nn.Module, torch.optim.Optimizer, KFACPreconditioner]] = {}
    for mode in modes:
        model = copy.deepcopy(model0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        pre = KFACPreconditioner(model, optimizer=opt, factor_update_freq=1, inv_update_freq=1, damping=0.003,
                                 overlap_factor_allreduce=MODES[mode][0], layer_types=args.layer_types,
                                 announce=rank == 0)  # fmt: skip
        kfac[mode] = (wrap(model), opt, pre)

    def sgd_step() -> None:
        sgd_opt.zero_grad()
        F.cross_entropy(sgd_model(x), y).backward()
        sgd_opt.step()

    def kfac_step(mode: str, factors: bool, decomp: bool) -> None:
        net, opt, pre = kfac[mode]
        force_kfac_step_kind(pre, factors, decomp)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        pre.step()
        opt.step()

    def spread_step() -> None:
        """A factor step that decomposes the heaviest phase of ``spread_decompositions`` at d=100: the most a
        step costs with the decompositions spread (``--spread``)."""
        net, opt, pre = kfac[modes[0]]
        plain, pre.options = pre.options, dataclasses.replace(pre.options, spread_decompositions=True)
        forms = [form for h in pre.handlers for form in h.factor_forms().values()]
        phases = spread_phases([form.cost for form in forms], SPREAD_INTERVAL)
        loads = [sum(f.cost for f, p in zip(forms, phases) if p == q) for q in range(SPREAD_INTERVAL)]
        pre.steps = max(range(1, SPREAD_INTERVAL), key=loads.__getitem__)  # not 0: every interval's multiple
        pre.schedule = pre.schedule.__class__(damping=pre.schedule.damping, factor_update_freq=1,
                                              inv_update_freq=SPREAD_INTERVAL)  # fmt: skip
        try:
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            pre.step()
            opt.step()
        finally:
            pre.options = plain

    first = modes[0]
    kinds = {
        "sgd": lambda: sgd_step(),
        "kfac_precondition": lambda: kfac_step(first, False, False),
    }
    if args.spread:
        kinds["kfac_factors_spread_max"] = spread_step
    if args.per_layer:  # the same precondition-only step with every layer preconditioned alone (no buckets)
        def per_layer_step() -> None:
            pre = kfac[first][2]
            batched, pre._buckets = pre._buckets, _PerLayer()
            try:
                kfac_step(first, False, False)
            finally:
                pre._buckets = batched

        kinds["kfac_precondition_per_layer"] = per_layer_step
    for mode in modes:
        suffix = MODES[mode][1]
        kinds[f"kfac_factors{suffix}"] = lambda mode=mode: kfac_step(mode, True, False)
        kinds[f"kfac_factors_decomp{suffix}"] = lambda mode=mode: kfac_step(mode, True, True)
    for mode in modes:
        kfac_step(mode, True, True)  # factors and decompositions exist before the precondition-only steps
    wall: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    order = list(kinds.items())
    for r in range(args.rounds):  # interleaved so background load hits every kind alike
        # Each round starts at another kind, so no kind always follows the same one (its cache and allocator
        # state): with a fixed order the precondition-only step, strictly more work, measured up to 7 % below SGD's.
        for k, fn in order[r % len(order):] + order[: r % len(order)]:
            for _ in range(args.warmup):
                fn()
            for _ in range(args.repeats):
                w0, c0 = time.perf_counter(), time.process_time()
                fn()
                wall[k].append(time.perf_counter() - w0)
                cpu[k].append(time.process_time() - c0)
    # On a loaded shared machine wall time mostly measures the other jobs; with one intra-op thread the
    # process CPU time is the work of the step itself. Both are reported; ratios use CPU time.
    t = {k: statistics.median(v) for k, v in cpu.items()}
    t_wall = {k: statistics.median(v) for k, v in wall.items()}
    # how far this run's samples of each kind lie apart, relative to their median, on the timing the ratios use: a
    # figure is no steadier than that
    samples = cpu if threads == 1 and world == 1 else wall
    sample_range = {k: (max(v) - min(v)) / statistics.median(v) for k, v in samples.items()}
    return t, t_wall, sample_range


if __name__ == "__main__":
    main()
