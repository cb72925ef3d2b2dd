"""lightning_hpc: HPC training techniques for PyTorch Lightning.

Importing the package registers every strategy name in Lightning's ``StrategyRegistry`` so
``Trainer(strategy="<name>")`` works.
"""

from lightning_hpc.lit import ImageClassifier
from lightning_hpc.registry import register_strategies
from lightning_hpc.strategies.spatial.strategy import SpatialParallelStrategy

__version__ = "0.1.0"

__all__ = ["ImageClassifier", "SpatialParallelStrategy", "__version__"]

register_strategies()
