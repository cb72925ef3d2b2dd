"""LBANN's on-disk layout for mesh data, and a reader that loads only a tile.

One raw, row-major float32 file per channel per sample::

    <dir>/<channel><suffix>/<channel><4-digit index>.bin      e.g.  data/Density/Density0007.bin

for the 18 input channels and the ``mask`` target.  A ``meta.json`` beside them records the generator settings
(height, width, samples, seed); the reader also works without it (square samples, size from the file length).

:func:`read_tile` memory-maps the file and copies only the rows ``[h0, h1)`` and columns ``[w0, w1)``, so a rank
of a spatially parallel run never holds a full sample (the OS reads the pages of those rows only).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from lightning_hpc.data.mesh_tangling.generator import CHANNELS, TARGET

__all__ = [
    "channel_path",
    "write_sample",
    "read_tile",
    "write_meta",
    "read_meta",
    "sample_shape",
    "count_samples",
    "MAX_SAMPLES",
]

MAX_SAMPLES = 10_000  # 4-digit indices


def channel_path(root: str | os.PathLike, channel: str, index: int, suffix: str = "") -> Path:
    if not 0 <= index < MAX_SAMPLES:
        raise ValueError(f"sample index {index} does not fit the 4-digit layout (0..{MAX_SAMPLES - 1})")
    return Path(root) / f"{channel}{suffix}" / f"{channel}{index:04d}.bin"


def write_sample(
    root: str | os.PathLike,
    index: int,
    sample: dict[str, np.ndarray],
    suffix: str = "",
    channels: Iterable[str] = (*CHANNELS, TARGET),
) -> None:
    """Write every channel of ``sample`` as raw row-major float32."""
    for name in channels:
        path = channel_path(root, name, index, suffix)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.ascontiguousarray(sample[name], dtype=np.float32).tofile(path)


def write_meta(root: str | os.PathLike, **meta: object) -> None:
    Path(root).mkdir(parents=True, exist_ok=True)
    (Path(root) / "meta.json").write_text(json.dumps(meta, indent=2))


def read_meta(root: str | os.PathLike) -> dict:
    path = Path(root) / "meta.json"
    return json.loads(path.read_text()) if path.exists() else {}


def sample_shape(root: str | os.PathLike, suffix: str = "") -> tuple[int, int]:
    """(H, W) of the samples: from ``meta.json``, else from the size of the first file (square samples)."""
    meta = read_meta(root)
    if "height" in meta and "width" in meta:
        return int(meta["height"]), int(meta["width"])
    path = channel_path(root, CHANNELS[0], 0, suffix)
    if not path.exists():
        raise FileNotFoundError(f"no mesh sample at {path}; generate one with `lightning-hpc mesh-data --out {root}`")
    n = path.stat().st_size // 4
    side = math.isqrt(n)
    if side * side != n:
        raise ValueError(f"{path} holds {n} values, not a square image; add a meta.json with height and width")
    return side, side


def count_samples(root: str | os.PathLike, suffix: str = "") -> int:
    """Number of consecutive samples 0..n-1 that have every channel and the target on disk."""
    n = 0
    while n < MAX_SAMPLES and all(channel_path(root, c, n, suffix).exists() for c in (*CHANNELS, TARGET)):
        n += 1
    return n


def read_tile(
    root: str | os.PathLike,
    channel: str,
    index: int,
    shape: tuple[int, int],
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
    suffix: str = "",
) -> np.ndarray:
    """Rows ``[h0, h1)`` x columns ``[w0, w1)`` of one channel of one sample, read through a memory map."""
    height, width = shape
    h0, h1 = rows or (0, height)
    w0, w1 = cols or (0, width)
    if not (0 <= h0 < h1 <= height and 0 <= w0 < w1 <= width):
        raise ValueError(f"tile rows {h0}:{h1}, cols {w0}:{w1} outside a {height} x {width} sample")
    path = channel_path(root, channel, index, suffix)
    expected = height * width * 4
    if path.stat().st_size != expected:
        raise ValueError(
            f"{path} has {path.stat().st_size} bytes, expected {expected} for a {height} x {width} float32 image"
        )
    # Map only the rows of the tile (offset = first row), then copy the columns out of them.
    mm = np.memmap(path, dtype=np.float32, mode="r", offset=h0 * width * 4, shape=(h1 - h0, width))
    tile = np.array(mm[:, w0:w1])
    del mm
    return tile
