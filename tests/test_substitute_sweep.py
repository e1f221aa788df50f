"""pyvis substitute-sweep: the grid and its command lines, the --moe-stats parsers, the summary, and one tiny
end-to-end run on the 3-layer MoEfied model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import pyvis  # noqa: F401
from pyvis.testbed import corpus
from pyvis.testbed import substitute_sweep as sw

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "models" / "testbed" / "test" / "tiny-shared16-3L.gguf"

# captured from: llama-perplexity -m tiny-shared16-3L.gguf -c 64 -b 64 -ub 1 --chunks 1 --moe-slots 8 --moe-stats
#                --moe-substitute router --override-kv deepseek.expert_used_count=int:4
STATS_OUT = """0.02.632.997 I perplexity: calculating perplexity over 1 chunks, n_ctx=64, batch_size=64, n_seq=1
0.15.355.793 I perplexity: 12.72 seconds per pass - ETA 0.20 minutes
vis-moe: expert cache stats (2 managed layers)
vis-moe: layer  slots     routed       hits     misses     hit%   MiB loaded   stall ms   passes
vis-moe:     1      8        264        207         57    78.4%        24.05     122.64       66
vis-moe:     2      8        132         96         36    72.7%        15.19      41.64       33
vis-moe: total               396        303         93    76.5%        39.23     164.28       99
vis-moe: substitution (--moe-substitute router): missing (token, expert) pairs by outcome
vis-moe: layer    tokens  missing    subst    tae margin   beta budget weight nocand anyway prefil  MiB saved bg read  bg wait
vis-moe:     1        66      114       57      0      0      0     53      0      4      0      0      24.05      57    12.50
vis-moe:     2        33       68       32      0      0      0     32      0      4      0      0      13.50      32     0.00
vis-moe: total        99      182       89      0      0      0     85      0      8      0      0      37.55      89    12.50
vis-moe: substitution: 89 of 99 token-layers ran a stand-in (0.90 per token and layer); 37.55 MiB not read before their layer, ~144.4 ms of reads at this run's rate
vis-moe: tiers: slab hits 303 | host-cache hits 0 | file reads 93 (39.23 MiB payload, 40.32 MiB from storage with O_DIRECT, 0.15 s waiting, 260 MiB/s) | model copies 0
vis-moe: memory: slabs 6.75 MiB, host cache 0.00/0.00 MiB (0 evictions), locked, peak RSS 181.95 MiB, major faults 0
[1]912079784.0148,
0.15.371.714 I Final estimate: PPL = 912079784.0148 +/- 1811168782.30219
"""

# the exact run: no substitution table; model store, so no tiers line
STATS_OFF = """vis-moe: expert cache stats (2 managed layers)
vis-moe: layer  slots     routed       hits     misses     hit%   MiB loaded   stall ms   passes
vis-moe:     1      8        264        152        112    57.6%        47.25       5.05       66
vis-moe:     2      8        132         65         67    49.2%        28.27      16.69       33
vis-moe: total               396        217        179    54.8%        75.52      21.74       99
"""


def test_parse_stats():
    r = sw.parse_stats(STATS_OUT)
    assert r["cache"] == {"routed": 396, "hits": 303, "misses": 93, "hit_pct": 76.5, "mib_loaded": 39.23,
                          "stall_ms": 164.28, "passes": 99}
    s = r["sub"]
    assert (s["tokens"], s["missing"], s["substituted"], s["blocked_budget"], s["no_candidate"]) == (99, 182, 89, 85, 8)
    assert s["mib_saved"] == pytest.approx(37.55) and s["bg_reads"] == 89 and s["bg_wait_ms"] == pytest.approx(12.5)
    assert s["blocked_tae"] == 0 and s["needed_anyway"] == 0 and s["not_eligible"] == 0
    t = r["tiers"]
    assert t == {"slab_hits": 303, "host_hits": 0, "file_reads": 93, "mib_read": 39.23, "mib_storage": 40.32,
                 "direct_io": True, "read_wait_s": 0.15, "read_mib_s": 260.0, "model_copies": 0}
    off = sw.parse_stats(STATS_OFF)
    assert off["cache"]["misses"] == 179 and off["cache"]["mib_loaded"] == pytest.approx(75.52)
    assert "sub" not in off and "tiers" not in off
    buffered = STATS_OUT.replace("with O_DIRECT", "buffered")
    assert sw.parse_tiers(buffered)["direct_io"] is False
    with pytest.raises(sw.SweepError, match="total"):
        sw.parse_stats("Final estimate: PPL = 3.0 +/- 0.1\n")
    # a build with one more gate column (rank): read from the heading
    ranked = STATS_OUT.replace("weight nocand", "weight   rank nocand").replace(
        "vis-moe: total        99      182       89      0      0      0     85      0      8",
        "vis-moe: total        99      182       89      0      0      0     85      0      7      8")
    s = sw.parse_stats(ranked)["sub"]
    assert s["blocked_rank"] == 7 and s["no_candidate"] == 8 and s["bg_reads"] == 89 and s["mib_saved"] == 37.55
    with pytest.raises(sw.SweepError, match="columns"):
        sw.parse_stats(STATS_OUT.replace("weight nocand", "weight   rank nocand"))


def test_parse_eval_seconds():
    # from 'calculating perplexity over' (2.632997 s) to the final estimate (15.371714 s)
    assert sw.parse_eval_seconds(STATS_OUT) == pytest.approx(12.738717, abs=1e-6)
    assert sw.parse_eval_seconds(STATS_OUT, wall=99.0) == pytest.approx(12.738717, abs=1e-6)
    # stdout and stderr captured apart: the final estimate may come before the start line in the text
    swapped = "[1]5.0,1.02.000.000 I Final estimate: PPL = 5.0 +/- 1\n0.01.500.000 I perplexity: calculating " \
              "perplexity over 1 chunks, n_ctx=64\n"
    assert sw.parse_eval_seconds(swapped) == pytest.approx(60.5, abs=1e-6)
    # --kl-divergence: no timestamp after the first chunk, so up to the process's end
    kl = "0.01.190.600 I kl_divergence: computing over 3 chunks, n_ctx=64\n0.03.000.000 I kl_divergence: 1.8 " \
         "seconds per pass - ETA 0.1 minutes\nMean    KLD:   0.1 ± 0.01\n"
    assert sw.parse_eval_seconds(kl, wall=10.0) == pytest.approx(8.8094, abs=1e-6)
    assert sw.parse_eval_seconds(kl) is None
    assert sw.parse_eval_seconds("perplexity: calculating perplexity over 1 chunks\n", wall=3.0) is None


def test_parse_config():
    c = sw.parse_config("router:tae=p50,budget=2")
    assert c.mode == "router" and c.options == {"tae": "p50", "budget": "2"} and c.needs_profile()
    assert not sw.parse_config("router:tae=0.9").needs_profile()
    assert sw.parse_config("buddy").needs_profile()
    assert sw.parse_config("off").flags(4) == ["--moe-substitute", "off"]
    assert sw.parse_config("router:wrel=1").flags(4) == ["--moe-substitute", "router", "--moe-sub-weight", "0.25"]
    assert sw.parse_config("router:wrel=1").flags(16) == ["--moe-substitute", "router", "--moe-sub-weight", "0.0625"]
    assert sw.parse_config("router:weight=0.3,margin=off,beta=0.5").flags(8) == [
        "--moe-substitute", "router", "--moe-sub-margin", "off", "--moe-sub-beta", "0.5", "--moe-sub-weight", "0.3"]
    assert sw.parse_config("router:rank=1,budget=1").flags(8) == [
        "--moe-substitute", "router", "--moe-sub-budget", "1", "--moe-sub-rank", "1"]
    assert sw.parse_config("buddy:tae=p25").flags(8, "P.gguf") == [
        "--moe-substitute", "buddy", "--moe-sub-profile", "P.gguf", "--moe-sub-tae", "p25"]
    with pytest.raises(sw.SweepError, match="profile"):
        sw.parse_config("buddy").flags(8)
    for bad in ("fast", "off:tae=p5", "router:tae", "router:foo=1", "router:budget=0", "router:weight=x",
                "router:tae=q50", "router:weight=0.1,wrel=1", "router:rank=-1"):
        with pytest.raises(sw.SweepError):
            sw.parse_config(bad)


def test_points_and_grid():
    assert [sw.slots_for(f, e) for f, e in ((0.5, 16), (0.75, 16), (0.5, 64), (0.75, 64), (0.01, 16))] == \
        [8, 12, 32, 48, 1]
    with pytest.raises(sw.SweepError):
        sw.slots_for(0, 16)
    p = sw.parse_point("shared+16@4")
    assert p.k == 4 and p.model.endswith("models/testbed/shared+16.gguf")
    assert sw.parse_point("/x/y.gguf@12") == sw.Point("/x/y.gguf", "/x/y.gguf", 12)
    for bad in ("shared+16", "shared+16@", "@4", "shared+16@0", "shared+16@x"):
        with pytest.raises(sw.SweepError):
            sw.parse_point(bad)
    pts = [sw.Point("a", "a.gguf", 4), sw.Point("b", "b.gguf", 16)]
    grid = sw.expand(pts, [0.5, 0.75], {"a.gguf": 16, "b.gguf": 64})
    assert [(s.point.name, s.slots) for s in grid] == [("a", 8), ("a", 12), ("b", 32), ("b", 48)]
    with pytest.raises(sw.SweepError, match="larger"):
        sw.expand([sw.Point("a", "a.gguf", 17)], [0.5], {"a.gguf": 16})
    sw.check_scored(256, 1)
    with pytest.raises(sw.SweepError, match="100"):
        sw.check_scored(64, 1)


@pytest.mark.skipif(not TINY.is_file(), reason="tiny testbed model not built")
def test_command_lines():
    s = sw.expand([sw.Point("tiny", str(TINY), 4)], [0.5])[0]
    assert s.n_expert == 16 and s.slots == 8
    a = sw.run_args(s, sw.parse_config("router:tae=p50,budget=2"), 256, 2, "model", "prof.gguf")
    assert Path(a[0]).name == "llama-perplexity"
    j = " ".join(a)
    assert f"-m {TINY} -c 256 -t 2 -b 256" in j
    assert "--override-kv deepseek.expert_used_count=int:4" in j
    assert "-ub 1 --moe-slots 8 --moe-store model --moe-stats" in j
    assert j.endswith("--moe-substitute router --moe-sub-profile prof.gguf --moe-sub-tae p50 --moe-sub-budget 2")
    f = sw.run_args(s, sw.parse_config("off"), 128, 2, "file")
    assert "--moe-store file" in " ".join(f) and f[-2:] == ["--moe-substitute", "off"]


def _res(rows):
    """A sweep result of one setting with the given {config: (cost %, tok/s)}."""
    res = {"options": {"ctx": 256, "chunks": 16, "text": "heldout", "speed_ctx": None, "speed_chunks": 1,
                       "threads": 2},
           "configs": list(rows), "settings": [{"key": "m@4/S8", "label": "m k=4 S=8/16", "model": "m.gguf", "k": 4,
                                                "n_expert": 16, "fraction": 0.5, "slots": 8}], "runs": {}}
    for c, (cost, tps) in rows.items():
        res["runs"][f"m@4/S8|{c}|quality|c256x16|heldout"] = {
            "ppl": 10 * (1 + cost / 100), "ppl_exact": 10.0, "cost_pct": cost, "kld": cost / 100, "same_top": 0.9,
            "sub": {"missing": 100, "substituted": 50 if c != "off" else 0}, "cache": {"misses": 10}}
        res["runs"][f"m@4/S8|{c}|speed|c256x1|t2"] = {"tok_s": tps, "cache": {"mib_loaded": 1.0, "stall_ms": 2.0,
                                                                           "misses": 3, "hit_pct": 50.0}}
    return res


def test_table_and_recommendation():
    res = _res({"off": (0.0, 10.0), "router": (3.0, 20.0), "router:tae=p50": (0.5, 12.0), "buddy": (0.9, 11.0)})
    rows = sw.table_rows(res)
    assert [r["speedup"] for r in rows] == pytest.approx([1.0, 2.0, 1.2, 1.1])
    assert rows[1]["subst_share"] == 0.5 and rows[0]["subst_share"] == 0.0
    rec = sw.recommend(res)
    assert rec["best"] == "router:tae=p50"          # router is faster but costs 3 %
    assert {c["config"]: c["qualifies"] for c in rec["candidates"]} == {
        "router": False, "router:tae=p50": True, "buddy": True}
    md = sw.format_table(res)
    assert "`router:tae=p50`" in md and "fastest configuration" in md and "| 2.000 |" in md
    assert rec["best_2sigma"] == "router:tae=p50"      # no uncertainty given: the same
    # with llama-perplexity's PPL-ratio uncertainty, p50's 2-sigma bound is 0.5 + 2 = 2.5 %: only buddy stays
    res["runs"]["m@4/S8|router:tae=p50|quality|c256x16|heldout"]["ppl_ratio_err"] = 0.01
    res.pop("table", None)
    rec = sw.recommend(res)
    assert rec["best"] == "router:tae=p50" and rec["best_2sigma"] == "buddy"
    assert "2-sigma upper bound < 1 % at every setting: `buddy`" in sw.format_table(res)
    # merged sweeps: a configuration not run at a setting has no row there and cannot qualify overall
    other = _res({"off": (0.0, 5.0), "router": (0.2, 9.0)})
    other["settings"][0].update(key="n@4/S8", label="n k=4 S=8/16")
    other["runs"] = {k.replace("m@4/S8", "n@4/S8"): v for k, v in other["runs"].items()}
    m = sw.merge([res, other])
    assert [s["key"] for s in m["settings"]] == ["m@4/S8", "n@4/S8"]
    assert m["configs"] == ["off", "router", "router:tae=p50", "buddy"]
    assert [(r["setting_key"], r["config"]) for r in m["table"]][4:] == [("n@4/S8", "off"), ("n@4/S8", "router")]
    assert m["recommendation"]["best"] is None      # router costs 3 % on m, the others were not run on n
    none = sw.recommend(_res({"off": (0.0, 10.0), "router": (3.0, 20.0)}))
    assert none["best"] is None
    assert "no configuration" in sw.format_table(_res({"off": (0.0, 10.0), "router": (3.0, 20.0)}))


@pytest.mark.skipif(not TINY.is_file(), reason="tiny testbed model not built")
def test_end_to_end_tiny(tmp_path, monkeypatch, capsys):
    """off against its own exact reference gives KLD ~ 0 and PPL ratio 1; router runs; the outputs exist."""
    from pyvis.cli import main
    monkeypatch.setenv("VIS_KLD_DIR", str(tmp_path / "kld"))
    monkeypatch.setenv("VIS_PROFILE_DIR", str(tmp_path / "prof"))
    text = tmp_path / "heldout.txt"
    text.write_text(corpus.heldout().text[:6_000])
    out = tmp_path / "out"
    rc = main(["substitute-sweep", "--point", f"{TINY}@4", "--fraction", "0.5", "--config", "off", "router",
               "-f", str(text), "-c", "256", "--chunks", "1", "--speed-ctx", "64", "--speed-chunks", "1", "-t", "1",
               "-j", "2", "--speed-threads", "2", "--verify-off", "-o", str(out), "--name", "t"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "1/4 " in cap.err and "4/4 " in cap.err        # one progress line per finished run
    res = json.loads((out / "t.json").read_text())
    rows = {r["config"]: r for r in res["table"]}
    off, router = rows["off"], rows["router"]
    q_off = res["runs"][f"{TINY}@4/S8|off|quality|c256x1|{text}"]
    assert not q_off.get("from_reference")               # --verify-off: a real --kl-divergence run
    assert off["kld"] < 1e-6 and off["same_top"] == 1.0
    assert off["ppl"] == pytest.approx(off["ppl_exact"], rel=1e-9) and abs(off["cost_pct"]) < 1e-6
    assert off["subst_share"] == 0.0 and off["tok_s"] > 0 and off["misses"] > 0
    # router substitutes on this cache, so it differs from exact and reads less before each layer
    assert router["subst_share"] > 0 and router["kld"] > off["kld"]
    sp = res["runs"][f"{TINY}@4/S8|router|speed|c64x1|t2"]
    assert sp["sub"]["substituted"] > 0 and sp["tiers"]["direct_io"] in (True, False)
    assert sp["tokens"] == 64 and sp["cache"]["misses"] < res["runs"][f"{TINY}@4/S8|off|speed|c64x1|t2"]["cache"]["misses"]
    # the reference was written once, under VIS_KLD_DIR
    assert len(list((tmp_path / "kld").glob("*.kld"))) == 1
    md = (out / "t.md").read_text()
    assert "| `off` |" in md and "| `router` |" in md
    import matplotlib.image as mpimg
    for png in ("t.png", "t-avoided.png", "t-kld.png"):
        img = mpimg.imread(out / png)
        assert img.shape[0] > 100 and img.shape[1] > 100
    # a second run reuses every run (--resume) and the cached reference
    rc = main(["substitute-sweep", "--point", f"{TINY}@4", "--fraction", "0.5", "--config", "off", "router",
               "-f", str(text), "-c", "256", "--chunks", "1", "--speed-ctx", "64", "--speed-chunks", "1", "-t", "1",
               "-j", "2", "--speed-threads", "2", "--verify-off", "-o", str(out), "--name", "t", "--resume"])
    assert rc == 0
    again = json.loads((out / "t.json").read_text())
    assert again["runs"] == res["runs"]
    # --replot rebuilds the outputs from the JSON without running anything
    (out / "t.md").unlink()
    assert main(["substitute-sweep", "-o", str(out), "--name", "t", "--replot"]) == 0
    assert (out / "t.md").read_text() == md


def test_cli_errors(capsys):
    from pyvis.cli import main
    assert main(["substitute-sweep", "--point", "nope.gguf@4", "--no-speed"]) == 1
    assert "model not found" in capsys.readouterr().err
    assert main(["substitute-sweep", "--point", "shared+16@4", "--config", "router:zzz=1"]) == 1
    assert "KEY=VALUE" in capsys.readouterr().err
