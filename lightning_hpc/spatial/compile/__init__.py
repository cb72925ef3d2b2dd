"""``torch.compile`` of a spatially split model: the forward captured on global shapes by dynamo, traced on this
rank's tiles into one graph of tile operations and compiled with the module's own backend
(:mod:`.tile_program`, :mod:`.split_module`)."""

from __future__ import annotations

from lightning_hpc.spatial.compile.split_module import SplitCompiledForward
from lightning_hpc.spatial.compile.tile_program import TileProgram, trace_tile_program

__all__ = ["SplitCompiledForward", "TileProgram", "trace_tile_program"]
