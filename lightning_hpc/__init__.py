"""lightning_hpc: HPC training techniques for PyTorch Lightning.

Importing the package registers every strategy name in Lightning's ``StrategyRegistry`` so
``Trainer(strategy="<name>")`` works, and registers an exit handler that destroys a still-initialised
torch.distributed process group before the interpreter finalises (see :mod:`lightning_hpc.distributed.exit`).
"""

from lightning_hpc.distributed.exit import destroy_process_group_at_exit
from lightning_hpc.kfac.callback import KFAC
from lightning_hpc.kfac.precision import KFACMixedPrecision
from lightning_hpc.kfac.preconditioner import KFACPreconditioner
from lightning_hpc.lit import ImageClassifier
from lightning_hpc.segmentation import SegmentationModule
from lightning_hpc.strategies.horovod import HorovodStrategy  # importing it never imports Horovod
from lightning_hpc.strategies.hybrid_fc import HybridParallelStrategy
from lightning_hpc.strategies.layered_sgd import LayeredSGDStrategy
from lightning_hpc.strategies.multigrid.strategy import MultigridStrategy
from lightning_hpc.strategies.spatial.strategy import SpatialParallelStrategy
from lightning_hpc.registry import register_strategies

__version__ = "0.1.0"

__all__ = ["HorovodStrategy", "HybridParallelStrategy", "ImageClassifier", "KFAC", "KFACMixedPrecision", "KFACPreconditioner", "LayeredSGDStrategy", "MultigridStrategy", "SegmentationModule", "SpatialParallelStrategy", "__version__"]

register_strategies()
destroy_process_group_at_exit()
