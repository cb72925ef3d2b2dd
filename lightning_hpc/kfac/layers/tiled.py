"""K-FAC for a convolution that runs on one spatial tile of each sample (spatial parallelism, Dryden et al.): KFC's
factors (Grosse & Martens 2016) as partial sums over the output positions the tile owns, from its halo-padded input,
which the spatial group sums into the factors of the whole samples.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_hpc.kfac.layers.conv import ConvHandler
from lightning_hpc.protocols import TiledLayers

__all__ = ["TiledConvHandler"]


class TiledConvHandler(ConvHandler):
    """A Conv1d / Conv2d / Conv3d that runs on one spatial tile (or sub-volume) of each sample (spatial
    parallelism, Dryden et al. sections I and III-A): a convolution the strategy's
    :class:`~lightning_hpc.protocols.TiledLayers` registry names (e.g.
    :class:`lightning_hpc.spatial.dispatch.kfac_contract.TiledLayerRegistry`), its op on a split activation run by
    the tile kernel :func:`lightning_hpc.spatial.kernels.conv`.

    KFC's expansion operator over the whole sample is the union over tiles of the patches of the output positions
    each tile owns, and the output gradients split the same way, so the whole-sample sums of ``a a^T`` and
    ``ds ds^T`` are the sums over tiles of the tiles' sums.  Each tile therefore forms

        A_k = 1/(B T) sum_n sum_{t in tile k} a a^T,    G_k = B sum_n sum_{t in tile k} grad grad^T

    with ``T`` the positions of the *whole* output (as the serial convention, :mod:`.base` docstring), and
    ``sum_k A_k``, ``sum_k G_k`` over the spatial group are exactly the serial factors of the sample group's
    samples; :attr:`partition_size` tells the preconditioner to sum them (:func:`..factor_update.update_factors`).

    The patches come from the layer's halo-padded input tile (border zero padding and the neighbours' halo
    rows included), which the registry records on capture steps only (``request`` before the forward, ``take``
    after it, with the whole sample's output extent).
    """

    records_input = True
    shifted_gram = False

    def __init__(self, name: str, module: nn.Module, layers: TiledLayers) -> None:
        self.layers = layers  # before the base class's state, which reads partition_size
        super().__init__(name, module)
        #: the whole sample's output extent of the captured forward (for the whole-sample normalisation)
        self.output_extent: tuple[int, ...] | None = None

    @property
    def partition_size(self) -> int:  # type: ignore[override]
        return int(self.layers.partition_size)

    def prepare_capture(self, capturing: bool) -> None:
        self.layers.request(self.module, capturing)

    def captured_input(self, inputs: tuple) -> torch.Tensor | None:
        record = self.layers.take(self.module, inputs)
        if record is None:
            return None
        x, self.output_extent = record
        return x

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        return x  # already padded by the layer (halo rows from the neighbours, zeros at the image border)

    @property
    def refuses_split_input(self) -> bool:  # type: ignore[override]
        return False  # the statistics come from the recorded box, in any number of dimensions

    def input_gram(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        gram, _ = super().input_gram(x)
        extent = self.output_extent
        assert extent is not None, "input_gram of a box that was not recorded"
        n = x.shape[0] if x.dim() == 2 + self.spatial_dims else 1
        return gram, n * math.prod(extent)  # rows of the whole sample: sum_k A_k is the serial A
