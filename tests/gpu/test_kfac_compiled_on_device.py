"""K-FAC's route for ``torch.compile``'d modules (:mod:`lightning_hpc.kfac.compiled`) on the GPU: a compiled CNN
trained in a plain loop under ``KFACPreconditioner`` is one dynamo graph, its factor-update steps the only eager
forwards, and its parameters equal the same loop on the CPU without compiling (float64, TF32 off)."""

from __future__ import annotations

import torch
from conftest import DEVICE

from tests.kfac.test_kfac_compiled_route import STEPS, plain_loop


def test_compiled_model_under_kfac_on_device_is_one_graph_and_equals_cpu() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    on_device, graphs, eager = plain_loop(DEVICE, compiled=True)
    on_cpu, _, _ = plain_loop("cpu", compiled=False)
    assert graphs == 1 and eager == STEPS // 2, (graphs, eager)
    for a, b in zip(on_device, on_cpu):
        scale = max(float(b.abs().max()), 1.0)
        assert float((a - b).abs().max()) <= 1e-9 * scale
