#!/usr/bin/env bash
# Multi-node torchrun with static rendezvous: every node gets its own NODE_RANK (0 on HEAD).
#   HEAD=<node 0's hostname or address> NODE_RANK=<0..NNODES-1> bash examples/cluster/torchrun_static.sh [overrides ...]
# NNODES (default 2), NPROC processes per node (default 2), JOB_ID (names the run folder, same on every node),
# PORT (master port on HEAD, default 29500).  Without --node-rank every node would claim rank 0 and wait forever.
set -euo pipefail
: "${HEAD:?set HEAD to the hostname or address of node 0}"
: "${NODE_RANK:?set NODE_RANK (0 on the node HEAD names, 1.. on the others)}"
NNODES=${NNODES:-2}
NPROC=${NPROC:-2}
JOB_ID=${JOB_ID:-digits-torchrun}
PORT=${PORT:-29500}

exec torchrun --nnodes="$NNODES" --nproc-per-node="$NPROC" --node-rank="$NODE_RANK" \
  --master-addr="$HEAD" --master-port="$PORT" \
  -m lightning_hpc train recipe=digits \
  trainer.devices="$NPROC" trainer.num_nodes="$NNODES" hydra.run.dir="outputs/$JOB_ID" "$@"
