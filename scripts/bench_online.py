#!/usr/bin/env python3
"""The online controller (VIS_MOE_ONLINE, docs/planning.md#online-controller) off vs on: llama-server in a fresh
memory cgroup (v1 or v2; run as root) serves a short chat workload, a few concurrent requests of different lengths
and then shorter ones that replace them; per arm it reports the slots per layer over time (the resize lines),
slot hits and misses, MiB read per generated token, tok/s (only as a same-run ratio) and the cgroup's peak.

    sudo .venv/bin/python scripts/bench_online.py models/testbed/shared+16.gguf --limit-mib 450 600 -- -c 4096 -np 4
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

WORDS = ("a model whose experts do not fit in memory keeps a few of them per layer in slots and reads the others "
         "from the file when a token routes to them").split()


def _prompt(n: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 5 + j) % len(WORDS)] for j in range(n))


def _post(port, prompt, n):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", method="POST",
                                 data=json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0,
                                                  "cache_prompt": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def _metrics(port) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        text = r.read().decode()
    out = {}
    for name in ("hits_total", "misses_total", "read_bytes_total"):
        out[name] = sum(float(m[1]) for m in re.finditer(rf"^llamacpp:vis_moe_{name}\S* (\S+)$", text, re.M))
    return out


def run_arm(args, online: str, limit_mib: int, log: Path) -> dict:
    from conftest import llama_server
    from test_paging import memory_cgroup
    rounds = [[_prompt(n, i) for i, n in enumerate(args.long)], [_prompt(n, i + 7) for i, n in enumerate(args.short)]]
    res = {"arm": "on" if online == "on" else "off", "limit_mib": limit_mib, "texts": []}
    os.system("sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null")
    with memory_cgroup(limit_mib << 20) as (wrap, peak):
        t0 = time.monotonic()
        with llama_server(Path(args.bindir), args.model, "--moe-mem", str(args.budget or limit_mib), "--metrics",
                          "--cache-ram", "0", "-t", str(args.threads), *args.server_args, log=log,
                          env={"VIS_MOE_ONLINE": online}, wrap=wrap) as (proc, port):
            n_gen, t_gen = 0, 0.0
            for prompts in rounds:
                out = {}

                def go(i, p):
                    out[i] = _post(port, p, args.n_predict)
                ts = [threading.Thread(target=go, args=(i, p)) for i, p in enumerate(prompts)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                for i in range(len(prompts)):
                    res["texts"].append(out[i]["content"])
                    n_gen += out[i]["timings"]["predicted_n"]
                    t_gen += out[i]["timings"]["predicted_ms"] / 1000
            res.update(_metrics(port))
        res["wall_s"] = round(time.monotonic() - t0, 1)
        res["peak_mib"] = round(peak() / 1048576, 1)
    res["generated"] = n_gen
    res["decode_tok_s"] = round(n_gen / t_gen, 3) if t_gen else 0
    res["mib_read_per_token"] = round(res["read_bytes_total"] / 1048576 / max(1, n_gen), 2)
    hm = res["hits_total"] + res["misses_total"]
    res["hit_pct"] = round(100 * res["hits_total"] / hm, 1) if hm else 0
    text = log.read_text(errors="replace")
    res["resizes"] = [f"{a}->{b}" for a, b in re.findall(r"vis-moe: resize: slots (\d+) -> (\d+)", text)]
    start = re.search(r"vis-moe: resize: slots (\d+) per layer \(start", text)
    res["start_slots"] = int(start[1]) if start else None
    res["load_avg"] = os.getloadavg()[0]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--limit-mib", type=int, nargs="+", required=True, help="cgroup limits, one pair of arms each")
    ap.add_argument("--budget", type=int, default=0, help="--moe-mem (default: the cgroup limit)")
    ap.add_argument("--long", type=int, nargs="+", default=[300, 150, 450, 80], help="first round's prompt words")
    ap.add_argument("--short", type=int, nargs="+", default=[20, 30, 25, 15], help="second round's prompt words")
    ap.add_argument("-n", "--n-predict", type=int, default=16)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--bindir", default=str(ROOT / "build" / "bin"))
    ap.add_argument("--out", type=Path, default=Path("bench-online"), help="output folder (logs, results.json)")
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.server_args = rest  # after --: more llama-server arguments (e.g. -c 4096 -np 4)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for limit in args.limit_mib:
        for online in ("off", "on"):
            r = run_arm(args, online, limit, args.out / f"{limit}-{online}.log")
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "texts"}), flush=True)
        a, b = results[-2], results[-1]
        print(f"{limit} MiB: texts equal: {a['texts'] == b['texts']}; decode tok/s on/off "
              f"{b['decode_tok_s'] / a['decode_tok_s'] if a['decode_tok_s'] else float('nan'):.2f}", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
