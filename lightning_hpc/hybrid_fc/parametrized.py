"""Head layers whose weight is a parametrization: which ones the hybrid head splits exactly, and the refusal of
the others.

Weight normalization (Salimans & Kingma, 2016, eq. 2: ``w = g v / ||v||``), as
``torch.nn.utils.parametrizations.weight_norm(nn.Linear(...))`` with its default ``dim=0``, normalises each row
of ``W`` (one output neuron's incoming weights): ``W[o] = g[o] v[o] / ||v[o]||``.  A ``col`` shard (layout.py)
holds whole rows, so with ``g[o_r]`` and ``v[o_r]`` it computes its rows of ``W`` exactly, with no collective
and no new autograd function.  A ``row`` shard holds a block of every row's columns, so each row norm would be a
sum over the ranks: an all-reduce in the forward and its adjoint in the backward, and ``g`` replicated with its
gradient summed over the ranks.  Both are exact; ``col`` is the simpler, so such a layer is always planned
``col`` (:func:`col_only`; the planner keeps the cheapest layout of the others, ``layout.plan_layout``).

Refused before anything is split (:func:`refuse_unsplittable`), naming the layer, the reason and a fix:
``spectral_norm`` (its power iteration runs over the whole matrix), weight normalization along another
dimension (a norm over columns spans the ranks of a ``col`` layout), any other parametrization (what it computes
from a block of the weight is unknown), and the deprecated hook-based ``torch.nn.utils.weight_norm`` /
``spectral_norm`` (their hooks recompute ``weight`` before every call of the layer, which the shard replaces).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from lightning_hpc._compat import weight_norm_parametrization_type

__all__ = ["weight_norm_dim", "col_only", "refuse_unsplittable", "parametrizations", "G", "V"]

#: the parametrization's originals under the parametrized module (``g``: out x 1, ``v``: out x in)
G, V = "parametrizations.weight.original0", "parametrizations.weight.original1"


def parametrizations(module: nn.Module) -> dict[str, parametrize.ParametrizationList]:
    """``module.parametrizations`` (parameter name -> its chain), typed (``nn.Module.__getattr__`` is not)."""
    return cast("dict[str, parametrize.ParametrizationList]", module.parametrizations)


def weight_norm_dim(linear: nn.Module) -> int | None:
    """0 when ``linear``'s weight is ``torch.nn.utils.parametrizations.weight_norm`` over its rows (the only
    parametrization the head splits), else ``None``."""
    if not parametrize.is_parametrized(linear, "weight"):
        return None
    chain = parametrizations(linear)["weight"]
    if len(chain) == 1 and isinstance(chain[0], weight_norm_parametrization_type()) and chain[0].dim in (0, -2):
        return 0
    return None


def col_only(linears: Sequence[nn.Module]) -> dict[int, str]:
    """The layers that must be ``col`` (index -> layout): the weight-normalised ones (see the module docstring)."""
    return {i: "col" for i, lin in enumerate(linears) if weight_norm_dim(lin) is not None}


def _reason(linear: nn.Module) -> str | None:
    """Why ``linear`` cannot be split exactly (``None``: it can)."""
    hooks = [h for h in linear._forward_pre_hooks.values() if isinstance(h, (WeightNorm, SpectralNorm))]
    if hooks:
        kind = "weight_norm" if isinstance(hooks[0], WeightNorm) else "spectral_norm"
        fix = " (torch.nn.utils.parametrizations.weight_norm is split exactly)" if kind == "weight_norm" else ""
        return (f"it carries the deprecated hook-based torch.nn.utils.{kind}, whose hook recomputes the weight "
                f"before every call of the layer the split replaces{fix}")
    if not parametrize.is_parametrized(linear):
        return None
    for name, chain in parametrizations(linear).items():
        kinds = ", ".join(type(p).__name__ for p in chain)
        if name != "weight":
            return f"its {name!r} is parametrized ({kinds}): only a weight-normalised weight is split"
        if weight_norm_dim(linear) is not None:
            continue
        if any(type(p).__name__ == "_SpectralNorm" for p in chain):
            return ("its weight is spectral_norm'ed: the power iteration and the spectral norm run over the "
                    "whole matrix, which no rank holds")
        if len(chain) == 1 and isinstance(chain[0], weight_norm_parametrization_type()):
            return (f"its weight_norm normalises along dim={chain[0].dim}: only dim=0 (the default, one norm per "
                    "output neuron, whole on the rank that owns the neuron) is split exactly")
        return (f"its weight is parametrized ({kinds}): what a parametrization computes from one rank's block "
                "of the weight is not known to be that block of the whole result")
    return None


def refuse_unsplittable(modules: Sequence[tuple[str, nn.Module]], prefix: str) -> None:
    """Raise before anything is split for a head linear layer whose weight cannot be split exactly (see the module
    docstring).  ``modules``: the head's (name, module), ``prefix``: their parent's dotted path.  The fix keeps
    the layer whole on every rank: in a data-parallel trunk (``head=`` naming the head's last linear layer, when
    the refused layer is not it) or under plain DDP."""
    linears = [(n, m) for n, m in modules if isinstance(m, nn.Linear)]
    for i, (name, linear) in enumerate(linears):
        reason = _reason(linear)
        if reason is None:
            continue
        where = f"{prefix}.{name}" if prefix else name
        last_name = linears[-1][0]
        last = f"{prefix}.{last_name}" if prefix else last_name
        fix = (f"name a head without it, HybridParallelStrategy(head={last!r}) (it then trains whole in the "
               "data-parallel trunk), or " if i < len(linears) - 1 and modules[-1][0] == last_name
               and _reason(linears[-1][1]) is None else "")
        raise ValueError(
            f"strategy='hybrid_fc' cannot split the fully-connected head's layer {where!r}: {reason}. To train it "
            f"exactly, {fix}train with strategy='ddp'"
        )
