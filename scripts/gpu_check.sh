#!/usr/bin/env bash
# The GPU check, for a machine with one CUDA GPU (at most about 9.5 minutes): the GPU tier's tests (tests/gpu: every strategy
# with devices=1 on the GPU against the CPU, K-FAC in float32 / bf16-mixed / 16-mixed, a checkpoint saved on the
# GPU resumed on the CPU, two ranks sharing the GPU where gloo runs the collectives on CUDA), then the first GPU
# figures (bench/gpu_figures.py). Everything it writes goes to one folder:
#   machine.txt  gpu-tier-one-device.{log,xml}  gpu-tier-two-ranks.{log,xml}  figures.log  figures.json
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
  "$PY" -m pip install -q --no-deps --target "${TMPDIR:-/tmp}/gpu-check-site" "$KFAC_PYTORCH_WHEEL" && export PYTHONPATH="$PYTHONPATH:${TMPDIR:-/tmp}/gpu-check-site"
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
  echo "[gpu_check] no CUDA device visible to $PY: nothing to check" | tee -a "$OUT/gpu-tier-one-device.log"
  exit 2
fi
# The tier in two parts started together, each with its own limit (the single-device tests; the two ranks sharing
# the GPU, whose launches start together and are killed by name at their own limit), so a hang costs its part's
# limit and names what hung.
echo "[gpu_check] GPU tier (tests/gpu), two parts at once ..."
timeout 240 "$PY" -m pytest tests/gpu -m gpu -p no:cacheprovider -q -rA --durations=10 \
  --ignore=tests/gpu/test_two_ranks_share_gpu.py --junitxml="$OUT/gpu-tier-one-device.xml" \
  > "$OUT/gpu-tier-one-device.log" 2>&1 &
one=$!
timeout 270 "$PY" -m pytest tests/gpu/test_two_ranks_share_gpu.py -m gpu -p no:cacheprovider -q -rA -s \
  --junitxml="$OUT/gpu-tier-two-ranks.xml" > "$OUT/gpu-tier-two-ranks.log" 2>&1 &
two=$!
wait $one; tier_one=$?
wait $two; tier_two=$?
tail -n 40 "$OUT/gpu-tier-one-device.log" "$OUT/gpu-tier-two-ranks.log"
tier=$(( tier_one != 0 || tier_two != 0 ))
echo "[gpu_check] tier: one device exit $tier_one, two ranks exit $tier_two"
figures=0
if [ "${GPU_CHECK_FIGURES:-1}" != 0 ]; then
  echo "[gpu_check] figures (bench/gpu_figures.py) ..."
  timeout 300 "$PY" bench/gpu_figures.py --out "$OUT/figures.json" 2>&1 | tee "$OUT/figures.log"
  figures=${PIPESTATUS[0]}
fi
echo "[gpu_check] tier exit code $tier, figures exit code $figures; results in $OUT"
[ "$tier" = 0 ] && [ "$figures" = 0 ]
