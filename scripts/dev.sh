#!/usr/bin/env bash
# One entry point for the README's commands:
#   bash scripts/dev.sh train [recipe=... key=value ...]   set up .venv, then train (default recipe: digits)
#   bash scripts/dev.sh test  [pytest args ...]           set up .venv, then run the default test suite
#                                                         (pytest -m "not slow and not cluster"; a later -m replaces it:
#                                                         `test -m cluster tests/cluster`, `test -m slow`)
#   bash scripts/dev.sh setup                             only set up .venv
# Environment: PYTHON (interpreter for the venv, default python3), VENV (default .venv),
# TORCH_SPEC (default torch==2.13.0, the CPU build on this kind of machine; GPU clusters: see README),
# TORCH_INDEX_URL (optional pip index for torch, e.g. a CUDA wheel index).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
  fi
  local py="$VENV/bin/python"
  # torch first, so the package's `torch>=` requirement is already satisfied (no CUDA wheels pulled in).
  if ! "$py" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] installing $TORCH_SPEC"
    "$py" -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
  fi
  echo "[setup] installing lightning_hpc with test, digits and bench extras"
  "$py" -m pip install -q -e ".[test,digits,bench]"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup ;;
  train) setup; exec "$VENV/bin/lightning-hpc" train "$@" ;;
  test)
    setup
    if ! "$VENV/bin/python" -c "import horovod.torch" >/dev/null 2>&1; then
      echo "[test] Horovod is not installed: the horovod tests will be reported as skipped (bash scripts/install-horovod.sh to run them)"
    fi
    exec "$VENV/bin/python" -m pytest -m "not slow and not cluster" "$@" ;;
  *) echo "usage: bash scripts/dev.sh {setup|train|test} [args...]" >&2; exit 2 ;;
esac
