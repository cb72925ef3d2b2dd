"""Mesh-tangling data (Dryden et al., section VI): a shocked-bubble Lagrangian mesh generator, Verdict quad
quality metrics, LBANN's on-disk layout with a tile reader, and a LightningDataModule."""

from lightning_hpc.data.mesh_tangling.datamodule import MeshTanglingDataModule
from lightning_hpc.data.mesh_tangling.dataset import (
    DiskSource,
    MeshTanglingDataset,
    OnTheFlySource,
    normalize_channels,
    tile_bounds,
)
from lightning_hpc.data.mesh_tangling.generator import CHANNELS, TARGET, generate_sample
from lightning_hpc.data.mesh_tangling.layout import (
    channel_path,
    read_tile,
    write_sample,
)
from lightning_hpc.data.mesh_tangling.quality import quad_quality

__all__ = [
    "CHANNELS",
    "TARGET",
    "DiskSource",
    "MeshTanglingDataModule",
    "MeshTanglingDataset",
    "OnTheFlySource",
    "channel_path",
    "generate_sample",
    "normalize_channels",
    "quad_quality",
    "read_tile",
    "tile_bounds",
    "write_sample",
]
