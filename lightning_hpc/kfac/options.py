"""``KFACOptions``: every K-FAC setting, defined and validated once.

Used by :class:`~lightning_hpc.kfac.preconditioner.KFACPreconditioner` (its keyword arguments build one), by
the Lightning callback (:class:`~lightning_hpc.kfac.callback.KFAC`, validated at construction, before training)
and by the Hydra config ``conf/callbacks/kfac.yaml``, whose keys are these fields (a test keeps them in step).
Runtime objects (optimizer, learning rate, communicator, grad scaler) are not options: they are passed to the
preconditioner directly.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch

from lightning_hpc.kfac.layers import LAYER_TYPES
from lightning_hpc.kfac.methods import COMPUTE_METHODS
from lightning_hpc.kfac.placement import check_grad_worker_fraction, check_placement
from lightning_hpc.kfac.schedules import KFACSchedule

__all__ = ["KFACOptions", "compile_skip_patterns", "with_option_keywords"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}
#: storage dtypes accepted by ``factor_dtype`` / ``inverse_dtype``
_STORAGE_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def _storage_dtype(name: str, value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None:
        return None
    dtype = _STORAGE_DTYPES.get(value) if isinstance(value, str) else value
    if dtype not in _STORAGE_DTYPES.values():
        raise ValueError(
            f"K-FAC {name} must be None or one of {tuple(_STORAGE_DTYPES)} (or the torch dtypes), got {value!r}"
        )
    return dtype


def compile_skip_patterns(skip_layers: str | Sequence[str] | None) -> list[re.Pattern[str]]:
    """``skip_layers`` as compiled regular expressions (``ValueError`` naming a bad one)."""
    if skip_layers is None:
        return []
    if isinstance(skip_layers, str):
        skip_layers = [skip_layers]
    out = []
    for p in skip_layers:
        try:
            out.append(re.compile(p))
        except re.error as e:
            raise ValueError(f"K-FAC skip_layers: invalid regular expression {p!r}: {e}") from e
    return out


@dataclass(frozen=True)
class KFACOptions:
    """K-FAC hyper-parameters (SC20 notation; see docs/kfac.md, "Options").

    Attributes:
        factor_update_freq: steps between factor updates (Eq 16-17); None = ``max(1, inv_update_freq // 10)``
            ("factors updated 10x as often", section V-C).
        inv_update_freq: steps between decompositions (the paper's kfac-update-freq).
        factor_decay: running-average weight of the old factor (xi of Eq 16-17), in [0, 1).
        damping: Tikhonov damping gamma (Eq 11, 14), >= 0.
        damping_decay_epochs / damping_decay_rate: multiply damping by the rate at each listed epoch.
        update_freq_decay_epochs / update_freq_decay_rate: multiply both update intervals at each listed epoch.
        kl_clip: kappa of Eq 18; None or 0 disables the scaling.
        compute_method: ``"eigen"`` (Eq 13-15) or ``"inverse"`` (Eq 11-12), see :mod:`.methods`.
        placement: ``"balanced"``, ``"round_robin"`` or ``"layer_wise"``, see :mod:`.placement`.
        grad_worker_fraction: KAISA's gradient-worker fraction (SC21, HYBRID-OPT): the fraction of
            ranks that hold each layer's decompositions and compute its preconditioned gradient, in (0, 1];
            ``world_size * fraction`` must be an integer dividing the world size (checked when the world is
            known). ``1 / world`` = MEM-OPT, ``1`` = COMM-OPT; None = the placement's default (``layer_wise``:
            ``1 / world``, the others: 1). See :class:`~.placement.GradWorkerGrid`.
        skip_layers: regex (or list of them) searched in module names and class names; matches are skipped.
        layer_types: the layer families to precondition, names of :data:`~.layers.LAYER_TYPES`: ``"linear"``,
            ``"conv"`` (Conv1d/2d/3d, grouped and depthwise), ``"conv_transpose"``, ``"norm"`` (affine parameters of
            BatchNorm / GroupNorm / LayerNorm / RMSNorm / InstanceNorm), ``"embedding"``; None = all of them.
        decomposition_dtype: ``"float32"`` / ``"float64"`` (or the torch dtypes): the dtype decompositions and
            preconditioning are computed in.
        factor_dtype: storage dtype of the running factors (the storage option kfac-pytorch 0.4 also offers):
            None = float32 (the default, unchanged); ``"bfloat16"`` / ``"float16"`` halve their memory (the
            statistics are still computed and all-reduced in float32, the running average is updated in float32
            and rounded once per factor update); ``"float64"`` computes and stores the statistics in float64.
        inverse_dtype: storage dtype of the decompositions (and of their broadcasts): None = the
            ``decomposition_dtype`` (unchanged); ``"bfloat16"`` / ``"float16"`` halve their memory and broadcast
            bytes. Decompositions are still computed in ``decomposition_dtype`` and preconditioning upcasts them to
            it; must not be wider than ``decomposition_dtype``.
        batch_averaged: the loss is a mean over the step's samples (see :mod:`.layers`).
        bucket_cap_mb: size of the fused factor-allreduce buffers.
        conv_input_sample_fraction: fraction of each batch's samples whose patches form a Conv2d's A, in (0, 1].
        Callables: ``damping``, ``factor_decay``, ``kl_clip``, ``factor_update_freq`` and ``inv_update_freq`` may
            be callables of the optimizer step (the preconditioner's step counter) returning the value for that
            step, checked when called (see :mod:`.schedules`).
        subsample_seed: seed of the sample-subset generator (only used when the fraction is below 1).
        symmetric_allreduce: all-reduce only the upper triangles of the (symmetric) factors, about half the
            bytes of the full matrices, with the same result (see :func:`.collectives.allreduce_mean_symmetric`).
        overlap_factor_allreduce: launch the factor all-reduce from the backward hooks of the step's last
            micro-batch, bucket by bucket as the layers' statistics become final, so it overlaps the rest of the
            backward pass (KAISA, SC21, arXiv:2107.01739); the step waits for it. False: all-reduced at the step.
            Same factors and parameters either way (see :mod:`.overlap`; with gradient accumulation mark the
            earlier micro-batches with :meth:`KFACPreconditioner.no_sync`, which the Lightning callback does).
        spread_decompositions: decompose each factor once per ``inv_update_freq`` steps at a step of its own
            (its phase, the factors' ``n^3`` costs balanced over the interval, :func:`.schedules.spread_phases`),
            from the running factor at that step, instead of all of them at the multiples of ``inv_update_freq``:
            no step stalls on all decompositions. A different schedule (later phases see newer factors), so
            False by default; the first decomposition of every factor is still at the first step.
    """

    factor_update_freq: int | Callable[[int], int] | None = None
    inv_update_freq: int | Callable[[int], int] = 100
    factor_decay: float | Callable[[int], float] = 0.95
    damping: float | Callable[[int], float] = 0.001
    damping_decay_epochs: Sequence[int] = field(default_factory=tuple)
    damping_decay_rate: float = 1.0
    update_freq_decay_epochs: Sequence[int] = field(default_factory=tuple)
    update_freq_decay_rate: float = 1.0
    kl_clip: float | Callable[[int], float] | None = 0.001
    compute_method: str = "eigen"
    placement: str = "balanced"
    grad_worker_fraction: float | None = None
    skip_layers: str | Sequence[str] | None = None
    layer_types: Sequence[str] | None = None
    decomposition_dtype: torch.dtype | str = "float32"
    factor_dtype: torch.dtype | str | None = None
    inverse_dtype: torch.dtype | str | None = None
    batch_averaged: bool = True
    bucket_cap_mb: float = 25.0
    conv_input_sample_fraction: float = 1.0
    subsample_seed: int = 0
    symmetric_allreduce: bool = True
    overlap_factor_allreduce: bool = False
    spread_decompositions: bool = False

    def __post_init__(self) -> None:
        # normalise containers (Hydra hands ListConfig) so the options compare and pickle plainly
        object.__setattr__(self, "damping_decay_epochs", tuple(int(e) for e in self.damping_decay_epochs))
        object.__setattr__(self, "update_freq_decay_epochs", tuple(int(e) for e in self.update_freq_decay_epochs))
        if self.skip_layers is not None and not isinstance(self.skip_layers, str):
            object.__setattr__(self, "skip_layers", tuple(self.skip_layers))
        if self.layer_types is not None:
            types = (self.layer_types,) if isinstance(self.layer_types, str) else tuple(self.layer_types)
            unknown = [t for t in types if t not in LAYER_TYPES]
            if unknown or not types:
                raise ValueError(f"K-FAC layer_types must name some of {tuple(LAYER_TYPES)}, got {self.layer_types!r}")
            object.__setattr__(self, "layer_types", types)
        self.schedule  # noqa: B018 - validates the schedule values
        if not callable(self.factor_decay) and not 0.0 <= self.factor_decay < 1.0:
            raise ValueError(f"K-FAC factor_decay must be in [0, 1), got {self.factor_decay}")
        if self.kl_clip is not None and not callable(self.kl_clip) and not self.kl_clip >= 0:
            raise ValueError(f"K-FAC kl_clip must be >= 0 or None (disabled), got {self.kl_clip}")
        if self.compute_method not in COMPUTE_METHODS:
            raise ValueError(
                f"K-FAC compute_method must be one of {tuple(COMPUTE_METHODS)}, got {self.compute_method!r}"
            )
        check_placement(self.placement)
        check_grad_worker_fraction(self.grad_worker_fraction)
        self.torch_decomposition_dtype  # noqa: B018 - validates the dtype
        self.torch_factor_dtype  # noqa: B018 - validates the dtype
        self.torch_inverse_dtype  # noqa: B018 - validates the dtype
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"K-FAC bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        f = self.conv_input_sample_fraction
        if isinstance(f, bool) or not 0.0 < f <= 1.0:
            raise ValueError(
                f"K-FAC conv_input_sample_fraction must be in (0, 1] (1 = every sample, the default), got {f!r}"
            )
        compile_skip_patterns(self.skip_layers)

    @property
    def schedule(self) -> KFACSchedule:
        """The epoch schedule of damping and update intervals (validated)."""
        factor_update_freq = self.factor_update_freq
        if factor_update_freq is None and callable(self.inv_update_freq):
            inv_freq = self.inv_update_freq
            factor_update_freq = lambda step: max(1, inv_freq(step) // 10)  # noqa: E731  (a value, not a def)
        elif factor_update_freq is None:
            inv = self.inv_update_freq
            valid = isinstance(inv, int) and not isinstance(inv, bool) and inv > 0
            factor_update_freq = (
                max(1, inv // 10) if valid and isinstance(inv, int) else 1
            )  # the schedule reports a bad inv_update_freq
        return KFACSchedule(
            damping=self.damping,
            factor_update_freq=factor_update_freq,
            inv_update_freq=self.inv_update_freq,
            damping_decay_epochs=self.damping_decay_epochs,
            damping_decay_rate=self.damping_decay_rate,
            update_freq_decay_epochs=self.update_freq_decay_epochs,
            update_freq_decay_rate=self.update_freq_decay_rate,
        )

    @property
    def torch_decomposition_dtype(self) -> torch.dtype:
        dtype = (
            _DTYPES.get(self.decomposition_dtype, self.decomposition_dtype)
            if isinstance(self.decomposition_dtype, str)
            else self.decomposition_dtype
        )
        if dtype not in (torch.float32, torch.float64):
            raise ValueError("K-FAC decomposition_dtype must be torch.float32 or torch.float64 ('float32' / 'float64')")
        return dtype  # type: ignore[return-value]

    @property
    def torch_factor_dtype(self) -> torch.dtype:
        """Storage dtype of the running factors (float32 unless ``factor_dtype`` says otherwise)."""
        return _storage_dtype("factor_dtype", self.factor_dtype) or torch.float32

    @property
    def torch_inverse_dtype(self) -> torch.dtype:
        """Storage dtype of the decompositions (the decomposition dtype unless ``inverse_dtype`` says otherwise)."""
        compute = self.torch_decomposition_dtype
        dtype = _storage_dtype("inverse_dtype", self.inverse_dtype) or compute
        if dtype.itemsize > compute.itemsize:
            raise ValueError(
                f"K-FAC inverse_dtype={self.inverse_dtype!r} is wider than "
                f"decomposition_dtype={self.decomposition_dtype!r}: "
                "storing decompositions in more precision than they are computed in gains nothing; use "
                "decomposition_dtype='float64' or a narrower inverse_dtype"
            )
        return dtype

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> KFACOptions:
        """The options among a call's arguments: ``locals()`` of a constructor that takes every field as a typed
        keyword argument (``KFAC``, ``KFACPreconditioner``), validated here."""
        return cls(**{name: arguments[name] for name in cls.field_names()})

    def as_kwargs(self) -> dict[str, Any]:
        """The options as the keyword arguments of ``KFAC`` / ``KFACPreconditioner`` (fields, unconverted)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> KFACOptions:
        return dataclasses.replace(self, **changes)


F = TypeVar("F", bound=Callable[..., Any])


def with_option_keywords(func: F) -> F:
    """``func`` (a constructor that takes the options as ``**option_fields``) with the signature that lists the
    fields of :class:`KFACOptions` as typed keyword-only arguments in place of its ``**`` parameter: their names,
    annotations and defaults are the dataclass's, derived here, so they cannot drift (what ``inspect.signature``,
    IDEs and documentation tools read). ``func`` itself passes the keywords to :meth:`KFACOptions.replace`, which
    validates them and names an unknown one."""
    sig = inspect.signature(func)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    for f in dataclasses.fields(KFACOptions):
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=f.type))
    cast(Any, func).__signature__ = sig.replace(parameters=params)
    return func
