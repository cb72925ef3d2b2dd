"""Decompositions of the Kronecker factors and the two preconditioning rules of the paper.

* eigen (default): ``A = Q_A diag(v_A) Q_A^T``, ``G = Q_G diag(v_G) Q_G^T`` and Eq 13-15::

      V1 = Q_G^T grad Q_A;   V2 = V1 / (v_G v_A^T + damping);   P = Q_G V2 Q_A^T

  which is exactly ``(A (x) G + damping I)^-1 vec(grad)``.
* inverse: Eq 11-12, ``P = (G + damping I)^-1 grad (A + damping I)^-1``.

Decompositions run in float32 (or float64 when asked) whatever the training dtype. ``torch.linalg.eigh`` can
fail to converge on ill-conditioned fp32 input; we then retry in float64, then with growing jitter on the
diagonal, and only if all of that fails return None so the caller keeps its previous decomposition: training
never stops because of one bad factor.

The Kronecker factors themselves are Gram matrices ``sum a a^T`` over many rows (``N T`` rows of ``C kh kw``
columns for a convolution's A, about 9x the layer's forward FLOPs): :func:`sym_gram` computes them with half the
FLOPs (BLAS ``syrk``, upper triangle only) from cache-sized chunks, which is what keeps K-FAC's factor steps cheap.
For stride-1 zero-padded convolutions (most of a ResNet), :func:`conv_patch_gram` computes A from the
``(2 kh - 1)(2 kw - 1)`` shifted channel correlations of the input instead, a third of syrk's FLOPs for 3x3.

On a CPU, large float32 products (Eq 13-15's, and the Grams of Linear layers that syrk does not take) run through
oneDNN's convolution kernels rather than torch's BLAS (:func:`precondition_eigen`, :func:`product`) where oneDNN
runs wider code (:func:`onednn_outruns_blas`): MKL's ``sgemm`` runs 256-bit code on CPUs that are not Intel's, and
AMD's cores from Zen 5 on execute oneDNN's 512-bit code on full-width units.
"""

from __future__ import annotations

import functools
import itertools
import math
import platform
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

try:  # optional: BLAS syrk on CPU (scipy comes with the `digits` extra through scikit-learn)
    from scipy.linalg import blas as _scipy_blas
except ImportError:  # pragma: no cover - depends on the environment
    _scipy_blas = None

__all__ = [
    "ACCELERATOR_GRAM_ELEMENTS",
    "JITTERS",
    "accelerator_routes",
    "cache_blocked",
    "conv_patch_gram",
    "cpu_vendor",
    "depthwise_patch_gram",
    "eigen_scale",
    "gram_chunk_elements",
    "group_gram",
    "keeps_transposes",
    "precondition_eigen",
    "precondition_inverse",
    "product",
    "safe_damped_inverse",
    "safe_eigh",
    "sym_gram",
    "unit_scaled",
]

#: elements of the chunk buffer :func:`sym_gram` copies rows into on a CPU (2 MiB in float32: it stays in the L2/L3
#: cache)
GRAM_CHUNK_ELEMENTS = 1 << 19
#: the same bound on an accelerator (256 MiB in float32): a GPU gains nothing from cache-sized chunks and pays a
#: kernel launch and its host work per chunk (measured on an H200: ResNet-50's factor step, batch 64 at 224^2,
#: cost 2.6-3x an SGD step with the CPU's chunks, its arithmetic a fraction of that), so all but the largest Grams
#: are one product
ACCELERATOR_GRAM_ELEMENTS = 1 << 26

_accelerator_routes_forced = False


def cache_blocked(t: torch.Tensor) -> bool:
    """Whether the Grams of ``t`` take the CPU's routes: cache-sized chunks (:data:`GRAM_CHUNK_ELEMENTS`), BLAS
    ``syrk``, the shifted correlations of :func:`conv_patch_gram` and the row pairs of
    :func:`depthwise_patch_gram`. Elsewhere (CUDA and other accelerators) every Gram is as few products as
    :data:`ACCELERATOR_GRAM_ELEMENTS` allows. :func:`accelerator_routes` sends CPU tensors the accelerator's way."""
    return t.device.type == "cpu" and not _accelerator_routes_forced


@contextmanager
def accelerator_routes() -> Iterator[None]:
    """Inside, CPU tensors take an accelerator's routes (:func:`cache_blocked` is False): the kernels a GPU
    launches are then counted, and those routes' sums tested, on a CPU."""
    global _accelerator_routes_forced
    before, _accelerator_routes_forced = _accelerator_routes_forced, True
    try:
        yield
    finally:
        _accelerator_routes_forced = before


def gram_chunk_elements(t: torch.Tensor) -> int:
    """The chunk bound of the Grams of ``t`` (:func:`cache_blocked`)."""
    return GRAM_CHUNK_ELEMENTS if cache_blocked(t) else ACCELERATOR_GRAM_ELEMENTS


#: smallest product (``m k n`` multiply-adds) that :func:`product` runs through oneDNN on a CPU: below it the
#: convolution's call and the operand copies cost more than its faster arithmetic saves (measured on an AMD EPYC
#: with AVX-512 at one thread: Eq 13-15's chain 1.08x faster at 320 x 81 x 81, 0.7x at 128 x 128 x 129)
ONEDNN_MIN_MACS = 1 << 23
#: most rows per column of a Linear layer's inputs or output gradients whose Gram :func:`_row_gram` takes through
#: oneDNN where BLAS syrk does not apply
ONEDNN_GRAM_MAX_ROWS_PER_COLUMN = 8


def _cpuinfo_field(key: str) -> str | None:
    """The value of the first ``key`` line of ``/proc/cpuinfo`` (Linux), or None where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith(key):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def cpu_vendor() -> str:
    """The CPU's vendor string as the operating system reports it (``GenuineIntel``, ``AuthenticAMD``, ...): the
    ``vendor_id`` line of ``/proc/cpuinfo`` on Linux, else :func:`platform.processor` (which names the vendor on
    Windows); empty where neither says."""
    vendor = _cpuinfo_field("vendor_id")
    return platform.processor() if vendor is None else vendor


def cpu_family() -> int | None:
    """The CPU's family number as the operating system reports it (the ``cpu family`` line of ``/proc/cpuinfo``:
    25 for AMD's Zen 3 and Zen 4, 26 for Zen 5); ``None`` where it does not say."""
    family = _cpuinfo_field("cpu family")
    return int(family) if family is not None and family.isdigit() else None


#: the first AMD CPU family whose cores execute 512-bit instructions on full-width units (Zen 5); Zen 4 (family 25)
#: splits each into two 256-bit halves
AMD_FULL_WIDTH_AVX512_FAMILY = 26


@functools.cache
def onednn_outruns_blas() -> bool:
    """Whether this CPU runs oneDNN's float32 kernels wider than torch's BLAS: where torch reports AVX-512
    (``torch.backends.cpu.get_cpu_capability()``) on an AMD CPU whose cores execute 512-bit instructions on
    full-width units (family :data:`AMD_FULL_WIDTH_AVX512_FAMILY` and later). MKL's ``sgemm`` runs 256-bit code on
    CPUs that are not Intel's, oneDNN 512-bit code: measured on an AMD EPYC with AVX-512, one thread, 85-104
    against 190-230 GFLOP/s (a rate above the 32 float32 flops per cycle that a core with 256-bit units issues, so
    a full-width core). Elsewhere oneDNN gains little or nothing and the products stay with BLAS:

    * on an AMD EPYC of family 25 (Zen 4, whose cores split each 512-bit instruction into two 256-bit halves), one
      thread: BLAS 91-98 against oneDNN 89-106 GFLOP/s, and 70-78 against 32 at 64 x 4096 x 4096;
    * on an Intel CPU with AVX-512, where MKL runs 512-bit code too (an Intel Xeon with AVX-512 and AMX, one
      thread: 128-160 against 108-156 GFLOP/s, and 110 against 42 at 64 x 4096 x 4096);
    * on an AVX2-only CPU, where both run 256-bit code (an AMD EPYC with AVX2, one thread: 79-90 against 84-92
      GFLOP/s, and 31 against 64 at 64 x 4096 x 4096);
    * on a CPU whose vendor or family the operating system does not report.

    The answer is the same on every rank of a cluster of one CPU model, so replicas round alike."""
    return (torch.backends.cpu.get_cpu_capability().startswith("AVX512")
            and cpu_vendor() == "AuthenticAMD"
            and (cpu_family() or 0) >= AMD_FULL_WIDTH_AVX512_FAMILY)


def _onednn_route(t: torch.Tensor) -> bool:
    """Whether products of ``t`` may run through oneDNN (:func:`precondition_eigen`): float32 on a CPU
    (:func:`cache_blocked`) whose oneDNN kernels outrun BLAS (:func:`onednn_outruns_blas`), with oneDNN built in and
    enabled (``torch.backends.mkldnn.flags(enabled=False)`` turns the route off)."""
    return (cache_blocked(t) and t.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and bool(torch.backends.mkldnn.enabled) and onednn_outruns_blas())


#: torch sends a one-image convolution of at most this many input elements to its slow dilated kernel, not to
#: oneDNN (``use_mkldnn`` in aten/src/ATen/native/Convolution.cpp): such products stay with BLAS
_ONEDNN_MIN_IMAGE = 20480


def _onednn_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``x @ w`` takes oneDNN's route: :func:`_onednn_route` for both, the same leading dimensions, at
    least :data:`ONEDNN_MIN_MACS` multiply-adds per matrix and more than ``_ONEDNN_MIN_IMAGE`` entries of ``x``."""
    m, k = x.shape[-2:]
    return (x.shape[:-2] == w.shape[:-2] and m * k * w.shape[-1] >= ONEDNN_MIN_MACS and m * k > _ONEDNN_MIN_IMAGE
            and _onednn_route(x) and _onednn_route(w))


def _onednn_mm_t(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """``x @ wt^T`` for two row-major matrices ``x (m, k)`` and ``wt (n, k)``, computed as a 1x1 convolution
    (oneDNN's kernels): the ``m`` rows of ``x`` are the pixels of a one-column channels-last image of ``k``
    channels and ``wt`` is the ``(n, k, 1, 1)`` filter bank; the output is ``(m, n)`` row-major. No copies."""
    m, k = x.shape
    image = x.view(1, m, 1, k).permute(0, 3, 1, 2)  # (1, k, m, 1) channels-last
    # A 1x1 filter's dilation changes nothing; it keeps torch from its own GEMM path, which it takes for undilated
    # 1x1 convolutions of fewer than 16 images on one thread (aten/src/ATen/native/Convolution.cpp, use_mkldnn).
    out = F.conv2d(image, wt.view(wt.shape[0], k, 1, 1), dilation=2)
    return out.permute(0, 2, 3, 1).reshape(m, wt.shape[0])  # channels-last output: a view


def keeps_transposes(q: torch.Tensor) -> bool:
    """Whether eigenvectors ``q`` are kept beside a row-major copy of their transpose for :func:`precondition_eigen`
    (one more copy of them in memory): where its oneDNN route can apply (float32 on a CPU with oneDNN enabled)."""
    return _onednn_route(q)


def _mm_t(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """``x @ wt^T`` of row-major matrices: through oneDNN where :func:`_onednn_applies`, else torch's BLAS."""
    if _onednn_applies(x, wt.mT):
        return _onednn_mm_t(x.contiguous(), wt.contiguous())
    return x @ wt.mT


def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w``, batched over equal leading dimensions: matrix by matrix through oneDNN on a CPU where it applies
    (every matrix alike; see :func:`precondition_eigen`), else one batched product."""
    if not _onednn_applies(x, w):
        return x @ w
    m, n = x.shape[-2], w.shape[-1]
    out = x.new_empty(*x.shape[:-2], m, n)
    for o, a, b in zip(out.view(-1, m, n), x.reshape(-1, *x.shape[-2:]), w.reshape(-1, *w.shape[-2:]), strict=True):
        o.copy_(_onednn_mm_t(a.contiguous(), b.mT.contiguous()))
    return out


#: smallest side for which the BLAS syrk path pays off: below it (and when the rows fit one chunk), one matrix
#: product from a single copy is cheaper than syrk's call overhead plus the mirroring (measured on the digits CNN:
#: 32x32 and 64x64 G factors, 9x9 and 65x65 A factors; 288x288 A factors keep syrk, 0.70x the time of a product)
SYRK_MIN_DIM = 128

@functools.cache
def _single_thread_blas() -> None:
    """Keep scipy's BLAS (OpenBLAS in scipy's wheels) at one thread; done once per process.

    OpenBLAS runs its own thread pool beside torch's OpenMP pool, and both spin-wait between calls: with more
    than one torch thread, the two pools oversubscribe the cores and every op slows down (measured on the digits
    CNN, 2 threads on 2 cores: K-FAC factor steps 115 ms instead of 12 ms, 30x SGD). So syrk is only used when
    torch itself runs on one thread (:func:`_syrk_applies`), and then with one BLAS thread. A no-op without
    threadpoolctl."""
    try:
        from threadpoolctl import ThreadpoolController

        libs = [
            lib
            for lib in ThreadpoolController().lib_controllers
            if lib.filepath and "scipy" in lib.filepath and lib.user_api == "blas"
        ]
    except Exception:  # threadpoolctl missing or unable to inspect the process: leave BLAS as it is
        return
    for lib in libs:
        lib.set_num_threads(1)


#: the largest magnitude below which :func:`unit_scaled` scales a tensor before its Gram is formed
SUBNORMAL_GUARD = 2.0**-32


def unit_scaled(t: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(t * 2^s, 2^-2s)`` on the CPU's routes (:func:`cache_blocked`) when the largest magnitude of a float32 (or
    lower precision) ``t`` is below :data:`SUBNORMAL_GUARD`: ``t`` scaled by the power of two that brings that
    magnitude into ``[1, 2)``, and the factor that undoes the scaling on a Gram of it.  Otherwise ``(t, 1.0)``.

    Products of float32 values below about ``1e-19`` are subnormal numbers, which x86 CPUs compute one to two
    orders of magnitude more slowly than normal ones; output gradients get that small (a ConvNeXt-style network's,
    whose blocks scale their branch by a layer scale of ``1e-6``, after some steps of training): measured at
    128x128, batch 32, one thread, its factor step took 4.9 s instead of 1.4 s.  A power of two scales exactly, so
    the Gram of the scaled tensor, scaled back, equals the Gram of ``t`` wherever that has no subnormal terms (and
    is no less accurate where it has).  Costs one pass over ``t`` (its extrema) and, when it scales, one copy.
    On accelerators, which compute subnormals at full speed, nothing is read or scaled."""
    if not cache_blocked(t) or t.dtype == torch.float64 or not t.is_floating_point() or t.numel() == 0:
        return t, 1.0
    lo, hi = torch.aminmax(t)
    amax = max(-float(lo), float(hi))
    if not 0.0 < amax < SUBNORMAL_GUARD:  # (zero, normal, or not finite: as it is)
        return t, 1.0
    shift = min(1 - math.frexp(amax)[1], 120)  # amax = m 2^e with m in [0.5, 1): amax 2^(1 - e) is in [1, 2)
    return t * 2.0**shift, 2.0 ** (-2 * shift)


def _syrk_applies(t: torch.Tensor) -> bool:
    """scipy's BLAS ``syrk`` for this Gram: CPU float32/float64 with scipy installed, and torch on one thread
    (with several, torch's own multi-threaded product is faster and does not fight a second pool; see
    :func:`_single_thread_blas`)."""
    return (cache_blocked(t) and _scipy_blas is not None and t.dtype in (torch.float32, torch.float64)
            and torch.get_num_threads() == 1)


def sym_gram(t: torch.Tensor, k_dims: int = 1, colsum: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sum_n sum_p a_{n,p} a_{n,p}^T`` for ``t`` of shape ``(N, *K, *P)`` (any strides): ``a`` runs over the
    ``prod(K)``-vectors at each sample ``n`` and position ``p``. Also returns ``sum a`` when ``colsum`` (the bias
    row/column of A, folded in analytically instead of appending a column of ones to a copy of the rows).

    A contiguous ``t`` with at least as many positions as vector entries (``P >= K``: a convolution's output
    gradients) is summed per sample without a copy (:func:`_per_sample_gram`), a contiguous row matrix ``(N, K)``
    (a Linear layer's) as it is by one syrk or product (:func:`_row_gram`). Otherwise chunks of samples are
    copied into one cache-sized ``(K, chunk * P)`` buffer (the only copy; ``t`` may be a
    strided window view of a convolution input) and accumulated. On CPU with scipy and one torch thread, BLAS
    ``ssyrk``/``dsyrk`` computes only the upper triangle (half the FLOPs of a matrix product); elsewhere (CUDA,
    no scipy, several torch threads) a plain ``addmm``. Rows that fit one chunk with ``k < SYRK_MIN_DIM`` take one
    copy and one matrix product instead
    (syrk's call and mirroring cost more than the FLOPs it saves there). All are the exact sums, up to the
    summation order of floating point.
    """
    n = t.shape[0]
    kshape, pshape = tuple(t.shape[1 : 1 + k_dims]), tuple(t.shape[1 + k_dims :])
    k, p = math.prod(kshape), math.prod(pshape)
    if p >= k and t.is_contiguous():
        return _per_sample_gram(t.view(n, k, p), colsum)
    if t.dim() == 2 and t.is_contiguous():
        return _row_gram(t, colsum)
    use_syrk = _syrk_applies(t)
    budget = gram_chunk_elements(t)
    if n * k * p <= budget and not (use_syrk and k >= SYRK_MIN_DIM):
        # Small: one copy (none when t is already a plain row matrix) and one product; exact sums as well.
        rows = t.movedim(0, k_dims).reshape(k, n * p)
        return rows @ rows.t(), (rows.sum(dim=1) if colsum else None)
    syrk = None
    if use_syrk:
        syrk = _scipy_blas.ssyrk if t.dtype == torch.float32 else _scipy_blas.dsyrk
        _single_thread_blas()
    per_chunk = max(1, min(n, budget // max(1, k * p)))
    buf = t.new_empty(k * per_chunk * p)
    # Fortran-ordered (k, k) result for syrk: its upper triangle is filled in place (overwrite_c, beta=1).
    acc = torch.zeros(k, k, dtype=t.dtype, device=t.device)
    acc_f = acc.t()  # a Fortran-contiguous view of the same memory, as numpy sees it
    sums = torch.zeros(k, dtype=t.dtype, device=t.device) if colsum else None
    for start in range(0, n, per_chunk):
        m = min(per_chunk, n - start)
        chunk = buf[: k * m * p].view(*kshape, m, *pshape)
        chunk.copy_(t[start : start + m].movedim(0, k_dims))
        rows = chunk.view(k, m * p)
        if syrk is not None:
            # rows (k, m p) C-contiguous is the Fortran (m p, k) matrix X: syrk(trans=1) gives X^T X = rows rows^T
            syrk(1.0, rows.numpy().T, beta=1.0, c=acc_f.numpy(), trans=1, lower=0, overwrite_c=1)
        else:
            acc.addmm_(rows, rows.t())
        if sums is not None:
            sums += rows.sum(dim=1)
    if syrk is not None:
        # acc_f's upper triangle (Fortran) is acc's lower triangle (C order); acc's upper triangle is still 0:
        # adding the transposed strict lower triangle mirrors it (one tril, one add).
        acc += acc.tril(-1).t()
    return acc, sums


def _row_gram(t: torch.Tensor, colsum: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``t^T t`` of a contiguous ``(n, k)`` row matrix (a Linear layer's inputs or output gradients) without a
    copy: row-major ``t`` is the column-major ``(k, n)`` matrix BLAS reads as it is. BLAS ``syrk`` (upper
    triangle, half the FLOPs) where it applies (:func:`_syrk_applies`) and pays: ``k >= SYRK_MIN_DIM`` and at
    least ``2 k`` rows; else one matrix product. Measured at one thread against the product (MKL): syrk 0.8x its
    time from 256 columns and 4 k rows on, even at ``n ~ k``, and 4x slower at 128 rows of 1280 (the last
    ConvNeXt stage's Linear inputs at 64x64); :func:`sym_gram`'s chunked copy cost up to another 0.3x."""
    n, k = t.shape
    sums = t.sum(dim=0) if colsum else None
    if not (_syrk_applies(t) and k >= SYRK_MIN_DIM and n >= 2 * k):
        if n <= ONEDNN_GRAM_MAX_ROWS_PER_COLUMN * k and _onednn_applies(t.mT, t):
            # oneDNN's full product (see precondition_eigen) from one transposed copy: 2x MKL's rate on an AMD
            # EPYC at 128-2048 rows of 320-1280 columns; with many more rows than columns its convolution has
            # few pixels for a long reduction and is slower than BLAS (0.5x at 8192 rows of 160)
            rows_t = t.t().contiguous()
            return _onednn_mm_t(rows_t, rows_t), sums
        return t.t() @ t, sums
    syrk = _scipy_blas.ssyrk if t.dtype == torch.float32 else _scipy_blas.dsyrk
    _single_thread_blas()
    acc = torch.zeros(k, k, dtype=t.dtype, device=t.device)
    # t.numpy().T is the Fortran (k, n) matrix X; syrk(trans=0) fills the upper triangle of X X^T = t^T t in
    # place (acc.t() is the Fortran view of acc's memory), i.e. acc's lower triangle
    syrk(1.0, t.numpy().T, beta=0.0, c=acc.t().numpy(), trans=0, lower=0, overwrite_c=1)
    acc += acc.tril(-1).t()
    return acc, sums


def _per_sample_gram(t: torch.Tensor, colsum: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sum_n t_n t_n^T`` of a contiguous ``(N, K, P)`` stack: each sample's ``(K, P)`` block is a row-major matrix
    already, so one batched product over chunks of samples (at most :data:`GRAM_CHUNK_ELEMENTS` partial sums
    held) needs no copy of ``t``. Measured on convolution output gradients (batch 128) against the copy and
    product of :func:`sym_gram`'s chunks, at one and two threads: 0.3-0.7x the time at 16-32 channels on 16x16 to
    32x32, about even at 64 channels on 8x8 (``P == K``); with fewer positions than channels 2-3x slower, so
    :func:`sym_gram` takes this route only for ``P >= K``."""
    n, k, _ = t.shape
    acc = t.new_zeros(k, k)
    for chunk in t.split(max(1, gram_chunk_elements(t) // (k * k))):
        acc += torch.bmm(chunk, chunk.mT).sum(dim=0)
    return acc, (t.sum(dim=(0, 2)) if colsum else None)


def group_gram(t: torch.Tensor, k_dims: int = 1,
               colsum: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`sym_gram` of every group at once: ``(G, k, k)`` with ``[i] = sum_n sum_p a_{n,i,p} a_{n,i,p}^T`` for
    ``t`` of shape ``(N, G, *K, *P)`` (any strides), and the ``(G, k)`` sums ``sum a`` when ``colsum``: the
    block-diagonal factors of a grouped (or depthwise) layer, one block per group, from one batched product
    (``baddbmm``) per chunk of samples instead of one Gram per group.

    Chunks of samples are copied into one cache-sized ``(G, k, chunk * P)`` buffer (at least one sample's rows),
    as :func:`sym_gram` does; a batch whose rows fit one chunk takes one copy and one batched product. Exact sums up
    to the summation order of floating point.
    """
    n, groups = t.shape[:2]
    kshape, pshape = tuple(t.shape[2 : 2 + k_dims]), tuple(t.shape[2 + k_dims :])
    k, p = math.prod(kshape), math.prod(pshape)
    per_chunk = max(1, min(n, gram_chunk_elements(t) // max(1, groups * k * p)))
    if per_chunk == n:  # one copy (none when t is already laid out as rows) and one batched product
        rows = t.movedim(0, 1 + k_dims).reshape(groups, k, n * p)
        return rows @ rows.mT, (rows.sum(dim=-1) if colsum else None)
    buf = t.new_empty(groups * k * per_chunk * p)
    acc = t.new_zeros(groups, k, k)
    sums = t.new_zeros(groups, k) if colsum else None
    for start in range(0, n, per_chunk):
        m = min(per_chunk, n - start)
        chunk = buf[: groups * k * m * p].view(groups, *kshape, m, *pshape)
        chunk.copy_(t[start : start + m].movedim(0, 1 + k_dims))
        rows = chunk.view(groups, k, m * p)
        acc.baddbmm_(rows, rows.mT)
        if sums is not None:
            sums += rows.sum(dim=-1)
    return acc, sums


def depthwise_patch_gram(x: torch.Tensor, kernel_size: tuple[int, int], stride: tuple[int, int],
                         padding: tuple[int, int, int, int], width_dilation: int = 1,
                         colsum: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The per-channel Grams of a depthwise 2-D convolution's patches, ``(C, kh kw, kh kw)`` with ``[c] = sum_n
    sum_p a_{n,c,p} a_{n,c,p}^T`` over the ``kh x kw`` patches ``a`` of channel ``c`` (ordered row, column, as
    ``weight.view(C_out, -1)``) at every output position ``p``, and the ``(C, kh kw)`` sums ``sum a`` when
    ``colsum``: :func:`group_gram` of the unfolded patches of a layer with one input channel per group, without
    forming them. ``x`` is ``(N, C, H, W)``; ``padding = (top, bottom, left, right)`` zero rows and columns (an
    input padded otherwise comes padded, with zeros here); any stride; no dilation along the height.

    Entry ``[(i, j), (i + d, j')]`` sums products of row ``r`` of the padded input (window column ``j``) and row
    ``r + d`` (column ``j'``) over the rows ``r = t s + i`` of the output rows ``t``. So the products are formed
    once per pair of input rows ``d < kh`` apart: for each input row, one matrix product of its ``kw`` width
    windows (``kw x N W_out``) with those of the ``kh`` rows from it down (``N W_out x kh kw``), batched over the
    rows and channels of a cache-sized chunk (over its channels alone, row by row, where the image has fewer than
    ``2 (kh - 1)`` rows); each block of the Gram is then a sum over ``H_out`` of them. About ``H / (kh
    H_out)`` of the multiply-adds of the Gram of the unfolded patches (1/7 for a 7x7 kernel at stride 1), from a
    copy of the input ``kw`` times its size instead of the patches' ``kh kw`` times; padding rows are zero and
    skipped. The blocks below the diagonal are the exact transposes of those above. Equal to the Gram of the
    patches up to the summation order of floating point."""
    n, c, h, _ = x.shape
    kh, kw = kernel_size
    sh, sw = stride
    top, bottom, left, right = padding
    if left or right:
        x = F.pad(x, (left, right))
    win = x.unfold(3, width_dilation * (kw - 1) + 1, sw)[..., ::width_dilation]  # (N, C, H, W_out, kw)
    k = n * win.shape[3]
    r = h + kh - 1  # each channel's rows, then zero rows: row pairs reach kh - 1 rows below an input row
    # Padding rows map to row h of the products, a zero row.
    rows = _depthwise_rows(kh, (h + top + bottom - kh) // sh + 1, sh, top, h)
    rows, blocks = rows.to(x.device), _depthwise_blocks(kh, kw).to(x.device)
    gram = x.new_empty(c, kh * kw, kh * kw)
    sums = x.new_empty(c, kh * kw) if colsum else None
    # channels in chunks whose copy stays cache-sized (as sym_gram's chunks of samples)
    per_chunk = max(1, min(c, gram_chunk_elements(x) // (r * kw * k)))
    buf = x.new_zeros(per_chunk, r, kw, k)  # rows from h on stay zero
    # [c, row, j, d kw + j'] = W_row[j] . W_{row + d}[j'] of every channel of the chunk; rows from h on stay zero
    pairs = x.new_zeros(per_chunk, r, kw, kh * kw)
    one_product = h >= 2 * (kh - 1)
    for c0 in range(0, c, per_chunk):
        m = min(per_chunk, c - c0)
        chunk = buf[:m]
        chunk[:, :h].view(m, h, kw, n, -1).copy_(win[:, c0 : c0 + m].permute(1, 2, 4, 0, 3))
        if one_product:
            # Every row of the chunk as one batch entry: its kw windows against the kh kw windows of the kh rows from
            # it down, an overlapping strided view (no copy). An entry starting on a channel's zero rows is zero, one
            # starting on its last image rows reaches only its own zero rows: kh - 1 wasted entries per channel, at
            # most half the work where h >= 2 (kh - 1), for one product per chunk instead of one per image row
            # (measured on one thread at 40 channels of 32 x 32, 7x7: 18 against 31 ms; at 4 x 4, 14 against 10).
            entries = m * r - kh + 1
            torch.bmm(chunk.view(m * r, kw, k)[:entries], chunk.as_strided((entries, kh * kw, k), (kw * k, k, 1)).mT,
                      out=pairs[:m].view(m * r, kw, kh * kw)[:entries])
        else:
            for row in range(h):
                torch.bmm(chunk[:, row], chunk[:, row : row + kh].reshape(m, kh * kw, k).mT, out=pairs[:m, row])
        # [c, i, j, d, j'] = block (i, i + d) of channel c: the products of output rows' kernel row i, summed
        block_sums = pairs[:m].index_select(1, rows.view(-1)).view(m, kh, -1, kw * kh * kw).sum(dim=2)
        gram[c0 : c0 + m] = block_sums.reshape(m, -1).index_select(1, blocks).view(m, kh * kw, -1)
        if sums is not None:  # the window sums, zero from row h on
            row_sums = chunk.sum(dim=-1).index_select(1, rows.view(-1)).view(m, kh, -1, kw)
            sums[c0 : c0 + m] = row_sums.sum(dim=2).reshape(m, kh * kw)
    return gram, sums


@functools.cache
def _depthwise_rows(kh: int, ho: int, sh: int, top: int, h: int) -> torch.Tensor:
    """``[i, t]``: the buffer row of kernel row ``i`` at output row ``t`` (``h``, a zero row, for padding rows)."""
    row = (torch.arange(ho) * sh)[None, :] + torch.arange(kh)[:, None] - top
    return torch.where((row >= 0) & (row < h), row, h)


@functools.cache
def _depthwise_blocks(kh: int, kw: int) -> torch.Tensor:
    """Flat indices into the ``(kh, kw, kh, kw)`` row-pair sums ``[i, j, d, j']`` of the Gram's entries ``[(i, j),
    (i', j')]`` in row-major order: the sum of ``(i, j)`` with ``(i + d, j')`` on and above the diagonal, below
    it the same element as its mirror's."""
    i, j, i2, j2 = torch.meshgrid(*(torch.arange(m) for m in (kh, kw, kh, kw)), indexing="ij")
    upper = (i2 > i) | ((i2 == i) & (j2 >= j))
    a, b, d, e = torch.where(upper, i, i2), torch.where(upper, j, j2), (i2 - i).abs(), torch.where(upper, j2, j)
    return (((a * kw + b) * kh + d) * kw + e).reshape(-1)


def _lines(x: torch.Tensor, pad: int) -> tuple[torch.Tensor, int]:
    """``x`` of shape ``(N, C, L, M)`` as a flat channel-last ``(L * N * (M + pad) + pad, C)`` buffer: line ``l``
    of every sample in turn, each followed by ``pad`` zeros, and ``pad`` zeros at the end. Returns the buffer and
    the length of one line of all samples, ``N (M + pad)``.

    A column shift by ``|d| <= pad`` of an element then lands on the same sample's element of the same line or
    on a zero, never on another sample or line, so the 1-D correlations of whole lines are single matrix
    products of two windows of the buffer (:func:`_corr`). Channel-last, because these products have a tiny
    ``C x C`` result and a long reduction: with the reduction along the rows, BLAS streams both windows once
    (measured 1.3-1.5x faster than the channel-first layout at 16-32 channels)."""
    n, c, lines, m = x.shape
    line = n * (m + pad)
    buf = x.new_empty(lines * line + pad, c)
    body = buf[: lines * line].view(lines, n, m + pad, c)
    body[:, :, :m].copy_(x.permute(2, 0, 3, 1))
    body[:, :, m:].zero_()
    buf[lines * line :].zero_()
    return buf, line


def _corr(buf: torch.Tensor, a: int, b: int, length: int) -> torch.Tensor:
    """``sum_i buf[a + i] buf[b + i]^T`` over ``i < length``: one matrix product of two windows; for ``a == b``
    made exactly symmetric (upper triangle mirrored), so that every block of the Gram built from these products is
    the exact transpose of its mirror block."""
    prod = buf[a : a + length].t() @ buf[b : b + length]
    return _mirror_upper(prod) if a == b else prod


def _mirror_upper(m: torch.Tensor) -> torch.Tensor:
    """The symmetric matrix with ``m``'s upper triangle."""
    upper = m.triu()
    return upper + upper.triu(1).t()


def _toeplitz(blocks: torch.Tensor, ia: torch.Tensor, ib: torch.Tensor) -> torch.Tensor:
    """The ``(C, nh, kw, C, nh, kw)`` tensor whose block ``[(u_h, u_w), (v_h, v_w)]`` is
    ``blocks[ia[u_h, v_h], ib[u_h, v_h], v_w - u_w + kw - 1]`` for ``blocks`` of shape ``(., ., 2 kw - 1, C, C)``
    (a block-Toeplitz structure along the kernel's width)."""
    dw = _diff_index((blocks.shape[2] + 1) // 2)
    full = blocks[ia[:, None, :, None], ib[:, None, :, None], dw[None, :, None, :]]  # (nh, kw, nh, kw, C, C)
    return full.permute(4, 0, 1, 5, 2, 3)


def _line_pair_blocks(buf: torch.Tensor, line: int, rows: range, kw: int) -> torch.Tensor:
    """``R[i, j, d + kw - 1] = sum_{n, q} x[rows[i], q] x[rows[j], q + d]^T`` (channels by channels) for
    ``|d| < kw``: the 1-D correlations of two whole lines (of all samples) of a :func:`_lines` buffer."""
    nr, c = len(rows), buf.shape[1]
    out = buf.new_empty(nr, nr, 2 * kw - 1, c, c)
    for (i, a), (j, b) in itertools.product(enumerate(rows), repeat=2):
        for d in range(0 if j >= i else 1, kw):  # the others are transposes: R[j, i, -d] = R[i, j, d]^T
            prod = _corr(buf, a * line, b * line + d, line)
            out[i, j, kw - 1 + d] = prod
            out[j, i, kw - 1 - d] = prod.t()
    return out


def conv_patch_gram(x: torch.Tensor, kernel_size: tuple[int, int], padding: tuple[int, int, int, int]) -> torch.Tensor:
    """``sum_n sum_p a_{n,p} a_{n,p}^T`` over the zero-padded ``kh x kw`` patches ``a`` (ordered channel, row,
    column, as ``weight.view(out, -1)``) at every output position ``p`` of a stride-1, undilated convolution of
    ``x`` (``(N, C, H, W)``), with ``padding = (top, bottom, left, right)``, each at most ``k - 1``: the sum
    behind ``A = a a^T`` of Eq 5 for a convolution (KFC's expansion operator; normalised by the handler),
    without forming the patches.

    Patch entries at kernel offsets ``u`` and ``v`` multiply input pixels ``d = v - u`` apart, so over the
    extended grid of every window that touches the image the block ``(u, v)`` is the channel correlation
    ``S(d) = sum_q x_q x_{q+d}^T`` of the whole image: ``(2 kh - 1)(2 kw - 1)`` of them, half of them transposes of
    the others, each one matrix product of two shifted windows of a row-padded copy of ``x`` (1-2 times the
    input, instead of the ``kh kw`` times of the unfolded patches). The windows of the extended grid that are
    not output positions (border rows and columns, where ``padding < k - 1``) are then subtracted exactly: the
    rows by 1-D correlations of whole image rows, the columns by those of image columns, and the corners where
    both overlap added back. About ``(2 kh - 1)(2 kw - 1) / (kh kw)^2`` of the products of a plain Gram
    (13/81 for 3x3), or 0.32 of a symmetric one; equal to it up to the summation order of floating point.
    The result is exactly symmetric."""
    n, c, h, w = x.shape
    kh, kw = kernel_size
    top, bottom, left, right = padding
    buf, line = _lines(x, kw - 1)  # lines are image rows
    # S(dh, dw) = sum_q x_q x_{q + (dh, dw)}^T for dh >= 0 (dw >= 0 at dh = 0); S(-d) = S(d)^T
    s = x.new_zeros(2 * kh - 1, 2 * kw - 1, c, c)
    for dh in range(min(kh, h)):
        for dw in range(1 - kw if dh else 0, kw):
            prod = _corr(buf, 0, dh * line + dw, (h - dh) * line)
            s[kh - 1 + dh, kw - 1 + dw] = prod
            s[kh - 1 - dh, kw - 1 - dw] = prod.t()
    k = c * kh * kw
    full = _toeplitz(s.unsqueeze(1), _diff_index(kh), torch.zeros(kh, kh, dtype=torch.long)).reshape(k, k)
    # Windows of the extended grid (window origin e in [1 - k, size) relative to the image) that are not output
    # positions (origin in [-pad_before, size + pad_after - k + 1)): their patches are nonzero at the offsets u
    # with 0 <= e + u < size only.
    rows_out = range(-top, h + bottom - kh + 1)
    cols_out = range(-left, w + right - kw + 1)
    rows_out_ext = [(e, max(0, -e), min(kh, h - e)) for e in range(1 - kh, h) if e not in rows_out]
    cols_out_ext = [(e, max(0, -e), min(kw, w - e)) for e in range(1 - kw, w) if e not in cols_out]
    view = full.view(c, kh, kw, c, kh, kw)
    for e, lo, hi in rows_out_ext:  # whole extended rows of windows: 1-D correlations of image rows
        blocks = _line_pair_blocks(buf, line, range(e + lo, e + hi), kw)
        view[:, lo:hi, :, :, lo:hi, :] -= _toeplitz(blocks, *_pair_index(hi - lo))
    for e, lo, hi in cols_out_ext:  # whole extended columns: the same on the transposed image
        tbuf, tline = _lines(x[:, :, :, e + lo : e + hi].transpose(2, 3), kh - 1)
        blocks = _line_pair_blocks(tbuf, tline, range(hi - lo), kh)
        view[:, :, lo:hi, :, :, lo:hi] -= _toeplitz(blocks, *_pair_index(hi - lo)).permute(0, 2, 1, 3, 5, 4)
    for (eh, lh, hh), (ew, lw, hw) in itertools.product(rows_out_ext, cols_out_ext):  # subtracted twice above
        patch = x[:, :, eh + lh : eh + hh, ew + lw : ew + hw].reshape(n, -1)
        corner = _mirror_upper(patch.t() @ patch)
        view[:, lh:hh, lw:hw, :, lh:hh, lw:hw] += corner.view(c, hh - lh, hw - lw, c, hh - lh, hw - lw)
    # Exactly symmetric without a final pass: blocks (u, v) and (v, u) are built from exact transposes by the
    # same element-wise operations, and the diagonal blocks from exactly symmetric products.
    return full


def _diff_index(k: int) -> torch.Tensor:
    """``[u, v] -> v - u + k - 1``: the index of the offset difference in a ``2 k - 1`` stack."""
    i = torch.arange(k)
    return i[None, :] - i[:, None] + k - 1


def _pair_index(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([u, v] -> u, [u, v] -> v)`` for ``u, v < k``."""
    i = torch.arange(k)
    return i[:, None].expand(k, k), i[None, :].expand(k, k)


#: relative diagonal jitter tried after the float64 retry (times mean |diag|)
JITTERS = (1e-6, 1e-4, 1e-2)


def _finite(*ts: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


def _jitter_scale(x: torch.Tensor) -> float:
    return float(x.diagonal(dim1=-2, dim2=-1).abs().mean().clamp_min(1e-12))


def _with_fallbacks(
    factor: torch.Tensor,
    dtype: torch.dtype,
    what: str,
    name: str,
    kept: str,
    solve: Callable[[torch.Tensor, float], tuple[torch.Tensor, ...]],
) -> tuple[torch.Tensor, ...] | None:
    """Run ``solve(symmetric factor, jitter)`` in ``dtype``, then float64, then float64 with growing diagonal
    jitter (:data:`JITTERS`, relative to mean |diag|) until it returns finite tensors; None (with a warning
    naming what is ``kept``) if every attempt fails, so training goes on with the previous result."""
    x = factor.to(dtype)
    x = 0.5 * (x + x.mT)  # allreduce/running averages can break exact symmetry by round-off
    attempts: list[tuple[torch.dtype, float]] = [(dtype, 0.0)]
    if dtype != torch.float64:
        attempts.append((torch.float64, 0.0))
    attempts += [(torch.float64, j) for j in JITTERS]
    for i, (dt, jitter) in enumerate(attempts):
        y = x.to(dt)
        try:
            out = solve(y, jitter * _jitter_scale(y) if jitter else 0.0)
        except RuntimeError:  # torch.linalg.LinAlgError subclasses RuntimeError
            continue
        if not _finite(*out):
            continue
        if i > 0:
            warnings.warn(
                f"K-FAC: {what} of factor {name!r} needed the fallback ({dt}, jitter {jitter:g})",
                RuntimeWarning,
                stacklevel=3,
            )
        return out
    warnings.warn(
        f"K-FAC: {what} of factor {name!r} failed even with jitter; keeping {kept}", RuntimeWarning, stacklevel=3
    )
    return None


def _eye(y: torch.Tensor) -> torch.Tensor:
    return torch.eye(y.shape[-1], dtype=y.dtype, device=y.device)  # broadcasts over a batch of blocks


def safe_eigh(
    factor: torch.Tensor, dtype: torch.dtype = torch.float32, name: str = ""
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(eigenvalues, eigenvectors)`` of a symmetric PSD factor in ``dtype``; negative round-off eigenvalues are
    clamped to 0 (the factor is PSD by construction). Falls back to float64, then jitter; None if all fail."""

    def solve(y: torch.Tensor, shift: float) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.linalg.eigh(y + shift * _eye(y) if shift else y)

    res = _with_fallbacks(factor, dtype, "eigh", name, "its previous decomposition", solve)
    return None if res is None else (res[0].clamp_min(0).to(dtype), res[1].to(dtype))


def safe_damped_inverse(
    factor: torch.Tensor, damping: float, dtype: torch.dtype = torch.float32, name: str = ""
) -> torch.Tensor | None:
    """``(factor + damping I)^-1`` in ``dtype`` with the same float64 / jitter fallbacks as :func:`safe_eigh`."""

    def solve(y: torch.Tensor, shift: float) -> tuple[torch.Tensor]:
        return (torch.linalg.inv(y + (damping + shift) * _eye(y)),)

    res = _with_fallbacks(factor, dtype, "inverse", name, "the previous one", solve)
    return None if res is None else res[0].to(dtype)


def eigen_scale(da: torch.Tensor, dg: torch.Tensor, damping: float) -> torch.Tensor:
    """Eq 14's element-wise factor ``1 / (v_G v_A^T + damping)`` as a ``(..., g_dim, a_dim)`` tensor: the
    reciprocal of each damped eigenvalue product, correctly rounded, so that ``V1`` times it rounds alike wherever it
    is computed (once per decomposition and damping for a bucket, :mod:`lightning_hpc.kfac.batched`; per call for a
    layer preconditioned alone)."""
    return torch.reciprocal(dg.unsqueeze(-1) * da.unsqueeze(-2) + damping)


def precondition_eigen(
    grad: torch.Tensor, qa: torch.Tensor, da: torch.Tensor, qg: torch.Tensor, dg: torch.Tensor, damping: float,
    qa_t: torch.Tensor | None = None, qg_t: torch.Tensor | None = None, scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq 13-15 on a ``(g_dim, a_dim)`` gradient matrix; computed in the decomposition dtype. Leading dimensions
    are a batch of independent blocks (a grouped layer's ``(G, g_dim, a_dim)`` gradients with ``(G, n, n)``
    eigenvectors and ``(G, n)`` eigenvalues): one batched product per side for all of them. ``scale``, when given,
    is :func:`eigen_scale` of ``da``, ``dg`` and ``damping``, kept between steps by the caller: Eq 14 is then one
    in-place multiplication instead of an outer product, a sum and a division over the gradient's size. ``out``, a
    tensor of the gradient's shape in the decomposition dtype, receives the result when given (the last product
    writes into it: no copy).

    On a CPU where oneDNN runs wider code than BLAS (:func:`onednn_outruns_blas`), large float32 chains run matrix
    by matrix through oneDNN's convolution kernels instead (:func:`_eigen_onednn`): torch's CPU wheels link MKL,
    whose ``sgemm`` runs 256-bit vector code on CPUs that are not Intel's, while oneDNN uses every vector unit the
    CPU has (on an AMD EPYC with full-width AVX-512, one thread: about 100 GFLOP/s against 190-230, the rate of the
    SGD step's own convolutions; report
    ``bench/reports/2026-11-29-kfac-onednn-products.md``). Each matrix is then its own chain on both the batched
    and the per-layer path, so the two agree bit for bit. ``qa_t`` and ``qg_t``, row-major copies of ``Q_A^T`` and
    ``Q_G^T`` kept with the decompositions (:func:`keeps_transposes`), save that chain its two transposes."""
    g = grad.to(qa.dtype)
    g_dim, a_dim = g.shape[-2:]
    scale = eigen_scale(da, dg, damping) if scale is None else scale
    if g_dim * a_dim * max(g_dim, a_dim) >= ONEDNN_MIN_MACS and _onednn_route(g) and _onednn_route(qg):
        return _eigen_onednn(g, qa, qg, scale, qa_t, qg_t, out)  # each product decides (_mm_t)
    v2 = (qg.mT @ g @ qa).mul_(scale)  # V1, a new tensor, scaled in place
    if out is None:
        return qg @ v2 @ qa.mT
    return torch.matmul(qg @ v2, qa.mT, out=out)


def _eigen_onednn(
    g: torch.Tensor, qa: torch.Tensor, qg: torch.Tensor, scale: torch.Tensor, qa_t: torch.Tensor | None,
    qg_t: torch.Tensor | None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`precondition_eigen` matrix by matrix as products ``x @ wt^T`` of row-major operands (:func:`_mm_t`):
    ``V1^T = (Q_A^T grad^T) Q_G``, ``V2^T = V1^T * scale^T`` (:func:`eigen_scale`), ``P = (Q_G V2) Q_A^T``, so that the
    gradient, the intermediate and the result are all row-major and only ``Q_A^T`` and ``Q_G^T`` are copied (unless
    given)."""
    m, n = g.shape[-2:]
    qa_t = qa.mT.contiguous() if qa_t is None else qa_t
    qg_t = qg.mT.contiguous() if qg_t is None else qg_t
    out = g.new_empty(g.shape) if out is None else out
    scale = scale.expand(g.shape)
    flat = zip(out.view(-1, m, n), g.reshape(-1, m, n), qa.reshape(-1, n, n), qa_t.reshape(-1, n, n),
               qg.reshape(-1, m, m), qg_t.reshape(-1, m, m), scale.reshape(-1, m, n), strict=True)
    for o, gi, qai, qati, qgi, qgti, si in flat:
        v2t = _mm_t(_mm_t(qati, gi), qgti).mul_(si.mT)  # V1^T, a new tensor, scaled in place
        o.copy_(_mm_t(_mm_t(qgi, v2t), qai))
    return out


def precondition_inverse(grad: torch.Tensor, a_inv: torch.Tensor, g_inv: torch.Tensor) -> torch.Tensor:
    """Eq 12: ``(G + damping I)^-1 grad (A + damping I)^-1`` with the damped inverses precomputed (batched over
    leading dimensions, as :func:`precondition_eigen`)."""
    grad = grad.to(a_inv.dtype)
    return product(product(g_inv, grad), a_inv)
