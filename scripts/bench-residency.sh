#!/usr/bin/env bash
# Benchmark the expert cache against upstream in one run (llama-bench pp/tg) and
# collect the cache stats of each configuration.
#   scripts/bench-residency.sh MODEL.gguf [OUT_DIR] [extra llama-bench args]
# Rows: upstream default (repack on), upstream --repack 0, cache at 100/50/25% of
# the experts (cache needs --repack 0: repacked buffers cannot serve single experts).
set -euo pipefail
MODEL="$1"; OUT="${2:-bench-out}"; shift $(( $# >= 2 ? 2 : 1 ))
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BENCH="${VIS_BENCH_BIN:-$ROOT/build/bin/llama-bench}"
PY="$ROOT/.venv/bin/python"
mkdir -p "$OUT"
N_EXPERT=$("$PY" -c "import gguf,sys; r=gguf.GGUFReader(sys.argv[1]); a=r.fields['general.architecture'].contents(); print(r.fields[a+'.expert_count'].contents())" "$MODEL")
ARGS=(-m "$MODEL" -p "${VIS_BENCH_P:-512}" -n "${VIS_BENCH_N:-128}" -r "${VIS_BENCH_R:-2}" -t "${VIS_BENCH_T:-2}" -o jsonl "$@")
run() {  # name, slots, repack
  local name=$1 slots=$2 repack=$3
  echo "== $name (slots=$slots, repack=$repack)" >&2
  local rc=0
  VIS_MOE_SLOTS=$slots VIS_MOE_STATS=1 "$BENCH" "${ARGS[@]}" --repack "$repack" > "$OUT/$name.jsonl" 2> "$OUT/$name.stderr" || rc=$?
  [ $rc -eq 0 ] || echo "   $name failed with exit code $rc (see $OUT/$name.stderr)" | tee -a "$OUT/$name.stderr" >&2
}
run upstream 0 1
run upstream-norepack 0 0
run cache-100 "$N_EXPERT" 0
run cache-50 $(( N_EXPERT / 2 )) 0
run cache-25 $(( N_EXPERT / 4 )) 0
"$PY" - "$OUT" <<'PYEOF'
import json, sys, pathlib, re
out = pathlib.Path(sys.argv[1])
rows = {}
for f in sorted(out.glob("*.jsonl")):
    for line in f.read_text().splitlines():
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        test = f"pp{d['n_prompt']}" if d["n_prompt"] else f"tg{d['n_gen']}"
        rows.setdefault(f.stem, {})[test] = (d["avg_ts"], d["stddev_ts"])
base = rows.get("upstream-norepack", {})
print(f"| config | test | t/s | vs upstream --repack 0 | hit rate | MiB loaded | stall ms |")
print("|---|---|---:|---:|---:|---:|---:|")
for name in ["upstream", "upstream-norepack", "cache-100", "cache-50", "cache-25"]:
    st = (out / f"{name}.stderr").read_text() if (out / f"{name}.stderr").exists() else ""
    totals = [l.split() for l in st.splitlines() if l.startswith("vis-moe: total")]
    hit = mib = stall = "-"
    if totals:  # summed over the benchmark's contexts
        r = sum(int(t[2]) for t in totals); h = sum(int(t[3]) for t in totals)
        hit = f"{100*h/r:.1f}%" if r else "-"
        mib = f"{sum(float(t[6]) for t in totals):.0f}"; stall = f"{sum(float(t[7]) for t in totals):.0f}"
    if name not in rows:
        print(f"| {name} | - | failed: {st.strip().splitlines()[-1] if st.strip() else 'no output'} | | | | |")
    for test, (ts, sd) in rows.get(name, {}).items():
        ratio = f"{ts / base[test][0]:.3f}" if test in base else "-"
        print(f"| {name} | {test} | {ts:.2f} ± {sd:.2f} | {ratio} | {hit} | {mib} | {stall} |")
PYEOF
