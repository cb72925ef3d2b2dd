"""The handler every K-FAC layer family builds on (:class:`LayerHandler`): what a layer type computes (how the
layer's input and output gradient become the rows or Grams of A and G, the forms of its factors where its curvature
is not two dense Kronecker factors, :meth:`LayerHandler.factor_forms` and :mod:`~lightning_hpc.kfac.forms`, its
gradient matrix and preconditioning). A layer's per-layer state is in two objects its handler owns: the statistics
captured since the last step (:class:`~.statistics.CapturedStatistics`, :attr:`LayerHandler.stats`) and its running
factors, their decompositions and their wire format (:class:`~.state.FactorState`, :attr:`LayerHandler.state`).

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

from typing import Any, cast

import torch
from torch import nn

from lightning_hpc._compat import backward_reaches
from lightning_hpc.kfac.forms import DenseForm, FactorForm, LayerForms
from lightning_hpc.kfac.layers.state import FactorState
from lightning_hpc.kfac.layers.statistics import CapturedStatistics
from lightning_hpc.kfac.linalg import unit_scaled
from lightning_hpc.kfac.methods import ComputeMethod
from lightning_hpc.kfac.subclasses import trainable_bias

__all__ = ["LayerHandler", "stat_dtype"]


def stat_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype factor statistics are formed in: float32, or the tensor's own when it is wider (a float64 model
    gets float64 factors, so its K-FAC steps do not depend on how the batch is split over ranks)."""
    return torch.promote_types(t.dtype, torch.float32)


def _view(owner: str, name: str, doc: str) -> Any:
    """A handler attribute that reads and writes attribute ``name`` of its per-layer state object ``owner``
    (:attr:`LayerHandler.stats`)."""
    return property(lambda self: getattr(getattr(self, owner), name),
                    lambda self, v: setattr(getattr(self, owner), name, v), doc=doc)


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
    #: the layer is a subclass with its own forward: its statistics are those of the functional calls on its weight
    #: (:class:`~lightning_hpc.kfac.subclasses.CallTracer`), not of the module's input and output
    traced: bool = False
    #: the leading input dimensions are a sample dimension and positions (Linear-like layers): discovery sets
    #: ``batch_dim`` (:func:`~lightning_hpc.kfac.layers.linear_batch_dim`) on such a handler
    sequence_input: bool = False
    #: why the layer was left to the optimizer after setup (a traced layer whose forward uses its weight otherwise);
    #: None while it is preconditioned
    left_out: str | None = None

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
        #: the bias is folded into A (and preconditioned with the weight) only when it is a parameter that trains: a
        #: frozen bias is neither part of the factors nor given a ``.grad``, and one computed by a parametrization
        #: has its gradient on other parameters
        self.has_bias = trainable_bias(module) is not None
        #: the statistics captured since the last optimizer step (:class:`~.statistics.CapturedStatistics`)
        self.stats = CapturedStatistics()
        self.reset_statistics()
        self._state: FactorState | None = None

    # -- the layer's factors and decompositions ------------------------------------------------------------
    @property
    def state(self) -> FactorState:
        """The layer's running factors, decompositions and their wire format (:class:`~.state.FactorState`), made
        on first use from :meth:`factor_forms` (after any subclass has finished setting up its sizes)."""
        if self._state is None:
            self._state = FactorState(self.name, self.factor_forms(), self.output_gradient_factors,
                                      self.partition_size)
        return self._state

    @property
    def factors(self) -> dict[str, torch.Tensor]:
        """The running factors by name (Eq 16-17; :meth:`factor_forms` says their forms); empty before the first
        factor update (:attr:`FactorState.factors`)."""
        return self.state.factors

    @property
    def decompositions(self) -> dict[str, torch.Tensor]:
        """The decompositions of the factors, ``f"{key}_{factor}"``; empty until the first decomposition, and on
        ranks outside the layer's gradient-worker group (:attr:`FactorState.decompositions`)."""
        return self.state.decompositions

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
        self.stats.forget_pending()

    def discard_committed(self) -> None:
        """Forget the statistics of completed backward passes (calls still waiting for theirs are kept)."""
        self.stats.discard_committed()

    # views of the captured statistics (:class:`~.statistics.CapturedStatistics`) under the handler's names
    a_sum = _view("stats", "a_sum", "Sum of the captured calls' input Grams (A's).")
    g_sum = _view("stats", "g_sum", "Sum of the captured output-gradient statistics (G's).")
    samples = _view("stats", "samples", "Samples captured, counted once per forward pass.")
    g_dtype = _view("stats", "g_dtype", "dtype of the captured output gradients.")
    max_calls_per_forward = _view("stats", "max_calls_per_forward",
                                  "Most calls of the layer in one forward pass.")

    def sample_count(self, x: torch.Tensor) -> int:
        """Samples in the captured input ``x`` (its batch dimension; 1 for an unbatched input)."""
        return x.shape[0] if x.dim() > 1 else 1

    def is_stale(self) -> bool:
        """True when statistics from a completed backward pass are held but the weight's gradient was cleared
        since (``zero_grad`` without :meth:`KFACPreconditioner.step`, e.g. a step skipped by the user or a
        grad scaler): they belong to a step that never happened. Gradient accumulation keeps ``.grad``."""
        return self.stats.commits > 0 and self.gradient_cleared()

    def stale_before(self, token: int) -> bool:
        """True when the call ``token``'s output gradient arrives after the weight's gradient was cleared, while
        statistics of an earlier backward pass are held: ``zero_grad`` between this pass's forward and its backward
        (the usual order of a GAN's second step, whose forward passes come before its ``zero_grad``; the first
        step's pass through this network left statistics and gradients that ``zero_grad`` cleared). The calls of
        one forward pass share the gradient, which the layer's weight receives after all of them."""
        pending = self.stats.pending.get(token)
        if pending is None or not any(f != pending[3] for f in self.stats.forward_counted):
            return False
        return self.gradient_cleared()

    def drop_call(self, token: int) -> None:
        """Forget the pending call ``token`` without committing it (see :meth:`backward_gives_gradient`)."""
        self.stats.take_call(token)

    def backward_gives_gradient(self) -> bool:
        """Inside the backward pass that reaches one of the layer's outputs: whether it gives the weight a gradient.
        Not a ``torch.autograd.grad`` pass that leaves the weight out (a gradient penalty differentiating the
        critic's output with respect to its input): its output gradient is that of the differentiated output, not of
        the loss, and the call it reaches is left out of the statistics. A frozen weight is not asked."""
        w = self.weight
        return not w.requires_grad or backward_reaches(w)

    def gradient_cleared(self) -> bool:
        """The weight has no gradient, or an all-zero one (``zero_grad(set_to_none=False)``)."""
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
        """``[[sum a a^T, sum a], [sum a^T, rows]]``: the bias's constant-1 input appended analytically (to every
        block of a stack of them, ``(..., k, k)`` grams with ``(..., k)`` sums)."""
        if not self.has_bias:
            return gram
        assert colsum is not None
        k = gram.shape[-1]
        out = gram.new_empty(*gram.shape[:-2], k + 1, k + 1)
        out[..., :k, :k] = gram
        out[..., :k, k] = colsum
        out[..., k, :k] = colsum
        out[..., k, k].fill_(rows)  # a fill, not a copy from a host tensor (which waits for the GPU)
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
        return self.stats.open_call(contrib, rows, self.sample_count(x))

    @torch.no_grad()
    def capture_output_grad(self, g: torch.Tensor, token: int | None = None) -> bool:
        """Add the output-gradient statistics of the call ``token`` and commit its input statistics; False when
        they had been discarded since its forward pass (nothing committed)."""
        pending = self.stats.take_call(token)
        if pending is None:  # statistics discarded since the forward pass
            return False
        a, rows, n, forward_id = pending
        with torch.autocast(g.device.type, enabled=False):
            self.accumulate(a, rows, g)
        self.stats.commit(n, forward_id, g)
        return True

    def accumulate(self, input_stat: torch.Tensor, rows: int, g: torch.Tensor) -> None:
        """Add one call's statistics to the sums: its input statistic (:meth:`input_gram`, computed in the forward
        pass) and ``rows``, and the Gram of its output gradient ``g``."""
        self.stats.add_output(self.output_statistic(g))
        self.stats.add_input(input_stat, rows)

    def output_statistic(self, g: torch.Tensor) -> torch.Tensor:
        """:meth:`output_gram` of ``g``, formed from ``g`` scaled into the normal range where its products would be
        subnormal on a CPU (:func:`~lightning_hpc.kfac.linalg.unit_scaled`: exact, and without the subnormals'
        slow arithmetic)."""
        g, unscale = unit_scaled(g)
        gram = self.output_gram(g)
        return gram if unscale == 1.0 else gram * unscale

    @property
    def has_statistics(self) -> bool:
        return self.stats.a_sum is not None and self.stats.g_sum is not None

    def batch_factors(self, grad_scale: float = 1.0, batch_averaged: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, G) of the captured micro-batches following the module docstring's convention.

        ``grad_scale`` is the loss scale the output gradients were multiplied by (AMP); G is unscaled by it.
        """
        if not self.has_statistics:
            raise RuntimeError(f"K-FAC layer {self.name!r}: no statistics captured in this step")
        s = self.stats
        assert s.a_sum is not None and s.g_sum is not None
        b = max(s.samples, 1)
        a = s.a_sum / s.a_rows
        g = s.g_sum * (b if batch_averaged else 1.0 / b)
        if grad_scale != 1.0:
            g = g / (grad_scale * grad_scale)
        return a, g

    # -- factor forms ------------------------------------------------------------------------------------
    #: what the setup report says about the layer's factors when they are not KFC's dense A and G
    form_note: str = ""
    #: the factors built from output gradients: an AMP loss scale enters them squared (see
    #: :meth:`.state.FactorState.unscale`)
    output_gradient_factors: tuple[str, ...] = ("G",)

    def factor_forms(self) -> dict[str, FactorForm]:
        """The layer's factors by name and form (:mod:`.forms`): KFC's dense A and G."""
        return {"A": DenseForm(self.a_dim), "G": DenseForm(self.g_dim)}

    def layer_forms(self) -> LayerForms:
        """The factors and the gradient matrix's shape, as the placement and ``plan-kfac`` price them."""
        return LayerForms(self.factor_forms(), self.grad_shape)

    def batch_statistics(self, grad_scale: float = 1.0, batch_averaged: bool = True) -> dict[str, torch.Tensor]:
        """This step's factors by name (:meth:`factor_forms`), from the captured micro-batches."""
        return dict(zip(("A", "G"), self.batch_factors(grad_scale, batch_averaged)))

    def precondition(self, grad: torch.Tensor, decompositions: dict[str, torch.Tensor], method: ComputeMethod,
                     damping: float) -> torch.Tensor:
        """The preconditioned ``(g_dim, a_dim)`` gradient matrix from the layer's decompositions (keys
        ``f"{name}_{factor}"``): ``(A (x) G + damping I)^-1 vec(grad)`` by the compute method (Eq 13-15 / 11-12)."""
        return method.precondition(grad, decompositions, damping)

    def precondition_flops(self, method: ComputeMethod) -> int:
        """Floating-point operations of the matrix products of :meth:`precondition` under ``method`` (a
        multiply-add counts 2; the element-wise part left out): the products of Eq 13-15 or Eq 12 on each of the
        layer's :attr:`groups` blocks. Handlers with their own preconditioning count theirs."""
        return self.groups * method.kronecker_flops(self.g_dim, self.a_dim)

    #: the gradient matrix is ``(rows, k)`` rows of independent blocks (a normalisation layer's channels) that
    #: :meth:`precondition` treats row by row from its arguments alone: layers of one handler type and equal
    #: ``k`` are then preconditioned as one concatenation of their rows (:mod:`lightning_hpc.kfac.batched`)
    row_blocks: bool = False

    def preconditioned(self, grad: torch.Tensor, method: ComputeMethod, damping: float,
                       dtype: torch.dtype) -> torch.Tensor:
        """:meth:`precondition` with the stored decompositions, computed in ``dtype`` (the decomposition dtype:
        decompositions stored narrower are widened to it first)."""
        return self.precondition(grad, self.state.decompositions_in(dtype), method, damping)

    # -- gradients ---------------------------------------------------------------------------------------
    #: independent blocks of the layer's gradient matrix (a grouped convolution's groups): :meth:`grad_matrix` is
    #: then a stack ``(groups, g_dim, a_dim)`` of them
    groups: int = 1

    @property
    def grad_shape(self) -> tuple[int, ...]:
        """Shape of :meth:`grad_matrix`: ``(g_dim, a_dim)``, or ``(groups, g_dim, a_dim)`` for several groups."""
        return (self.groups, self.g_dim, self.a_dim) if self.groups > 1 else (self.g_dim, self.a_dim)

    def grad_matrix(self) -> torch.Tensor | None:
        """``[dW | db]`` as a ``(g_dim, a_dim)`` matrix (a stack ``(groups, g_dim, a_dim)`` for a layer of several
        :attr:`groups`), or None when the weight has no gradient."""
        w = self.weight
        if w.grad is None:
            return None
        mat = w.grad.reshape(*self.grad_shape[:-1], -1)
        if self.has_bias:
            b = self.bias
            bgrad = b.grad if b.grad is not None else torch.zeros_like(b)
            mat = torch.cat([mat, bgrad.reshape(*self.grad_shape[:-1], 1)], dim=-1)
        return mat

    def grad_params(self) -> list[torch.Tensor]:
        """The parameters whose gradients make up :meth:`grad_matrix`, in :meth:`grad_views`' order."""
        return [self.weight, self.bias] if self.has_bias else [self.weight]

    def grad_views(self, mat: torch.Tensor) -> list[torch.Tensor] | None:
        """Views of ``mat``, a matrix laid out as :meth:`grad_matrix`'s, shaped like the gradients of
        :meth:`grad_params`: the batched route (:mod:`lightning_hpc.kfac.batched`) fills its buffers from ``.grad``
        and writes the results back through them, in one multi-tensor copy each for all layers. None where the
        layout is no such view (a handler with its own :meth:`grad_matrix` that does not say otherwise): its
        :meth:`grad_matrix` and :meth:`set_grad_matrix` are used."""
        if type(self).grad_matrix is not LayerHandler.grad_matrix:
            return None
        n_w = mat.shape[-1] - int(self.has_bias)
        views = [mat[..., :n_w].view(self.weight.shape)]
        if self.has_bias:
            views.append(mat[..., n_w].view(self.bias.shape))
        return views

    @torch.no_grad()
    def set_grad_matrix(self, mat: torch.Tensor) -> None:
        """Write :meth:`grad_matrix`'s layout back into ``.grad`` in place (dtype of the gradient kept)."""
        w = self.weight
        assert w.grad is not None
        n_w = mat.shape[-1] - (1 if self.has_bias else 0)
        w.grad.copy_(mat[..., :n_w].reshape_as(w.grad))
        if self.has_bias:
            b = self.bias
            if b.grad is None:
                b.grad = torch.zeros_like(b)
            b.grad.copy_(mat[..., n_w].reshape_as(b.grad))
