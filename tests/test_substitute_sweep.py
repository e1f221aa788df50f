"""pyvis substitute-sweep: the grid and its command lines, the --moe-stats parsers, the summary, and one tiny
end-to-end run on the 3-layer MoEfied model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import pyvis  # noqa: F401
from pyvis.testbed import corpus
from pyvis.testbed import substitute_sweep as sw
from pyvis.testbed import sweep_precision as sp

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


@pytest.fixture(scope="module")
def tiny() -> Path:
    """The tiny testbed model, built when missing (test_moefy builds the same file; it is cached)."""
    from test_moefy import tiny_model
    assert tiny_model() == TINY
    return TINY


def test_command_lines(tiny):
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


def test_end_to_end_tiny(tiny, tmp_path, monkeypatch, capsys):
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


# --------------------------------------------------------------------------
# precision rules (prec:RULE[:KEY=VALUE,...]; docs/precision-study.md)
# --------------------------------------------------------------------------
# the tables of a --moe-precision gate run (layers cut to two), as llama-perplexity prints them; the attach-time
# log line ("precision (lossy)") is not a table
PREC_OUT = """vis-moe: precision (lossy): --moe-precision gate, vision share >= 0.5, gate < 1; 8 shadow slots per managed layer (3.80 MiB of q4_0 slabs); full-precision refetch on
0.00.552.566 I perplexity: calculating perplexity over 1 chunks, n_ctx=256, batch_size=256, n_seq=1
0.13.230.100 I Final estimate: PPL = 23.5466 +/- 5.96765
vis-moe: expert cache stats (2 managed layers)
vis-moe: layer  slots     routed       hits     misses     hit%   MiB loaded   stall ms   passes
vis-moe:     1      8       1964       1109        855    56.5%       360.70     296.80      258
vis-moe:     2      8       1934       1088        846    56.3%       356.91     271.69      258
vis-moe: total              3898       2197       1701    56.4%       717.61     568.49      516
vis-moe: precision (--moe-precision gate, q4_0 shadows): misses served from shadow experts
vis-moe: layer  eligibl   shadow    pairs  sh hits sh reads   MiB read  MiB saved  refetch  stall ms  vision
vis-moe:     1      100      100      100       64       36       2.14      40.05      100     10.18       0
vis-moe:     2      130      130      130       68       62       3.68      51.17      130     14.00       0
vis-moe: total      230      230      230      132       98       5.82      91.22      230     24.18       0
vis-moe: precision: 230 of 230 eligible misses ran from shadows (230 pairs); 91.22 MiB of full-precision reads left off the critical path
vis-moe: tiers: slab hits 2197 | host-cache hits 0 | file reads 1701 (717.61 MiB payload, 740.00 MiB from storage with O_DIRECT, 0.50 s waiting, 1435 MiB/s) | model copies 0
"""


def test_parse_prec_config():
    c = sw.parse_config("prec:gate=0.05:type=Q8_0")
    assert isinstance(c, sw.PrecConfig) and (c.mode, c.rule, c.type, c.options) == ("prec", "gate", "Q8_0",
                                                                                     {"gate": "0.05"})
    assert not c.needs_profile() and c.side_key(sw.Point("m", "m.gguf", 8)) == ("shadow", "m.gguf", "Q8_0")
    assert c.flags(8, "S.gguf") == ["--moe-substitute", "off", "--moe-shadow", "S.gguf", "--moe-precision", "gate",
                                    "--moe-prec-gate", "0.05"]
    # gate without a value: the runtime's default threshold, passed explicitly; all has no threshold
    g = sw.parse_config("prec:gate:type=q4_0")
    assert g.type == "Q4_0" and g.flags(4, "S")[-2:] == ["--moe-prec-gate", "0.1"]
    assert sw.parse_config("prec:all:type=Q4_0").flags(4, "S") == [
        "--moe-substitute", "off", "--moe-shadow", "S", "--moe-precision", "all"]
    assert sw.parse_config("prec:all:type=Q4_0,refetch=off,slots=4").flags(4, "S")[-4:] == [
        "--moe-shadow-slots", "4", "--moe-prec-refetch", "off"]
    assert sw.parse_config("prec:auto:type=IQ4_NL,gate=0.2,target=0.1,vision=0.5").flags(4, "S")[4:] == [
        "--moe-precision", "auto", "--moe-prec-gate", "0.2", "--moe-prec-target", "0.1", "--moe-prec-vision", "0.5"]
    assert sw.is_prec("prec:all:type=Q4_0") and not sw.is_prec("router") and not sw.is_prec(sw.parse_config("off"))
    with pytest.raises(sw.SweepError, match="shadow"):
        sw.parse_config("prec:all:type=Q4_0").flags(4)
    # strict: every part is checked, and the message names it
    for bad, msg in (("prec", "prec:RULE"), ("prec:", "prec:RULE"), ("prec:fast:type=Q4_0", "one of all, vision"),
                     ("prec:all", "type=T"), ("prec:gate=0.1", "type=T"), ("prec:all:type=F16", "quantized"),
                     ("prec:all:type=Q9_9", "quantized"), ("prec:gate=1.5:type=Q4_0", "0..1"),
                     ("prec:gate=x:type=Q4_0", "0..1"), ("prec:all=0.1:type=Q4_0", "only gate"),
                     ("prec:all:type=Q4_0,type=Q8_0", "twice"), ("prec:all:type=Q4_0,foo=1", "KEY=VALUE"),
                     ("prec:all:type", "KEY=VALUE"), ("prec:all:type=Q4_0:x", "prec:RULE"),
                     ("prec:gate=0.1:type=Q4_0,gate=0.2", "gate is given twice"),
                     ("prec:gate:type=Q4_0,gate=0.2", "gate key is for auto"),
                     ("prec:all:type=Q4_0,target=0.2", "auto rule only"), ("prec:gate:type=Q4_0,vision=0.5", "vision"),
                     ("prec:all:type=Q4_0,slots=0", "slots"), ("prec:all:type=Q4_0,refetch=yes", "refetch"),
                     ("precision:all", "mode must be one of")):
        with pytest.raises(sw.SweepError, match=msg):
            sw.parse_config(bad)


def test_parse_prec_stats():
    r = sw.parse_stats(PREC_OUT)
    assert r["cache"]["misses"] == 1701 and r["cache"]["mib_loaded"] == pytest.approx(717.61)
    assert r["prec"] == {"eligible": 230, "shadow": 230, "pairs": 230, "sh_hits": 132, "sh_reads": 98,
                         "mib_read": 5.82, "mib_saved": 91.22, "refetch": 230, "stall_ms": 24.18, "vision": 0,
                         "mode": "gate", "type": "Q4_0"}
    assert "sub" not in r and r["tiers"]["file_reads"] == 1701
    # auto: the controller's share and switches from the summary line
    auto = PREC_OUT.replace("--moe-precision gate, q4_0", "--moe-precision auto, q4_0").replace(
        "off the critical path\n", "off the critical path; controller: share 25 %, 7 switches\n")
    a = sw.parse_stats(auto)["prec"]
    assert (a["mode"], a["share_pct"], a["switches"]) == ("auto", 25, 7)
    # a column the parser does not know keeps its heading as its name; a row that does not fit is an error
    more = PREC_OUT.replace("stall ms  vision", "stall ms  vision  extra").replace(
        "24.18       0\n", "24.18       0  9\n")
    assert sw.parse_stats(more)["prec"]["extra"] == 9
    with pytest.raises(sw.SweepError, match="precision total row has 11 values for 10 columns"):
        sw.parse_stats(PREC_OUT.replace("24.18       0\n", "24.18       0  9\n"))
    # the share of the misses from shadows: shadow-served experts are not in the cache table
    f = sp.prec_fields(r)
    assert f["shadow_share"] == pytest.approx(230 / (230 + 1701)) and f["refetch_mib"] == pytest.approx(
        230 * 717.61 / 1701)
    assert f["shadow_use_share"] == pytest.approx(230 / (230 + 3898))
    assert sp.prec_fields(sw.parse_stats(STATS_OFF)) == {}


def test_parse_kld_identical_run():
    """A rule that never fires gives the base's logits: llama-perplexity prints the paired uncertainties as nan or
    -nan (a variance of differences that rounds below 0); they read as 0, not as a failed run."""
    from pyvis.testbed import quality
    out = ("Mean PPL(Q)                   :  22.205100 ±   0.610000\n"
           "Mean PPL(base)                :  22.205100 ±   0.610000\n"
           "Mean ln(PPL(Q)/PPL(base))     :   0.000000 ±       -nan\n"
           "Mean PPL(Q)/PPL(base)         :   1.000000 ±       -nan\n"
           "Mean PPL(Q)-PPL(base)         :   0.000000 ±        nan\n"
           "Mean    KLD:   0.000000 ±   0.000000\nMaximum KLD:   0.000000\n99.0%   KLD:   0.000000\n"
           "Median  KLD:   0.000000\nSame top p: 100.000 ±  0.000 %\n")
    r = quality.parse_kld(out)
    assert (r["ppl_ratio"], r["ppl_ratio_err"], r["kld"], r["same_top"]) == (1.0, 0.0, 0.0, 1.0)
    r = quality.parse_kld(out.replace("-nan", "0.012000"))
    assert r["ppl_ratio_err"] == 0.012
    with pytest.raises(quality.QualityError, match="ppl_ratio"):
        quality.parse_kld(out.replace("-nan", "inf"))


def test_prec_table_and_recommendation():
    res = _res({"off": (0.0, 10.0), "prec:all:type=Q4_0": (3.0, 20.0), "prec:gate=0.1:type=Q4_0": (0.5, 12.0)})
    for c, served, misses in (("off", None, 10), ("prec:all:type=Q4_0", 30, 0), ("prec:gate=0.1:type=Q4_0", 5, 15)):
        for kind in ("quality|c256x16|heldout", "speed|c256x1|t2"):
            run = res["runs"][f"m@4/S8|{c}|{kind}"]
            run.pop("sub", None)
            run["cache"].update(misses=misses, mib_loaded=2.0 * misses, stall_ms=2.0)
            if served is not None:
                run["prec"] = {"eligible": served, "shadow": served, "pairs": served, "mib_read": 0.25 * served,
                               "mib_saved": 1.75 * served, "refetch": served, "stall_ms": 1.0, "mode": "gate"}
    res["shadows"] = {"m.gguf|Q4_0": {"model_mib": 64.0, "layers": 2, "type": "Q4_0"}}   # 2 MiB per expert
    rows = {r["config"]: r for r in sw.table_rows(res)}
    assert rows["off"]["avoided_share"] == 0.0 and "shadow_share" not in rows["off"]
    a, g = rows["prec:all:type=Q4_0"], rows["prec:gate=0.1:type=Q4_0"]
    assert a["shadow_share"] == 1.0 and g["shadow_share"] == pytest.approx(0.25) and g["avoided_share"] == 0.25
    assert a["bg_mib"] == pytest.approx(60.0) and a["shadow_mib"] == pytest.approx(7.5) and a["stall_ms"] == 3.0
    assert a["speedup"] == 2.0 and g["ppl_ratio"] is None
    rec = sw.recommend(res)
    assert rec["best"] == "prec:gate=0.1:type=Q4_0"
    assert next(c for c in rec["candidates"] if c["config"] == rec["best"])["avoided_share_mean"] == 0.25
    md = sw.format_table(res)
    assert "| PPL ratio |" in md and "misses avoided (from shadows / substituted)" in md
    assert "| `prec:all:type=Q4_0` | 10.3000 | 1.0300 | +3.00 |" in md and "| 0 + 8 sh + 60 |" in md
    assert "25.0 % of misses from shadows" in md
    # a substitution-only sweep keeps its table as it was
    assert "| substituted |" in sw.format_table(_res({"off": (0.0, 10.0), "router": (3.0, 20.0)}))


def test_prec_plots(tmp_path):
    import matplotlib.image as mpimg
    res = _res({"off": (0.0, 10.0), "prec:all:type=Q4_0": (3.0, 20.0), "router": (1.0, 15.0)})
    # 10 experts from shadows next to the quality run's 10 full-precision misses
    res["runs"]["m@4/S8|prec:all:type=Q4_0|quality|c256x16|heldout"]["prec"] = {"shadow": 10, "refetch": 0}
    res["table"] = sw.table_rows(res)
    assert {r["config"]: r["avoided_share"] for r in res["table"]} == {
        "off": 0.0, "prec:all:type=Q4_0": 0.5, "router": 0.5}
    paths = sw.write_outputs(res, tmp_path, "p")
    for k in ("png", "png_avoided", "png_kld"):
        assert mpimg.imread(paths[k]).shape[0] > 100


@pytest.fixture(scope="module")
def prec_sweep(tiny, tmp_path_factory):
    """One sweep on the tiny model (off, all and a gate rule, -t 1) that the precision tests share: the Q4_0 shadow
    is made once (by the sweep, staged with the model).  The counts checked are deterministic: a background refetch
    is collected, waiting if it must, before the layer's next ubatch is planned, so load changes only times."""
    tmp = tmp_path_factory.mktemp("prec-sweep")
    text = tmp / "heldout.txt"
    text.write_text(corpus.heldout().text[:6_000])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VIS_KLD_DIR", str(tmp / "kld"))
        mp.setenv("VIS_SHADOW_DIR", str(tmp / "sh"))
        settings = sw.expand([sw.Point("tiny", str(TINY), 4)], [0.5])
        configs = [sw.parse_config(c) for c in ("off", "prec:all:type=Q4_0", "prec:gate=0.1:type=Q4_0")]
        o = sw.Options(text=str(text), ctx=256, chunks=1, speed_ctx=64, speed_chunks=1, threads=1,
                       stage=str(tmp / "stage"))
        res = sw.sweep(settings, configs, o, tmp / "r.json", progress=None)
    return tmp, text, res


def test_shadow_cache(prec_sweep, tmp_path, monkeypatch):
    """The cache of ensure_shadow: reuse, a damaged file moved aside and written again, the writer's refusal."""
    import shutil
    from pyvis.runtime import shadow as sh
    made = prec_sweep[0] / "sh" / "tiny-shared16-3L.shadow-Q4_0.gguf"     # written by the sweep
    monkeypatch.setenv("VIS_SHADOW_DIR", str(tmp_path / "sh"))
    f = sp.shadow_path(str(TINY), "Q4_0")
    assert f == tmp_path / "sh" / "tiny-shared16-3L.shadow-Q4_0.gguf"
    f.parent.mkdir()
    shutil.copy2(made, f)
    f2, info = sp.ensure_shadow(str(TINY), "Q4_0", 1)
    assert f2 == f and not info["made"] and 0.1 < info["ratio"] < 0.2     # reused
    # a damaged file is moved aside and written again (the writer itself: tests/test_shadow.py; here it copies
    # the good file, which ensure_shadow then reads back as a shadow of the model)
    f.write_bytes(b"not a gguf")
    calls = []
    with monkeypatch.context() as mp:
        mp.setattr(sh, "write_shadow", lambda model, t, out, *a: calls.append((model, t)) or shutil.copy(made, out))
        assert sp.ensure_shadow(str(TINY), "Q4_0", 1)[1]["made"] and calls == [(str(TINY), "Q4_0")]
    assert f.with_name(f.name + ".bad").read_bytes() == b"not a gguf" and f.read_bytes() == made.read_bytes()
    # the writer's refusal, as a SweepError: rows of 576 values do not fit 256-value blocks
    with pytest.raises(sw.SweepError, match=r"no Q2_K shadow of tiny-shared16-3L.gguf: .*576 % 256 = 64"):
        sp.ensure_shadow(str(TINY), "Q2_K", 1)
    with pytest.raises(sw.SweepError, match="model not found"):
        sp.ensure_shadow(str(tmp_path / "none.gguf"), "Q4_0")
    s = sw.expand([sw.Point("tiny", str(TINY), 4)], [0.5], {str(TINY): 16})[0]
    a = " ".join(sw.run_args(s, sw.parse_config("prec:gate=0.05:type=Q4_0"), 256, 1, "file", str(f)))
    assert a.endswith(f"--moe-substitute off --moe-shadow {f} --moe-precision gate --moe-prec-gate 0.05")


def test_prec_end_to_end_tiny(prec_sweep):
    """off, all and a gate rule on the tiny model: the shadow is made once (staged with the model), all serves
    every miss from it and differs from exact, gate at 0.1 never fires on the testbed (every selected expert
    weighs 1 +- 1e-4, so its share of the token's gate weight is 1/k = 0.25) and equals exact."""
    tmp, text, res = prec_sweep
    assert {k: r["error"] for k, r in res["runs"].items() if "error" in r} == {}
    assert res["shadows"][f"{TINY}|Q4_0"]["made"] and (tmp / "stage" / "tiny-shared16-3L.shadow-Q4_0.gguf").is_file()
    rows = {r["config"]: r for r in res["table"]}
    a, g = rows["prec:all:type=Q4_0"], rows["prec:gate=0.1:type=Q4_0"]
    q = res["runs"][f"{TINY}@4/S8|prec:all:type=Q4_0|quality|c256x1|{text}"]
    # all: every miss ran from the shadow (none left in the cache table), each queued for a refetch
    assert q["cache"]["misses"] == 0 and q["prec"]["shadow"] == q["prec"]["eligible"] == q["prec"]["refetch"] > 0
    assert a["shadow_share"] == 1.0 and a["kld"] > 1e-4 and a["tok_s"] > 0 and a["shadow_mib"] > 0
    assert g["shadow_share"] == 0.0 and g["eligible_q"] == 0 and g["kld"] < 1e-6
    assert "--moe-precision all" in q["command"] and "/stage/" in q["command"]
    speed = res["runs"][f"{TINY}@4/S8|prec:all:type=Q4_0|speed|c64x1|t1"]
    assert str(tmp / "sh") in speed["command"]             # the speed run reads the original shadow
    assert speed["cache"]["misses"] == 0 and speed["prec"]["shadow"] > 0


def test_run_loads_the_libraries_beside_the_binary(tmp_path, monkeypatch):
    """llama-perplexity's RUNPATH is the build tree it was linked in: a copied build (VIS_LIB_DIR) must load its
    own libraries (LD_LIBRARY_PATH), not those a concurrent rebuild rewrites (then: exit 127 from the loader, the
    cause on the error's first line, which is all a sweep keeps)."""
    from pyvis.testbed import quality
    tool = tmp_path / "bin" / "llama-perplexity"
    tool.parent.mkdir()
    tool.write_text('#!/bin/sh\necho "LD=$LD_LIBRARY_PATH"\n[ -z "$FAIL" ] || { echo "ld.so: cannot open libllama.so.0" >&2; '
                    'exit 127; }\n')
    tool.chmod(0o755)
    monkeypatch.setenv("LD_LIBRARY_PATH", f"/elsewhere:{tool.parent}")
    out, _ = quality._run([str(tool)], 10)
    assert out.strip() == f"LD={tool.parent}:/elsewhere"
    monkeypatch.setenv("FAIL", "1")
    with pytest.raises(quality.QualityError) as e:
        quality._run([str(tool)], 10)
    assert str(e.value).splitlines()[0].startswith("llama-perplexity failed (exit 127: ld.so: cannot open libllama")


def test_speed_repeats():
    """--speed-repeats N: the median try (by tok/s) is kept with every try's tok/s; its own row key."""
    m = sw._median_try([{"tok_s": 5.0}, {"error": "x"}, {"tok_s": 9.0}, {"tok_s": 7.0}])
    assert (m["tok_s"], m["tok_s_tries"], m["tries"], m["failed_tries"]) == (7.0, [5.0, 9.0, 7.0], 4, 1)
    assert sw._median_try([{"tok_s": 5.0}, {"tok_s": 9.0}])["tok_s"] == 9.0
    assert "error" in sw._median_try([{"error": "x"}])
    # --resume keeps finished runs of the same build: not failed ones, not the partial median of a cut-off pass
    prev = {"runs": {"a": {"build": "B", "tok_s": 1.0}, "p": {"build": "B", "tok_s": 2.0, "partial": True},
                     "e": {"build": "B", "error": "x"}, "o": {"build": "other", "tok_s": 3.0}}}
    assert list(sw._kept_runs(prev, "B")) == ["a"] and sw._kept_runs(None, "B") == {}
    s = sw.Setting(sw.Point("m", "m.gguf", 4), 16, 0.5, 8)
    assert sw._row_key(s, sw.parse_config("off"), "speed", sw.Options(threads=1)).endswith("|speed|c256x1|t1")
    assert sw._row_key(s, sw.parse_config("off"), "speed", sw.Options(threads=1, speed_repeats=3)).endswith("|t1|r3")
    res = _res({"off": (0.0, 10.0), "router": (3.0, 20.0)})
    res["options"]["speed_repeats"] = 3
    res["runs"] = {(k + "|r3" if "|speed|" in k else k): v for k, v in res["runs"].items()}
    assert [r["speedup"] for r in sw.table_rows(res)] == [1.0, 2.0]
    assert "median of 3 tries" in sw.format_table(res)
