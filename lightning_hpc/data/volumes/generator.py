"""Generated volumes with structure a tile cannot decide alone: bright spheres of random radii in noise, labelled
where a sphere is *large*.

Small and large spheres have the same intensity, so whether a voxel is labelled depends on the extent of the sphere
around it, up to a diameter of half the volume's smallest side: when a volume is split into sub-volumes (spatial
parallelism along D, H or W), a voxel's label needs voxels other ranks hold, the case halo exchanges exist for
(Dryden et al., section III-A; section I on 3-D data).  Deterministic in ``(seed, index)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["sphere_volume", "LARGE_FRACTION"]

#: a sphere is large (labelled) when its radius is at least this fraction of the volume's smallest side
LARGE_FRACTION = 0.15


def sphere_volume(
    size: Sequence[int], seed: int, index: int, *, spheres: int = 10, noise: float = 0.3
) -> tuple[np.ndarray, np.ndarray]:
    """One sample: ``(x, y)`` of shapes ``(1, D, H, W)`` (float32 intensity) and ``(1, D, H, W)`` (float32 0/1).

    Radii are uniform in ``[0.05, 0.25]`` of the smallest side; a sphere of radius at least
    :data:`LARGE_FRACTION` of it is large.  Each sphere adds a soft-edged unit intensity (one voxel of ramp), then
    Gaussian noise of standard deviation ``noise`` is added."""
    shape = tuple(int(n) for n in size)
    if len(shape) != 3 or min(shape) < 4:
        raise ValueError(f"volume size {tuple(size)}: three extents (D, H, W) of at least 4 voxels each")
    rng = np.random.default_rng([int(seed), int(index)])
    side = min(shape)
    x = np.zeros(shape, dtype=np.float32)
    y = np.zeros(shape, dtype=np.float32)
    for _ in range(spheres):
        centre = rng.uniform(0, shape)
        radius = rng.uniform(0.05, 0.25) * side
        large = radius >= LARGE_FRACTION * side
        # only the sphere's bounding box is touched (a 128^3 volume stays cheap to write)
        lo = [max(int(c - radius - 1), 0) for c in centre]
        hi = [min(int(c + radius + 2), n) for c, n in zip(centre, shape)]
        grids = np.ogrid[lo[0] : hi[0], lo[1] : hi[1], lo[2] : hi[2]]
        dist = np.sqrt(sum((g - c) ** 2 for g, c in zip(grids, centre)))
        box = (slice(lo[0], hi[0]), slice(lo[1], hi[1]), slice(lo[2], hi[2]))
        x[box] = np.maximum(x[box], np.clip(radius - dist + 0.5, 0.0, 1.0))
        if large:
            y[box] = np.maximum(y[box], (dist <= radius).astype(np.float32))
    x += noise * rng.standard_normal(shape, dtype=np.float32)
    return x[None], y[None]
