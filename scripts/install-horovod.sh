#!/usr/bin/env bash
# Build and install Horovod against the torch already installed in a Python environment.
#
# Usage:  scripts/install-horovod.sh [PYTHON]
#         PYTHON defaults to $PYTHON, then to the `python` on PATH (the active environment).
#
# Why a script: Horovod 0.28.1 (the latest release) ships only an sdist, and its CMake pins C++14
# (`set(CMAKE_CXX_STANDARD 14)`), while the headers of torch >= 2.1 need C++17.  We build it with a
# compiler wrapper that rewrites -std=c++14/gnu++14 to c++17/gnu++17 (nothing else changes).
#
# What gets built:
#   * always: PyTorch framework + Gloo controller (horovodrun --gloo), no TensorFlow / MXNet;
#   * MPI controller when an MPI compiler wrapper (mpicxx) is on PATH (then mpirun/srun launches work);
#   * NCCL GPU operations (HOROVOD_GPU_OPERATIONS=NCCL) when torch was built with CUDA and nvcc is found.
# Every one of these can be forced through Horovod's own variables (HOROVOD_WITH_MPI=1,
# HOROVOD_WITHOUT_MPI=1, HOROVOD_GPU_OPERATIONS=..., HOROVOD_NCCL_HOME=..., HOROVOD_CUDA_HOME=...), which this
# script leaves alone when they are already set.
#
# Idempotent: if `import horovod.torch` already works (and `horovodrun --check-build` lists PyTorch and
# Gloo) nothing is built.  FORCE=1 rebuilds.  Built wheels are cached per (horovod, torch, python, GPU ops)
# in $HOROVOD_WHEEL_CACHE (default ~/.cache/lightning_hpc/horovod), so a fresh virtualenv on the same
# machine installs in seconds; HOROVOD_WHEEL_CACHE=off disables the cache.
#
# Other knobs: HOROVOD_VERSION (default 0.28.1), BUILD_JOBS (default: number of CPUs), KEEP_DEBUG_INFO=1
# (Horovod builds RelWithDebInfo; by default we drop -g, which makes the build faster and smaller).
set -euo pipefail

PY="${1:-${PYTHON:-python}}"
HOROVOD_VERSION="${HOROVOD_VERSION:-0.28.1}"
FORCE="${FORCE:-0}"

log() { echo "[install-horovod] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

command -v "$PY" >/dev/null 2>&1 || die "python '$PY' not found; pass the interpreter as the first argument"
PY="$(command -v "$PY")"
"$PY" -c "import torch" 2>/dev/null || die "torch is not importable from $PY; install torch first"

SCRIPTS_DIR="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
horovodrun_cmd() {
    if [ -x "$SCRIPTS_DIR/horovodrun" ]; then
        "$SCRIPTS_DIR/horovodrun" "$@"
    else
        "$PY" -c 'import sys; from horovod.runner.launch import run_commandline; sys.argv[0] = "horovodrun"; run_commandline()' "$@"
    fi
}

TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__)')"
TORCH_CUDA="$("$PY" -c 'import torch; print(torch.version.cuda or "")')"

# ---- which features to build ---------------------------------------------------------------------
export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
if [ -z "${HOROVOD_WITH_MPI:-}" ] && [ -z "${HOROVOD_WITHOUT_MPI:-}" ]; then
    if command -v mpicxx >/dev/null 2>&1; then
        export HOROVOD_WITH_MPI=1
    else
        export HOROVOD_WITHOUT_MPI=1
    fi
fi

WANT_NCCL=0
if [ -n "${HOROVOD_GPU_OPERATIONS:-}" ]; then
    [ "$HOROVOD_GPU_OPERATIONS" = "NCCL" ] && WANT_NCCL=1
elif [ -n "$TORCH_CUDA" ]; then
    NVCC=""
    if [ -n "${HOROVOD_CUDA_HOME:-}" ] && [ -x "$HOROVOD_CUDA_HOME/bin/nvcc" ]; then NVCC="$HOROVOD_CUDA_HOME/bin/nvcc"
    elif [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then NVCC="$CUDA_HOME/bin/nvcc"
    elif command -v nvcc >/dev/null 2>&1; then NVCC="$(command -v nvcc)"
    elif [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc
    fi
    if [ -n "$NVCC" ]; then
        export HOROVOD_GPU_OPERATIONS=NCCL
        export HOROVOD_CUDA_HOME="${HOROVOD_CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}"
        WANT_NCCL=1
    else
        log "WARNING: torch $TORCH_VERSION has CUDA $TORCH_CUDA but no nvcc (CUDA toolkit) was found;"
        log "         building CPU-only Horovod (Gloo on host memory). Set CUDA_HOME to build NCCL operations."
    fi
fi

check_build() {
    # A working install: horovod.torch imports, and check-build lists PyTorch + Gloo (+ NCCL when wanted).
    "$PY" -c "import horovod.torch as hvd; assert hvd.gloo_built(), 'Horovod built without Gloo'" || return 1
    local out
    out="$(horovodrun_cmd --check-build 2>&1)" || { echo "$out" >&2; return 1; }
    echo "$out" >&2
    echo "$out" | grep -q '\[X\] PyTorch' || { log "check-build: PyTorch framework missing"; return 1; }
    echo "$out" | grep -q '\[X\] Gloo' || { log "check-build: Gloo controller missing"; return 1; }
    if [ "$WANT_NCCL" = 1 ]; then
        echo "$out" | grep -q '\[X\] NCCL' || { log "check-build: NCCL operations missing"; return 1; }
    fi
    return 0
}

if [ "$FORCE" != 1 ] && "$PY" -c "import horovod.torch" 2>/dev/null; then
    if check_build; then
        log "Horovod already works with $PY (torch $TORCH_VERSION); nothing to do (FORCE=1 rebuilds)."
        exit 0
    fi
    log "an installed Horovod does not pass the check; rebuilding"
fi

# ---- wheel cache -------------------------------------------------------------------------------------
PY_TAG="$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
GPU_TAG="cpu"; [ "$WANT_NCCL" = 1 ] && GPU_TAG="nccl-cuda${TORCH_CUDA}"
MPI_TAG="nompi"; [ "${HOROVOD_WITH_MPI:-}" = 1 ] && MPI_TAG="mpi"
CACHE_ROOT="${HOROVOD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lightning_hpc/horovod}"
CACHE_DIR=""
if [ "$CACHE_ROOT" != off ]; then
    CACHE_DIR="$CACHE_ROOT/horovod-${HOROVOD_VERSION}-torch-${TORCH_VERSION}-${PY_TAG}-${GPU_TAG}-${MPI_TAG}"
fi

install_cached_wheel() {
    [ -n "$CACHE_DIR" ] || return 1
    local whl
    whl="$(ls "$CACHE_DIR"/horovod-*.whl 2>/dev/null | head -n1)" || true
    [ -n "$whl" ] || return 1
    log "installing cached wheel $whl"
    "$PY" -m pip install --no-deps --force-reinstall "$whl" >&2 && "$PY" -m pip install "$whl" >&2 && check_build
}

if [ "$FORCE" != 1 ] && install_cached_wheel; then
    log "done (from the wheel cache)"
    exit 0
fi

# ---- build ----------------------------------------------------------------------------------------------
WORK="$(mktemp -d -t install-horovod.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT

# build prerequisites of `--no-build-isolation` (setup.py imports packaging; the build uses setuptools/wheel)
"$PY" -c "import setuptools, wheel, packaging" 2>/dev/null || "$PY" -m pip install setuptools wheel packaging >&2
command -v cmake >/dev/null 2>&1 || log "cmake not on PATH: Horovod's setup.py will pip-install a temporary one"

REAL_CXX="${CXX:-$(command -v g++ || command -v c++ || true)}"
[ -n "$REAL_CXX" ] || die "no C++ compiler found (install g++ or set CXX)"
REAL_CXX="$(command -v "$REAL_CXX")"
# The wrapper: C++17 instead of the C++14/C++11 Horovod's CMake asks for; optionally no -g.
cat >"$WORK/cxx" <<EOF
#!/usr/bin/env bash
args=()
for a in "\$@"; do
    case "\$a" in
        -std=c++14|-std=c++11|-std=c++1y|-std=c++0x) args+=("-std=c++17") ;;
        -std=gnu++14|-std=gnu++11|-std=gnu++1y|-std=gnu++0x) args+=("-std=gnu++17") ;;
        -g) if [ "${KEEP_DEBUG_INFO:-0}" = 1 ]; then args+=("\$a"); fi ;;
        *) args+=("\$a") ;;
    esac
done
exec "$REAL_CXX" "\${args[@]}"
EOF
chmod +x "$WORK/cxx"
export CXX="$WORK/cxx"

if [ "$WANT_NCCL" = 1 ] && [ -z "${HOROVOD_NCCL_HOME:-}${HOROVOD_NCCL_INCLUDE:-}" ]; then
    # torch's CUDA wheels ship NCCL as the nvidia-nccl-cu* package: headers + libnccl.so.2 (no libnccl.so
    # link, which CMake's find_library needs), so expose it through a temporary prefix.
    NCCL_PKG="$("$PY" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)"
    if [ -n "$NCCL_PKG" ] && [ -f "$NCCL_PKG/include/nccl.h" ]; then
        mkdir -p "$WORK/nccl/lib"
        ln -s "$NCCL_PKG/include" "$WORK/nccl/include"
        ln -s "$NCCL_PKG/lib/libnccl.so.2" "$WORK/nccl/lib/libnccl.so"
        export HOROVOD_NCCL_HOME="$WORK/nccl" HOROVOD_NCCL_LINK=SHARED
        log "using NCCL from torch's nvidia-nccl package: $NCCL_PKG"
    fi
fi

export MAKEFLAGS="${MAKEFLAGS:--j${BUILD_JOBS:-$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)}}"
log "building horovod==$HOROVOD_VERSION for torch $TORCH_VERSION ($PY_TAG, $GPU_TAG, $MPI_TAG) with MAKEFLAGS=$MAKEFLAGS"
log "  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=${HOROVOD_WITH_MPI:-} HOROVOD_WITHOUT_MPI=${HOROVOD_WITHOUT_MPI:-} HOROVOD_GPU_OPERATIONS=${HOROVOD_GPU_OPERATIONS:-}"
start=$(date +%s)
"$PY" -m pip wheel --no-build-isolation --no-deps --no-binary horovod --no-cache-dir \
    -w "$WORK/wheel" "horovod==$HOROVOD_VERSION" >&2
whl="$(ls "$WORK"/wheel/horovod-*.whl | head -n1)"
log "built $whl in $(( $(date +%s) - start )) s"
"$PY" -m pip install --force-reinstall --no-deps "$whl" >&2
"$PY" -m pip install "$whl" >&2   # runtime dependencies (cloudpickle, psutil, pyyaml, packaging)
if [ -n "$CACHE_DIR" ]; then
    mkdir -p "$CACHE_DIR" && cp "$whl" "$CACHE_DIR/" && log "cached the wheel in $CACHE_DIR"
fi
check_build || die "Horovod installed but the check failed (see above)"
log "done in $(( $(date +%s) - start )) s"
