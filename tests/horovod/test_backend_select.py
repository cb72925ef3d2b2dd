"""The communication backend follows the strategy (``communicator="auto"``); no Horovod needed."""

from __future__ import annotations

import pytest
from lightning.pytorch.strategies import DDPStrategy

from lightning_hpc.distributed.backend import backend_for, communicator_for
from lightning_hpc.distributed.comm import TorchDistributedCommunicator
from lightning_hpc.horovod.strategy import HorovodStrategy


class _Horovodish:
    communication_backend = "horovod"


def test_auto_follows_the_strategy():
    assert backend_for(None) == "torch"
    assert backend_for(DDPStrategy()) == "torch"
    assert backend_for(_Horovodish()) == "horovod"
    assert HorovodStrategy.communication_backend == "horovod"


def test_explicit_choice_wins_and_bad_names_are_rejected():
    assert backend_for(_Horovodish(), "torch") == "torch"
    assert backend_for(None, "horovod") == "horovod"
    with pytest.raises(ValueError, match="communicator must be one of"):
        backend_for(None, "mpi")
    comm = TorchDistributedCommunicator()
    assert communicator_for(_Horovodish(), comm) is comm
    assert isinstance(communicator_for(DDPStrategy()), TorchDistributedCommunicator)
