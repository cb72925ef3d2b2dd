#!/usr/bin/env bash
# Multi-node torchrun with c10d rendezvous: run this same command on every node (in any order).
#   HEAD=<first node's hostname or address> bash examples/cluster/torchrun_c10d.sh [overrides ...]
# NNODES (default 2), NPROC processes per node (default 2), JOB_ID (same on every node; names the run folder),
# PORT (rendezvous port on HEAD, default 29500).  Extra arguments are Hydra overrides, e.g. strategy=layered_sgd.
set -euo pipefail
: "${HEAD:?set HEAD to the hostname or address of the first node}"
NNODES=${NNODES:-2}
NPROC=${NPROC:-2}
JOB_ID=${JOB_ID:-digits-torchrun}
PORT=${PORT:-29500}

exec torchrun --nnodes="$NNODES" --nproc-per-node="$NPROC" \
  --rdzv-backend=c10d --rdzv-endpoint="$HEAD:$PORT" --rdzv-id="$JOB_ID" \
  -m lightning_hpc train recipe=digits \
  trainer.devices="$NPROC" trainer.num_nodes="$NNODES" hydra.run.dir="outputs/$JOB_ID" "$@"
