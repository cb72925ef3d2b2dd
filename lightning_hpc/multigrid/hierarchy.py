"""The multilevel hierarchy over one rank's steps (paper section III-C, Fig. 2).

Level 0 is the network itself: step k maps u_k to u_{k+1} with weights theta_k and step size h_k.  Level l + 1
keeps every c-th point of level l (the C-points, "C-layers"); its step k uses the weights of fine step
k c^(l+1) (restriction of the parameters by injection) and the step size H = sum of the fine step sizes it
spans (= c h for uniform h, the paper's H = c h, Eq. 25).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_hpc.multigrid.parallel import LayerChain

__all__ = ["Hierarchy", "scale_slice"]


def scale_slice(s: slice, factor: int) -> slice:
    """Map a slice of level-l steps to the fine steps (layers) whose weights they use."""
    return slice(s.start * factor, s.stop * factor, (s.step or 1) * factor)


class Hierarchy:
    """Sizes and step sizes of every level for ``h`` (the local fine step sizes, length n)."""

    def __init__(self, h: torch.Tensor, cfactor: int, levels: int) -> None:
        n = h.numel()
        if n % cfactor ** (levels - 1):
            raise ValueError(
                f"{n} local steps do not divide into blocks of cfactor^(levels-1) = {cfactor ** (levels - 1)}"
            )
        self.cfactor, self.levels = cfactor, levels
        self.sizes = [n // cfactor**level for level in range(levels)]
        self.step_sizes = [h.reshape(self.sizes[level], cfactor**level).sum(1) for level in range(levels)]

    def coarsest_layers(self) -> slice:
        """The fine layers whose weights the coarsest level's steps use."""
        top = self.levels - 1
        return self.layer_slice(top, slice(0, self.sizes[top], 1))

    def gathered_coarsest(self, chain: LayerChain, device: torch.device) -> Hierarchy:
        """One-level hierarchy of the coarsest steps of every rank of ``chain``, in layer order (collective;
        ``device``: where the communication backend takes tensors, e.g. the GPU for NCCL)."""
        h = self.step_sizes[self.levels - 1].to(device)
        return Hierarchy(torch.cat(chain.all_gather(h, forward_order=True)).cpu(), self.cfactor, 1)

    def layer_slice(self, level: int, steps: slice) -> slice:
        """Fine layers whose weights the level-``level`` steps ``steps`` use (injection of theta)."""
        return scale_slice(steps, self.cfactor**level)
