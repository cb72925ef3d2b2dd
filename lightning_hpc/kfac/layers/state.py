"""One layer's K-FAC state (:class:`FactorState`): its running factors (Eq 16-17), their decompositions (Eq 13 /
Eq 11) and their wire format (the packed vector of the factor all-reduce, the shapes a broadcast or a checkpoint
carries), all as the factors' forms (:mod:`~lightning_hpc.kfac.forms`) say. What the layer type computes (its
rows, Grams, factor forms, gradient matrix, preconditioning) is its handler's (:class:`~.base.LayerHandler`); the
handler owns one of these (:attr:`~.base.LayerHandler.state`).
"""

from __future__ import annotations

import torch

from lightning_hpc.kfac.forms import FactorForm
from lightning_hpc.kfac.methods import ComputeMethod

__all__ = ["FactorState", "generation"]

#: how many times any layer's factors or decompositions were replaced (:func:`generation`)
_generation = 0


def generation() -> int:
    """A number that changes whenever any layer's running factors or decompositions are replaced or cleared (by
    :class:`FactorState`'s setters and methods; not by writing into their dicts from outside): what the
    preconditioning plan of :mod:`lightning_hpc.kfac.batched` compares, once per step, instead of every layer's
    decomposition tensors."""
    return _generation


def _changed() -> None:
    global _generation
    _generation += 1


class FactorState:
    """The running factors and decompositions of the layer ``name``, whose factors have ``forms``.

    ``output_gradient_factors`` are the factors built from output gradients (an AMP loss scale enters them
    squared, :meth:`unscale`); ``partition_size`` > 1 marks partial factors of a spatially tiled layer, summed over
    that many ranks (:meth:`pack`).
    """

    def __init__(self, name: str, forms: dict[str, FactorForm], output_gradient_factors: tuple[str, ...],
                 partition_size: int = 1) -> None:
        self.name = name
        self.forms = forms
        self.output_gradient_factors = output_gradient_factors
        self.partition_size = partition_size
        self._factors: dict[str, torch.Tensor] = {}
        self._decompositions: dict[str, torch.Tensor] = {}

    @property
    def factors(self) -> dict[str, torch.Tensor]:
        """The running factors by name (Eq 16-17); empty before the first factor update (updated in place after)."""
        return self._factors

    @factors.setter
    def factors(self, value: dict[str, torch.Tensor]) -> None:
        self._factors = value
        _changed()

    @property
    def decompositions(self) -> dict[str, torch.Tensor]:
        """The decompositions of the factors, ``f"{key}_{factor}"`` (:meth:`.forms.FactorForm.result_shapes`); empty
        until the first decomposition, and on ranks outside the layer's gradient-worker group."""
        return self._decompositions

    @decompositions.setter
    def decompositions(self, value: dict[str, torch.Tensor]) -> None:
        self._decompositions = value
        _changed()

    # -- wire format ---------------------------------------------------------------------------------------
    def packed_numel(self, symmetric: bool) -> int:
        """Elements of the layer's factors in the all-reduce (:meth:`pack`)."""
        return sum(form.packed_numel(symmetric) for form in self.forms.values())

    def pack(self, factors: dict[str, torch.Tensor], symmetric: bool) -> torch.Tensor:
        """This step's factors as the one vector the all-reduce averages, each packed by its form (``symmetric``:
        upper triangles). A spatially tiled layer's partial factors are scaled by :attr:`partition_size`: a sample
        group's factor is the sum over its ranks (:class:`~.tiled.TiledConvHandler`), so the world mean becomes the
        mean over sample groups of those sums."""
        scale = self.partition_size
        return torch.cat([form.pack(factors[k] * scale if scale > 1 else factors[k], symmetric)
                          for k, form in self.forms.items()])  # fmt: skip

    def unpack(self, flat: torch.Tensor, symmetric: bool) -> dict[str, torch.Tensor]:
        """The factors from :meth:`pack`'s (averaged) vector."""
        out, offset = {}, 0
        for k, form in self.forms.items():
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

    def result_shapes(self, kind: str, method: ComputeMethod) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the decomposition of factor ``kind`` (what a broadcast or checkpoint carries)."""
        return self.forms[kind].result_shapes(method)

    # -- running factors and decompositions -----------------------------------------------------------------
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

    def decompose(self, kind: str, method: ComputeMethod, damping: float, dtype: torch.dtype,
                  storage: torch.dtype) -> dict[str, torch.Tensor]:
        """The decomposition of the running factor ``kind`` computed in ``dtype``, stored in ``storage``. When every
        fallback fails (:mod:`~lightning_hpc.kfac.linalg`), the previous decomposition, or before any an identity
        factor's (the step is then a damped SGD step): what the layer's other workers receive, so every rank stays
        identical."""
        form = self.forms[kind]
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
            self._decompositions[f"{k}_{kind}"] = v
        _changed()

    def decomposition_of(self, kind: str, method: ComputeMethod) -> dict[str, torch.Tensor]:
        """Factor ``kind``'s part of :attr:`decompositions`, by its own names (for a broadcast)."""
        return {k: self.decompositions[f"{k}_{kind}"] for k in self.result_shapes(kind, method)}

    def decompositions_in(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The decompositions in ``dtype`` (the decomposition dtype: those stored narrower are widened to it)."""
        d = self.decompositions
        if any(v.dtype != dtype for v in d.values()):
            d = {k: v.to(dtype) for k, v in d.items()}
        return d

    def load(self, factors: dict[str, torch.Tensor], decompositions: dict[str, torch.Tensor], device: torch.device,
             factor_dtype: torch.dtype, inverse_dtype: torch.dtype) -> None:
        """Take a checkpoint's running factors and decompositions (empty dicts: none), on ``device`` in the storage
        dtypes."""
        self.factors = {k: v.to(device, factor_dtype) for k, v in factors.items()}
        self.decompositions = {k: v.to(device, inverse_dtype) for k, v in decompositions.items()}

    def clear(self) -> None:
        """Forget the factors and decompositions (a layer left to the optimizer)."""
        self.factors, self.decompositions = {}, {}
