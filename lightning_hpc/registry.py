"""The strategy names lightning_hpc adds to Lightning's ``StrategyRegistry``.

Registration is lazy on both sides: importing ``lightning_hpc`` (or any of its plain-torch cores) imports
neither Lightning nor a strategy module.  The names are registered the moment ``lightning.pytorch.strategies``
is imported (see :mod:`lightning_hpc._registration`), and each name maps to a small factory that imports its
strategy module only when a ``Trainer(strategy="<name>")`` builds it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

__all__ = ["StrategySpec", "STRATEGY_SPECS", "register_strategies", "strategy_class", "load", "launcher_environment"]


def load(target: str) -> Any:
    """The object a ``"module:Name"`` target names (imports its module): how one folder names another's class
    without importing it (techniques do not import each other; the shared layer imports none of them)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class StrategySpec:
    """One registered name: where its class lives and the description Lightning lists."""

    name: str
    target: str  # "module:Class"
    description: str

    def load(self) -> type:
        return load(self.target)  # type: ignore[no-any-return]

    def __call__(self, **init_params: Any) -> Any:
        """The factory Lightning's ``StrategyRegistry.get`` calls: build the strategy."""
        return self.load()(**init_params)


#: every strategy name this package registers
STRATEGY_SPECS: dict[str, StrategySpec] = {
    spec.name: spec
    for spec in (
        StrategySpec(
            "layered_sgd",
            "lightning_hpc.layered_sgd.strategy:LayeredSGDStrategy",
            "Layered SGD (Yu et al.): hierarchical reduce/allreduce/broadcast overlapped with data loading",
        ),
        StrategySpec(
            "hybrid_fc",
            "lightning_hpc.hybrid_fc.strategy:HybridParallelStrategy",
            "Data-parallel conv trunk, model-parallel fully-connected head (Krizhevsky 2014, schemes a/b/c)",
        ),
        StrategySpec(
            "spatial",
            "lightning_hpc.spatial.lightning.strategy:SpatialParallelStrategy",
            "Hybrid sample x spatial parallelism with halo exchange (Dryden et al.)",
        ),
        StrategySpec(
            "multigrid",
            "lightning_hpc.multigrid.strategy:MultigridStrategy",
            "Layer-parallel multigrid (FAS/MGRIT) training of deep ODE-ResNets",
        ),
        StrategySpec(
            "horovod",
            "lightning_hpc.horovod.strategy:HorovodStrategy",
            "Horovod data parallelism: hvd.DistributedOptimizer allreduce, launched by horovodrun/mpirun",
        ),
    )
}


def strategy_class(name: str) -> type:
    """The class behind a registered name (imports its module)."""
    return STRATEGY_SPECS[name].load()


def register_strategies() -> None:
    """Register every name in ``lightning.pytorch``'s ``StrategyRegistry`` (idempotent; imports Lightning)."""
    from lightning.pytorch.strategies import StrategyRegistry

    for spec in STRATEGY_SPECS.values():
        if spec.name not in StrategyRegistry:
            StrategyRegistry.register(spec.name, spec, description=spec.description)


#: cluster environments of launchers that start every process themselves, "module:Class" with a static
#: ``launched_by_<launcher>()`` check, asked in this order by :func:`launcher_environment`
LAUNCHER_ENVIRONMENTS: tuple[tuple[str, str], ...] = (
    ("lightning_hpc.horovod.environment:HorovodEnvironment", "launched_by_horovodrun"),
)


def launcher_environment() -> Any | None:
    """A ``ClusterEnvironment`` for a DDP-derived strategy whose ranks a launcher outside Lightning started
    (``horovodrun``: Horovod's ranks), or ``None``.  Layered SGD asks here instead of importing Horovod's folder."""
    for target, launched in LAUNCHER_ENVIRONMENTS:
        environment = load(target)
        if getattr(environment, launched)():
            return environment()
    return None
