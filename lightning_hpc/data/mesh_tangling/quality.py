"""Verdict quad mesh-quality metrics, vectorised over a structured quadrilateral mesh.

Definitions follow the Verdict library manual (C. J. Stimpson, C. D. Ernst, P. Knupp, P. P. Pebay, D. Thompson,
"The Verdict Geometric Quality Library", Sandia report SAND2007-1751, section "Quadrilateral metrics"), for
planar quads with nodes P0..P3 in counter-clockwise order:

* edges ``L0 = P1-P0, L1 = P2-P1, L2 = P3-P2, L3 = P0-P3``; corner areas ``alpha_k = L_{k-1} x L_k``;
* principal axes ``X1 = (P1-P0) + (P2-P3)``, ``X2 = (P2-P1) + (P3-P0)``; cross derivative
  ``X12 = (P0-P1) + (P2-P3)``.

Metrics that Verdict defines as ``DBL_MAX`` for degenerate or inverted cells (condition, oddy, aspect ratio,
taper) are capped at :data:`METRIC_CAP` so they stay finite in float32.  Angles are in degrees.

The mesh is an array of node positions ``nodes[i, j] = (z, r)`` of shape ``(H+1, W+1, 2)``; cell ``(i, j)`` has
nodes ``P0 = nodes[i, j]``, ``P1 = nodes[i, j+1]``, ``P2 = nodes[i+1, j+1]``, ``P3 = nodes[i+1, j]``, which is
counter-clockwise when ``z`` grows with ``j`` and ``r`` with ``i``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["METRIC_CAP", "QUALITY_METRICS", "corner_areas", "min_corner_jacobian", "quad_quality"]

#: value used where Verdict returns DBL_MAX (degenerate or inverted cells)
METRIC_CAP = 1.0e6

#: the Verdict metrics this module computes, in the order of LBANN's mesh channels
QUALITY_METRICS = (
    "aspectRatio",
    "conditionNumber",
    "distortion",
    "jacobian",
    "largestAngle",
    "oddy",
    "scaledJacobian",
    "shape",
    "shear",
    "skew",
    "smallestAngle",
    "stretch",
    "taper",
    "volume",
)

_TINY = 1e-300


def _cross(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a[..., 0] * b[..., 1] - a[..., 1] * b[..., 0]


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(-1)


def _corners(nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return nodes[:-1, :-1], nodes[:-1, 1:], nodes[1:, 1:], nodes[1:, :-1]


def _edges(nodes: torch.Tensor) -> list[torch.Tensor]:
    p0, p1, p2, p3 = _corners(nodes)
    return [p1 - p0, p2 - p1, p3 - p2, p0 - p3]


def corner_areas(nodes: torch.Tensor) -> torch.Tensor:
    """``alpha_k = L_{k-1} x L_k`` for k = 0..3, shape ``(4, H, W)`` (twice the corner triangle areas)."""
    edges = _edges(nodes)
    return torch.stack([_cross(edges[k - 1], edges[k]) for k in range(4)])


def min_corner_jacobian(nodes: torch.Tensor) -> torch.Tensor:
    """Verdict ``jacobian`` (the smallest corner area); a cell is tangled when it is <= 0."""
    return corner_areas(nodes).amin(0)


def _cap(x: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    return torch.where(bad | ~torch.isfinite(x), torch.full_like(x, METRIC_CAP), x.clamp(max=METRIC_CAP))


def quad_quality(nodes: torch.Tensor) -> dict[str, torch.Tensor]:
    """All 14 Verdict quad metrics of every cell, each of shape ``(H, W)`` (dtype of ``nodes``)."""
    if nodes.ndim != 3 or nodes.shape[-1] != 2 or nodes.shape[0] < 2 or nodes.shape[1] < 2:
        raise ValueError(f"nodes must have shape (H+1, W+1, 2) with H, W >= 1, got {tuple(nodes.shape)}")
    p0, p1, p2, p3 = _corners(nodes)
    edges = _edges(nodes)
    lengths = torch.stack([e.norm(dim=-1) for e in edges])  # (4, H, W)
    len2 = lengths**2
    alpha = torch.stack([_cross(edges[k - 1], edges[k]) for k in range(4)])
    dots = torch.stack([_dot(edges[k - 1], edges[k]) for k in range(4)])
    len_prev, len_k = lengths.roll(1, 0), lengths  # |L_{k-1}|, |L_k| at corner k
    len2_prev = len2.roll(1, 0)
    area = alpha.sum(0) / 4
    jac = alpha.amin(0)
    degenerate_edge = lengths.amin(0) <= _TINY

    scaled = (alpha / (len_prev * len_k).clamp_min(_TINY)).amin(0)
    scaled = torch.where(degenerate_edge, torch.zeros_like(scaled), scaled)
    shear = scaled.clamp_min(0.0)
    shape = (2 * alpha / (len_prev**2 + len_k**2).clamp_min(_TINY)).amin(0).clamp_min(0.0)
    shape = torch.where(degenerate_edge, torch.zeros_like(shape), shape)

    nonpositive = alpha.amin(0) <= 0
    condition = _cap(0.5 * ((len2_prev + len2) / alpha.clamp_min(_TINY)).amax(0), nonpositive)
    # Oddy uses the Gram determinant g = |L_{k-1}|^2 |L_k|^2 - (L_{k-1}.L_k)^2 = alpha_k^2 of each corner.
    gram = alpha**2
    oddy = ((len2_prev - len2) ** 2 + 4 * dots**2) / (2 * gram.clamp_min(_TINY))
    oddy = _cap(oddy.amax(0), gram.amin(0) <= _TINY)
    aspect = _cap(lengths.amax(0) * lengths.sum(0) / (4 * area).clamp_min(_TINY), area <= 0)
    # With corner nodes included, the minimum of the bilinear map's det J is min(alpha)/4 and the area is
    # sum(alpha)/4, so Verdict's distortion (min det J * master area 4 / area) is jacobian / area.
    distortion = torch.where(
        area.abs() > _TINY, jac / torch.where(area.abs() > _TINY, area, torch.ones_like(area)), torch.zeros_like(area)
    )

    # Interior angle at corner k between -L_{k-1} and L_k; reflex (> 180 deg) where alpha_k < 0.
    angles = torch.remainder(torch.atan2(alpha, -dots), 2 * math.pi) * (180.0 / math.pi)
    largest, smallest = angles.amax(0), angles.amin(0)

    x1 = (p1 - p0) + (p2 - p3)
    x2 = (p2 - p1) + (p3 - p0)
    x12 = (p0 - p1) + (p2 - p3)
    n1, n2 = x1.norm(dim=-1), x2.norm(dim=-1)
    axes_bad = (n1 <= _TINY) | (n2 <= _TINY)
    skew = (_dot(x1, x2) / (n1 * n2).clamp_min(_TINY)).abs()
    skew = torch.where(axes_bad, torch.zeros_like(skew), skew)
    taper = _cap(x12.norm(dim=-1) / torch.minimum(n1, n2).clamp_min(_TINY), axes_bad)
    diag = torch.maximum((p2 - p0).norm(dim=-1), (p3 - p1).norm(dim=-1))
    stretch = math.sqrt(2.0) * lengths.amin(0) / diag.clamp_min(_TINY)
    stretch = torch.where(diag <= _TINY, torch.zeros_like(stretch), stretch)

    return {
        "aspectRatio": aspect,
        "conditionNumber": condition,
        "distortion": distortion,
        "jacobian": jac,
        "largestAngle": largest,
        "oddy": oddy,
        "scaledJacobian": scaled,
        "shape": shape,
        "shear": shear,
        "skew": skew,
        "smallestAngle": smallest,
        "stretch": stretch,
        "taper": taper,
        "volume": area,
    }
