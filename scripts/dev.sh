#!/usr/bin/env bash
# One entry point for the README's commands:
#   bash scripts/dev.sh train [recipe=... key=value ...]   set up .venv, then train (default recipe: digits)
#   bash scripts/dev.sh test  [pytest args ...]           set up .venv, then run the default test suite
#                                                         (pytest -m "not slow and not cluster"; a later -m replaces it:
#                                                         `test -m cluster tests/cluster`, `test -m slow`)
#   bash scripts/dev.sh setup                             only set up .venv
#   bash scripts/dev.sh torch-range newest|oldest [pytest args ...]
#                                                         the torch-range subset (pytest -m torch_range: imports, one
#                                                         fit per strategy, the spatial kernels, K-FAC numerics) on the
#                                                         newest / oldest torch release pyproject.toml admits, each in
#                                                         its own virtual environment (.venv-torch-newest,
#                                                         .venv-torch-oldest), made once and reused while its torch
#                                                         release and pyproject.toml are unchanged
# Environment: PYTHON (interpreter for the venv, default python3), VENV (default .venv),
# TORCH_SPEC (default torch==2.13.0, the CPU build on this kind of machine; GPU clusters: see README),
# TORCH_INDEX_URL (optional pip index for torch, e.g. a CUDA wheel index; https://download.pytorch.org/whl/cpu keeps
# torch-range's downloads small), TORCH_NEWEST / TORCH_OLDEST (the releases torch-range installs: the ends of the
# range pyproject.toml states, tests/test_packaging.py checks that they agree).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_NEWEST=${TORCH_NEWEST:-2.14.1}
TORCH_OLDEST=${TORCH_OLDEST:-2.9.0}

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

# The torch-range subset on one torch release, in its own virtual environment: made (torch, then the package with
# the test and digits extras) only when it is missing or holds another torch release, the package reinstalled when
# pyproject.toml changed, so a CI run downloads nothing once the environment exists.  Exit status 75 (EX_TEMPFAIL,
# which pytest never uses): the environment could not be made (the release does not install here); else pytest's.
torch_range() {
  local which=${1:-}
  local release
  case "$which" in
    newest) release=$TORCH_NEWEST ;;
    oldest) release=$TORCH_OLDEST ;;
    *) echo "usage: bash scripts/dev.sh torch-range newest|oldest [pytest args...]" >&2; exit 2 ;;
  esac
  shift
  local venv=".venv-torch-$which" extras=".[test,digits]" stamp  # digits: scipy, which K-FAC's BLAS tests use
  local py="$venv/bin/python"
  stamp="torch==$release $extras $(sha256sum pyproject.toml | cut -c1-16)"
  local have=""
  if [ -x "$py" ]; then
    have=$("$py" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
  fi
  if [ "$have" != "$release" ]; then
    echo "[torch-range] making $venv with torch $release (found: ${have:-none})"
    rm -f "$venv/.torch-range"
    if ! { "$PYTHON" -m venv --clear "$venv" &&
           "$py" -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$release"; }; then
      echo "[torch-range] torch $release does not install here: $venv not made" >&2
      exit 75
    fi
  fi
  if [ "$(cat "$venv/.torch-range" 2>/dev/null)" != "$stamp" ]; then
    echo "[torch-range] installing lightning_hpc ($extras) into $venv"
    # torch pinned in the same resolve: the package's dependencies never move it
    if ! "$py" -m pip install -q "torch==$release" -e "$extras"; then
      echo "[torch-range] lightning_hpc's dependencies do not install beside torch $release in $venv" >&2
      exit 75
    fi
    echo "$stamp" > "$venv/.torch-range"
  fi
  "$py" -c "import sys, torch, lightning; print(f'[torch-range] $which: torch {torch.__version__}, lightning \
{lightning.__version__}, python {sys.version.split()[0]} ($venv)')"
  "$py" -m pytest -m "torch_range and not slow and not cluster" "$@"
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
  torch-range) torch_range "$@" ;;
  *) echo "usage: bash scripts/dev.sh {setup|train|test|torch-range} [args...]" >&2; exit 2 ;;
esac
