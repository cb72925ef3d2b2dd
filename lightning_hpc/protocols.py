"""Declared contracts between the techniques, in one place.

* :class:`StrategyContract`: what a lightning_hpc strategy tells callbacks (the K-FAC callback) and modules
  (learning-rate scaling) about itself, and its ranks as a named ``DeviceMesh``.  Every strategy of this package
  inherits it, so each item is declared once with its default and a misspelt override is caught by mypy instead
  of silently falling back.  Readers use :func:`contract_of`, which gives the same defaults for strategies that
  are not ours (Lightning's DDP, ...).
* :class:`CommunicationBackendAware`: a strategy or cluster environment that names the collective library
  (``"torch"`` or ``"horovod"``) K-FAC and layered SGD must use.
* :class:`PostponedUpdateSafe`: a callback whose ``on_before_optimizer_step`` / ``on_train_batch_end`` may run
  when layered SGD applies its postponed update (at the next batch), because it neither logs nor keeps state tied
  to the batch (the K-FAC callback); layered SGD otherwise updates at once for a run with a callback that has
  code of its own in those hooks.
* :class:`TiledLayers`: which layers a spatial strategy runs on tiles, and the recorded input boxes of its tiled
  convolutions, so K-FAC's factors cover the whole samples (the halo rows included), see
  :class:`lightning_hpc.kfac.layers.TiledConvHandler`.
* :class:`ShardedFullyConnected`: what a fully-connected layer of which each rank holds one block (hybrid_fc's
  head) tells K-FAC so its factors and its preconditioned gradient are the whole layer's, see
  :class:`lightning_hpc.kfac.layers.ShardedLinearHandler`.

No Lightning import here: the plain-torch cores import this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "StrategyContract",
    "CommunicationBackendAware",
    "PostponedUpdateSafe",
    "TiledLayers",
    "ShardedFullyConnected",
    "contract_of",
    "data_parallel_size",
]


class StrategyContract:
    """Mixin of every lightning_hpc strategy: the facts other components may ask it (defaults shown)."""

    @property
    def kfac_unsupported(self) -> str | None:
        """Why K-FAC cannot precondition under this strategy (``None``: it can); the callback refuses at setup."""
        return None

    #: the strategy changes or declares the model's layers in its own ``setup``, after the callbacks' ``setup``
    #: (hybrid_fc shards its head; the spatial strategy turns SyncBatchNorm into batch norm and declares the
    #: convolutions and norms to K-FAC): K-FAC registers its hooks in ``on_fit_start`` instead, on the layers that run
    replaces_layers_in_setup: bool = False

    #: the strategy reduces a parameter from the step its ``requires_grad`` changes (``BackboneFinetuning``); the
    #: others refuse such a change before the step (see :mod:`lightning_hpc.distributed.trainability`), and so
    #: does the K-FAC callback under a strategy that is not ours
    follows_trainability_changes: bool = False

    @property
    def kfac_tiled_layers(self) -> TiledLayers | None:
        """The layers this strategy runs on spatial tiles (:class:`TiledLayers`), for K-FAC; ``None``: none."""
        return None

    @property
    def kfac_note(self) -> str | None:
        """A note the K-FAC callback prints once (e.g. which layers it leaves to the optimizer under this strategy)."""
        return None

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different samples (the world size unless ranks also split samples or layers)."""
        return int(self.world_size)  # type: ignore[attr-defined]

    #: set by the strategy when it makes its process groups (setup); ``None`` before that, and where it has none
    _device_mesh: DeviceMesh | None = None
    #: why there is no mesh after setup (``None``: the usual reason, before setup or one process alone)
    _no_device_mesh: str | None = None

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ranks as a torch ``DeviceMesh`` with named dimensions, as Lightning's ``ModelParallelStrategy``
        exposes it: its groups (``device_mesh.get_group(name)``) are the strategy's own (``"data"`` for layered
        SGD, ``("data", "layer")`` for multigrid, ``("sample", "tile")`` for the spatial strategy, ``"head"`` for
        hybrid_fc).  Raises before the strategy is set up and in a run without torch.distributed."""
        if self._device_mesh is None:
            reason = self._no_device_mesh or (
                "the mesh is made with the strategy's process groups, when Trainer sets it up on initialised "
                "torch.distributed (in or after the setup hooks of a fit / validate / test / predict)"
            )
            raise RuntimeError(f"{type(self).__name__}.device_mesh is not available: {reason}")
        return self._device_mesh


_DEFAULTS = StrategyContract()


def contract_of(strategy: Any) -> StrategyContract:
    """``strategy`` itself when it declares the contract, else the defaults (any other Lightning strategy)."""
    return strategy if isinstance(strategy, StrategyContract) else _DEFAULTS


def data_parallel_size(strategy: Any) -> int:
    """Data-parallel ranks of any Lightning strategy (ours declare it; others: their world size)."""
    if isinstance(strategy, StrategyContract):
        return strategy.data_parallel_size
    return int(getattr(strategy, "world_size", 1))


@runtime_checkable
class CommunicationBackendAware(Protocol):
    """Declared by a strategy (Horovod's) or a cluster environment (``horovodrun`` under a DDP-style strategy)
    whose ranks must talk through a collective library other than torch.distributed."""

    communication_backend: str


@runtime_checkable
class PostponedUpdateSafe(Protocol):
    """A callback that declares ``postponed_update_safe = True``: its step hooks only read the gradients and the
    parameters (no ``self.log``, nothing tied to the current batch), so layered SGD may run them when it applies
    the postponed update, one batch later, and keep overlapping the reduction with the next batch's loading.

    Layered SGD judges by class, not by ``isinstance``: the declaration covers the hooks as the declaring class and
    its bases implement them, not a subclass's overrides, and never ``on_after_backward`` (it runs inside the
    backward pass, before the postponed reduction completes)."""

    postponed_update_safe: bool


@runtime_checkable
class TiledLayers(Protocol):
    """The layers of a model that run on one spatial tile of each sample (spatial parallelism), as the strategy
    that tiles them tells K-FAC: an object the strategy owns and hands to the K-FAC callback
    (:attr:`StrategyContract.kfac_tiled_layers`), which hands it to the preconditioner; nothing is written onto
    the user's modules.  See :class:`lightning_hpc.kfac.layers.TiledConvHandler`.

    ``partition_size`` tiles make up a sample.  :meth:`is_tiled`: a convolution whose input is a tile (it gets the
    tiled handler); :meth:`splits_statistics`: a normalisation layer whose statistics span the tiles (left to the
    optimizer).  Before a forward whose statistics K-FAC captures it calls :meth:`request` for the layer; after it,
    :meth:`take` gives the input box whose padding-0 convolution is exactly the output positions this tile owns
    (halo rows and border padding included) and the whole sample's output extent, or None when nothing was
    recorded.
    """

    partition_size: int

    def is_tiled(self, module: Any) -> bool: ...

    def splits_statistics(self, module: Any) -> bool: ...

    def request(self, module: Any, capturing: bool) -> None: ...

    def take(self, module: Any, inputs: tuple) -> tuple[torch.Tensor, tuple[int, ...]] | None: ...


@runtime_checkable
class ShardedFullyConnected(Protocol):
    """``nn.Linear(in_features, out_features)`` of which this rank holds one block (hybrid_fc's head layers).

    ``layout`` ``"col"``: this rank holds the rows ``kfac_block("out")`` of the weight (a block of output neurons)
    and of the bias, and sees the whole input; ``"row"``: the columns ``kfac_block("in")`` of the weight (a block of
    input neurons, which is all of the input it sees), the bias block ``kfac_block("out")``, and its output is a
    partial sum over its inputs whose gradient is the whole output's.  Every call's rows are samples of their own
    (one sub-batch of the ranks' samples per call), and the output gradients a backward pass delivers are
    ``1 / kfac_grad_scale`` times those of the mean loss over all ranks' samples (the layer's parameter gradients
    are scaled by ``kfac_grad_scale``).  ``kfac_gather(t, side, dim)`` concatenates every rank's block of the
    ``side`` (``"in"`` / ``"out"``) features of ``t`` along ``dim``: a collective over the layer's ranks.
    """

    in_features: int
    out_features: int
    layout: str
    kfac_grad_scale: float

    def kfac_block(self, side: str) -> tuple[int, int]: ...

    def kfac_gather(self, t: torch.Tensor, side: str, dim: int) -> torch.Tensor: ...
