import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_hpc
from lightning_hpc.registry import STRATEGY_SPECS, strategy_class
from tests import fit_harness

REPO = Path(__file__).resolve().parents[1]

#: every strategy the product promises (README); importing Lightning must register all of them
EXPECTED = {"layered_sgd", "hybrid_fc", "spatial", "multigrid", "horovod"}


def test_every_strategy_name_is_registered():
    assert EXPECTED == set(STRATEGY_SPECS)
    for name, spec in STRATEGY_SPECS.items():
        assert name == name.lower()
        assert StrategyRegistry[name]["strategy"] is spec
        assert getattr(lightning_hpc, strategy_class(name).__name__) is strategy_class(name)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_trainer_resolves_registered_name(name):
    if name == "horovod":
        pytest.importorskip("horovod.torch")
    trainer = fit_harness.trainer(strategy=name)
    assert isinstance(trainer.strategy, strategy_class(name))
    assert lightning_hpc.__version__


@pytest.mark.parametrize("order", ["lightning_hpc first", "lightning first"])
def test_names_resolve_whichever_is_imported_first(order):
    first, second = ("import lightning_hpc", "import lightning.pytorch as pl") if order == "lightning_hpc first" else (
        "import lightning.pytorch as pl", "import lightning_hpc")
    code = (
        f"{first}; {second}\n"
        "from tests import fit_harness\n"  # imported after both: it cannot change their order
        "t = fit_harness.trainer(strategy='layered_sgd')\n"
        "assert type(t.strategy).__name__ == 'LayeredSGDStrategy', type(t.strategy)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=REPO)
