#!/usr/bin/env bash
# One command on a Jetson Orin: check JetPack and CUDA, build the `jetson` preset, install llama-server as a
# systemd service whose MemoryMax and --moe-mem match the board (pyvis/runtime/devices.py), print the plan.
#
#   sudo jetson/install.sh --model /opt/models/Qwen3-30B-A3B-Q4_K_M.gguf            # SKU detected
#   jetson/install.sh --dry-run --sku orin-nano-8g --model M.gguf                     # print every step, change nothing
#
# Options: --sku orin-nano-8g|orin-nx-8g|orin-nx-16g|agx-orin-32g|agx-orin-64g, --model GGUF (required),
# --user NAME (default: the invoking user), -c N (context, default 4096), --port N (default 8080), --dry-run.
# The checkout this script lives in is the install prefix (build-jetson/ and .venv/ go there).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SKU="" MODEL="" USER_NAME="${SUDO_USER:-${USER:-jetson}}" CTX=4096 PORT=8080 DRY=0
UNIT_PATH=/etc/systemd/system/vis-moe-server.service
die() { printf 'error: %s\n' "$*" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --sku) SKU="${2:-}"; shift 2 ;;
        --model) MODEL="${2:-}"; shift 2 ;;
        --user) USER_NAME="${2:-}"; shift 2 ;;
        -c|--ctx-size) CTX="${2:-}"; shift 2 ;;
        --port) PORT="${2:-}"; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
done
[ -n "$MODEL" ] || die "--model GGUF is required"
MODEL="$(realpath -m "$MODEL")"   # the unit runs from another directory
case "$CTX" in ''|*[!0-9]*) die "-c must be a positive integer, got '$CTX'" ;; esac
case "$PORT" in ''|*[!0-9]*) die "--port must be an integer in 1..65535, got '$PORT'" ;; esac
PY="$ROOT/.venv/bin/python"; [ -x "$PY" ] || PY=python3
devices() { PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pyvis.runtime.devices "$@"; }
step() { printf '\n== %s\n' "$*"; }
# run a command, or only show it with --dry-run
run() { if [ $DRY = 1 ]; then printf '[dry-run] %s\n' "$*"; else "$@"; fi; }

step "board"
if [ -z "$SKU" ]; then
    SKU="$(devices detect)" || die "could not detect the board; give --sku"
fi
devices list | grep -E "^$SKU " || die "unknown --sku '$SKU'; valid: $(devices list | cut -d' ' -f1 | xargs | tr ' ' ,)"

step "JetPack and CUDA"
if [ -r /etc/nv_tegra_release ]; then
    head -1 /etc/nv_tegra_release
    grep -q "R3[6-9]" /etc/nv_tegra_release || echo "warning: JetPack 6 (L4T R36) or later is what the jetson preset is written for"
elif [ $DRY = 1 ]; then
    echo "[dry-run] /etc/nv_tegra_release not found: not a Jetson (a real install stops here)"
else
    die "/etc/nv_tegra_release not found: this is not a Jetson with JetPack; use --dry-run to see the steps"
fi
NVCC="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
if [ -x "$NVCC" ]; then
    "$NVCC" --version | tail -1
elif [ $DRY = 1 ]; then
    echo "[dry-run] nvcc not found (JetPack installs it in /usr/local/cuda/bin)"
else
    die "nvcc not found; install JetPack's CUDA (sudo apt install nvidia-jetpack) or put /usr/local/cuda/bin on PATH"
fi

step "build (preset jetson: sm_87, GGML_CUDA_NO_VMM)"
run env VIS_PRESET=jetson bash scripts/setup.sh
# the vision-projector crash of upstream #29142 comes from the CUDA VMM pool reserving 32 GiB: our preset turns it off
if [ -f build-jetson/CMakeCache.txt ]; then
    grep -q "^GGML_CUDA_NO_VMM:BOOL=ON" build-jetson/CMakeCache.txt \
        || die "build-jetson was configured without GGML_CUDA_NO_VMM=ON: multimodal requests would crash (upstream #29142)"
    echo "GGML_CUDA_NO_VMM=ON in build-jetson (no 32 GiB VMM reservation)"
else
    grep -q 'GGML_CUDA_NO_VMM ON' CMakeLists.txt || die "CMakeLists.txt no longer sets GGML_CUDA_NO_VMM for the jetson preset"
    echo "the jetson preset sets GGML_CUDA_NO_VMM=ON (checked in CMakeLists.txt; build-jetson not configured yet)"
fi

step "service unit ($UNIT_PATH)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
unit="$tmp/vis-moe-server.service"   # systemd-analyze verify wants the unit's own name
devices unit --sku "$SKU" --model "$MODEL" --prefix "$ROOT" --user "$USER_NAME" -c "$CTX" --port "$PORT" > "$unit"
cat "$unit"
if command -v systemd-analyze >/dev/null; then
    # verify the unit's syntax (a missing binary or user on a non-Jetson is reported, not fatal here)
    systemd-analyze verify "$unit" 2>&1 | grep -v -E "Command .* is not executable|Failed to resolve user|not found" || true
fi
run install -m 0644 "$unit" "$UNIT_PATH"
run systemctl daemon-reload
run systemctl enable --now vis-moe-server

step "memory plan for $SKU"
if [ -f "$MODEL" ] && [ -x "$ROOT/.venv/bin/pyvis" ]; then
    "$ROOT/.venv/bin/pyvis" plan "$MODEL" --device "$SKU" -c "$CTX" || true
else
    echo "run after the build: $ROOT/.venv/bin/pyvis plan $MODEL --device $SKU -c $CTX"
fi
[ $DRY = 1 ] && echo "dry run: nothing was changed"
echo "done: journalctl -u vis-moe-server -f shows the memory plan the server logs at start"
