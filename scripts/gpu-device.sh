#!/usr/bin/env bash
# On a lent GPU machine, from the repo root, with .devcarry/ made by scripts/gpu-carry.sh: build the cuda preset for
# this GPU from the carried patched tree (cuBLAS from the machine's toolkit or its Python packages), then
# scripts/gpu-check.sh on that build with the machine's python3.  Args: gpu-check steps (default "2 4 5"), build
# timeout in seconds (default 330).  Logs and the report go to $OUT.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
D=$PWD/.devcarry; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS="${1:-2 4 5}"; BUILD_T="${2:-330}"; T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,compute_cap,driver_version --format=csv,noheader
ARCH="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')"
if [ ! -x build-cuda/bin/llama-perplexity ]; then
    mkdir -p vendor && cp "$D/stamp" vendor/.llama.cpp-stamp
    python3 -c "import tarfile; tarfile.open('$D/vendor.tar.xz').extractall('vendor')"
    extra=()
    if [ ! -f /usr/local/cuda/lib64/libcublas.so ]; then
        extra+=(-DCUDA_cublas_LIBRARY="$(find /opt /usr -name 'libcublas.so.1*' 2>/dev/null | head -1)"
                -DCUDA_cublasLt_LIBRARY="$(find /opt /usr -name 'libcublasLt.so.1*' 2>/dev/null | head -1)")
    fi
    cmake --preset cuda -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DGGML_CCACHE=OFF "${extra[@]}" > "$OUT/configure.log" 2>&1 ||
        { tail -40 "$OUT/configure.log"; exit 1; }
    timeout "$BUILD_T" cmake --build build-cuda -j "$(nproc)" --target llama-perplexity llama-cli llama-mtmd-cli llama-bench \
        > "$OUT/build.log" 2>&1
    rc=$?; echo "build rc=$rc in $(( $(date +%s) - T0 )) s"
    [ $rc = 0 ] || { grep -m3 -A8 FAILED "$OUT/build.log"; tail -5 "$OUT/build.log"; exit 1; }
fi
libs=$(dirname "$(find /opt /usr -name 'libcublasLt.so.1*' 2>/dev/null | head -1)" 2>/dev/null)
export LD_LIBRARY_PATH="$PWD/build-cuda/bin:${libs}:${LD_LIBRARY_PATH:-}"
export PYTHONPATH="$D:$PWD" VIS_SMOLLM2_GGUF="$D/tok.gguf" VIS_GPU_CHECK_BIN="$PWD/build-cuda/bin" VIS_GPU_CHECK_PYTHON=python3
VIS_GPU_CHECK_STEPS="$STEPS" bash scripts/gpu-check.sh > "$OUT/gpu-check.stdout" 2>&1
echo "gpu-check rc=$? at $(( $(date +%s) - T0 )) s"
cat "$OUT/gpu-report.md"
