"""LightningDataModules; sharding across ranks comes from Lightning's distributed sampler."""

from lightning_hpc.data.cifar10 import Cifar10DataModule
from lightning_hpc.data.digits import DigitsDataModule
from lightning_hpc.data.imagefolder import ImageFolder, ImageFolderDataModule
from lightning_hpc.data.mesh_tangling import MeshTanglingDataModule
from lightning_hpc.data.synthetic import SyntheticDataModule, SyntheticImages

__all__ = [
    "Cifar10DataModule",
    "DigitsDataModule",
    "ImageFolder",
    "ImageFolderDataModule",
    "MeshTanglingDataModule",
    "SyntheticDataModule",
    "SyntheticImages",
]
