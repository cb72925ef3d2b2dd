#!/usr/bin/env bash
# A Hydra sweep submitted to SLURM by the submitit launcher (pip install -e ".[slurm]"): one 2-node job per value.
#   bash examples/cluster/submitit_sweep.sh [more overrides ...]
# tasks_per_node must equal trainer.devices (the launcher's default of 1 task per node does not match the
# recipe's 2 devices), and nodes must equal trainer.num_nodes.  NNODES (default 2), NPROC (default 2),
# LRS (comma-separated values to sweep, default 0.05,0.1).
set -euo pipefail
NNODES=${NNODES:-2}
NPROC=${NPROC:-2}
LRS=${LRS:-0.05,0.1}
PYTHON=${PYTHON:-python}

exec "$PYTHON" -m lightning_hpc train recipe=digits hydra/launcher=submitit_slurm --multirun \
  hydra.launcher.nodes="$NNODES" hydra.launcher.tasks_per_node="$NPROC" \
  trainer.devices="$NPROC" trainer.num_nodes="$NNODES" optimizer.lr="$LRS" "$@"
