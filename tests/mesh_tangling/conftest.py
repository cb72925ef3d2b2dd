import pytest
import torch

from lightning_hpc.data.mesh_tangling.generator import generate_sample

SIZE = 64


@pytest.fixture(scope="session")
def sample0():
    torch.set_num_threads(1)
    return generate_sample(seed=0, index=0, size=SIZE)
