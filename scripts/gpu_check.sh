#!/usr/bin/env bash
# The GPU check, for a machine with one CUDA GPU (about 8 minutes): the GPU tier's tests (tests/gpu: every strategy
# with devices=1 on the GPU against the CPU, K-FAC in float32 / bf16-mixed / 16-mixed, a checkpoint saved on the
# GPU resumed on the CPU, two ranks sharing the GPU where gloo runs the collectives on CUDA), then the first GPU
# figures (bench/gpu_figures.py). Everything it writes goes to one folder:
#   machine.txt  gpu-tier.log  gpu-tier.xml  figures.log  figures.json
#
#   bash scripts/gpu_check.sh [OUTDIR]            default OUTDIR: gpu-check-<UTC time>
#
# Environment: PYTHON (default .venv/bin/python when it exists, else python3; it needs torch with CUDA, lightning,
# torchmetrics, pytest, pytest-timeout: the package itself is used from this checkout), GPU_CHECK_FIGURES=0 skips
# the figures, KFAC_PYTORCH_WHEEL (a kfac-pytorch 0.4.2 wheel to install beside, for the K-FAC comparison).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -n "${KFAC_PYTORCH_WHEEL:-}" ]; then
  "$PY" -m pip install -q --no-deps --target "$OUT/site" "$KFAC_PYTORCH_WHEEL" && export PYTHONPATH="$PYTHONPATH:$OUT/site"
fi
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  "$PY" -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'lightning', lightning.__version__, 'gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"
  echo "cpus: $(nproc)"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "[gpu_check] no CUDA device visible to $PY: nothing to check" | tee -a "$OUT/gpu-tier.log"
  exit 2
fi
echo "[gpu_check] GPU tier (tests/gpu) ..."
timeout 360 "$PY" -m pytest tests/gpu -m gpu -p no:cacheprovider -q -rA --durations=15 \
  --junitxml="$OUT/gpu-tier.xml" 2>&1 | tee "$OUT/gpu-tier.log"
tier=${PIPESTATUS[0]}
figures=0
if [ "${GPU_CHECK_FIGURES:-1}" != 0 ]; then
  echo "[gpu_check] figures (bench/gpu_figures.py) ..."
  timeout 180 "$PY" bench/gpu_figures.py --out "$OUT/figures.json" 2>&1 | tee "$OUT/figures.log"
  figures=${PIPESTATUS[0]}
fi
echo "[gpu_check] tier exit code $tier, figures exit code $figures; results in $OUT"
[ "$tier" = 0 ] && [ "$figures" = 0 ]
