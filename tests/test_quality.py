"""Quality harness: parsing llama-perplexity's output, and real runs on the tiny MoEfied model."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pyvis  # noqa: F401
from pyvis.testbed import corpus, quality

PPL_OUT = """0.02.038.673 I perplexity: calculating perplexity over 20 chunks, n_ctx=256, batch_size=2048, n_seq=8
[1]15.1405,[2]23.0623,[3]17.7654,
1.12.141.875 I Final estimate: PPL = 15.0154 +/- 0.82678
"""

KLD_OUT = """kl_divergence: computing over 3 chunks, n_ctx=128, batch_size=2048, n_seq=16
====== Perplexity statistics ======
Mean PPL(Q)                   :  21.733915 ±   2.212434
Mean PPL(base)                :  20.934611 ±   2.124361
Cor(ln(PPL(Q)), ln(PPL(base))):  97.88%
Mean ln(PPL(Q)/PPL(base))     :   0.037470 ±   0.021106
Mean PPL(Q)/PPL(base)         :   1.038181 ±   0.021912
Mean PPL(Q)-PPL(base)         :   0.799304 ±   0.472906

====== KL divergence statistics ======
Mean    KLD:   0.118270 ±   0.006874
Maximum KLD:   2.090570
99.9%   KLD:   1.981126
99.0%   KLD:   0.838930
95.0%   KLD:   0.355263
90.0%   KLD:   0.259120
Median  KLD:   0.071860
Minimum KLD:   0.000015

====== Token probability statistics ======
Same top p:  81.102 ± 1.997 %
"""


def test_parse_ppl():
    r = quality.parse_ppl(PPL_OUT)
    assert r == {"ppl": 15.0154, "ppl_err": 0.82678, "chunks": 20}
    with pytest.raises(quality.QualityError, match="Final estimate"):
        quality.parse_ppl("garbage")


def test_parse_kld():
    r = quality.parse_kld(KLD_OUT)
    assert r["ppl"] == pytest.approx(21.733915) and r["ppl_base"] == pytest.approx(20.934611)
    assert r["kld"] == pytest.approx(0.118270) and r["kld_err"] == pytest.approx(0.006874)
    assert r["kld_median"] == pytest.approx(0.07186) and r["kld_p99"] == pytest.approx(0.83893)
    assert r["same_top"] == pytest.approx(0.81102) and r["ppl_ratio"] == pytest.approx(1.038181)
    assert r["chunks"] == 3
    with pytest.raises(quality.QualityError, match="KL output"):
        quality.parse_kld(PPL_OUT)


@pytest.fixture(scope="module")
def tiny():
    from test_moefy import tiny_model
    return tiny_model()


@pytest.fixture()
def kld_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VIS_KLD_DIR", str(tmp_path / "kld"))
    return tmp_path / "kld"


def test_kl_divergence_against_dense(tiny, kld_dir, tmp_path):
    """All experts = dense (KLD ~ 0); fewer experts diverge more; the reference logits are reused."""
    text = tmp_path / "heldout.txt"
    text.write_text(corpus.heldout().text[:15_000])
    dense = quality.Config(str(tiny.with_name("dense-f32-3L.gguf")), label="dense")
    cfgs = [quality.with_k(str(tiny), k) for k in (16, 2)]
    res = quality.compare(cfgs, dense, str(text), ctx=128, chunks=3, threads=2)
    full, k2 = res["results"]
    assert res["reference"]["chunks"] == 3 and full["chunks"] == 3
    assert full["kld"] < 1e-4 and full["same_top"] > 0.99
    assert full["ppl"] == pytest.approx(res["reference"]["ppl"], rel=1e-3)
    # (PPL(base) is recomputed from llama-perplexity's 16-bit compressed log-probabilities; on this
    # 3-layer truncation, whose perplexity is in the millions, that is far off, so it is not compared)
    assert k2["kld"] > 100 * max(full["kld"], 1e-6) and k2["ppl"] > full["ppl"]
    assert "deepseek.expert_used_count=int:2" in k2["overrides"]
    # the reference's log-probabilities are cached and reused
    files = list(kld_dir.glob("*.kld"))
    assert len(files) == 1
    again = quality.compare([cfgs[0]], dense, str(text), ctx=128, chunks=3, threads=2)
    assert again["reference_logits"] == res["reference_logits"]
    assert "mean KLD" in quality.format_results(res)


def test_quality_cli(tiny, kld_dir, tmp_path, capsys):
    from pyvis.cli import main
    text = tmp_path / "t.txt"
    text.write_text(corpus.heldout().text[:8_000])
    out = tmp_path / "q.json"
    rc = main(["quality", "-m", str(tiny), "-k", "8", "-f", str(text), "-c", "128", "--chunks", "2", "-t", "2",
               "--json", str(out)])
    assert rc == 0
    assert "PPL" in capsys.readouterr().out and out.is_file()
    rc = main(["quality", "-m", str(tmp_path / "missing.gguf"), "-f", str(text)])
    assert rc == 1 and "model not found" in capsys.readouterr().err
