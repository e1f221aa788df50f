#!/usr/bin/env bash
# Cross-compile the CPU build for aarch64 (Jetson Orin's CPU: Cortex-A78AE, armv8.2-a + dotprod + fp16) and,
# where qemu-user is installed, run the C tests under emulation: proof that nothing in src/ assumes x86.
#
#   bash scripts/cross-aarch64.sh            # build-aarch64/, then ctest binaries under qemu-aarch64
#
# Needs a cross compiler: aarch64-linux-gnu-gcc/g++ (Debian: apt-get install g++-aarch64-linux-gnu), or set
# CC/CXX.  Emulation needs qemu-aarch64 (apt-get install qemu-user); without it the build is checked only.
# Upstream must be fetched and patched first (scripts/setup.sh or python3 scripts/upstream.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CC="${CC:-aarch64-linux-gnu-gcc}"
CXX="${CXX:-aarch64-linux-gnu-g++}"
SYSROOT="${VIS_AARCH64_SYSROOT:-/usr/aarch64-linux-gnu}"
BUILD="${VIS_AARCH64_BUILD:-build-aarch64}"
JOBS="${VIS_JOBS:-$(nproc 2>/dev/null || echo 2)}"
die() { printf 'error: %s\n' "$*" >&2; exit 1; }
command -v "$CXX" >/dev/null || die "$CXX not found. Fix: apt-get install g++-aarch64-linux-gnu, or set CC/CXX to an aarch64 cross compiler."
[ -f vendor/.llama.cpp-stamp ] || die "vendor/llama.cpp is missing. Fix: run bash scripts/setup.sh (or python3 scripts/upstream.py) first."
export CCACHE_DIR="${CCACHE_DIR:-${VIS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vis-moe}/ccache}" CCACHE_BASEDIR="$ROOT" CCACHE_NOHASHDIR=true
[ -x .venv/bin/ccache ] && export PATH="$ROOT/.venv/bin:$PATH"

t0=$(date +%s)
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 \
    -DCMAKE_C_COMPILER="$CC" -DCMAKE_CXX_COMPILER="$CXX" \
    -DCMAKE_FIND_ROOT_PATH="$SYSROOT" -DCMAKE_FIND_ROOT_PATH_MODE_PROGRAM=NEVER \
    -DCMAKE_FIND_ROOT_PATH_MODE_LIBRARY=ONLY -DCMAKE_FIND_ROOT_PATH_MODE_INCLUDE=ONLY \
    -DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16 -DGGML_OPENMP=OFF >/dev/null
cmake --build "$BUILD" -j "$JOBS" --target llama llama-cli test-vis-info test-vis-policy
t1=$(date +%s)
file "$BUILD/bin/test-vis-policy" | grep -q "ARM aarch64" || die "$BUILD/bin/test-vis-policy is not an aarch64 binary"
echo "aarch64 build: $((t1 - t0)) s ($BUILD)"

if ! command -v qemu-aarch64 >/dev/null; then
    echo "qemu-aarch64 not found: built, not run (apt-get install qemu-user to run the tests)"
    exit 0
fi
run() { QEMU_LD_PREFIX="$SYSROOT" LD_LIBRARY_PATH="$BUILD/bin" qemu-aarch64 "$@"; }
run "$BUILD/bin/test-vis-policy"
FIX="${VIS_FIXTURE_DIR:-models/fixtures}"
if [ -f "$FIX/qwen3moe.gguf" ]; then
    run "$BUILD/bin/test-vis-info" "$FIX/qwen3moe.gguf" "$FIX/deepseek2.gguf" "$FIX/gptoss.gguf" "$FIX/mixtral.gguf"
    # the expert cache end to end under emulation (gpt-oss fixture: it prints visible tokens): paged from the file,
    # one slot per layer, exact passes,
    # and the same text as the plain run
    cli=("$BUILD/bin/llama-cli" -m "$FIX/gptoss.gguf" -p "Experts on arm" -n 8 -st -c 128 -t 2 --temp 0)
    ref=$(run "${cli[@]}" 2>/dev/null) || die "llama-cli under qemu failed"
    out=$(run "${cli[@]}" --moe-slots 1 --moe-stats 2>/tmp/vis-aarch64-stats.txt) || {
        tail -20 /tmp/vis-aarch64-stats.txt; die "llama-cli --moe-slots 1 under qemu failed"; }
    grep -E "vis-moe: +total" /tmp/vis-aarch64-stats.txt || die "no --moe-stats table from the aarch64 llama-cli"
    text() { sed -n '/Experts on arm/,/\[ Prompt:/p' | sed '1d' | grep -v '\[ Prompt:' | tr -d '[:space:]'; }
    [ -n "$(echo "$ref" | text)" ] || die "aarch64: no generated text to compare"
    [ "$(echo "$ref" | text)" = "$(echo "$out" | text)" ] || die "aarch64: --moe-slots 1 changed the text"
    echo "aarch64: --moe-slots 1 text identical to the plain run"
else
    echo "fixtures not generated ($FIX): skipped test-vis-info and llama-cli (run pyvis fixtures first)"
fi
echo "aarch64: ok"
