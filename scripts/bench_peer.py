#!/usr/bin/env python3
"""Side by side with the strongest peer on CPU, BigMoeOnEdge (#26 item 6; docs/benchmarks.md#side-by-side-with-bigmoeonedge).

Runs the peer's CLI (built by you from its public repository, outside this one: docs/benchmarks.md says how) and
ours on the same model, the same prompt, sampled at the same temperature, under the same memory cgroup with a cold page cache: ours with
`--moe-mem auto`, the peer with `--moe-stream --cache-mb auto` and a ceiling under the limit (inside a cgroup its
auto size reads the machine's free memory, not the limit). Prints decode and prefill tok/s, bytes read per
generated token and peak memory of each. Needs root (cgroups, drop_caches), like scripts/bench_paging.py, whose
helpers it uses.

    scripts/bench_peer.py MODEL --peer-bin /work/peer/src/build/cli --limits-mib 4096 -n 32
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_paging import PROMPT_WORDS, ROOT, run_one, storage_bandwidth  # noqa: E402

PEER_GEN = re.compile(r"generation: (\d+) tokens, [\d.]+ s/token \(([\d.]+) tok/s\)")
PEER_PREFILL = re.compile(r"prefill: (\d+) tokens, [\d.]+ s \(([\d.]+) tok/s\)")


def _positive(v: str) -> int:
    n = int(v)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return n


def peer_numbers(log: str) -> dict:
    """decode and prefill tok/s as the peer's CLI prints them ({} when it printed neither)."""
    r = {}
    m = PEER_GEN.search(log)
    if m:
        r["decode_tps"], r["n_generated"] = float(m.group(2)), int(m.group(1))
    m = PEER_PREFILL.search(log)
    if m:
        r["prefill_tps"], r["n_prompt"] = float(m.group(2)), int(m.group(1))
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--peer-bin", required=True, help="directory holding the peer's bmoe-cli")
    ap.add_argument("--bin", default=str(ROOT / "build/bin"), help="our build's bin dir")
    ap.add_argument("--limits-mib", type=_positive, nargs="+", required=True, help="memory cgroup limits in MiB")
    ap.add_argument("--peer-ceil-mib", type=_positive, default=None,
                    help="the peer's --cache-ceil-mb (default: the limit minus 1700 MiB for its dense weights (1068 MiB on the "
                         "48-layer model), compute, KV and its mapping; it is killed when its auto size exceeds the "
                         "cgroup: 2996 MiB was killed at 4096)")
    ap.add_argument("-n", "--n-predict", type=_positive, default=32)
    ap.add_argument("--prompt-tokens", type=_positive, default=128)
    ap.add_argument("--temp", type=float, default=0.8,
                    help="sampling temperature of both (default 0.8: greedy text on a random-weights model repeats a "
                         "token and keeps every cache hot; the two samplers differ, so the tokens differ, the routing "
                         "statistics do not)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lossy", action="store_true",
                    help="also the lossy counterparts: ours --moe-substitute drop and the peer's --drop-cold-experts 0.5 "
                         "(the same rule: skip a missing expert below half an even split of the gate weight), and "
                         "ours --moe-mode fast (each token runs ceil(2k/3) of its k experts)")
    ap.add_argument("--peer-overlap", action="store_true",
                    help="also the peer with --overlap (its read/compute overlap; needs its expert-ready hook in the "
                         "llama.cpp it was built against, docs/benchmarks.md says how), against ours, which overlaps "
                         "by default")
    ap.add_argument("--timeout", type=_positive, default=900)
    ap.add_argument("--out", default="bench-peer", help="directory for logs and results.json (never the model)")
    a = ap.parse_args()
    model, peer = Path(a.model).resolve(), Path(a.peer_bin) / "bmoe-cli"
    if not model.is_file():
        ap.error(f"{model}: no such model file")
    if not peer.is_file():
        ap.error(f"{peer}: not found; build the peer first (docs/benchmarks.md#side-by-side-with-bigmoeonedge)")
    out = Path(a.out)
    if out.resolve() == model or out.is_file():
        ap.error(f"--out {out}: must be a directory, not a file")
    out.mkdir(parents=True, exist_ok=True)
    prompt = (PROMPT_WORDS * (a.prompt_tokens // 30 + 1))
    from pyvis.runtime import plan as vplan
    expert = max(vplan.read_shape(model).expert_bytes.values())
    bw = storage_bandwidth(model, expert // 3)
    print(f"storage: {bw / 2**20:.0f} MiB/s O_DIRECT random reads of {expert // 3 / 2**20:.2f} MiB, 4 threads", flush=True)
    results = []
    for lim in a.limits_mib:
        ceil = a.peer_ceil_mib or max(1500, lim - 1700)
        runs = {
            "ours": [Path(a.bin) / "llama-cli", "-m", model, "-p", prompt, "-n", str(a.n_predict), "-st", "-c", "512",
                     "-t", "2", "--temp", str(a.temp), "--seed", str(a.seed), "--moe-mem", "auto", "--moe-stats"],
            "peer": [peer, "-m", model, "-p", prompt, "-n", str(a.n_predict), "-c", "512", "-t", "2", "--moe-stream",
                     "--cache-mb", "auto", "--cache-ceil-mb", str(ceil), "--temp", str(a.temp), "--seed", str(a.seed)],
        }
        if a.peer_overlap:
            runs["peer-overlap"] = runs["peer"] + ["--overlap"]
        if a.lossy:
            runs["ours-drop"] = runs["ours"] + ["--moe-substitute", "drop"]
            runs["ours-fast"] = runs["ours"] + ["--moe-mode", "fast"]
            runs["peer-drop"] = runs["peer"] + ["--drop-cold-experts", "0.5"]
        print(f"== limit {lim} MiB (peer cache ceiling {ceil} MiB)", flush=True)
        for name, cmd in runs.items():
            log = out / f"{name}-{lim}.log"
            r = run_one(name, cmd, lim << 20, a.timeout, a.n_predict, log,
                        parse=peer_numbers if name.startswith("peer") else None)
            r["limit_mib"] = lim
            results.append(r)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print("| limit | run | finished | prefill tok/s | decode tok/s | read MiB / generated token | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['limit_mib']} MiB | {r['name']} | {r['finished']} | {r.get('prefill_tps', '-')} | "
              f"{r.get('decode_tps', '-')} | {r['read_bytes_per_token'] / 2**20:.0f} | {r['peak_bytes'] / 2**20:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
