#!/usr/bin/env bash
# srun on SLURM: one task per process, launched on a login node (or inside an salloc/sbatch allocation).
#   bash examples/cluster/srun.sh [overrides ...]
# NNODES (default 2), NPROC tasks per node (default 2), JOB_ID (names the run folder).  Give
# --ntasks-per-node: Lightning rejects `srun -n N` alone (it checks the tasks per node against trainer.devices).
# All ranks share hydra.run.dir (ranks that start in different seconds would otherwise make one folder each).
# EXTRA_SRUN_ARGS: more srun options (e.g. --distribution=cyclic). GPU clusters add --gpus-per-node="$NPROC" and trainer=gpu.
set -euo pipefail
NNODES=${NNODES:-2}
NPROC=${NPROC:-2}
JOB_ID=${JOB_ID:-digits-srun}
PYTHON=${PYTHON:-python}

exec srun --nodes="$NNODES" --ntasks-per-node="$NPROC" ${EXTRA_SRUN_ARGS:-} \
  "$PYTHON" -m lightning_hpc train recipe=digits \
  trainer.devices="$NPROC" trainer.num_nodes="$NNODES" hydra.run.dir="outputs/$JOB_ID" "$@"
