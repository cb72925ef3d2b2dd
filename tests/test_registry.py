import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_hpc
from lightning_hpc.registry import STRATEGIES, STRATEGY_MODULES

#: every strategy the product promises (README); importing lightning_hpc must register all of them
EXPECTED = {"layered_sgd", "hybrid_fc", "spatial", "multigrid", "horovod"}


def test_import_registers_every_strategy_module():
    assert len(STRATEGIES) >= len(STRATEGY_MODULES)
    for name, cls in STRATEGIES.items():
        assert name == name.lower()
        assert StrategyRegistry[name]["strategy"] is cls
    assert EXPECTED <= set(STRATEGIES), f"not registered: {EXPECTED - set(STRATEGIES)}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_trainer_resolves_registered_name(name):
    cls = STRATEGIES[name]
    if name == "horovod":
        pytest.importorskip("horovod.torch")
    trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert isinstance(trainer.strategy, cls)
    assert lightning_hpc.__version__
