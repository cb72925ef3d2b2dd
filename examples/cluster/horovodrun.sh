#!/usr/bin/env bash
# Horovod across nodes: run this once, on the first node; horovodrun starts every rank over ssh (passwordless ssh
# between the nodes, the same Python environment and working directory on each).
#   HOSTS=<node>,<node>,... bash examples/cluster/horovodrun.sh [overrides ...]
# NPROC processes per node (default 2), JOB_ID (names the run folder), SSH_PORT (default 22).
# Extra arguments are Hydra overrides, e.g. callbacks=kfac.
set -euo pipefail
: "${HOSTS:?set HOSTS to the comma-separated hostnames of the nodes}"
NPROC=${NPROC:-2}
JOB_ID=${JOB_ID:-digits-horovodrun}
SSH_PORT=${SSH_PORT:-22}
IFS=, read -ra nodes <<< "$HOSTS"
NNODES=${#nodes[@]}
slots=$(printf "%s:$NPROC," "${nodes[@]}")

exec horovodrun --gloo -np $(( NNODES * NPROC )) -H "${slots%,}" -p "$SSH_PORT" \
  python -m lightning_hpc train recipe=digits strategy=horovod \
  trainer.devices="$NPROC" trainer.num_nodes="$NNODES" hydra.run.dir="outputs/$JOB_ID" "$@"
