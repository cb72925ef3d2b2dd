"""KFAC with the layer-parallel multigrid trunk is refused at setup, with the fix, before any training step.

Before: the K-FAC hooks fired inside the multigrid block at the first forward and raised a RuntimeError that
blamed the spatial strategy ("replaced by a Conv2d ... the KFAC callback does this by itself"), after training
had started.
"""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpc import KFAC, ImageClassifier, MultigridStrategy
from lightning_hpc.models import ode_resnet
from tests.fit_harness import fit


class _Counting(ImageClassifier):
    steps_run = 0

    def training_step(self, batch, batch_idx):
        type(self).steps_run += 1
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("mode", ["mg", "pm"])
def test_kfac_with_layer_parallel_multigrid_fails_before_training(mode):
    torch.manual_seed(0)
    module = _Counting(ode_resnet(num_steps=8, width=4), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    _Counting.steps_run = 0
    loader = DataLoader(TensorDataset(torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))), batch_size=4)
    with pytest.raises(
        ValueError, match=rf"KFAC does not support strategy='multigrid' with mode='{mode}'.*Remove the KFAC callback"
    ):
        fit(module, loader, strategy=MultigridStrategy(cfactor=2, levels=2, mode=mode), max_steps=2,
            callbacks=[KFAC(factor_update_freq=1, inv_update_freq=1)], num_sanity_val_steps=0, limit_val_batches=0)
    assert _Counting.steps_run == 0
