"""Settings of the multigrid solver (forward and backward set separately)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SolveSettings", "MultigridOptions", "RELAXATIONS"]

RELAXATIONS = ("F", "FCF")


@dataclass(frozen=True)
class SolveSettings:
    """When to stop the FAS iteration of one pass (Algorithm 1, step 6).

    ``cycles`` is the maximum number of V-cycles; ``tol`` (absolute L2 norm of the fine residual R_h, Eq. 19)
    stops earlier when reached.  ``tol=None`` runs exactly ``cycles`` cycles, as the paper's training does
    (two cycles, section IV-A, "early stopping").
    """

    cycles: int = 2
    tol: float | None = None

    def __post_init__(self) -> None:
        if self.cycles < 1:
            raise ValueError(f"cycles must be >= 1, got {self.cycles}")
        if self.tol is not None and not self.tol > 0:
            raise ValueError(f"tol must be positive or None (fixed number of cycles), got {self.tol}")


@dataclass(frozen=True)
class MultigridOptions:
    """Hierarchy and relaxation of the layer-parallel solver.

    Args:
        cfactor: coarsening factor c: every c-th layer is a C-layer of the next coarser level (Fig. 2).
        levels: number of levels; 1 = no multigrid (exact sequential propagation, the partitioned-model
            baseline); 2 = two-level FAS with an exact coarse solve; more = recursive V-cycles.
        relaxation: "F" (F-relaxation) or "FCF" (F-, C-, then F-relaxation; Fig. 3).
        forward / backward: stopping rules of the forward (state) and backward (adjoint) solves.
        concurrent: evaluate all blocks of a relaxation in one batched (vmapped) call; False evaluates them
            block after block (for comparison only).
        coarse_gather_threshold: with several layer-parallel ranks, gather the coarsest level onto every rank
            and solve it there serially when it has at most this many steps in all (N / c^(levels-1));
            0 (default) never gathers: the coarsest level is propagated rank after rank.  Same result either
            way (coarse.py).
    """

    cfactor: int = 4
    levels: int = 2
    relaxation: str = "FCF"
    forward: SolveSettings = SolveSettings()
    backward: SolveSettings = SolveSettings()
    concurrent: bool = True
    coarse_gather_threshold: int = 0

    def __post_init__(self) -> None:
        if self.coarse_gather_threshold < 0:
            raise ValueError(
                "coarse_gather_threshold must be >= 0 (0: never gather the coarsest level), got "
                f"{self.coarse_gather_threshold}"
            )
        if self.cfactor < 2:
            raise ValueError(f"cfactor must be >= 2 (every c-th layer is a coarse layer), got {self.cfactor}")
        if self.levels < 1:
            raise ValueError(f"levels must be >= 1, got {self.levels}")
        if self.relaxation not in RELAXATIONS:
            raise ValueError(f"relaxation must be one of {RELAXATIONS}, got {self.relaxation!r}")
