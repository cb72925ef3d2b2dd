"""K-FAC's float32 products on this CPU through torch's BLAS (``x @ w^T``, MKL in torch's CPU wheels) and through
oneDNN (the 1x1-convolution route of :func:`lightning_hpc.kfac.linalg._onednn_mm_t`), side by side on the shapes
Eq 13-15's chains and the Linear Grams make, with the route :func:`~lightning_hpc.kfac.linalg.onednn_outruns_blas`
chooses here (oneDNN where torch reports AVX-512 on a CPU that is not Intel's: MKL runs 256-bit code there).

    python bench/kfac_product_routes.py [--threads 1] [--repeats 7] [--tag _2026_12_07]

Best of ``--repeats`` after a warm-up, one process; run it alone on the machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import Report, timeit  # noqa: E402

from lightning_hpc.kfac import linalg  # noqa: E402

#: (m, k, n) of ``x (m, k) @ w (n, k)^T``: a 1280 x 321 layer's chain (both orders), a 576-wide square, a 1536
#: Linear, a 96 x 864 conv, a wide 4096 Gram-like product
SHAPES = [(320, 1280, 1280), (1280, 1280, 320), (1280, 320, 320), (576, 576, 576), (384, 1536, 1536),
          (96, 864, 864), (64, 4096, 4096)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tag", default="", help="suffix of the result files (bench/results/kfac_product_routes<tag>.*)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = Report(f"kfac_product_routes{args.tag}")
    report.meta.update(cpu_capability=torch.backends.cpu.get_cpu_capability(), cpu_vendor=linalg.cpu_vendor(),
                       threads=args.threads,
                       route_taken="onednn" if linalg.onednn_outruns_blas() else "blas")
    print(f"torch CPU capability {report.meta['cpu_capability']}, vendor {report.meta['cpu_vendor'] or '(unknown)'}: "
          f"K-FAC takes the {report.meta['route_taken']} route")
    gen = torch.Generator().manual_seed(0)
    for m, k, n in SHAPES:
        x, wt = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        flops = 2.0 * m * k * n
        blas = min(timeit(lambda: x @ wt.mT, warmup=1, repeats=args.repeats).samples)
        onednn = min(timeit(lambda: linalg._onednn_mm_t(x, wt), warmup=1, repeats=args.repeats).samples)
        report.add(m=m, k=k, n=n, blas_gflops=flops / blas / 1e9, onednn_gflops=flops / onednn / 1e9,
                   onednn_vs_blas_time=onednn / blas)
    report.print()
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
