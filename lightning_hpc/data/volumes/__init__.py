"""Volumetric segmentation data for the 3-D spatial recipe: generated spheres whose label depends on their size
(context larger than one sub-volume), written once as ``.npy`` files and read one sub-volume at a time."""

from lightning_hpc.data.volumes.datamodule import SphereVolumeDataModule
from lightning_hpc.data.volumes.generator import sphere_volume

__all__ = ["SphereVolumeDataModule", "sphere_volume"]
