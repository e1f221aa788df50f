#!/usr/bin/env bash
# The GPU checks, unattended, the day a GPU machine is lent (the `device` tool's run, or any CUDA box):
#   1. build the `cuda` preset for this GPU's architecture (scripts/cuda-check.sh);
#   2. byte-identity matrix on the GPU: for every fixture, llama-perplexity --kl-divergence of the expert cache
#      (several slot counts, pinned 0/1, -ngl 99) against the plain GPU run; the cache is exact on CPU, on CUDA
#      the batched mul_mat_id kernels may differ in the last bits with a different number of experts (n_as), so
#      this bounds the difference (max KLD, same-top-1 share) instead of asserting zero;
#   3. residency/paging benchmark: llama-bench on a Qwen3-30B-A3B-sized random model, upstream's --n-cpu-moe
#      (experts of the last N layers on the CPU) against ours (--moe-slots on the GPU) at about equal VRAM;
#   4. asynchronous uploads (docs/paging.md#discrete-gpus-pinned-tier-2-and-the-upload-stream): a substitution
#      decode (--moe-substitute router, half the experts in slots, file store, a small host cache) whose
#      background reads upload on the second stream; it must finish, read in the background, say "asynchronous"
#      in its uploads line, and give the same text with tier 2 pinned, --moe-pin-mib off and pinning refused
#      (GGML_CUDA_NO_PINNED=1);
#   5. shadow experts and capacity (docs/precision.md): --moe-precision all against upstream on the hybrid model
#      (KLD bound, as step 2), and an image prompt with --moe-precision vision --moe-capacity finishing.
# Everything goes to one report: $OUT/gpu-report.md (the device tool brings $OUT back), else ./gpu-report.md.
#
#   bash scripts/gpu-check.sh            # ~15-25 min on an H100 machine (16 cores)
#
# VIS_GPU_CHECK_STEPS="2 4" runs only those of steps 2-5 (default: all; the build always runs on a GPU).
# VIS_GPU_CHECK_BIN=DIR skips step 1 and runs a cuda build made elsewhere (e.g. `bash scripts/cuda-check.sh cuda 90`
# on a machine with nvcc, its build-cuda/bin carried to the GPU machine; put DIR and the toolkit's cuBLAS/cudart on
# LD_LIBRARY_PATH).  VIS_GPU_CHECK_PYTHON=PY runs the Python parts (fixtures, shapes, shadows: numpy and gguf, no
# llama_cpp) with PY instead of .venv/bin/python, for a machine without scripts/setup.sh's venv; the fixtures'
# tokenizer then comes from $VIS_SMOLLM2_GGUF (only its tokenizer.* keys are read).
# Written without a GPU to test it on.  VIS_GPU_CHECK_CPU=1 runs steps 2, 3 and 5 on the CPU build instead (no
# nvidia-smi, no CUDA build, step 3 on a 2-layer model): that is how its logic was checked.  Each step logs and
# continues, so one failure still leaves a report.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
REPORT="${OUT:-$ROOT}/gpu-report.md"
LOG="${OUT:-$ROOT}/gpu-check.log"
: > "$LOG"
say() { printf '%s\n' "$*" | tee -a "$REPORT"; }
logrun() { echo "+ $*" >> "$LOG"; "$@" >> "$LOG" 2>&1; }
printf '# vis-moe GPU check\n\n' > "$REPORT"
say "- date: $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
CPU_MODE="${VIS_GPU_CHECK_CPU:-0}"
STEPS=" ${VIS_GPU_CHECK_STEPS:-2 3 4 5} "
PY="${VIS_GPU_CHECK_PYTHON:-.venv/bin/python}"
want() { [[ "$STEPS" == *" $1 "* ]]; }
NGL=(-ngl 99)
LAYERS=16
if [ "$CPU_MODE" = 1 ]; then
    say "- VIS_GPU_CHECK_CPU=1: the script's logic on the CPU build (no GPU involved)"
    BIN="$ROOT/build/bin"; NGL=(); LAYERS=2
else
    if ! command -v nvidia-smi >/dev/null; then say "- no nvidia-smi: not a GPU machine, stopping"; exit 1; fi
    say "- GPU: $(nvidia-smi --query-gpu=name,memory.total,compute_cap,driver_version --format=csv,noheader | head -1)"
    ARCH="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')"
    say ""; say "## 1. build"
    if [ -n "${VIS_GPU_CHECK_BIN:-}" ]; then
        BIN="$(cd "$VIS_GPU_CHECK_BIN" 2>/dev/null && pwd)" || { say "- VIS_GPU_CHECK_BIN=$VIS_GPU_CHECK_BIN: no such directory"; exit 1; }
        [ -x "$BIN/llama-cli" ] && ls "$BIN"/libggml-cuda.so* >/dev/null 2>&1 ||
            { say "- VIS_GPU_CHECK_BIN=$BIN: no llama-cli or libggml-cuda.so there (a cuda build's bin/)"; exit 1; }
        missing="$(ldd "$BIN"/libggml-cuda.so "$BIN/llama-cli" 2>&1 | grep 'not found' | sort -u | tr -s ' \t' ' ')"
        [ -z "$missing" ] || { say "- prebuilt binaries miss libraries:$missing (add their folders to LD_LIBRARY_PATH)"; exit 1; }
        say "- prebuilt cuda build (VIS_GPU_CHECK_BIN): $BIN; GPU architecture sm_$ARCH"
    else
        t0=$(date +%s)
        if logrun bash scripts/setup.sh && logrun bash scripts/cuda-check.sh cuda "$ARCH"; then
            say "- cuda preset for sm_$ARCH built in $(( $(date +%s) - t0 )) s (setup included)"
        else
            say "- build FAILED after $(( $(date +%s) - t0 )) s: see gpu-check.log"; exit 1
        fi
        BIN="$ROOT/build-cuda/bin"
    fi
fi
logrun "$PY" -c "from pyvis import fixtures as fx; fx.ensure_all()" || { say "- fixtures could not be written: see gpu-check.log"; exit 1; }
TEXT="$(mktemp)"; "$PY" -c "print(' '.join(f'word{i % 97} experts route tokens to slabs' for i in range(400)))" > "$TEXT"

if want 2; then
say ""; say "## 2. byte identity on the GPU (KL divergence against the plain -ngl 99 run)"
say ""; say "| fixture | config | mean KLD | max KLD | same top-1 |"; say "|---|---|---|---|---|"
for m in qwen3moe deepseek2 gptoss mixtral qwen3vlmoe; do
    M="models/fixtures/$m.gguf"; base="$(mktemp)"
    PPL=("$BIN/llama-perplexity" -m "$M" -f "$TEXT" -c 128 -b 128 --chunks 3 "${NGL[@]}")
    logrun "${PPL[@]}" --kl-divergence-base "$base" || { say "| $m | base run failed | | | |"; continue; }
    n_exp="$("$PY" -c "from pyvis.runtime import plan; s = plan.read_shape('$M'); print(s.n_expert, s.n_expert_used)")"
    read -r E K <<<"$n_exp"
    # "" = the plain run against its own base: the floor set by the base file's 16-bit log-probabilities
    for cfg in "" "--moe-slots $K" "--moe-slots 1" "--moe-slots $((E / 2)) --moe-pinned-layers 1" "--moe-slots $K --moe-store model"; do
        out="$("${PPL[@]}" --kl-divergence-base "$base" --kl-divergence $cfg 2>&1)"; echo "$out" >> "$LOG"
        mean="$(echo "$out" | sed -n 's/^Mean *KLD: *\([0-9.e+-]*\).*/\1/p')"
        max="$(echo "$out" | sed -n 's/^Maximum KLD: *\([0-9.e+-]*\).*/\1/p')"
        top="$(echo "$out" | sed -n 's/^Same top p: *\([0-9.]*\).*/\1 %/p')"
        say "| $m | \`${cfg:-plain (noise floor)}\` | ${mean:-fail} | ${max:-fail} | ${top:-fail} |"
    done
    rm -f "$base"
done
fi

if want 3; then
say ""; say "## 3. residency benchmark: upstream --n-cpu-moe vs our slabs (llama-bench -p 512 -n 128 -r 3)"
LARGE="models/bench/qwen3moe-30b-a3b-${LAYERS}L-q4_0.gguf"
[ -f "$LARGE" ] || logrun "$PY" -c "from pyvis import fixtures as fx; from pyvis.fixtures import large; large.write_large('models/bench', fx.large_preset(n_layer=$LAYERS))"
say ""; say "| config | pp512 tok/s | tg128 tok/s | VRAM used (MiB) |"; say "|---|---|---|---|"
bench() {  # label, env, args...
    local label="$1" envs="$2"; shift 2
    local vram0 out vram1
    out="$(env $envs "$BIN/llama-bench" -m "$LARGE" -p 512 -n 128 -r 3 "${NGL[@]}" -o csv "$@" 2>>"$LOG" &
           pid=$!; sleep 20; { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null || echo n/a; } \
               > "$LOG.vram"; wait $pid)"
    echo "$out" >> "$LOG"
    local pp tg
    pp="$(echo "$out" | tail -2 | head -1 | awk -F, '{gsub(/"/,""); print $(NF-1)}')"
    tg="$(echo "$out" | tail -1 | awk -F, '{gsub(/"/,""); print $(NF-1)}')"
    say "| $label | ${pp:-fail} | ${tg:-fail} | $(head -1 "$LOG.vram" 2>/dev/null) |"
}
bench "all on GPU (reference)" ""
for n in $(printf "%s\n" $((LAYERS / 2)) $((LAYERS * 3 / 4)) | sort -un); do
    bench "upstream --n-cpu-moe $n" "" --n-cpu-moe "$n"
done
for s in 32 16; do
    bench "ours --moe-slots $s (all layers managed)" "VIS_MOE_SLOTS=$s"
done
say ""; say "VRAM is sampled 20 s into each run; match rows by it when comparing upstream and ours."
fi

if want 4; then
say ""; say "## 4. asynchronous uploads: background reads of substituted experts (--moe-substitute router --moe-stats)"
say ""; say "| fixture | config | exit | bg reads | uploads | tier 2 pinning | same text | check |"
say "|---|---|---|---|---|---|---|---|"
PROMPT="Mixture-of-experts layers route every token to a few experts; a cache keeps the hot ones resident."
gen_text() { awk -v p="> ${PROMPT:0:20}" 'index($0, p) == 1 {on = 1} /^\[ Prompt:/ {on = 0} on' "$1"; }
for m in qwen3moe deepseek2; do  # fixtures with room for background reads beside a pass
    M="models/fixtures/$m.gguf"
    read -r E K <<<"$("$PY" -c "from pyvis.runtime import plan; s = plan.read_shape('$M'); print(s.n_expert, s.n_expert_used)")"
    ref=""
    for row in "tier 2 pinned;;" "--moe-pin-mib off;;--moe-pin-mib off" "pinning refused;GGML_CUDA_NO_PINNED=1;"; do
        IFS=';' read -r label envs flags <<<"$row"
        so="$(mktemp)"; se="$(mktemp)"
        env $envs "$BIN/llama-cli" -m "$M" -p "$PROMPT" -n 48 -st --temp 0 -c 256 --no-warmup -v "${NGL[@]}" \
            --moe-slots $((E / 2)) --moe-host-mib 4 --moe-substitute router --moe-stats $flags > "$so" 2> "$se"
        rc=$?
        cat "$so" "$se" >> "$LOG"
        bg="$(awk '/^vis-moe: total/ && NF > 12 {v = $(NF-1)} END {print v}' "$se")"
        up="$(sed -n 's/^vis-moe: uploads to \([^:]*\): \([a-z]*\).*, \([0-9]*\) copies.*/\1 \2, \3 copies/p' "$se" | head -1)"
        pin="$(grep -o 'host cache: [^;:]*\(pinned\|ordinary memory\|refused\)' "$se" | head -1 | sed 's/^host cache: //')"
        text="$(gen_text "$so")"
        [ -n "$ref" ] || ref="$text"
        same=no; [ -n "$text" ] && [ "$text" = "$ref" ] && same=yes
        ok=FAIL
        if [ "$rc" = 0 ] && [ "${bg:-0}" -gt 0 ] 2>/dev/null && [ "$same" = yes ] &&
           { [ "$CPU_MODE" = 1 ] || [[ "$up" == *" asynchronous, "* ]]; }; then
            ok=pass
        fi
        say "| $m | $label | $rc | ${bg:-none} | ${up:-none} | ${pin:-none} | $same | $ok |"
        rm -f "$so" "$se"
    done
done
say ""; say "Pass: exit 0, background reads > 0, the same text in the three configurations, and (GPU) an uploads line"
say "saying asynchronous. 'none' in uploads/pinning on a GPU means the cache chose synchronous uploads or no host"
say "cache: see gpu-check.log for the vis-moe lines of that run."
fi
if want 5; then
say ""; say "## 5. shadow experts and capacity on the GPU (docs/precision.md)"
say ""
say "--moe-precision all with no refetch runs every managed expert from its shadow: against upstream on the hybrid"
say "model (the shadow's tensors in place, -nr), both -ngl 99. On CPU this is bit-exact (tests/test_precision.py); on"
say "CUDA the batched mul_mat_id may differ in the last bits, so the KLD is bounded, as in step 2."
say ""; say "| fixture | config | mean KLD | max KLD | same top-1 |"; say "|---|---|---|---|---|"
SH_DIR="$(mktemp -d)"
for m in qwen3moe deepseek2; do
    M="models/fixtures/$m.gguf"; S="$SH_DIR/$m.shadow.gguf"; H="$SH_DIR/$m.hybrid.gguf"; base="$(mktemp)"
    logrun "$PY" -c "from pyvis.runtime import shadow as sh; sh.write_shadow('$M', 'Q4_1', '$S', threads=4); sh.write_hybrid('$M', '$S', '$H')" \
        || { say "| $m | shadow/hybrid not written | | | |"; continue; }
    PPL=("$BIN/llama-perplexity" -f "$TEXT" -c 128 -b 128 --chunks 3 "${NGL[@]}")
    logrun "${PPL[@]}" -m "$H" -nr --kl-divergence-base "$base" || { say "| $m | hybrid base run failed | | | |"; continue; }
    read -r E K <<<"$("$PY" -c "from pyvis.runtime import plan; s = plan.read_shape('$M'); print(s.n_expert, s.n_expert_used)")"
    for cfg in "--moe-slots $K" "--moe-slots 2 --moe-shadow-slots 2"; do
        out="$(VIS_MOE_STREAM_PASSES=0 "${PPL[@]}" -m "$M" --kl-divergence-base "$base" --kl-divergence $cfg \
               --moe-shadow "$S" --moe-precision all --moe-prec-refetch off 2>&1)"; echo "$out" >> "$LOG"
        mean="$(echo "$out" | sed -n 's/^Mean *KLD: *\([0-9.e+-]*\).*/\1/p')"
        max="$(echo "$out" | sed -n 's/^Maximum KLD: *\([0-9.e+-]*\).*/\1/p')"
        top="$(echo "$out" | sed -n 's/^Same top p: *\([0-9.]*\).*/\1 %/p')"
        say "| $m | \`all from shadows $cfg\` | ${mean:-fail} | ${max:-fail} | ${top:-fail} |"
    done
    rm -f "$base"
done
say ""; say "An image prompt with the vision policy and the capacity (llama-mtmd-cli -ngl 99): it must finish, and the"
say "capacity forces experts in instead of dropping (drops are CPU-only)."
M=models/fixtures/qwen3vlmoe.gguf; S="$SH_DIR/vl.shadow.gguf"
logrun "$PY" -c "from pyvis.runtime import shadow as sh; sh.write_shadow('$M', 'Q4_0', '$S', threads=4)"
out="$("$BIN/llama-mtmd-cli" -m "$M" --mmproj models/fixtures/qwen3vlmoe-mmproj.gguf --image models/fixtures/test-image.png \
       -p "Describe the image." -n 8 --temp 0 -c 512 "${NGL[@]}" --moe-slots 4 --moe-stats --moe-shadow "$S" \
       --moe-precision vision --moe-capacity 2 2>&1)"; rc=$?; echo "$out" >> "$LOG"
prec="$(echo "$out" | awk '/precision \(--moe-precision/ {on = 1} on && /^vis-moe: total/ {print $3, $4; exit}')"
cap="$(echo "$out" | awk '/entropy-weighted capacity/ {on = 1} on && /^vis-moe: total/ {print $8, $9, $10; exit}')"
say "- exit $rc; precision total (eligible, served): ${prec:-none}; capacity total (overflow, forced, rerouted): ${cap:-none}"
rm -rf "$SH_DIR"
fi
echo "report: $REPORT"
