"""Ready LightningModules: ordinary modules that happen to be ours (nothing a strategy depends on)."""

from lightning_hpc.modules.classification import ImageClassifier
from lightning_hpc.modules.segmentation import SegmentationModule

__all__ = ["ImageClassifier", "SegmentationModule"]
