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


def test_names_resolve_whichever_is_imported_first():
    """Each import order in a fresh interpreter (the two at once: most of each is importing Lightning)."""
    orders = {"lightning_hpc first": ("import lightning_hpc", "import lightning.pytorch as pl"),
              "lightning first": ("import lightning.pytorch as pl", "import lightning_hpc")}
    procs = {}
    for order, (first, second) in orders.items():
        code = (
            f"{first}; {second}\n"
            "from tests import fit_harness\n"  # imported after both: it cannot change their order
            "t = fit_harness.trainer(strategy='layered_sgd')\n"
            "assert type(t.strategy).__name__ == 'LayeredSGDStrategy', type(t.strategy)\n"
        )
        procs[order] = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
    failed = {}
    for order, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=120)
        finally:
            proc.kill()
        if proc.returncode != 0:
            failed[order] = out[-3000:]
    assert not failed, failed
