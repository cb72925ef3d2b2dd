"""Every strategy exposes ``device_mesh`` (a torch DeviceMesh, as Lightning's ``ModelParallelStrategy`` does), whose
named dimensions are the strategy's own process groups: checked through ``Trainer.fit`` on 2 gloo CPU processes
(the names, the ranks' places, and a sum over each dimension's group), and the error before setup."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_hpc.distributed import run_in_processes
from tests.fit_harness import fit

REPO = Path(__file__).resolve().parents[2]
STRATEGIES = ("layered_sgd", "hybrid_fc", "multigrid", "spatial")


def _rank(rank: int, world: int) -> dict[str, dict]:
    import lightning.pytorch as pl
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_hpc  # noqa: F401 - registers the strategy names
    from lightning_hpc import ImageClassifier
    from lightning_hpc.models import ode_resnet, small_cnn

    torch.set_num_threads(1)
    seen: dict[str, dict] = {}

    class ReadMesh(pl.Callback):
        def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            mesh = trainer.strategy.device_mesh
            sums = {}
            for name in mesh.mesh_dim_names:
                t = torch.tensor([float(dist.get_rank())])
                dist.all_reduce(t, group=mesh.get_group(name))
                sums[name] = t.item()
            seen[name_of] = {"names": mesh.mesh_dim_names, "ranks": mesh.mesh.tolist(), "sums": sums}

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g))
    for name_of in STRATEGIES:
        model = ode_resnet(num_steps=8, width=4) if name_of == "multigrid" else small_cnn(width=4, dropout=0.0)
        fit(ImageClassifier(model), DataLoader(data, batch_size=4), devices=2, strategy=name_of, max_steps=1,
            callbacks=[ReadMesh()])
    return seen


@pytest.fixture(scope="module")
def meshes():
    return run_in_processes(_rank, 2, timeout_s=600, collective_timeout_s=120,
                            env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize(
    ("strategy", "names", "ranks", "sums"),
    [
        # data parallel over both ranks
        ("layered_sgd", ("data",), [0, 1], [{"data": 1.0}] * 2),
        # one head shard per rank
        ("hybrid_fc", ("head",), [0, 1], [{"head": 1.0}] * 2),
        # one layer-parallel chain of 2 ranks (layer_parallel_size defaults to the world): data groups of one rank
        ("multigrid", ("data", "layer"), [[0, 1]], [{"data": 0.0, "layer": 1.0}, {"data": 1.0, "layer": 1.0}]),
        # one sample group of 2 tiles (spatial_parts defaults to the world)
        ("spatial", ("sample", "tile"), [[0, 1]], [{"sample": 0.0, "tile": 1.0}, {"sample": 1.0, "tile": 1.0}]),
    ],
)
def test_device_mesh_names_the_strategys_groups(meshes, strategy, names, ranks, sums):
    for rank, seen in enumerate(meshes):
        mesh = seen[strategy]
        assert mesh["names"] == names
        assert mesh["ranks"] == ranks
        assert mesh["sums"] == sums[rank]


@pytest.mark.parametrize("strategy", ["layered_sgd", "hybrid_fc", "multigrid", "spatial"])
def test_device_mesh_before_setup_says_when_it_exists(strategy):
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_hpc  # noqa: F401

    s = StrategyRegistry.get(strategy)
    with pytest.raises(RuntimeError, match=r"device_mesh is not available: the mesh is made with the strategy's "
                                           r"process groups, when Trainer sets it up"):
        s.device_mesh  # noqa: B018 - the property raises
