"""Blocked partitions of an extent over parts (uneven sizes allowed).

Shared by the spatial layers (tiles of H and W), the mesh-tangling reader (a rank reads only its tile), the
hybrid head (neurons per rank) and the multigrid layer partition (residual steps per rank).
"""

from __future__ import annotations

__all__ = ["block_sizes", "block_bounds", "block_range"]


def block_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous blocks covering ``n`` items; the first ``n % parts`` are one larger."""
    if parts <= 0:
        raise ValueError(f"number of parts must be positive, got {parts}")
    if n < parts:
        raise ValueError(f"cannot split an extent of {n} into {parts} non-empty blocks; use at most {n} parts")
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def block_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of every block."""
    bounds, start = [], 0
    for size in block_sizes(n, parts):
        bounds.append((start, start + size))
        start += size
    return bounds


def block_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of block ``index``."""
    if not 0 <= index < parts:
        raise ValueError(f"block index {index} out of range for {parts} parts")
    return block_bounds(n, parts)[index]
