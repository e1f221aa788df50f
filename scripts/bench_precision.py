#!/usr/bin/env python3
"""Vision-heavy prefill under a memory budget: the lossy mechanisms of #14 against exact (docs/precision-speed.md).

    .venv/bin/python scripts/bench_precision.py MODEL.gguf --mmproj MMPROJ.gguf --shadow SHADOW.gguf \\
        --image A.png [--image B.png] [--images 1|2] [--fractions 0.25 0.125] [--repeat 2] [--only NAME ...] \\
        [--timeout 900] [--out DIR] [--bin DIR]

For every budget (a fraction of the model file's bytes), every round and every configuration, interleaved
(configurations inside a round, so a round's ratios share the machine's load), it runs from a cold page cache
(drop_caches) inside a fresh memory cgroup with that hard limit:

  llama-mtmd-cli -m MODEL --mmproj MMPROJ --image A [--image B] -p PROMPT -n 1 --temp 0 -t 2
                 -c 1024 -b 512 -ub 512 -lv 4 --moe-mem auto --moe-stats  + the configuration's flags:

    exact             (none)
    exact-passes      --moe-stream-passes 64
    exact-stream      --moe-stream-passes 1   (every prompt ubatch that needs two passes streams, staged)
    precision         --moe-shadow SHADOW --moe-precision vision
    precision-passes  --moe-shadow SHADOW --moe-precision vision --moe-stream-passes 64
    precision-stream  --moe-shadow SHADOW --moe-precision vision --moe-stream-passes 1
    precision-auto    --moe-shadow SHADOW --moe-precision auto   (vision or gate under the stall controller)
    capacity          --moe-capacity auto
    both              --moe-shadow SHADOW --moe-precision vision --moe-capacity auto

  python -m pyvis chat -m MODEL --mmproj MMPROJ --image A [--image B] -p PROMPT -n 1 --temp 0 -t 2
                 -c 1024 -b 512 -ub 512 --moe-stats + flags,
                 with VIS_MOE_MEM=auto in the environment (pyvis chat has no --moe-mem):

    chat-exact        (none: pyvis chat's own baseline; its prefill path differs from llama-mtmd-cli's)
    prune             --keep-ratio 0.5 --prune-method affinity
    all-three         --keep-ratio 0.5 --prune-method affinity + precision + capacity flags
    prune-precision   --keep-ratio 0.5 --prune-method affinity + precision flags

and parses the --moe-stats footer: time to first token (compute time of the last prompt's ubatches), MiB read
from the model file (tiers payload, staged and mapped streaming) and from the shadow (precision table), stall ms
(cache table total + precision table total) and its share of the time to first token, the capacity totals
(rerouted, dropped, overflow), the wall time of the image ubatches (llama-mtmd-cli's -lv 4 log, pyvis chat's
timings), the bytes the child read from storage and its CPU seconds (getrusage), whether it finished or was
OOM-killed, and the cgroup's peak memory.  Ratios are against exact of the same tool in the same round and budget.
Needs root (cgroups, drop_caches).  Results: OUT/results.json, OUT/results.md, one log per run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_paging import median_cell, run_one, storage_bandwidth  # noqa: E402  (Cgroup, drop_caches: used by run_one)

PROMPT = "Describe the images."
# the same context for both tools: llama-mtmd-cli's default context is the model's training context (40960 tokens
# here: 1.25 GiB of KV cache, more than the 12.5 % budget), pyvis chat's is 4096 with -b 512
CTX = ["-c", "1024", "-b", "512", "-ub", "512"]
PRUNE = ["--keep-ratio", "0.5", "--prune-method", "affinity"]


def configs(shadow: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (tool, flags): tool 'mtmd' = llama-mtmd-cli, 'chat' = pyvis chat"""
    prec = ["--moe-shadow", shadow, "--moe-precision", "vision"]
    cap = ["--moe-capacity", "auto"]
    passes = ["--moe-stream-passes", "64"]
    stream = ["--moe-stream-passes", "1"]
    return {
        "exact": ("mtmd", []),
        "exact-passes": ("mtmd", passes),
        "exact-stream": ("mtmd", stream),
        "precision": ("mtmd", prec),
        "precision-passes": ("mtmd", prec + passes),
        "precision-stream": ("mtmd", prec + stream),
        "precision-auto": ("mtmd", ["--moe-shadow", shadow, "--moe-precision", "auto"]),
        "capacity": ("mtmd", cap),
        "both": ("mtmd", prec + cap),
        "chat-exact": ("chat", []),
        "prune": ("chat", PRUNE),
        "all-three": ("chat", PRUNE + prec + cap),
        "prune-precision": ("chat", PRUNE + prec),
    }


def _total_after(out: str, header: str) -> list[float] | None:
    """the numbers of the first 'vis-moe: total' row after the last line containing `header`"""
    i = out.rfind(header)
    if i < 0:
        return None
    m = re.search(r"^vis-moe:\s+total((?:\s+-?[\d.]+)+)\s*$", out[i:], re.M)
    return [float(x) for x in m.group(1).split()] if m else None


def parse(out: str) -> dict:
    """the --moe-stats footer of the last context (llama-mtmd-cli or pyvis chat)"""
    r: dict = {}
    m = re.findall(r"time to first token: ([\d.]+) ms \(the last prompt: (\d+) ubatch", out)
    if m:
        r["ttft_ms"], r["prompt_ubatches"] = float(m[-1][0]), int(m[-1][1])
    m = re.findall(r"vis-moe:\s+total\s+(\d+)\s+(\d+)\s+(\d+)\s+[\d.]+%\s+([\d.]+)\s+([\d.]+)\s+(\d+)", out)
    if m:
        routed, hits, misses, mib, stall, passes = m[-1]
        r.update(routed=int(routed), hits=int(hits), misses=int(misses), cache_mib_loaded=float(mib),
                 cache_stall_ms=float(stall), passes=int(passes))
    p = _total_after(out, "vis-moe: precision (--moe-precision")
    if p and len(p) >= 10:   # eligible shadow pairs sh-hits sh-reads MiB-read MiB-saved refetch stall-ms vision
        r.update(prec_eligible=int(p[0]), prec_shadow=int(p[1]), prec_pairs=int(p[2]), shadow_mib=p[5],
                 prec_saved_mib=p[6], prec_refetch=int(p[7]), prec_stall_ms=p[8], prec_vision_ubatches=int(p[9]))
    k = _total_after(out, "entropy-weighted capacity")
    if k and len(k) >= 10:   # ubatches cap-avg R_v missing loaded overflow forced rerouted dropped MiB-saved
        r.update(cap_ubatches=int(k[0]), cap_avg=k[1], cap_rv=k[2], cap_missing=int(k[3]), cap_loaded=int(k[4]),
                 cap_overflow=int(k[5]), cap_forced=int(k[6]), cap_rerouted=int(k[7]), cap_dropped=int(k[8]),
                 cap_saved_mib=k[9])
    m = re.findall(r"tiers: slab hits (\d+) \| host-cache hits (\d+) \| file reads (\d+) \(([\d.]+) MiB payload, "
                   r"([\d.]+) MiB from storage[^,]*, ([\d.]+) s waiting", out)
    if m:
        r.update(file_reads=int(m[-1][2]), payload_mib=float(m[-1][3]), storage_mib=float(m[-1][4]),
                 io_wait_s=float(m[-1][5]))
    m = re.findall(r"prefill streaming: (\d+) experts \(([\d.]+) MiB\)", out)
    if m:
        r["streamed_experts"], r["streamed_mib"] = int(m[-1][0]), float(m[-1][1])
    m = re.findall(r"staged streaming: (\d+) layers .*?, ([\d.]+) MiB read, ([\d.]+) s waited", out)
    if m:
        r.update(staged_layers=int(m[-1][0]), staged_mib=float(m[-1][1]), staged_wait_s=float(m[-1][2]))
    m = re.findall(r"memory plan: budget (\d+) MiB", out)
    if m:
        r["plan_budget_mib"] = int(m[-1])
    m = re.findall(r"^vis-moe:\s+\d+\s+(\d+)\s+\d+\s+\d+\s+\d+\s+[\d.]+%", out, re.M)
    if m:
        r["slots"] = int(m[-1])
    m = re.findall(r"prefill ([\d.]+) ms;", out)    # pyvis chat's own prefill timing (whole prepare)
    if m:
        r["chat_prefill_ms"] = float(m[-1])
    m = re.findall(r"kept (\d+)/(\d+) tokens", out)
    if m:
        r["image_tokens_kept"] = sum(int(a) for a, _ in m)
        r["image_tokens"] = sum(int(b) for _, b in m)
    m = re.findall(r"timings: .*?probe ([\d.]+) ms, .*?decode_image ([\d.]+) ms, decode_text ([\d.]+) ms", out)
    if m:   # pyvis chat: where its prefill went
        r["chat_probe_ms"], r["chat_decode_image_ms"], r["chat_decode_text_ms"] = map(float, m[-1])
        r["image_ms"] = r["chat_probe_ms"] + r["chat_decode_image_ms"]
    m = re.findall(r"image decoded \(batch \d+/\d+\) in (\d+) ms", out)   # llama-mtmd-cli -lv 4 (mtmd-helper)
    if m:
        r["image_ms"] = float(sum(int(x) for x in m))
    r["stall_ms"] = r.get("cache_stall_ms", 0.0) + r.get("prec_stall_ms", 0.0)
    # a staged (streamed) layer's wait for its reads is a stall too, counted apart from the cache table's
    r["stall_staged_ms"] = r["stall_ms"] + 1e3 * r.get("staged_wait_s", 0.0)
    if r.get("ttft_ms"):
        r["stall_share"] = r["stall_ms"] / r["ttft_ms"]
        r["stall_staged_share"] = r["stall_staged_ms"] / r["ttft_ms"]
    # the tiers' payload holds the slot loads and the staged streaming reads; streaming through the mapping
    # (the streamed bytes not staged) is read by the kernel and is not in it
    r["mib_read"] = r.get("payload_mib", 0.0) + max(0.0, r.get("streamed_mib", 0.0) - r.get("staged_mib", 0.0))
    return r


def command(a, tool: str, flags: list[str]) -> tuple[list, dict]:
    images = [x for im in a.image[:a.images] for x in ("--image", im)]
    env = {"VIS_LIB_DIR": a.bin, "LD_LIBRARY_PATH": a.bin}
    if tool == "mtmd":
        cmd = [Path(a.bin) / "llama-mtmd-cli", "-m", a.model, "--mmproj", a.mmproj, *images, "-p", a.prompt,
               "-n", "1", "--temp", "0", "-t", "2", *CTX, "-lv", "4", "--moe-mem", "auto", "--moe-stats", *flags]
    else:
        cmd = [a.python, "-m", "pyvis", "chat", "-m", a.model, "--mmproj", a.mmproj, *images, "-p", a.prompt,
               "-n", "1", "--temp", "0", "-t", "2", *CTX, "--moe-stats", *flags]
        env["VIS_MOE_MEM"] = "auto"
        env["PYTHONPATH"] = str(ROOT)
    return cmd, env


def _frac(s: str) -> float:
    v = float(s)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"{s}: a budget fraction is in (0, 1]")
    return v


def _pos(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{s}: must be >= 1")
    return v


def table(results: list[dict]) -> str:
    def med(rs, key, fmt="%.0f"):
        return median_cell(rs, key, fmt)
    rows = ["| images | budget | config | finished | TTFT ms | TTFT speed-up vs exact: median (per round) | image ubatches ms | image ubatches speed-up: median (per round) | CPU s | MiB file | MiB shadow | "
            "MiB storage (rusage) | stall share (+ staged wait) | misses | rerouted / dropped / overflow | peak MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for r in results:
        groups.setdefault((r["images"], r["fraction"], r["name"]), []).append(r)
    order = {n: i for i, n in enumerate(configs("S"))}
    for (nim, frac, name), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], -kv[0][1], order.get(kv[0][2], 99))):
        fin = sum(1 for x in rs if x["finished"])
        why = "" if fin == len(rs) else (" OOM" if any(x["oom_killed"] for x in rs) else f" rc {rs[0]['rc']}")
        def ratios_of(key):   # the median of the per-round ratios, then each round's
            v = [x[key] for x in sorted(rs, key=lambda x: x["rep"]) if x.get(key)]
            return f"**{statistics.median(v):.2f}x** ({', '.join(f'{y:.2f}' for y in v)})" if v else "-"
        ratios, iratios = ratios_of("speedup"), ratios_of("image_speedup")
        cap = "-"
        if any(x.get("cap_rerouted") is not None for x in rs):
            cap = f"{med(rs, 'cap_rerouted')} / {med(rs, 'cap_dropped')} / {med(rs, 'cap_overflow')}"
        rows.append(f"| {nim} | {frac:g} ({rs[0]['limit_bytes'] / 2**20:.0f} MiB) | {name} | {fin}/{len(rs)}{why} | "
                    f"{med(rs, 'ttft_ms')} | {ratios} | {med(rs, 'image_ms')} | {iratios} | {med(rs, 'cpu_s')} | {med(rs, 'mib_read')} | {med(rs, 'shadow_mib')} | "
                    f"{med(rs, 'storage_read_mib')} | {med(rs, 'stall_share', '%.2f')} ({med(rs, 'stall_staged_share', '%.2f')}) | {med(rs, 'misses')} | {cap} | "
                    f"{med(rs, 'peak_mib')} |")
    return "\n".join(rows) + "\n"


def plot(results: list[dict], path: Path) -> None:
    """bars: median time to first token per configuration, one group per budget, one panel per image count"""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n in configs("S") if any(r["name"] == n for r in results)]
    nims = sorted({r["images"] for r in results})
    fig, axes = plt.subplots(1, len(nims), figsize=(5.0 * len(nims), 4.2), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    w = 0.8 / max(len(names), 1)
    for ax, nim in zip(axes[0], nims):
        fracs = sorted({r["fraction"] for r in results if r["images"] == nim}, reverse=True)
        for i, n in enumerate(names):
            ys, lo, hi = [], [], []
            for f in fracs:
                v = [r["ttft_ms"] / 1e3 for r in results if r["name"] == n and r["images"] == nim
                     and r["fraction"] == f and r["finished"]]
                m = statistics.median(v) if v else 0.0
                ys.append(m)
                lo.append(m - min(v) if v else 0.0)
                hi.append(max(v) - m if v else 0.0)
            xs = [j + (i - (len(names) - 1) / 2) * w for j in range(len(fracs))]
            ax.bar(xs, ys, w, yerr=[lo, hi], capsize=2, label=n, color=colors[i % 10],
                   hatch="//" if configs("S")[n][0] == "chat" else None, edgecolor="white", linewidth=0.3,
                   error_kw=dict(elinewidth=0.8))
            for x, y, f in zip(xs, ys, fracs):
                rs = [r for r in results if r["name"] == n and r["images"] == nim and r["fraction"] == f]
                if rs and y == 0:   # ran, never finished: say why
                    why = ("OOM" if any(r["oom_killed"] for r in rs) else
                           "no stats" if all(r["rc"] == 0 for r in rs) else "failed")
                    ax.text(x, 0.5, why, rotation=90, ha="center", va="bottom", fontsize=7, color=colors[i % 10])
        ax.set_xticks(range(len(fracs)), [f"{f * 100:g} % budget" for f in fracs])
        ax.set_ylabel("time to first token (s)")
        ax.set_title(f"{nim} image{'s' if nim > 1 else ''} (196 tokens each)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=min(len(names), 5), fontsize=7,
               title="bars: median of the rounds, whiskers: min..max; hatched: pyvis chat (its own exact baseline)",
               title_fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    fig.savefig(path, dpi=80)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("model", help="the language model GGUF")
    ap.add_argument("--mmproj", required=True, help="the projector GGUF")
    ap.add_argument("--shadow", required=True, help="the model's shadow sidecar (pyvis shadow MODEL --type Q2_K)")
    ap.add_argument("--image", action="append", required=True, help="an image (repeatable; --images uses the first N)")
    ap.add_argument("--images", type=int, choices=[1, 2], default=1, help="images per prompt (default: 1)")
    ap.add_argument("--fractions", type=_frac, nargs="+", default=[0.25, 0.125],
                    help="memory budgets as fractions of the model file's size (default: 0.25 0.125)")
    ap.add_argument("--repeat", type=_pos, default=1, help="rounds; each round runs every configuration once")
    ap.add_argument("--first-round", type=int, default=0, metavar="K",
                    help="number the rounds K .. K+repeat-1 (default 0), to add rounds to an OUT that has some")
    ap.add_argument("--only", nargs="+", default=None, choices=list(configs("S")), metavar="NAME",
                    help=f"configurations to run (default: all: {', '.join(configs('S'))})")
    ap.add_argument("--timeout", type=_pos, default=900, help="seconds per run (default: 900)")
    ap.add_argument("--out", default="bench-precision", help="results folder (default: bench-precision)")
    ap.add_argument("--bin", default=os.environ.get("VIS_LIB_DIR", str(ROOT / "build/bin")),
                    help="bin dir of the fork (default: $VIS_LIB_DIR, else build/bin)")
    ap.add_argument("--python", default=str(ROOT / ".venv/bin/python"), help="interpreter for pyvis chat")
    ap.add_argument("-p", "--prompt", default=PROMPT, help=f"the prompt (default: {PROMPT!r})")
    ap.add_argument("--no-bandwidth", action="store_true", help="skip the storage bandwidth probe")
    ap.add_argument("--plot", default=None, metavar="PNG", help="also draw OUT/results.json as bars into PNG")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: recompute ratios, the table (and --plot) from OUT/results.json")
    a = ap.parse_args()
    if a.first_round < 0:
        ap.error("--first-round must be >= 0")
    if len(a.image) < a.images:
        ap.error(f"--images {a.images} needs {a.images} --image files (got {len(a.image)})")
    for f in [a.model, a.mmproj, a.shadow, *a.image[:a.images]]:
        if not Path(f).is_file():
            ap.error(f"{f}: no such file")
    if os.geteuid() != 0 and not a.report_only:
        ap.error("needs root (memory cgroups, drop_caches)")
    a.model, a.mmproj, a.shadow = (str(Path(x).resolve()) for x in (a.model, a.mmproj, a.shadow))
    a.image = [str(Path(x).resolve()) for x in a.image]
    cfgs = configs(a.shadow)
    names = a.only or list(cfgs)
    size = Path(a.model).stat().st_size
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else []
    bw = None
    if not a.no_bandwidth and not a.report_only:
        from pyvis.runtime import plan as vplan
        expert = max(vplan.read_shape(Path(a.model)).expert_bytes.values())
        bw = storage_bandwidth(Path(a.model), expert // 3)
        print(f"storage: {bw / 2**20:.0f} MiB/s O_DIRECT random reads of one expert tensor, 4 threads", flush=True)
    for frac in ([] if a.report_only else a.fractions):
        limit = int(size * frac)
        print(f"== {a.images} image(s), budget {frac:g} x {size / 2**30:.2f} GiB = {limit / 2**20:.0f} MiB", flush=True)
        for rep in range(a.first_round, a.first_round + a.repeat):
            for name in names:
                tool, flags = cfgs[name]
                cmd, env = command(a, tool, flags)
                log = out / f"{name}-{a.images}img-{frac}-{rep}.log"
                load1 = os.getloadavg()[0]
                ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                r = run_one(name, cmd, limit, a.timeout, 1, log, env)
                ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                # the child's CPU seconds (whole run: load, vision encoder, prefill): less sensitive than wall time
                # to the other jobs on the machine; the load average says how busy it was when the run started
                r["cpu_s"] = round(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime, 1)
                r["loadavg_start"] = load1
                r.update(parse(log.read_text(errors="replace")))
                r["finished"] = r["rc"] == 0 and r.get("ttft_ms") is not None and not r["oom_killed"]
                if r["finished"]:
                    r.pop("tail", None)
                for k in ("decode_tps", "prefill_tps", "read_bytes_per_token"):
                    r.pop(k, None)
                r.update(tool=tool, images=a.images, fraction=frac, limit_bytes=limit, model=a.model, model_bytes=size,
                         rep=rep, storage_bw=bw, peak_mib=r["peak_bytes"] / 2**20,
                         storage_read_mib=r["read_bytes"] / 2**20)
                print(f"    -> TTFT {r.get('ttft_ms')} ms, MiB file {r.get('mib_read', 0):.0f} shadow "
                      f"{r.get('shadow_mib', 0):.0f}, stall {r.get('stall_ms', 0):.0f} ms, misses {r.get('misses')}, "
                      f"rerouted {r.get('cap_rerouted')}, streamed {r.get('streamed_experts', 0)}, staged "
                      f"{r.get('staged_layers', 0)}, slots {r.get('slots')}", flush=True)
                results = [x for x in results if not (x["name"] == name and x["fraction"] == frac
                                                      and x["rep"] == rep and x["images"] == a.images)] + [r]
                (out / "results.json").write_text(json.dumps(results, indent=1))
    # ratios against exact of the same tool, images, budget and round
    for r in results:
        base = "exact" if r["tool"] == "mtmd" else "chat-exact"
        b = next((x for x in results if x["name"] == base and x["images"] == r["images"]
                  and x["fraction"] == r["fraction"] and x["rep"] == r["rep"] and x["finished"]), None)
        r["speedup"] = b["ttft_ms"] / r["ttft_ms"] if b and r["finished"] and r.get("ttft_ms") else None
        r["image_speedup"] = (b["image_ms"] / r["image_ms"] if b and r["finished"] and r.get("image_ms")
                              and b.get("image_ms") else None)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    md = table(results)
    (out / "results.md").write_text(md)
    print(md)
    if a.plot:
        plot(results, Path(a.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
