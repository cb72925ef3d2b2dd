"""Performance model shared by the planners: alpha-beta collectives, calibration, measured layer times, and the
measured cost of synchronising busy ranks."""

from lightning_hpc.perfmodel import alphabeta
from lightning_hpc.perfmodel.alphabeta import AlphaBeta
from lightning_hpc.perfmodel.calibrate import calibrate, calibrate_local, fit_alpha_beta
from lightning_hpc.perfmodel.contention import compute_contention
from lightning_hpc.perfmodel.layer_times import LayerTimer, time_callable
from lightning_hpc.perfmodel.sync import SyncCost, calibrate_sync, measure_sync

__all__ = [
    "alphabeta",
    "AlphaBeta",
    "calibrate",
    "calibrate_local",
    "fit_alpha_beta",
    "compute_contention",
    "LayerTimer",
    "time_callable",
    "SyncCost",
    "calibrate_sync",
    "measure_sync",
]
