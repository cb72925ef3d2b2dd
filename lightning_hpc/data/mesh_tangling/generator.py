"""One mesh-tangling sample: 18 input channels and the ``mask`` label, from a seed and an index.

The input is the state of a Lagrangian hydro mesh (:mod:`.physics`) after ``steps`` time steps: per-cell fields
(density, pressure, radial velocity, bubble volume fraction) and the 14 Verdict quad-quality metrics
(:mod:`.quality`).  The label marks the cells whose Jacobian (smallest corner area) becomes non-positive at any
of the next ``lookahead`` steps if the mesh keeps moving with the flow, i.e. the cells a code would have to relax
now to avoid tangling (the task of Dryden et al., section VI).

Channel names are the ones of LBANN's mesh reader; the sample is a dict ``name -> float32 array (H, W)``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lightning_hpc.data.mesh_tangling.physics import (
    GAMMA_GAS,
    LagrangianMesh,
    ShockBubble,
)
from lightning_hpc.data.mesh_tangling.quality import (
    QUALITY_METRICS,
    min_corner_jacobian,
    quad_quality,
)

__all__ = ["CHANNELS", "TARGET", "FIELDS", "sample_seed", "generate_sample", "DEFAULT_STEPS", "DEFAULT_LOOKAHEAD"]

FIELDS = ("Density", "Pressure", "VectorComp_AvgVelocity_R", "VolumeFractions_bubble")
#: the 18 input channels, in LBANN's order
CHANNELS = FIELDS + QUALITY_METRICS
TARGET = "mask"

DEFAULT_STEPS = 36
DEFAULT_LOOKAHEAD = 6


def sample_seed(seed: int, index: int) -> int:
    """The problem seed of sample ``index`` of a data set with base ``seed`` (independent streams)."""
    if index < 0:
        raise ValueError(f"sample index must be >= 0, got {index}")
    return int(np.random.SeedSequence([int(seed), int(index)]).generate_state(1)[0])


def _volume_fraction(problem: ShockBubble, height: int, width: int) -> torch.Tensor:
    """Initial fraction of each cell inside the bubble (signed distance of the centre, one-cell ramp).

    Lagrangian cells keep their material, so this is also the fraction at any later time.
    """
    hr, hz = 1.0 / height, 1.0 / width
    rc = (torch.arange(height, dtype=torch.float64) + 0.5) * hr
    zc = (torch.arange(width, dtype=torch.float64) + 0.5) * hz
    rr, zz = torch.meshgrid(rc, zc, indexing="ij")
    dist = torch.sqrt((zz - problem.center_z) ** 2 + (rr - problem.center_r) ** 2) - problem.radius
    return (0.5 - dist / math.hypot(hr, hz)).clamp(0.0, 1.0)


def _cell_mean(nodal: torch.Tensor) -> torch.Tensor:
    return 0.25 * (nodal[:-1, :-1] + nodal[:-1, 1:] + nodal[1:, 1:] + nodal[1:, :-1])


def generate_sample(
    seed: int,
    index: int,
    size: int | tuple[int, int] = 1024,
    steps: int = DEFAULT_STEPS,
    lookahead: int = DEFAULT_LOOKAHEAD,
    dt: float = 0.0125,
) -> dict[str, np.ndarray]:
    """Channels (float32, shape ``(H, W)``) and ``mask`` (float32 0/1) of sample ``index``."""
    height, width = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    if steps < 1 or lookahead < 1:
        raise ValueError(f"steps and lookahead must be >= 1, got steps={steps}, lookahead={lookahead}")
    problem = ShockBubble.sample(sample_seed(seed, index), cells=max(height, width))
    mesh = LagrangianMesh(problem, height, width, dt=dt)
    area0 = (1.0 / height) * (1.0 / width)
    for _ in range(steps):
        mesh.step()
    nodes = mesh.nodes()
    out: dict[str, torch.Tensor] = dict(quad_quality(nodes))

    # Per-cell state: Lagrangian mass conservation gives the density, an ideal-gas isentrope (with the
    # Rankine-Hugoniot entropy jump for shocked cells) the pressure, less the swirl's dynamic pressure.
    frac = _volume_fraction(problem, height, width)
    rho_bubble = (1 + problem.atwood) / (1 - problem.atwood)
    rho0 = frac * rho_bubble + (1 - frac)
    density = rho0 * area0 / out["volume"].clamp_min(1e-3 * area0)
    g, eta = GAMMA_GAS, problem.compression
    p_ratio = ((g + 1) * eta - (g - 1)) / ((g + 1) - (g - 1) * eta)
    zc = _cell_mean(mesh.z)
    shocked = zc < problem.front(mesh.t)
    entropy = torch.where(shocked, p_ratio / (eta * rho0) ** g, 1.0 / rho0**g)
    u_vort, v_vort = mesh.vortical_velocity(mesh.z, mesh.r, mesh.t)
    swirl2 = _cell_mean(u_vort**2 + v_vort**2)
    out["Density"] = density
    out["Pressure"] = entropy * density**g - 0.5 * density * swirl2
    out["VectorComp_AvgVelocity_R"] = _cell_mean(v_vort)  # the drift is along z, so v is all vortical
    out["VolumeFractions_bubble"] = frac

    # Label: cells whose smallest corner area turns <= 0 within the next ``lookahead`` steps.
    tangles = torch.zeros(height, width, dtype=torch.bool)
    for _ in range(lookahead):
        mesh.step()
        tangles |= min_corner_jacobian(mesh.nodes()) <= 0
    sample = {name: out[name].to(torch.float32).numpy() for name in CHANNELS}
    sample[TARGET] = tangles.to(torch.float32).numpy()
    return sample
