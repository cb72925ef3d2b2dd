"""A small physics model: a shocked bubble moving a 2-D Lagrangian quadrilateral mesh.

A planar shock travels in +z through ambient gas holding a circular bubble of a different density (the classic
shock-bubble interaction; Haas & Sturtevant, J. Fluid Mech. 181, 1987).  The model keeps the three mechanisms a
Lagrangian hydro code's mesh feels, each in a closed form so that it is fast and deterministic:

1. **Shock compression.**  Material behind the front moves at the particle speed ``u_p``; material ahead is at
   rest.  The nodal displacement per step is integrated exactly for a front moving at ``U_s``
   (``dz = (u_p / U_s) clip(z_s(t+dt) - z, 0, U_s dt)``), so the map stays monotone and compresses cells by
   ``U_s / (U_s - u_p)`` as in a real shock.
2. **Baroclinic vortex sheet.**  When the front crosses the interface, the misaligned pressure and density
   gradients deposit circulation ``dGamma = 2 A u_p sin(theta) ds`` (A: Atwood number, theta: angle between the
   interface normal and the shock normal; Rudinger & Somers 1960, Picone & Boris 1988).  The sheet is a chain of
   Lamb-Oseen blobs that advect each other (vortex-blob method), so the bubble rolls up into a vortex pair.
3. **Kelvin-Helmholtz roll-ups at grid scale.**  The sheared interface of a numerical simulation rolls up at the
   smallest scale the grid resolves (a few cells), which is what tangles Lagrangian meshes.  These secondary
   vortices are shielded (Gaussian) swirls ``u_theta = Omega r exp(-r^2 / sigma^2)`` riding on the interface,
   with cores of a few cells, whose spin grows after the shock passes.

Coordinates are ``(z, r)`` (the axial and radial directions of LBANN's RZ mesh data); ``z`` maps to the image
width (columns), ``r`` to the height (rows).  The domain is the unit square; the mesh is ``H x W`` cells.

Everything here is plain torch on CPU in float64 (node positions) / float32 (velocity grids).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["ShockBubble", "LagrangianMesh", "GAMMA_GAS"]

GAMMA_GAS = 1.4  # ratio of specific heats of both gases (ideal gas)


@dataclass(frozen=True)
class ShockBubble:
    """Parameters of one shock-bubble problem; :meth:`sample` draws them from a seed."""

    center_z: float
    center_r: float
    radius: float
    atwood: float  # (rho_bubble - rho_ambient) / (rho_bubble + rho_ambient)
    shock_speed: float  # U_s
    particle_speed: float  # u_p behind the front
    shock_start: float  # z of the front at t = 0
    primary_core: float  # Lamb-Oseen core radius of the sheet blobs (domain units)
    secondary_centers: tuple[tuple[float, float], ...]  # initial (z, r) of the grid-scale roll-ups
    secondary_core_cells: tuple[float, ...]  # core radius in cells
    secondary_turns: tuple[float, ...]  # rotation angle (rad) at full spin over the growth time, signed
    growth_time: float
    n_primary: int = 96

    @classmethod
    def sample(cls, seed: int, cells: int = 1024) -> ShockBubble:
        """Draw a problem; ``cells`` (mesh cells across the domain) sets how many grid-scale roll-ups the
        interface carries (one every 25-40 cells of perimeter, as a KH instability at grid scale would)."""
        rng = np.random.default_rng(seed)
        radius = float(rng.uniform(0.12, 0.2))
        center_z = float(rng.uniform(0.3, 0.42))
        center_r = float(rng.uniform(0.38, 0.62))
        # Light (helium-like) or heavy (R22-like) bubble.
        atwood = float(rng.choice([-1.0, 1.0]) * rng.uniform(0.3, 0.75))
        n_sec = max(int(round(2 * math.pi * radius * cells / rng.uniform(25, 40))), 3)
        angles = rng.uniform(0, 2 * math.pi, n_sec)
        # Roll-ups sit on the interface, slightly inside or outside it.
        rad = radius * (1 + rng.uniform(-0.04, 0.04, n_sec))
        centers = tuple(
            (float(center_z + r * math.cos(a)), float(center_r + r * math.sin(a))) for a, r in zip(angles, rad)
        )
        cores = tuple(float(c) for c in rng.uniform(2.5, 6.0, n_sec))
        # The sheet strength scales with |sin(theta)|: roll-ups are strongest where the front meets the
        # interface obliquely.  Their spin (turns) is drawn around what tangles a core of that size.
        strength = np.abs(np.sin(angles)) * 0.7 + 0.3
        turns = tuple(
            float(np.sign(math.sin(a) * atwood) * s * c * rng.uniform(0.8, 2.4))
            for a, s, c in zip(angles, strength, cores)
        )
        return cls(
            center_z=center_z,
            center_r=center_r,
            radius=radius,
            atwood=atwood,
            shock_speed=1.0,
            particle_speed=float(rng.uniform(0.3, 0.45)),
            shock_start=float(center_z - radius - rng.uniform(0.05, 0.1)),
            primary_core=0.02,
            secondary_centers=centers,
            secondary_core_cells=cores,
            secondary_turns=turns,
            growth_time=0.25,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def compression(self) -> float:
        """Density ratio across the front, ``U_s / (U_s - u_p)`` (mass conservation)."""
        return self.shock_speed / (self.shock_speed - self.particle_speed)

    def front(self, t: float) -> float:
        return self.shock_start + self.shock_speed * t


def _lamb_oseen(
    z: torch.Tensor, r: torch.Tensor, cz: torch.Tensor, cr: torch.Tensor, gamma: torch.Tensor, core: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Velocity of Lamb-Oseen vortices (circulation ``gamma``, core ``core``) at points; sums over vortices.

    ``z, r``: (...,) points; ``cz, cr, gamma``: (K,) vortices.
    """
    dz = z.unsqueeze(-1) - cz
    dr = r.unsqueeze(-1) - cr
    d2 = dz * dz + dr * dr
    factor = gamma / (2 * math.pi) * (-torch.expm1(-d2 / core**2)) / d2.clamp_min(1e-12)
    return (-dr * factor).sum(-1), (dz * factor).sum(-1)


class LagrangianMesh:
    """Nodes of an ``H x W`` quad mesh of the unit square, moved by the :class:`ShockBubble` flow.

    :meth:`step` advances one time step (exact shock displacement + midpoint rule for the vortical part).
    """

    #: extent of the Eulerian grids the velocity is sampled from (material moves right by at most ~0.3)
    Z_RANGE = (-0.05, 1.45)
    R_RANGE = (-0.1, 1.1)
    #: periodic box of the spectral sheet solve (padded so the images of the vortex pair are far away)
    SHEET_Z_RANGE = (-0.8, 2.2)
    SHEET_R_RANGE = (-1.0, 2.0)

    def __init__(
        self, problem: ShockBubble, height: int, width: int, dt: float = 0.0125, primary_grid: float = 1 / 128
    ) -> None:
        if height < 2 or width < 2:
            raise ValueError(f"mesh must have at least 2 x 2 cells, got {height} x {width}")
        self.p, self.height, self.width, self.dt = problem, height, width, dt
        self.h = 1.0 / max(height, width)
        self.t = 0.0
        r = torch.linspace(0, 1, height + 1, dtype=torch.float64)
        z = torch.linspace(0, 1, width + 1, dtype=torch.float64)
        self.r, self.z = torch.meshgrid(r, z, indexing="ij")
        self.r, self.z = self.r.clone(), self.z.clone()
        # Vortex sheet: blobs on the interface, circulation 2 A u_p sin(theta) ds (switched on by the front).
        n = problem.n_primary
        theta = torch.arange(n, dtype=torch.float64) * (2 * math.pi / n)
        self.sheet_z = problem.center_z + problem.radius * torch.cos(theta)
        self.sheet_r = problem.center_r + problem.radius * torch.sin(theta)
        ds = 2 * math.pi * problem.radius / n
        self.sheet_gamma = 2 * problem.atwood * problem.particle_speed * torch.sin(theta) * ds
        self.sheet_hit = (self.sheet_z - problem.shock_start) / problem.shock_speed  # time the front arrives
        sec = torch.tensor(problem.secondary_centers, dtype=torch.float64).reshape(-1, 2)
        self.sec_z, self.sec_r = sec[:, 0].clone(), sec[:, 1].clone()
        self.sec_core = torch.tensor(problem.secondary_core_cells, dtype=torch.float64) * self.h
        # Full spin Omega such that the core turns by ``secondary_turns`` radians over one growth time.
        self.sec_omega = torch.tensor(problem.secondary_turns, dtype=torch.float64) / problem.growth_time
        self.sec_hit = (self.sec_z - problem.shock_start) / problem.shock_speed
        # Coarse Eulerian grid for the (smooth) sheet velocity; fine (cell-size) grid for the roll-ups.
        self._coarse = self._grid(primary_grid, self.SHEET_Z_RANGE, self.SHEET_R_RANGE)
        self._fine = self._grid(self.h, self.Z_RANGE, self.R_RANGE)

    @staticmethod
    def _grid(
        spacing: float, z_range: tuple[float, float], r_range: tuple[float, float]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        nz = int(math.ceil((z_range[1] - z_range[0]) / spacing))
        nr = int(math.ceil((r_range[1] - r_range[0]) / spacing))
        gz = z_range[0] + spacing * torch.arange(nz + 1, dtype=torch.float64)
        gr = r_range[0] + spacing * torch.arange(nr + 1, dtype=torch.float64)
        return gz, gr

    # ---- vortical velocity ---------------------------------------------------------------------------
    def _sheet_strength(self, t: float) -> torch.Tensor:
        # The front deposits the circulation as it sweeps a blob (ramp over the front's crossing time).
        ramp = ((t - self.sheet_hit) / (self.p.primary_core / self.p.shock_speed)).clamp(0, 1)
        return self.sheet_gamma * ramp

    def _spin(self, t: float) -> torch.Tensor:
        return self.sec_omega * ((t - self.sec_hit) / self.p.growth_time).clamp(0, 1)

    def _drift_at(self, z: torch.Tensor, t: float) -> torch.Tensor:
        return torch.where(z < self.p.front(t), torch.full_like(z, self.p.particle_speed), torch.zeros_like(z))

    def _advect_vortices(self, t: float, dt: float) -> None:
        """Move sheet blobs and roll-up centres with the sheet velocity and the shock drift (midpoint rule)."""

        def vel(sz, sr, cz, cr, tt):
            gamma = self._sheet_strength(tt)
            u_s, v_s = _lamb_oseen(sz, sr, sz, sr, gamma, self.p.primary_core)  # self-term is zero
            u_c, v_c = _lamb_oseen(cz, cr, sz, sr, gamma, self.p.primary_core)
            return u_s + self._drift_at(sz, tt), v_s, u_c + self._drift_at(cz, tt), v_c

        sz, sr, cz, cr = self.sheet_z, self.sheet_r, self.sec_z, self.sec_r
        a = vel(sz, sr, cz, cr, t)
        b = vel(sz + 0.5 * dt * a[0], sr + 0.5 * dt * a[1], cz + 0.5 * dt * a[2], cr + 0.5 * dt * a[3], t + 0.5 * dt)
        self.sheet_z, self.sheet_r = sz + dt * b[0], sr + dt * b[1]
        self.sec_z, self.sec_r = cz + dt * b[2], cr + dt * b[3]

    def _sheet_grid(self, t: float) -> torch.Tensor:
        """Sheet velocity on the coarse periodic box: Biot-Savart of the Lamb-Oseen blobs solved spectrally.

        The blobs' circulation is deposited bilinearly on the grid; in Fourier space the Lamb-Oseen core is the
        factor ``exp(-k^2 sigma^2 / 4)`` and the stream function is ``omega_hat / k^2`` (``u = d psi / dr``,
        ``v = -d psi / dz``).  The box is padded well beyond the mesh and the sheet's net circulation is zero, so
        the periodic images are negligible.
        """
        gz, gr = self._coarse
        d = float(gz[1] - gz[0])
        nz, nr = gz.numel(), gr.numel()
        fz = (self.sheet_z - gz[0]) / d
        fr = (self.sheet_r - gr[0]) / d
        j, i = fz.floor().long(), fr.floor().long()
        wz, wr = fz - j, fr - i
        gamma = self._sheet_strength(t)
        omega = torch.zeros(nr * nz, dtype=torch.float64)
        for di, dj, w in ((0, 0, (1 - wr) * (1 - wz)), (0, 1, (1 - wr) * wz), (1, 0, wr * (1 - wz)), (1, 1, wr * wz)):
            ii, jj = (i + di).clamp(0, nr - 1), (j + dj).clamp(0, nz - 1)
            omega.index_add_(0, ii * nz + jj, gamma * w / d**2)
        omega_hat = torch.fft.rfft2(omega.view(nr, nz))
        kr = (2 * math.pi * torch.fft.fftfreq(nr, d, dtype=torch.float64)).unsqueeze(1)
        kz = 2 * math.pi * torch.fft.rfftfreq(nz, d, dtype=torch.float64)
        k2 = kr**2 + kz**2
        psi_hat = (
            omega_hat * torch.exp(-k2 * self.p.primary_core**2 / 4) / torch.where(k2 == 0, torch.ones_like(k2), k2)
        )
        psi_hat[0, 0] = 0
        u = torch.fft.irfft2(1j * kr * psi_hat, s=(nr, nz))
        v = torch.fft.irfft2(-1j * kz * psi_hat, s=(nr, nz))
        return torch.stack([u, v]).float()

    def _rollup_grid(self, t: float) -> torch.Tensor:
        gz, gr = self._fine
        field = torch.zeros(2, gr.numel(), gz.numel(), dtype=torch.float32)
        spin = self._spin(t)
        dz, dr = float(gz[1] - gz[0]), float(gr[1] - gr[0])
        for k in torch.nonzero(spin != 0).flatten().tolist():
            core = float(self.sec_core[k])
            reach = 3.5 * core  # exp(-12) beyond: the swirl is shielded
            cz, cr = float(self.sec_z[k]), float(self.sec_r[k])
            j0 = max(int(math.floor((cz - reach - gz[0]) / dz)), 0)
            j1 = min(int(math.ceil((cz + reach - gz[0]) / dz)) + 1, gz.numel())
            i0 = max(int(math.floor((cr - reach - gr[0]) / dr)), 0)
            i1 = min(int(math.ceil((cr + reach - gr[0]) / dr)) + 1, gr.numel())
            if j0 >= j1 or i0 >= i1:
                continue
            wz = gz[j0:j1] - cz
            wr = (gr[i0:i1] - cr).unsqueeze(1)
            g = float(spin[k]) * torch.exp(-(wz**2 + wr**2) / core**2)
            field[0, i0:i1, j0:j1] += (-wr * g).float()
            field[1, i0:i1, j0:j1] += (wz * g).float()
        return field

    @staticmethod
    def _sample(
        field: torch.Tensor, grid: tuple[torch.Tensor, torch.Tensor], z: torch.Tensor, r: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bilinear interpolation of a (2, nr, nz) field on ``grid`` (its z and r nodes) at points."""
        gz0, gz1, gr0, gr1 = float(grid[0][0]), float(grid[0][-1]), float(grid[1][0]), float(grid[1][-1])
        gz = 2 * (z - gz0) / (gz1 - gz0) - 1
        gr = 2 * (r - gr0) / (gr1 - gr0) - 1
        points = torch.stack([gz, gr], dim=-1).float().unsqueeze(0)
        out = F.grid_sample(field.unsqueeze(0), points, mode="bilinear", padding_mode="border", align_corners=True)[0]
        return out[0].double(), out[1].double()

    def vortical_velocity(self, z: torch.Tensor, r: torch.Tensor, t: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Sheet + roll-up velocity at points (the shock drift is integrated separately, exactly)."""
        u1, v1 = self._sample(self._sheet_grid(t), self._coarse, z, r)
        u2, v2 = self._sample(self._rollup_grid(t), self._fine, z, r)
        return u1 + u2, v1 + v2

    def velocity(self, t: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Total nodal velocity (drift + vortical) at time ``t`` (default: now)."""
        t = self.t if t is None else t
        u, v = self.vortical_velocity(self.z, self.r, t)
        return u + self._drift_at(self.z, t), v

    # ---- time stepping -------------------------------------------------------------------------------
    def step(self) -> None:
        t, dt = self.t, self.dt
        # Midpoint rule for the vortical part, evaluated on the mesh moved by half a step.
        u0, v0 = self.vortical_velocity(self.z, self.r, t)
        u1, v1 = self.vortical_velocity(self.z + 0.5 * dt * u0, self.r + 0.5 * dt * v0, t + 0.5 * dt)
        # Exact displacement by the front: material crossed during the step moves for the remaining time only.
        us, up = self.p.shock_speed, self.p.particle_speed
        shock = (up / us) * (self.p.front(t + dt) - self.z).clamp(0.0, us * dt)
        self.z = self.z + dt * u1 + shock
        self.r = self.r + dt * v1
        self._advect_vortices(t, dt)
        self.t = t + dt

    def nodes(self) -> torch.Tensor:
        """Node positions, shape ``(H+1, W+1, 2)`` as ``(z, r)``."""
        return torch.stack([self.z, self.r], dim=-1)
