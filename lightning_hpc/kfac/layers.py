"""Per-layer K-FAC handlers: factors and gradient reshaping for ``nn.Linear``, ``nn.Conv1d/2d/3d`` and
``nn.ConvTranspose1d/2d/3d`` (Kronecker factors; grouped ones per group), normalisation layers' affine parameters
(a 2x2 block per channel) and ``nn.Embedding`` (a diagonal A). Each handler owns the form of its factors
(:meth:`LayerHandler.factor_forms`, :mod:`.forms`) and how its gradient is preconditioned with them.

Scaling convention (damping depends on it)
-------------------------------------------
Let ``B`` be the number of samples that contributed to the optimizer step on this rank (all micro-batches of
an accumulated step), ``t`` run over the ``T`` spatial positions of a convolution (``T = 1`` for Linear), ``a``
be the layer input at one position (for Conv2d, the unfolded ``C_in * kh * kw`` patch; a trailing 1 when the
layer has a bias, so the bias is folded into A) and ``ds`` the gradient of the *per-sample* loss with respect
to the layer output at that position. Then (Grosse & Martens, KFC, 2016)::

    A = 1/(B T) * sum_n sum_t a a^T          (mean over samples and positions)
    G = 1/B     * sum_n sum_t ds ds^T        (mean over samples, sum over positions)

so ``A (x) G`` equals KFC's ``Omega (x) Gamma = (sum_t E[a a^T]) (x) (1/T sum_t E[ds ds^T])`` and also the
product used by the SC20 code (which puts 1/T on A and T^2 on G); the eigen method (Eq 13-15) only sees that
product, so the paper's damping values carry over. For a Linear layer both are the usual batch means.

The loss of an optimizer step is assumed to be the mean over its ``B`` samples (``batch_averaged=True``, as
``F.cross_entropy`` and Lightning's division of accumulated losses by the number of micro-batches give), so
``ds = B * grad_output`` and ``G = B * sum grad_output grad_output^T``. With ``batch_averaged=False`` (a summed
loss) ``ds = grad_output`` and ``G = 1/B * sum grad_output grad_output^T``.

Factors are formed in float32, or in float64 for a float64 model (:func:`stat_dtype`).  Statistics are accumulated
as raw sums while the micro-batches run and normalised once in
:meth:`LayerHandler.batch_factors`, so an accumulated step covers all of its micro-batches exactly.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.kfac.forms import BlockDiagonalForm, DenseForm, DiagonalForm, FactorForm, LayerForms
from lightning_hpc.kfac.linalg import conv_patch_gram, sym_gram
from lightning_hpc.kfac.methods import ComputeMethod
from lightning_hpc.protocols import ShardedFullyConnected

__all__ = [
    "SUPPORTED",
    "ShardedLinearHandler",
    "CONVOLUTIONS",
    "ConvHandler",
    "ConvTransposeHandler",
    "EmbeddingHandler",
    "GroupConvHandler",
    "GroupConvTransposeHandler",
    "NORMS",
    "NormAffineHandler",
    "TRANSPOSED_CONVOLUTIONS",
    "LAYER_TYPES",
    "LayerHandler",
    "LinearHandler",
    "TiledConvHandler",
    "layer_type_of",
    "linear_batch_dim",
    "make_handlers",
]

#: module types K-FAC preconditions; every other layer is left to the optimizer
SUPPORTED = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.Embedding,
)  # fmt: skip
#: least ``output positions x a_dim^2`` (the multiply-adds of the plain Gram) for which a convolution's A is
#: computed from channel correlations: below it the unfolded patches' single product is cheaper (measured at
#: 1 thread: 32 samples of 8 channels at 8x8, 3x3 kernel, 0.36 ms unfolded against 0.69 ms; ResNet-32's layers
#: at batch 128 (about 2.7e9) take less than half the time of the symmetric product of the patches)
SHIFTED_GRAM_MIN_WORK = 1 << 25


def stat_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype factor statistics are formed in: float32, or the tensor's own when it is wider (a float64 model
    gets float64 factors, so its K-FAC steps do not depend on how the batch is split over ranks)."""
    return torch.promote_types(t.dtype, torch.float32)


class LayerHandler:
    """Factor statistics and gradient reshaping for one layer.

    ``a_dim`` / ``g_dim`` are the sides of A and G. The gradient is handled as the matrix
    ``[W | b]`` of shape ``(g_dim, a_dim)``.
    """

    #: ranks whose batch factors are partial sums of one sample group's factor (> 1 for spatially tiled layers)
    partition_size: int = 1
    #: the layer must be told before a capturing forward (see :meth:`prepare_capture`)
    records_input: bool = False
    #: least dtype the statistics are computed in: float32, or float64 with ``factor_dtype=float64``
    stat_dtype: torch.dtype = torch.float32
    #: the statistics are completed by a collective when the step forms the factors (a sharded layer's)
    gathers_statistics: bool = False

    def dtype_for(self, t: torch.Tensor) -> torch.dtype:
        """The dtype this layer's statistics of ``t`` are formed in: :attr:`stat_dtype`, or ``t``'s own when it
        is wider (:func:`stat_dtype`: a float64 model gets float64 factors)."""
        return torch.promote_types(stat_dtype(t), self.stat_dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The layer's weight parameter (typed: ``nn.Module.__getattr__`` is not)."""
        return cast(torch.Tensor, self.module.weight)

    @property
    def bias(self) -> torch.Tensor:
        """The layer's bias parameter; only used when :attr:`has_bias`."""
        return cast(torch.Tensor, self.module.bias)

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.module = module
        bias = getattr(module, "bias", None)
        #: the bias is folded into A (and preconditioned with the weight) only when it trains: a frozen bias is
        #: neither part of the factors nor given a ``.grad``
        self.has_bias = isinstance(bias, torch.Tensor) and bias.requires_grad
        #: most calls of the layer seen in one forward pass (> 1: shared weights, counted as positions)
        self.max_calls_per_forward = 0
        # never reset: a hook of a discarded forward pass must not match a later call's token
        self._next_token = 0
        self._forward_id = 0
        self.reset_statistics()
        #: the running factors by name (Eq 16-17; :meth:`factor_forms` says their forms); empty before the first
        #: factor update
        self.factors: dict[str, torch.Tensor] = {}
        #: the decompositions of the factors, ``f"{key}_{factor}"`` (:meth:`.forms.FactorForm.result_shapes`); empty
        #: until the first decomposition, and on ranks outside the layer's gradient-worker group
        self.decompositions: dict[str, torch.Tensor] = {}

    # -- sizes -------------------------------------------------------------------------------------------
    @property
    def a_dim(self) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def g_dim(self) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    # -- statistics --------------------------------------------------------------------------------------
    def reset_statistics(self) -> None:
        """Forget what the hooks captured (called after every optimizer step and on skipped AMP steps)."""
        self.discard_committed()
        # A call's input statistics wait here until its output gradient arrives (then both are committed): a
        # forward pass that is never backpropagated (a skipped training_step, a loss not used) leaves nothing.
        self._pending: dict[int, tuple[torch.Tensor, int, int, int]] = {}
        self._in_forward = False

    def discard_committed(self) -> None:
        """Forget the statistics of completed backward passes (calls still waiting for theirs are kept)."""
        self.a_sum: torch.Tensor | None = None
        self.a_rows = 0
        self.g_sum: torch.Tensor | None = None
        self.samples = 0
        self.g_samples = 0
        #: calls committed since the statistics were last discarded (tells whether they changed since a point)
        self.commits = 0
        #: dtype of the captured output gradients (float16 ones carry an AMP loss scale)
        self.g_dtype: torch.dtype | None = None
        # Samples are counted once per forward pass (its largest call), not once per call: a layer applied k
        # times per sample is one layer at k positions (KFC's weight sharing), so its G equals the one of a single
        # call on the k inputs stacked along a position dimension. A forward pass is the calls between two
        # backward passes of the layer.
        self._forward_counted: dict[int, tuple[int, int]] = {}  # forward id -> (samples counted, calls committed)

    def sample_count(self, x: torch.Tensor) -> int:
        """Samples in the captured input ``x`` (its batch dimension; 1 for an unbatched input)."""
        return x.shape[0] if x.dim() > 1 else 1

    def is_stale(self) -> bool:
        """True when statistics from a completed backward pass are held but the weight's gradient was cleared
        since (``zero_grad`` without :meth:`KFACPreconditioner.step`, e.g. a step skipped by the user or a
        grad scaler): they belong to a step that never happened. Gradient accumulation keeps ``.grad``."""
        if self.g_sum is None:
            return False
        grad = self.weight.grad
        return grad is None or not bool(grad.any())

    def prepare_capture(self, capturing: bool) -> None:
        """Called before the layer's forward when :attr:`records_input` is set."""

    def captured_input(self, inputs: tuple) -> torch.Tensor | None:
        """The tensor whose statistics form A, taken after the forward (default: the layer's input)."""
        return inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None

    def input_rows(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - overridden
        """The layer input as rows ``a`` (one per sample and position), float32, bias column appended."""
        raise NotImplementedError

    def output_rows(self, g: torch.Tensor) -> torch.Tensor:  # pragma: no cover - overridden
        """The output gradient as rows (one per sample and position), float32."""
        raise NotImplementedError

    def _with_bias(self, rows: torch.Tensor) -> torch.Tensor:
        if not self.has_bias:
            return rows
        return torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)

    def input_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``(sum of a a^T over the rows of x, number of rows)``; handlers compute it without forming the rows.

        :meth:`input_rows` / :meth:`output_rows` are the plain definitions; the grams are computed from
        cache-sized chunks with a symmetric product (:func:`~lightning_hpc.kfac.linalg.sym_gram`) instead.
        """
        rows = self.input_rows(x)
        return rows.t() @ rows, rows.shape[0]

    def output_gram(self, g: torch.Tensor) -> torch.Tensor:
        rows = self.output_rows(g)
        return rows.t() @ rows

    def _fold_bias(self, gram: torch.Tensor, colsum: torch.Tensor | None, rows: int) -> torch.Tensor:
        """``[[sum a a^T, sum a], [sum a^T, rows]]``: the bias's constant-1 input appended analytically."""
        if not self.has_bias:
            return gram
        assert colsum is not None
        k = gram.shape[0]
        out = gram.new_empty(k + 1, k + 1)
        out[:k, :k] = gram
        out[:k, k] = colsum
        out[k, :k] = colsum
        out[k, k] = rows
        return out

    #: the layer has no statistics for one tile of a split activation (a tensor subclass that carries its
    #: partition, e.g. the spatial strategy's): such an input is refused instead of giving one tile's factors
    refuses_split_input: bool = False

    def captures(self, x: torch.Tensor) -> bool:
        """Whether this forward's input gives the layer statistics (False: the call is not captured)."""
        return True

    def check_input(self, x: torch.Tensor) -> None:
        """Refuse, naming the layer and the fix, an input this handler's statistics do not cover."""
        if self.refuses_split_input and type(x) is not torch.Tensor:
            raise RuntimeError(
                f"K-FAC layer {self.name!r} ({type(self.module).__name__}) got a {type(x).__name__} input (one tile "
                "of a split activation): K-FAC has no tiled statistics for this layer type; leave it to the "
                f"optimizer with KFAC(skip_layers=[{self.name.split('#')[0]!r}])"
            )

    @torch.no_grad()
    def capture_input(self, x: torch.Tensor) -> int:
        """Compute the input statistics of one call; returns the token :meth:`capture_output_grad` commits."""
        self.check_input(x)
        # Autocast would run this product in fp16/bf16 inside the forward pass: factors are float32 at least.
        with torch.autocast(x.device.type, enabled=False):
            contrib, rows = self.input_gram(x)
        if not self._in_forward:  # first call since the last backward pass: a new forward pass
            self._in_forward = True
            self._forward_id += 1
        token = self._next_token
        self._next_token += 1
        self._pending[token] = (contrib, rows, self.sample_count(x), self._forward_id)
        return token

    @torch.no_grad()
    def capture_output_grad(self, g: torch.Tensor, token: int | None = None) -> bool:
        """Add the output-gradient statistics of the call ``token`` and commit its input statistics; False when
        they had been discarded since its forward pass (nothing committed)."""
        self._in_forward = False  # the backward pass ends the forward pass's calls
        pending = self._pending.pop(token if token is not None else max(self._pending, default=-1), None)
        if pending is None:  # statistics discarded since the forward pass
            return False
        a, rows, n, forward_id = pending
        with torch.autocast(g.device.type, enabled=False):
            self.accumulate(a, rows, g)
        self.g_samples += g.shape[0]
        self.g_dtype = g.dtype
        counted, calls = self._forward_counted.get(forward_id, (0, 0))
        if n > counted:
            self.samples += n - counted
        self._forward_counted[forward_id] = (max(n, counted), calls + 1)
        self.max_calls_per_forward = max(self.max_calls_per_forward, calls + 1)
        self.commits += 1
        return True

    def accumulate(self, input_stat: torch.Tensor, rows: int, g: torch.Tensor) -> None:
        """Add one call's statistics to the sums: its input statistic (:meth:`input_gram`, computed in the forward
        pass) and ``rows``, and the Gram of its output gradient ``g``."""
        contrib = self.output_gram(g)
        self.g_sum = contrib if self.g_sum is None else self.g_sum + contrib
        self.a_sum = input_stat if self.a_sum is None else self.a_sum + input_stat
        self.a_rows += rows

    def awaiting_output_grads(self) -> bool:
        """Calls of the latest forward pass whose output gradient has not arrived yet (a layer called several
        times per forward pass receives one per call; a call whose output does not reach the loss never does)."""
        return any(p[3] == self._forward_id for p in self._pending.values())

    @property
    def has_statistics(self) -> bool:
        return self.a_sum is not None and self.g_sum is not None

    def batch_factors(self, grad_scale: float = 1.0, batch_averaged: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, G) of the captured micro-batches following the module docstring's convention.

        ``grad_scale`` is the loss scale the output gradients were multiplied by (AMP); G is unscaled by it.
        """
        if not self.has_statistics:
            raise RuntimeError(f"K-FAC layer {self.name!r}: no statistics captured in this step")
        assert self.a_sum is not None and self.g_sum is not None
        b = max(self.samples, 1)
        a = self.a_sum / self.a_rows
        g = self.g_sum * (b if batch_averaged else 1.0 / b)
        if grad_scale != 1.0:
            g = g / (grad_scale * grad_scale)
        return a, g

    # -- factor forms ------------------------------------------------------------------------------------
    #: what the setup report says about the layer's factors when they are not KFC's dense A and G
    form_note: str = ""
    #: the factors built from output gradients: an AMP loss scale enters them squared (see :meth:`unscale`)
    output_gradient_factors: tuple[str, ...] = ("G",)

    def factor_forms(self) -> dict[str, FactorForm]:
        """The layer's factors by name and form (:mod:`.forms`): KFC's dense A and G."""
        return {"A": DenseForm(self.a_dim), "G": DenseForm(self.g_dim)}

    def layer_forms(self) -> LayerForms:
        """The factors and the gradient matrix's shape, as the placement and ``plan-kfac`` price them."""
        return LayerForms(self.factor_forms(), (self.g_dim, self.a_dim))

    def batch_statistics(self, grad_scale: float = 1.0, batch_averaged: bool = True) -> dict[str, torch.Tensor]:
        """This step's factors by name (:meth:`factor_forms`), from the captured micro-batches."""
        return dict(zip(("A", "G"), self.batch_factors(grad_scale, batch_averaged)))

    def packed_numel(self, symmetric: bool) -> int:
        """Elements of this layer's factors in the all-reduce (:meth:`pack_factors`)."""
        return sum(form.packed_numel(symmetric) for form in self.factor_forms().values())

    def pack_factors(self, factors: dict[str, torch.Tensor], symmetric: bool) -> torch.Tensor:
        """This step's factors as the one vector the all-reduce averages, each packed by its form (``symmetric``:
        upper triangles). A spatially tiled layer's partial factors are scaled by :attr:`partition_size`: a sample
        group's factor is the sum over its ranks (:class:`TiledConvHandler`), so the world mean becomes the mean
        over sample groups of those sums."""
        scale = self.partition_size
        return torch.cat([form.pack(factors[k] * scale if scale > 1 else factors[k], symmetric)
                          for k, form in self.factor_forms().items()])  # fmt: skip

    def unpack_factors(self, flat: torch.Tensor, symmetric: bool) -> dict[str, torch.Tensor]:
        """The factors from :meth:`pack_factors`'s (averaged) vector."""
        out, offset = {}, 0
        for k, form in self.factor_forms().items():
            size = form.packed_numel(symmetric)
            out[k] = form.unpack(flat[offset : offset + size], symmetric)
            offset += size
        return out

    def unscale(self, factors: dict[str, torch.Tensor], grad_scale: float) -> dict[str, torch.Tensor]:
        """``factors`` with the output-gradient ones divided by ``grad_scale**2`` (statistics reduced before the
        loss scale was known: the overlapped all-reduce)."""
        if grad_scale == 1.0:
            return factors
        s = grad_scale * grad_scale
        return {k: v / s if k in self.output_gradient_factors else v for k, v in factors.items()}

    def precondition(self, grad: torch.Tensor, decompositions: dict[str, torch.Tensor], method: ComputeMethod,
                     damping: float) -> torch.Tensor:
        """The preconditioned ``(g_dim, a_dim)`` gradient matrix from the layer's decompositions (keys
        ``f"{name}_{factor}"``): ``(A (x) G + damping I)^-1 vec(grad)`` by the compute method (Eq 13-15 / 11-12)."""
        return method.precondition(grad, decompositions, damping)

    # -- running factors and decompositions ---------------------------------------------------------------
    def fold(self, batch: dict[str, torch.Tensor], decay: float, dtype: torch.dtype) -> None:
        """Fold this step's (rank-averaged) factors into the running averages stored in ``dtype`` (Eq 16-17:
        ``decay`` weighs the old average; the first update takes the batch factors)."""
        if not self.factors:
            self.factors = {k: f.to(dtype, copy=True) for k, f in batch.items()}
            return
        for k, new in batch.items():
            running = self.factors[k]
            if new.dtype == dtype:
                running.mul_(decay).add_(new, alpha=1.0 - decay)
            else:  # narrower storage (factor_dtype): average in the statistics' dtype, round once
                running.copy_(running.to(new.dtype).mul_(decay).add_(new, alpha=1.0 - decay))

    def result_shapes(self, kind: str, method: ComputeMethod) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the decomposition of factor ``kind`` (what a broadcast or checkpoint carries)."""
        return self.factor_forms()[kind].result_shapes(method)

    def decompose(self, kind: str, method: ComputeMethod, damping: float, dtype: torch.dtype,
                  storage: torch.dtype) -> dict[str, torch.Tensor]:
        """The decomposition of the running factor ``kind`` computed in ``dtype``, stored in ``storage``. When every
        fallback fails (:mod:`.linalg`), the previous decomposition, or before any an identity factor's (the step
        is then a damped SGD step): what the layer's other workers receive, so every rank stays identical."""
        form = self.factor_forms()[kind]
        factor = self.factors[kind]
        res = form.decompose(factor, method, damping, dtype, f"{self.name}.{kind}")
        if res is None:
            if self.decompositions:
                res = {k: self.decompositions[f"{k}_{kind}"] for k in form.result_shapes(method)}
            else:
                res = form.identity(method, damping, dtype, factor.device)
        return {k: v.to(storage) for k, v in res.items()}

    def set_decomposition(self, kind: str, res: dict[str, torch.Tensor]) -> None:
        """Keep ``res`` (:meth:`decompose`'s, computed here or received) as factor ``kind``'s decomposition."""
        for k, v in res.items():
            self.decompositions[f"{k}_{kind}"] = v

    def decomposition_of(self, kind: str, method: ComputeMethod) -> dict[str, torch.Tensor]:
        """Factor ``kind``'s part of :attr:`decompositions`, by its own names (for a broadcast)."""
        return {k: self.decompositions[f"{k}_{kind}"] for k in self.result_shapes(kind, method)}

    def load_state(self, factors: dict[str, torch.Tensor], decompositions: dict[str, torch.Tensor],
                   factor_dtype: torch.dtype, inverse_dtype: torch.dtype) -> None:
        """Take a checkpoint's running factors and decompositions (empty dicts: none), on the layer's device in the
        storage dtypes."""
        device = self.weight.device
        self.factors = {k: v.to(device, factor_dtype) for k, v in factors.items()}
        self.decompositions = {k: v.to(device, inverse_dtype) for k, v in decompositions.items()}

    def preconditioned(self, grad: torch.Tensor, method: ComputeMethod, damping: float,
                       dtype: torch.dtype) -> torch.Tensor:
        """:meth:`precondition` with the stored decompositions, computed in ``dtype`` (the decomposition dtype:
        decompositions stored narrower are widened to it first)."""
        d = self.decompositions
        if any(v.dtype != dtype for v in d.values()):
            d = {k: v.to(dtype) for k, v in d.items()}
        return self.precondition(grad, d, method, damping)

    # -- gradients ---------------------------------------------------------------------------------------
    #: the rows of ``weight`` (and ``bias``) this handler preconditions: all of them, or one group's
    rows: slice = slice(None)

    def grad_matrix(self) -> torch.Tensor | None:
        """``[dW | db]`` (this handler's :attr:`rows`) as a ``(g_dim, a_dim)`` matrix, or None when the weight has
        no gradient."""
        w = self.weight
        if w.grad is None:
            return None
        mat = w.grad[self.rows].reshape(self.g_dim, -1)
        if self.has_bias:
            b = self.bias
            bgrad = b.grad if b.grad is not None else torch.zeros_like(b)
            mat = torch.cat([mat, bgrad[self.rows].reshape(-1, 1)], dim=1)
        return mat

    @torch.no_grad()
    def set_grad_matrix(self, mat: torch.Tensor) -> None:
        """Write a ``(g_dim, a_dim)`` matrix back into ``.grad`` (this handler's :attr:`rows`) in place (dtype of
        the gradient kept)."""
        w = self.weight
        assert w.grad is not None
        n_w = mat.shape[1] - (1 if self.has_bias else 0)
        w.grad[self.rows].copy_(mat[:, :n_w].reshape_as(w.grad[self.rows]))
        if self.has_bias:
            b = self.bias
            if b.grad is None:
                b.grad = torch.zeros_like(b)
            b.grad[self.rows].copy_(mat[:, n_w])


class LinearHandler(LayerHandler):
    """``nn.Linear``; inputs with extra leading dimensions count each position as a row (T = numel / B / in).

    Of the leading dimensions of an input ``(..., in_features)``, :attr:`batch_dim` is the sample dimension and
    all others are positions (KFC's weight sharing, as a convolution's positions): A is the mean over all rows,
    G the per-sample sum over positions. ``batch_dim`` is 0 (batch first) unless the layer sits in a module
    with ``batch_first=False`` (torch's ``TransformerEncoderLayer`` / ``TransformerDecoderLayer`` /
    ``MultiheadAttention``, or a user module that sets that attribute), then 1: see
    :func:`linear_batch_dims`.
    """

    module: nn.Linear
    batch_dim: int = 0

    def sample_count(self, x: torch.Tensor) -> int:
        if x.dim() <= 1:
            return 1
        if x.dim() == 2:
            return x.shape[0]
        return x.shape[self.batch_dim]

    @property
    def a_dim(self) -> int:
        return self.module.in_features + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self.module.out_features

    def input_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self._with_bias(x.detach().reshape(-1, x.shape[-1]).to(self.dtype_for(x)))

    def output_rows(self, g: torch.Tensor) -> torch.Tensor:
        return g.detach().reshape(-1, g.shape[-1]).to(self.dtype_for(g))

    def input_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        rows = x.detach().reshape(-1, x.shape[-1]).to(self.dtype_for(x))
        gram, colsum = sym_gram(rows, colsum=self.has_bias)
        return self._fold_bias(gram, colsum, rows.shape[0]), rows.shape[0]

    def output_gram(self, g: torch.Tensor) -> torch.Tensor:
        return sym_gram(self.output_rows(g))[0]



def _plain(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor of a model-parallel block (a :class:`~lightning_hpc.distributed.partitioned.BlockTensor`
    reduces over its group; the handler means this rank's block)."""
    if type(t) is torch.Tensor:
        return t
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


class ShardedLinearHandler(LinearHandler):
    """A fully-connected layer of which this rank holds one block (:class:`~lightning_hpc.protocols.
    ShardedFullyConnected`: hybrid_fc's head), preconditioned as the whole layer, as one process does.

    Each call is one sub-batch of the ranks' samples, the same rows on every rank, so the rows of all calls are the
    step's samples (counted per call, not as positions of one forward pass).  The side of the layer a rank sees
    whole gives its factor's Gram at once (a column block's input, a row block's output gradient); the other side's
    rows are kept per call and all-gathered along the features at the step, so A and G are the whole layer's, from
    every sample, and equal on every rank (the world mean of the factor all-reduce leaves them so).  The output
    gradients carry ``1 / kfac_grad_scale`` times the mean loss's, undone before they enter G.  At the step the
    gradient ``[dW | db]`` is gathered whole, preconditioned (and KL-clipped) as one process does it, and each rank
    keeps its block.  The gathers are collectives at the step, in layer order: the overlapped factor all-reduce,
    which would run them from backward hooks, is refused for such layers (:class:`KFACPreconditioner`)."""

    gathers_statistics = True

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__(name, module)
        self._token = -1  # the call whose output gradient is being committed

    def reset_statistics(self) -> None:
        super().reset_statistics()
        #: the gradient scale of each pending call (the layer's ``kfac_grad_scale`` at its forward)
        self._scales: dict[int, float] = {}

    @property
    def _layout(self) -> str:
        return str(cast(Any, self.module).layout)

    def discard_committed(self) -> None:
        super().discard_committed()
        #: (token, rows) of the side seen as a block: a row layer's inputs, a column layer's output gradients
        self._blocks: list[tuple[int, torch.Tensor]] = []

    def is_stale(self) -> bool:
        if not self.commits:
            return False
        grad = self.weight.grad
        return grad is None or not bool(_plain(grad).any())

    @property
    def has_statistics(self) -> bool:
        return self.commits > 0

    def input_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self._layout == "col":  # the whole input: its Gram now
            return super().input_gram(x)
        rows = x.detach().reshape(-1, x.shape[-1]).to(self.dtype_for(x))
        return rows, rows.shape[0]  # this rank's input block: gathered at the step

    def capture_input(self, x: torch.Tensor) -> int:
        self._in_forward = False  # every call is a sub-batch of samples of its own, not a position
        token = super().capture_input(x)
        self._scales[token] = float(cast(Any, self.module).kfac_grad_scale)
        return token

    def capture_output_grad(self, g: torch.Tensor, token: int | None = None) -> bool:
        key = token if token is not None else max(self._pending, default=-1)
        scale = self._scales.pop(key, 1.0)
        self._token = key
        return super().capture_output_grad(g * scale if scale != 1.0 else g, token)

    def accumulate(self, input_stat: torch.Tensor, rows: int, g: torch.Tensor) -> None:
        self.a_rows += rows
        if self._layout == "col":
            self.a_sum = input_stat if self.a_sum is None else self.a_sum + input_stat
            self._blocks.append((self._token, self.output_rows(g)))
        else:
            contrib = self.output_gram(g)
            self.g_sum = contrib if self.g_sum is None else self.g_sum + contrib
            self._blocks.append((self._token, input_stat))

    def _gather_statistics(self) -> None:
        """The whole layer's Gram of the blocked side, from every rank's block of every call (collective)."""
        if not self._blocks:
            return
        m = cast(Any, self.module)
        rows = torch.cat([r for _, r in sorted(self._blocks, key=lambda item: item[0])])
        self._blocks = []
        if self._layout == "col":
            self.g_sum = sym_gram(m.kfac_gather(rows, "out", 1))[0]
        else:
            whole = m.kfac_gather(rows, "in", 1)
            gram, colsum = sym_gram(whole, colsum=self.has_bias)
            self.a_sum = self._fold_bias(gram, colsum, whole.shape[0])

    def batch_factors(self, grad_scale: float = 1.0, batch_averaged: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        self._gather_statistics()
        return super().batch_factors(grad_scale, batch_averaged)

    def grad_matrix(self) -> torch.Tensor | None:
        """The whole layer's ``[dW | db]`` (collective: every rank's blocks gathered)."""
        w = self.weight
        if w.grad is None:
            return None
        m = cast(Any, self.module)
        wg = _plain(w.grad)
        bg = None
        if self.has_bias:
            bg = _plain(self.bias.grad) if self.bias.grad is not None else torch.zeros_like(_plain(self.bias))
        if self._layout == "col":
            mat = wg if bg is None else torch.cat([wg, bg.reshape(-1, 1)], dim=1)
            return m.kfac_gather(mat, "out", 0)
        mat = m.kfac_gather(wg, "in", 1)
        if bg is not None:
            mat = torch.cat([mat, m.kfac_gather(bg, "out", 0).reshape(-1, 1)], dim=1)
        return mat

    @torch.no_grad()
    def set_grad_matrix(self, mat: torch.Tensor) -> None:
        """This rank's blocks of the whole layer's preconditioned ``[dW | db]``."""
        w = self.weight
        assert w.grad is not None
        m = cast(Any, self.module)
        n_w = mat.shape[1] - (1 if self.has_bias else 0)
        o0, o1 = m.kfac_block("out")
        if self._layout == "col":
            _plain(w.grad).copy_(mat[o0:o1, :n_w])
        else:
            i0, i1 = m.kfac_block("in")
            _plain(w.grad).copy_(mat[:, i0:i1])
        if self.has_bias:
            b = self.bias
            if b.grad is None:
                b.grad = torch.zeros_like(b)
            _plain(b.grad).copy_(mat[o0:o1, n_w])


def sliding_windows(t: torch.Tensor, kernel: tuple[int, ...], stride: tuple[int, ...],
                    dilation: tuple[int, ...]) -> torch.Tensor:
    """Strided view ``(N, C, *positions, *kernel)`` of a padded ``(N, C, *spatial)`` tensor: the windows of a
    convolution with these kernel sizes, strides and dilations (every ``d``-th element of a ``d (k - 1) + 1`` span),
    without copying."""
    for i, (k, s, d) in enumerate(zip(kernel, stride, dilation)):
        t = t.unfold(2 + i, d * (k - 1) + 1, s)
    return t[(...,) + tuple(slice(None, None, d) for d in dilation)]


#: the convolutions K-FAC preconditions: one handler for 1, 2 and 3 spatial dimensions (grouped ones by
#: :class:`GroupConvHandler`)
CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: the transposed convolutions K-FAC preconditions (grouped ones by :class:`GroupConvTransposeHandler`)
TRANSPOSED_CONVOLUTIONS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


class ConvHandler(LayerHandler):
    """``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d`` with groups=1, any stride / padding (incl. 'same' and non-zero
    padding modes) / dilation.

    A uses the unfolded input patches (KFC's expansion operator, Grosse & Martens 2016, section 3.1, for any
    number of spatial dimensions: the positions ``t`` run over the whole output grid), ordered like
    ``weight.view(out, -1)``; G the output gradients at every position.
    """

    module: nn.Conv1d | nn.Conv2d | nn.Conv3d

    #: fraction of each captured batch whose input patches form A (1.0: every sample, KFC's definition). Below 1,
    #: a random subset of ``ceil(fraction * N)`` samples is drawn from :attr:`generator` (see
    #: ``KFACPreconditioner(conv_input_sample_fraction=...)``); G always uses the whole batch.
    sample_fraction: float = 1.0
    generator: torch.Generator | None = None
    #: A of stride-1 zero-padded 2-D convolutions from channel correlations (:meth:`_shifted_padding`); False for
    #: inputs that come padded already (:class:`TiledConvHandler`)
    shifted_gram: bool = True

    @property
    def spatial_dims(self) -> int:
        return len(self.module.kernel_size)

    @property
    def refuses_split_input(self) -> bool:  # type: ignore[override]
        # Conv2d on split activations is the tiled handler's; Conv1d / Conv3d have no tiled statistics yet
        return self.spatial_dims != 2

    @property
    def a_dim(self) -> int:
        m = self.module
        return m.in_channels * math.prod(m.kernel_size) + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self.module.out_channels

    def _batched(self, t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(0) if t.dim() == self.spatial_dims + 1 else t  # an unbatched input is one sample

    def _windows(self, x: torch.Tensor) -> torch.Tensor:
        """Strided view ``(N, C, *out, *kernel)`` of the padded input: the patches without copying.

        Padding (zeros, 'same', reflect/replicate/circular) is applied exactly as the module's forward does;
        dilation takes every ``d``-th element of a ``d (k - 1) + 1`` window. One later copy lays the patches out
        as needed, about 40% cheaper on CPU than ``F.unfold`` (im2col) followed by a transposed copy.
        """
        m = self.module
        return sliding_windows(self._pad(self._batched(x.detach().to(self.dtype_for(x)))), m.kernel_size, m.stride,
                               m.dilation)

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
        if any(m._reversed_padding_repeated_twice):
            x = F.pad(x, m._reversed_padding_repeated_twice, mode=mode)
        return x

    def input_rows(self, x: torch.Tensor) -> torch.Tensor:
        win, nd = self._windows(x), self.spatial_dims
        positions = tuple(range(2, 2 + nd))
        kernel = tuple(range(2 + nd, 2 + 2 * nd))
        rows = win.permute(0, *positions, 1, *kernel)
        return self._with_bias(rows.reshape(-1, win.shape[1] * math.prod(win.shape[2 + nd:])))

    def output_rows(self, g: torch.Tensor) -> torch.Tensor:
        g = self._batched(g.detach().to(self.dtype_for(g)))
        return g.movedim(1, -1).reshape(-1, g.shape[1])

    def sample_subset(self, x: torch.Tensor) -> torch.Tensor:
        """The samples of ``x`` whose patches form A: all of them unless :attr:`sample_fraction` < 1, else a
        random subset (sorted indices, so a subset that covers the batch is the batch itself)."""
        if self.sample_fraction >= 1.0 or x.dim() != self.spatial_dims + 2:
            return x
        n = x.shape[0]
        keep = max(1, math.ceil(self.sample_fraction * n))
        if keep >= n:
            return x
        idx = torch.randperm(n, generator=self.generator)[:keep].sort().values
        return x.index_select(0, idx.to(x.device))

    def input_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        x = self.sample_subset(x)  # A is a mean over rows: a subset's mean estimates it without rescaling
        pads = self._shifted_padding(x)
        if pads is not None:  # stride 1, zero padding: from channel correlations, no patches formed
            xs = self._batched(x.detach().to(self.dtype_for(x)))
            rows = self._positions(xs, pads)
            kh, kw = self.module.kernel_size  # type: ignore[misc]  # 2-D only (_shifted_padding)
            gram = conv_patch_gram(xs, (kh, kw), pads)
            colsum = self._windows(x).sum(dim=(0, 2, 3)).reshape(-1) if self.has_bias else None
            return self._fold_bias(gram, colsum, rows), rows
        win, nd = self._windows(x), self.spatial_dims  # (N, C, *out, *kernel), a view: sym_gram copies it in chunks
        rows = win.shape[0] * math.prod(win.shape[2 : 2 + nd])
        patches = win.permute(0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd))  # (N, C, *kernel, *out)
        gram, colsum = sym_gram(patches, k_dims=1 + nd, colsum=self.has_bias)
        return self._fold_bias(gram, colsum, rows), rows

    def output_gram(self, g: torch.Tensor) -> torch.Tensor:
        return sym_gram(self._batched(g.detach().to(self.dtype_for(g))), k_dims=1)[0]

    def _shifted_padding(self, x: torch.Tensor) -> tuple[int, int, int, int] | None:
        """``(top, bottom, left, right)`` zero padding when A is computed by
        :func:`~lightning_hpc.kfac.linalg.conv_patch_gram` (stride 1, no dilation, zero padding of at most
        ``k - 1``, a kernel larger than 1x1, on CPU, and enough work: below :data:`SHIFTED_GRAM_MIN_WORK` its
        fixed cost of some 30 small products exceeds what it saves); else None (the unfolded patches)."""
        m = self.module
        if self.spatial_dims != 2:
            return None
        (kh, kw), (left, right, top, bottom) = m.kernel_size, m._reversed_padding_repeated_twice  # type: ignore[misc]
        if (not self.shifted_gram or x.device.type != "cpu" or x.dim() not in (3, 4) or kh * kw == 1
                or m.stride != (1, 1) or m.dilation != (1, 1) or m.padding_mode != "zeros"
                or max(top, bottom) >= kh or max(left, right) >= kw):  # fmt: skip
            return None
        pads = top, bottom, left, right
        return pads if self._positions(x, pads) * self.a_dim**2 >= SHIFTED_GRAM_MIN_WORK else None

    def _positions(self, x: torch.Tensor, pads: tuple[int, int, int, int]) -> int:
        """Output positions of all samples of ``x`` (batched or not) at stride 1 with ``(top, bottom, left,
        right)`` padding."""
        (kh, kw), (top, bottom, left, right) = self.module.kernel_size, pads  # type: ignore[misc]
        n = x.shape[0] if x.dim() == 4 else 1
        return n * (x.shape[-2] + top + bottom - kh + 1) * (x.shape[-1] + left + right - kw + 1)


class TiledConvHandler(ConvHandler):
    """A Conv1d / Conv2d / Conv3d that runs on one spatial tile (or sub-volume) of each sample (spatial
    parallelism, Dryden et al. sections I and III-A): a convolution declared by
    :func:`lightning_hpc.spatial.kfac_contract.declare_tiled_convolutions`, its op on a split activation run by
    the tile kernel :func:`lightning_hpc.spatial.kernels.conv`.

    KFC's expansion operator over the whole sample is the union over tiles of the patches of the output positions
    each tile owns, and the output gradients split the same way, so the whole-sample sums of ``a a^T`` and
    ``ds ds^T`` are the sums over tiles of the tiles' sums.  Each tile therefore forms

        A_k = 1/(B T) sum_n sum_{t in tile k} a a^T,    G_k = B sum_n sum_{t in tile k} grad grad^T

    with ``T`` the positions of the *whole* output (as the serial convention, :mod:`.layers` docstring), and
    ``sum_k A_k``, ``sum_k G_k`` over the spatial group are exactly the serial factors of the sample group's
    samples; :attr:`partition_size` tells the preconditioner to sum them (``KFACPreconditioner._update_factors``).

    The patches come from the layer's halo-padded input tile (border zero padding and the neighbours' halo
    rows included), which the layer records on capture steps only: the protocol is ``kfac_record_input``,
    ``kfac_padded_input``, ``kfac_output_extent`` and ``kfac_partition_size`` on the module.
    """

    records_input = True
    shifted_gram = False

    @property
    def partition_size(self) -> int:  # type: ignore[override]
        return int(cast(Any, self.module).kfac_partition_size)

    def prepare_capture(self, capturing: bool) -> None:
        cast(Any, self.module).kfac_record_input = capturing

    def captured_input(self, inputs: tuple) -> torch.Tensor | None:
        m = cast(Any, self.module)  # the TiledConvolution protocol's attributes
        x: torch.Tensor | None = m.kfac_padded_input
        m.kfac_padded_input = None
        m.kfac_record_input = False
        return x

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        return x  # already padded by the layer (halo rows from the neighbours, zeros at the image border)

    @property
    def refuses_split_input(self) -> bool:  # type: ignore[override]
        return False  # the statistics come from the recorded box, in any number of dimensions

    def input_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        gram, _ = super().input_gram(x)
        extent = cast(Any, self.module).kfac_output_extent
        n = x.shape[0] if x.dim() == 2 + self.spatial_dims else 1
        return gram, n * math.prod(extent)  # rows of the whole sample: sum_k A_k is the serial A


class _OneGroup(LayerHandler):
    """The channel slicing of one group of a grouped (transposed) convolution: the group's input channels form its
    statistics' input, its output channels their output gradient (put before the layer's handler in the bases)."""

    group: int
    in_per_group: int
    out_per_group: int

    def _set_group(self, module: nn.Module, group: int) -> None:
        m = cast(Any, module)
        self.group = group
        self.in_per_group = m.in_channels // m.groups
        self.out_per_group = m.out_channels // m.groups

    def _channels(self, t: torch.Tensor, per_group: int) -> torch.Tensor:
        dim = t.dim() - len(cast(Any, self.module).kernel_size) - 1  # 0 for an unbatched input, else 1
        return t.narrow(dim, self.group * per_group, per_group)

    def capture_input(self, x: torch.Tensor) -> int:
        return super().capture_input(self._channels(x, self.in_per_group))

    def capture_output_grad(self, g: torch.Tensor, token: int | None = None) -> bool:
        return super().capture_output_grad(self._channels(g, self.out_per_group), token)


class GroupConvHandler(_OneGroup, ConvHandler):
    """One group of a grouped convolution (``groups > 1``; depthwise when each group has one input channel).

    Group ``i``'s weights ``W[i Co/g : (i+1) Co/g]`` see only input channels ``[i Ci/g, (i+1) Ci/g)`` and produce
    only output channels ``[i Co/g, (i+1) Co/g)``: each group is a convolution of its own, and K-FAC gives it its
    own Kronecker block (KFC's factors of that sub-convolution), so the layer's curvature is block-diagonal over
    its groups, as K-FAC's is over layers (Martens & Grosse 2015, section 3). The handler is named
    ``<layer>#g<i>``; its gradient matrix is the group's rows of ``[dW | db]``.
    """

    refuses_split_input = True  # type: ignore[assignment]

    def __init__(self, name: str, module: nn.Conv1d | nn.Conv2d | nn.Conv3d, group: int) -> None:
        self._set_group(module, group)
        super().__init__(f"{name}#g{group}", module)
        self.rows = slice(group * self.out_per_group, (group + 1) * self.out_per_group)

    @property
    def a_dim(self) -> int:
        return self.in_per_group * math.prod(self.module.kernel_size) + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self.out_per_group


class ConvTransposeHandler(LayerHandler):
    """``nn.ConvTranspose1d/2d/3d`` with groups=1 (U-Net decoders), any stride / padding / output padding / dilation.

    A transposed convolution scatters each *input* position ``t`` into an output window: with ``w_t`` the output
    gradient in that window (``C_out * prod(kernel)`` values, the patches of ``dL/dy`` under the convolution that is
    the layer's adjoint: same kernel, stride, padding, dilation), ``dW = sum_n sum_t x_t w_t^T`` for the weight
    ``(C_in, C_out, *kernel)``. That is KFC's form (Grosse & Martens 2016, section 3.1) with the roles of the two
    sides swapped: A is the input at the input positions, ``1/(B T) sum x x^T`` (``C_in`` square, T the input
    positions), G the output-gradient windows, ``B sum_n sum_t w w^T``. The gradient matrix is ``dW`` viewed as
    ``(C_out * prod(kernel), C_in)``. The bias (one value per output channel, summed over every output position) is
    not of that form: it is left to the optimizer.
    """

    module: nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d
    refuses_split_input = True

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__(name, module)
        self.has_bias = False  # left to the optimizer (see the class docstring)

    @property
    def spatial_dims(self) -> int:
        return len(self.module.kernel_size)

    @property
    def a_dim(self) -> int:
        return self.module.in_channels

    @property
    def g_dim(self) -> int:
        return self.module.out_channels * math.prod(self.module.kernel_size)

    def _batched(self, t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(0) if t.dim() == self.spatial_dims + 1 else t

    def _output_windows(self, g: torch.Tensor) -> torch.Tensor:
        """``(N, C_out, *input positions, *kernel)``: the output gradient seen by each input position."""
        m = self.module
        g = self._batched(g.detach().to(self.dtype_for(g)))
        pads = cast(tuple[int, ...], m.padding)  # a transposed convolution's padding is always numbers
        g = F.pad(g, [p for p in reversed(pads) for _ in range(2)])
        return sliding_windows(g, m.kernel_size, m.stride, m.dilation)

    def input_rows(self, x: torch.Tensor) -> torch.Tensor:
        x = self._batched(x.detach().to(self.dtype_for(x)))
        return x.movedim(1, -1).reshape(-1, x.shape[1])

    def output_rows(self, g: torch.Tensor) -> torch.Tensor:
        win, nd = self._output_windows(g), self.spatial_dims
        return win.permute(0, *range(2, 2 + nd), 1, *range(2 + nd, 2 + 2 * nd)).reshape(-1, self.g_dim)

    def input_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        x = self._batched(x.detach().to(self.dtype_for(x)))
        return sym_gram(x, k_dims=1)[0], x.shape[0] * math.prod(x.shape[2:])

    def output_gram(self, g: torch.Tensor) -> torch.Tensor:
        win, nd = self._output_windows(g), self.spatial_dims
        return sym_gram(win.permute(0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd)), k_dims=1 + nd)[0]

    def grad_matrix(self) -> torch.Tensor | None:
        w = self.weight
        return None if w.grad is None else w.grad[self.rows].reshape(self.a_dim, -1).t()

    @torch.no_grad()
    def set_grad_matrix(self, mat: torch.Tensor) -> None:
        w = self.weight
        assert w.grad is not None
        w.grad[self.rows].copy_(mat.t().reshape_as(w.grad[self.rows]))


class GroupConvTransposeHandler(_OneGroup, ConvTransposeHandler):
    """One group of a grouped transposed convolution (``groups > 1``).

    The weight is ``(C_in, C_out / groups, *kernel)``: group ``i``'s input channels ``[i C_in/g, (i+1) C_in/g)``
    scatter only into its output channels ``[i C_out/g, (i+1) C_out/g)``, so each group is a transposed
    convolution of its own and gets its own block of :class:`ConvTransposeHandler`'s swapped KFC form, as a grouped
    convolution's groups do (:class:`GroupConvHandler`). Named ``<layer>#g<i>``; its gradient matrix is its input
    channels' rows of ``dW``, viewed as ``(C_out/g * prod(kernel), C_in/g)``.
    """

    def __init__(self, name: str, module: nn.Module, group: int) -> None:
        self._set_group(module, group)
        super().__init__(f"{name}#g{group}", module)
        self.rows = slice(group * self.in_per_group, (group + 1) * self.in_per_group)

    @property
    def a_dim(self) -> int:
        return self.in_per_group

    @property
    def g_dim(self) -> int:
        return self.out_per_group * math.prod(self.module.kernel_size)


#: normalisation layers whose affine parameters are preconditioned (exact types: a subclass such as
#: ``nn.SyncBatchNorm`` normalises with statistics from other ranks)
NORMS: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
)  # fmt: skip
#: the norms over the trailing ``normalized_shape`` of each position (features), not over channels
FEATURE_NORMS = (nn.LayerNorm, nn.RMSNorm)
#: dimensions of a batched input of each instance norm (one fewer: a single unbatched sample)
_INSTANCE_NORM_DIMS: dict[type[nn.Module], int] = {nn.InstanceNorm1d: 3, nn.InstanceNorm2d: 4, nn.InstanceNorm3d: 5}


class NormAffineHandler(LayerHandler):
    """The affine parameters of a normalisation layer (``nn.BatchNorm1d/2d/3d``, ``nn.GroupNorm``, ``nn.LayerNorm``,
    ``nn.RMSNorm``, ``nn.InstanceNorm1d/2d/3d`` with ``affine=True``): a 2x2 Fisher block per channel over its
    (scale, shift).

    The layer computes ``y = gamma_c xhat + beta_c`` at every position ``t`` of channel ``c`` (``xhat`` the
    normalised input), so the gradient of sample ``n``'s loss is ``d gamma_c = sum_t ds_{n,c,t} xhat_{n,c,t}``,
    ``d beta_c = sum_t ds_{n,c,t}`` (``ds`` as in the module docstring: ``B * grad_output`` for a mean loss). This
    is not a Kronecker product of an input and an output factor: K-FAC treats such a layer with a block of its own
    from these per-example gradients (Martens & Grosse 2015, section 3, on layers other than fully connected
    ones; KFAC-JAX's ``ScaleAndShiftDiagonal`` / ``ScaleAndShiftFull`` curvature blocks for ``scale_and_shift``
    layers, whose per-example gradients are exactly these). Between KFAC-JAX's diagonal (channels and the two
    parameters independent) and full (all ``2C`` parameters together) blocks this handler keeps, per channel,

        F_c = 1/B sum_n u_{n,c} u_{n,c}^T,    u_{n,c} = (d gamma_c, d beta_c) of sample n,

    the exact Fisher block of the pair (a :class:`~.forms.BlockDiagonalForm` of ``(C, 2, 2)``; ``(C, 1, 1)`` for
    a layer without a trainable shift), and preconditions ``(d gamma_c, d beta_c)`` by ``(F_c + damping I)^-1``.
    The gradient matrix is ``(C, 2)``: columns scale and shift. For a ``LayerNorm`` / ``RMSNorm`` (which has no
    shift: a 1x1 block) the "channels" are the elements of ``normalized_shape`` and the leading dimensions other
    than the sample dimension are positions.

    ``xhat`` is recomputed in the backward hook from the layer's input (kept by reference, which autograd holds
    anyway) with the layer's own normalisation and ``eps``: training-mode batch statistics for BatchNorm (only
    training forwards are captured), per-sample ones for the others.
    """

    output_gradient_factors = ("F",)
    #: sample dimension of a LayerNorm / RMSNorm input with more than one leading dimension (:func:`linear_batch_dim`)
    batch_dim: int = 0

    @property
    def channels(self) -> int:
        m = self.module
        if isinstance(m, FEATURE_NORMS):
            return math.prod(m.normalized_shape)
        return int(m.num_channels if isinstance(m, nn.GroupNorm) else m.num_features)  # type: ignore[arg-type]

    @property
    def a_dim(self) -> int:
        return 1 + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        return self.channels

    def factor_forms(self) -> dict[str, FactorForm]:
        return {"F": BlockDiagonalForm(self.channels, self.a_dim)}

    @property
    def form_note(self) -> str:  # type: ignore[override]
        return "a 2x2 block per channel over scale and shift" if self.has_bias else "a 1x1 block per channel (scale)"

    def _batched(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` with a leading sample dimension (an unbatched instance-norm or layer-norm input is one sample)."""
        m = self.module
        if isinstance(m, FEATURE_NORMS):
            extra = t.dim() - len(m.normalized_shape)
            if extra == 0:
                return t.unsqueeze(0)
            return t.movedim(self.batch_dim, 0) if extra >= 2 else t
        batched = _INSTANCE_NORM_DIMS.get(type(m))
        return t.unsqueeze(0) if batched is not None and t.dim() == batched - 1 else t

    def sample_count(self, x: torch.Tensor) -> int:
        return self._batched(x).shape[0]

    def captures(self, x: torch.Tensor) -> bool:
        # One tile of a split activation (the spatial strategy's "local" BatchNorm normalises each tile alone):
        # the tile's statistics are not the sample's. Nothing is captured, so the layer is left to the optimizer
        # with the preconditioner's one warning about layers whose hooks do not fire.
        return type(x) is torch.Tensor

    def _by_channel(self, t: torch.Tensor) -> torch.Tensor:
        """``(N, C, positions)`` of a batched tensor of the layer's layout."""
        if isinstance(self.module, FEATURE_NORMS):
            return t.reshape(t.shape[0], -1, self.channels).transpose(1, 2)
        return t.reshape(t.shape[0], t.shape[1], -1)

    def _normalized(self, x: torch.Tensor) -> torch.Tensor:
        """``xhat``: the layer's normalisation of ``x`` without its affine parameters."""
        m = self.module
        if isinstance(m, nn.LayerNorm):
            return F.layer_norm(x, m.normalized_shape, eps=m.eps)
        if isinstance(m, nn.RMSNorm):  # scale only: x / rms(x)
            return F.rms_norm(x, m.normalized_shape, eps=m.eps)
        if isinstance(m, nn.GroupNorm):
            return F.group_norm(x, m.num_groups, eps=m.eps)
        if type(m) in _INSTANCE_NORM_DIMS:
            return F.instance_norm(x, eps=float(cast(Any, m).eps))
        return F.batch_norm(x, None, None, training=True, eps=m.eps)  # type: ignore[arg-type]

    def input_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        # The statistics need the output gradient as well: keep the input (a reference: no copy) until it comes.
        return x.detach(), 0

    def accumulate(self, input_stat: torch.Tensor, rows: int, g: torch.Tensor) -> None:
        dtype = self.dtype_for(g)
        xhat = self._by_channel(self._normalized(self._batched(input_stat.to(dtype))))
        gg = self._by_channel(self._batched(g.detach().to(dtype)))
        u = (gg * xhat).sum(-1, keepdim=True)  # (N, C, 1): per-sample gradients of the scale
        if self.has_bias:
            u = torch.cat([u, gg.sum(-1, keepdim=True)], dim=-1)  # and of the shift
        contrib = torch.einsum("nci,ncj->cij", u, u)
        self.g_sum = contrib if self.g_sum is None else self.g_sum + contrib

    @property
    def has_statistics(self) -> bool:
        return self.g_sum is not None

    def batch_statistics(self, grad_scale: float = 1.0, batch_averaged: bool = True) -> dict[str, torch.Tensor]:
        if self.g_sum is None:
            raise RuntimeError(f"K-FAC layer {self.name!r}: no statistics captured in this step")
        b = max(self.samples, 1)
        f = self.g_sum * (b if batch_averaged else 1.0 / b)
        return {"F": f / (grad_scale * grad_scale) if grad_scale != 1.0 else f}

    def grad_matrix(self) -> torch.Tensor | None:
        w = self.weight
        if w.grad is None:
            return None
        cols = [w.grad.reshape(-1, 1)]
        if self.has_bias:
            b = self.bias
            cols.append((b.grad if b.grad is not None else torch.zeros_like(b)).reshape(-1, 1))
        return torch.cat(cols, dim=1)

    @torch.no_grad()
    def set_grad_matrix(self, mat: torch.Tensor) -> None:
        w = self.weight
        assert w.grad is not None
        w.grad.copy_(mat[:, 0].reshape_as(w.grad))
        if self.has_bias:
            b = self.bias
            if b.grad is None:
                b.grad = torch.zeros_like(b)
            b.grad.copy_(mat[:, 1].reshape_as(b.grad))

    def precondition(self, grad: torch.Tensor, decompositions: dict[str, torch.Tensor], method: ComputeMethod,
                     damping: float) -> torch.Tensor:
        """``(F_c + damping I)^-1 (d gamma_c, d beta_c)`` for every channel ``c`` (eigen: ``Q (Q^T v / (d +
        damping))``; inverse: the damped inverses)."""
        if method.name == "eigen":
            q, d = decompositions["q_F"], decompositions["d_F"]
            v = torch.einsum("cji,cj->ci", q, grad.to(q.dtype)) / (d + damping)
            return torch.einsum("cij,cj->ci", q, v)
        inv = decompositions["inv_F"]
        return torch.einsum("cij,cj->ci", inv, grad.to(inv.dtype))


class EmbeddingHandler(LayerHandler):
    """``nn.Embedding``: a Linear layer fed one-hot rows, so KFC's A is diagonal.

    Looking up token ``v`` is multiplying ``W^T`` by the one-hot vector ``e_v``, so ``A = E[a a^T]`` over the rows
    (every looked-up position) is ``diag(count_v) / rows``, the token frequencies, and G is the Linear layer's
    (``B sum_n sum_t ds ds^T`` over the positions, module docstring). A is kept as its diagonal
    (:class:`~.forms.DiagonalForm`), as ASDL's embedding factor (Osawa et al., "ASDL: A Unified Interface for
    Gradient Preconditioning in PyTorch", 2023). The gradient matrix is ``dW^T``, ``(embedding_dim,
    num_embeddings)``: with A's eigenbasis the unit vectors, Eq 15 becomes ``Q_G [(Q_G^T grad) / (v_G d_A^T +
    damping)]``, and the inverse method ``(G + damping I)^-1 grad diag(1 / (d_A + damping))``. Tokens not seen in
    a step have a zero gradient column, which stays zero. Inputs of several dimensions count one sample dimension
    (:attr:`batch_dim`, as a Linear's) and positions.
    """

    module: nn.Embedding
    refuses_split_input = True
    batch_dim: int = 0

    @property
    def a_dim(self) -> int:
        return self.module.num_embeddings

    @property
    def g_dim(self) -> int:
        return self.module.embedding_dim

    form_note = "diagonal A (token frequencies)"

    def factor_forms(self) -> dict[str, FactorForm]:
        return {"A": DiagonalForm(self.a_dim), "G": DenseForm(self.g_dim)}

    def sample_count(self, x: torch.Tensor) -> int:
        if x.dim() == 0:
            return 1
        return x.shape[0] if x.dim() == 1 else x.shape[self.batch_dim]

    def input_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        counts = torch.bincount(x.detach().reshape(-1), minlength=self.a_dim)
        return counts.to(self.dtype_for(self.weight)), x.numel()

    def output_gram(self, g: torch.Tensor) -> torch.Tensor:
        return sym_gram(g.detach().reshape(-1, g.shape[-1]).to(self.dtype_for(g)))[0]

    def grad_matrix(self) -> torch.Tensor | None:
        w = self.weight
        return None if w.grad is None else w.grad.t()

    @torch.no_grad()
    def set_grad_matrix(self, mat: torch.Tensor) -> None:
        w = self.weight
        assert w.grad is not None
        w.grad.copy_(mat.t())

    def precondition(self, grad: torch.Tensor, decompositions: dict[str, torch.Tensor], method: ComputeMethod,
                     damping: float) -> torch.Tensor:
        if method.name == "eigen":
            qg, dg, da = decompositions["q_G"], decompositions["d_G"], decompositions["d_A"]
            v = (qg.t() @ grad.to(qg.dtype)) / (dg.unsqueeze(1) * da.unsqueeze(0) + damping)
            return qg @ v
        inv_g, inv_a = decompositions["inv_G"], decompositions["inv_A"]
        return (inv_g @ grad.to(inv_g.dtype)) * inv_a.unsqueeze(0)


#: ``layer_types`` names: the module types of each family K-FAC can precondition
LAYER_TYPES: dict[str, tuple[type[nn.Module], ...]] = {
    "linear": (nn.Linear,),
    "conv": CONVOLUTIONS,
    "conv_transpose": TRANSPOSED_CONVOLUTIONS,
    "norm": NORMS,
    "embedding": (nn.Embedding,),
}


def layer_type_of(module: nn.Module) -> str | None:
    """The ``layer_types`` family of ``module`` (None: not one K-FAC handles); a sharded fully-connected layer
    (:class:`~lightning_hpc.protocols.ShardedFullyConnected`) is a ``"linear"``."""
    if isinstance(module, ShardedFullyConnected):
        return "linear"
    return next((name for name, types in LAYER_TYPES.items() if isinstance(module, types)), None)


def make_handlers(name: str, module: nn.Module) -> list[LayerHandler]:
    """The handlers of a supported module (one per group of a grouped convolution), else none.

    A Conv2d offering the tiled-input protocol (``kfac_padded_input``, see :class:`TiledConvHandler`) gets the
    tiled handler: its input is one tile of a spatially partitioned sample."""
    if isinstance(module, ShardedFullyConnected):
        return [ShardedLinearHandler(name, module)]
    if isinstance(module, nn.Linear):
        return [LinearHandler(name, module)]
    if isinstance(module, CONVOLUTIONS):
        tiled = isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and hasattr(module, "kfac_padded_input")
        if module.groups > 1:  # tiled grouped convolutions are left out (discovery.skip_reason says why)
            return [] if tiled else [GroupConvHandler(name, module, i) for i in range(module.groups)]
        if tiled:
            return [TiledConvHandler(name, module)]
        return [ConvHandler(name, module)]
    if isinstance(module, TRANSPOSED_CONVOLUTIONS):
        if module.groups > 1:
            return [GroupConvTransposeHandler(name, module, i) for i in range(module.groups)]
        return [ConvTransposeHandler(name, module)]
    if type(module) in NORMS and isinstance(getattr(module, "weight", None), torch.Tensor):
        return [NormAffineHandler(name, module)]
    if isinstance(module, nn.Embedding):
        return [EmbeddingHandler(name, module)]
    return []


def _batch_first(module: nn.Module) -> bool | None:
    """``module.batch_first`` when it declares one (directly or through a ``MultiheadAttention`` child, as
    ``TransformerEncoderLayer`` does), else None."""
    value = getattr(module, "batch_first", None)
    if isinstance(value, bool):
        return value
    for child in module.children():
        if isinstance(child, nn.MultiheadAttention):
            return bool(child.batch_first)
    return None


def linear_batch_dim(name: str, modules: dict[str, nn.Module]) -> int:
    """Sample dimension of the inputs of the Linear called ``name`` (for inputs of 3 or more dimensions): 1 when
    the nearest enclosing module that declares ``batch_first`` declares it False (sequence-first ``(T, N, d)``
    inputs, torch's default for its Transformer layers), else 0."""
    parts = name.split(".") if name else []
    for depth in range(len(parts) - 1, -1, -1):
        parent = modules.get(".".join(parts[:depth]))
        if parent is None:
            continue
        bf = _batch_first(parent)
        if bf is not None:
            return 0 if bf else 1
    return 0
