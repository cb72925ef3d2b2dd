"""K-FAC with one preconditioner per optimizer (a GAN's generator and discriminator) on the GPU: the plain loop of
``tests/kfac/test_kfac_several_optimizers.py``, whose discriminator's statistics drop the generator step's pass when
its output gradients arrive after ``zero_grad`` (a read of the gradient on the device), equals the same loop on the
CPU (float64, TF32 off)."""

from __future__ import annotations

import torch
from conftest import DEVICE

from tests.kfac.test_kfac_several_optimizers import STEPS, train_plain


def test_gan_preconditioned_per_optimizer_on_device_equals_cpu() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    on_device, pres = train_plain(reference=False, device=DEVICE)
    on_cpu, _ = train_plain(reference=False)
    assert [p.steps for p in pres] == [STEPS, STEPS]
    for a, b in zip(on_device.parameters(), on_cpu.parameters()):
        scale = max(float(b.abs().max()), 1.0)
        assert float((a.detach().cpu() - b).abs().max()) <= 1e-9 * scale
