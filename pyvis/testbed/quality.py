"""Quality harness (``pyvis quality``): perplexity and KL divergence through our llama-perplexity.

A *configuration* is a GGUF plus ``--override-kv`` settings (for the MoEfied testbed, the top-k:
``deepseek.expert_used_count=int:K``).  Against a *reference* configuration, the reference's
log-probabilities are saved once with ``llama-perplexity --kl-divergence-base FILE`` (cached under
``models/testbed/kld/``, keyed by the reference file, its overrides, the text and the context size),
then each configuration runs ``--kl-divergence`` on the same tokens: that gives its perplexity, the
reference's, and the mean KL divergence (reference || configuration) over the second half of each
chunk, as llama-perplexity defines them.

Default text: the held-out Vim user manual (:mod:`pyvis.testbed.corpus`), ``-c 256``.  Weight repacking
is disabled (``-nr``, see :mod:`pyvis.testbed._llm`) unless ``VIS_REPACK=1``.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


class QualityError(RuntimeError):
    pass


@dataclass
class Config:
    model: str
    overrides: list[str] = field(default_factory=list)   # "key=type:value", as --override-kv takes them
    label: str = ""

    def name(self) -> str:
        return self.label or (Path(self.model).stem + ("" if not self.overrides else
                                                       " [" + ", ".join(self.overrides) + "]"))

    def key(self) -> str:
        p = Path(self.model)
        st = p.stat()
        return hashlib.sha256(json.dumps([str(p.resolve()), st.st_size, int(st.st_mtime), self.overrides])
                              .encode()).hexdigest()[:16]


def model_arch(model: str) -> str:
    import gguf
    if not Path(model).is_file():
        raise QualityError(f"model not found: {model}")
    r = gguf.GGUFReader(model)
    return str(r.fields["general.architecture"].contents())


def with_k(model: str, k: int | None, overrides: list[str] | None = None, label: str = "") -> Config:
    ov = list(overrides or [])
    if k is not None:
        ov.append(f"{model_arch(model)}.expert_used_count=int:{int(k)}")
    return Config(model, ov, label)


def _bin() -> Path:
    from .. import _paths
    return _paths.bin_path("llama-perplexity")


def _base_args(cfg: Config, ctx: int, threads: int | None, batch: int | None) -> list[str]:
    if not Path(cfg.model).is_file():
        raise QualityError(f"model not found: {cfg.model}")
    a = [str(_bin()), "-m", cfg.model, "-c", str(ctx), "-t", str(threads or min(os.cpu_count() or 1, 8))]
    if batch:
        a += ["-b", str(batch)]
    for o in cfg.overrides:
        a += ["--override-kv", o]
    from ._llm import repack_enabled
    if not repack_enabled():
        a.append("-nr")
    return a


def _run(args: list[str], timeout: float | None) -> tuple[str, float]:
    env = dict(os.environ)
    env.setdefault("LLAMA_LOG_COLORS", "0")
    # the tools' RUNPATH names the build tree they were linked in (build/bin): a copied build (VIS_LIB_DIR) would
    # load that tree's libraries, other numerics, or none at all (exit 127) while a rebuild rewrites them
    bin_dir = str(Path(args[0]).resolve().parent)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([bin_dir] + [d for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep)
                                                          if d and d != bin_dir])
    t0 = time.monotonic()
    try:
        p = subprocess.run(args, capture_output=True, text=True, errors="surrogateescape", timeout=timeout,
                           stdin=subprocess.DEVNULL, env=env)
    except subprocess.TimeoutExpired as e:
        raise QualityError(f"llama-perplexity timed out after {timeout} s: {' '.join(args)}") from e
    dt = time.monotonic() - t0
    out = p.stdout + p.stderr
    if p.returncode != 0:
        # the last line of output (usually the cause) goes on the first line: sweeps keep only that one
        last = next((ln.strip() for ln in reversed(out.splitlines()) if ln.strip()), "no output")
        raise QualityError(f"llama-perplexity failed (exit {p.returncode}: {last[:300]}): {' '.join(args)}\n"
                           f"{out[-3000:]}")
    return out, dt


_NUM = r"([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def parse_ppl(out: str) -> dict:
    m = re.search(r"Final estimate: PPL = " + _NUM + r" \+/- " + _NUM, out)
    if not m:
        raise QualityError("no 'Final estimate: PPL' in llama-perplexity's output:\n" + out[-2000:])
    res = {"ppl": float(m.group(1)), "ppl_err": float(m.group(2))}
    m = re.search(r"calculating perplexity over (\d+) chunks", out)
    if m:
        res["chunks"] = int(m.group(1))
    return res


def parse_kld(out: str) -> dict:
    pats = {
        "ppl": r"Mean PPL\(Q\)\s*:\s*" + _NUM + r"\s*±\s*" + _NUM,
        "ppl_base": r"Mean PPL\(base\)\s*:\s*" + _NUM + r"\s*±\s*" + _NUM,
        "kld": r"Mean\s+KLD:\s*" + _NUM + r"\s*±\s*" + _NUM,
        "kld_median": r"Median\s+KLD:\s*" + _NUM,
        "kld_p99": r"99\.0%\s+KLD:\s*" + _NUM,
        "kld_max": r"Maximum KLD:\s*" + _NUM,
        "same_top": r"Same top p:\s*" + _NUM + r"\s*±\s*" + _NUM,
        "ppl_ratio": r"Mean PPL\(Q\)/PPL\(base\)\s*:\s*" + _NUM + r"\s*±\s*" + _NUM,
    }
    # a run equal to its base (e.g. a lossy rule that never fired) prints its paired uncertainties as nan or -nan:
    # sqrt of a variance of differences that rounds below 0; they are 0
    pats = {k: p.replace(r"±\s*" + _NUM, r"±\s*(" + _NUM[1:-1] + r"|[-+]?nan)") for k, p in pats.items()}
    res = {}
    for k, p in pats.items():
        m = re.search(p, out)
        if not m:
            raise QualityError(f"could not find {k} in llama-perplexity's KL output:\n" + out[-2000:])
        res[k] = float(m.group(1))
        if m.lastindex and m.lastindex >= 2:
            res[k + "_err"] = 0.0 if "nan" in m.group(2) else float(m.group(2))
    res["same_top"] /= 100.0
    res["same_top_err"] /= 100.0
    m = re.search(r"computing over (\d+) chunks", out)
    if m:
        res["chunks"] = int(m.group(1))
    return res


def kld_dir() -> Path:
    env = os.environ.get("VIS_KLD_DIR")
    if env:
        return Path(env)
    from .moefy import default_out_dir
    return default_out_dir() / "kld"


def _text_file(text_spec: str) -> tuple[Path, str]:
    """The evaluation text as a file (named texts are written under models/testbed/text/)."""
    from . import corpus
    t = corpus.load_text(text_spec)
    if t.name.startswith("file:"):
        return Path(t.files[0]), t.sha256
    p = kld_dir().parent / "text" / f"{t.name.replace(':', '-')}-{t.sha256[:12]}.txt"
    if not p.is_file():
        t.write(p)
    return p, t.sha256


def perplexity(cfg: Config, text: str = "heldout", ctx: int = 256, chunks: int | None = None,
               threads: int | None = None, batch: int | None = None, timeout: float | None = None) -> dict:
    f, sha = _text_file(text)
    a = _base_args(cfg, ctx, threads, batch) + ["-f", str(f)]
    if chunks:
        a += ["--chunks", str(chunks)]
    out, dt = _run(a, timeout)
    r = parse_ppl(out)
    r.update(config=cfg.name(), model=cfg.model, overrides=cfg.overrides, ctx=ctx, text_sha256=sha, seconds=dt)
    return r


def reference_logits(ref: Config, text: str = "heldout", ctx: int = 256, chunks: int | None = None,
                     threads: int | None = None, batch: int | None = None, timeout: float | None = None,
                     progress=None) -> tuple[Path, dict]:
    """Save (or reuse) the reference's log-probabilities; returns (file, reference perplexity result)."""
    f, sha = _text_file(text)
    key = hashlib.sha256(json.dumps([ref.key(), sha, ctx, chunks]).encode()).hexdigest()[:16]
    d = kld_dir()
    d.mkdir(parents=True, exist_ok=True)
    base = d / f"{Path(ref.model).stem}-{key}.kld"
    meta = d / f"{Path(ref.model).stem}-{key}.json"
    if base.is_file() and meta.is_file():
        return base, json.loads(meta.read_text())
    if progress:
        progress(f"reference log-probabilities of {ref.name()} -> {base}")
    a = _base_args(ref, ctx, threads, batch) + ["-f", str(f), "--kl-divergence-base", str(base) + ".part"]
    if chunks:
        a += ["--chunks", str(chunks)]
    out, dt = _run(a, timeout)
    r = parse_ppl(out)
    r.update(config=ref.name(), model=ref.model, overrides=ref.overrides, ctx=ctx, text_sha256=sha, seconds=dt)
    os.replace(str(base) + ".part", base)
    meta.write_text(json.dumps(r) + "\n")
    return base, r


def kl_divergence(cfg: Config, base_file: Path, ctx: int = 256, threads: int | None = None,
                  batch: int | None = None, timeout: float | None = None) -> dict:
    a = _base_args(cfg, ctx, threads, batch) + ["--kl-divergence-base", str(base_file), "--kl-divergence"]
    out, dt = _run(a, timeout)
    r = parse_kld(out)
    r.update(config=cfg.name(), model=cfg.model, overrides=cfg.overrides, ctx=ctx, seconds=dt)
    return r


def compare(configs: list[Config], ref: Config | None, text: str = "heldout", ctx: int = 256,
            chunks: int | None = None, threads: int | None = None, batch: int | None = None,
            timeout: float | None = None, progress=None) -> dict:
    """Perplexity of each configuration and, with a reference, its KL divergence from it."""
    res: dict = {"text": text, "ctx": ctx, "chunks": chunks, "results": []}
    if ref is None:
        for c in configs:
            if progress:
                progress(f"perplexity of {c.name()}")
            res["results"].append(perplexity(c, text, ctx, chunks, threads, batch, timeout))
        return res
    base, rr = reference_logits(ref, text, ctx, chunks, threads, batch, timeout, progress)
    res["reference"] = rr
    res["reference_logits"] = str(base)
    for c in configs:
        if progress:
            progress(f"KL divergence of {c.name()} against {ref.name()}")
        try:
            res["results"].append(kl_divergence(c, base, ctx, threads, batch, timeout))
        except QualityError as e:   # one failing configuration does not lose the others
            if len(configs) == 1:
                raise
            res["results"].append({"config": c.name(), "model": c.model, "overrides": c.overrides,
                                   "error": str(e).splitlines()[0]})
    return res


def format_results(res: dict) -> str:
    out = [f"text: {res['text']}, -c {res['ctx']}" + (f", {res['chunks']} chunks" if res.get("chunks") else "")]
    if "reference" in res:
        r = res["reference"]
        out.append(f"reference: {r['config']}: PPL = {r['ppl']:.4f} +/- {r['ppl_err']:.4f}")
        out.append(f"{'configuration':60s} {'PPL':>9s} {'PPL/ref':>8s} {'mean KLD':>9s} {'KLD p99':>8s} "
                   f"{'same top':>8s}")
        for r in res["results"]:
            if "error" in r:
                out.append(f"{r['config'][:60]:60s} failed: {r['error'][:200]}")
                continue
            out.append(f"{r['config'][:60]:60s} {r['ppl']:9.4f} {r['ppl_ratio']:8.4f} {r['kld']:9.5f} "
                       f"{r['kld_p99']:8.4f} {100 * r['same_top']:7.2f}%")
    else:
        out.append(f"{'configuration':60s} {'PPL':>9s} {'+/-':>8s}")
        for r in res["results"]:
            out.append(f"{r['config'][:60]:60s} {r['ppl']:9.4f} {r['ppl_err']:8.4f}")
    return "\n".join(out)


def _progress(msg: str) -> None:
    sys.stderr.write(f"[quality] {msg}\n")
    sys.stderr.flush()


def _cmd_quality(args) -> int:
    from . import corpus
    from .._paths import BuildNotFound
    try:
        ks = args.n_expert_used or [None]
        configs = [with_k(args.model, k, args.override_kv) for k in ks]
        ref = None
        if args.ref:
            ref = with_k(args.ref, args.ref_k, args.ref_override_kv)
        res = compare(configs, ref, args.file, args.ctx_size, args.chunks, args.threads, args.batch_size,
                      progress=_progress)
    except (QualityError, corpus.CorpusError, BuildNotFound) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_results(res))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 1 if any("error" in r for r in res["results"]) else 0


def register(sub) -> None:
    s = sub.add_parser("quality", help="perplexity and KL divergence of a configuration against a reference",
                       description="Run our llama-perplexity on the held-out text: the perplexity of each "
                       "configuration (a model at each -k) and, with --ref, its mean KL divergence from the "
                       "reference configuration (--kl-divergence-base / --kl-divergence). Example: pyvis "
                       "quality -m models/testbed/shared+16.gguf -k 16 8 4 --ref models/testbed/dense-f32-30L.gguf")
    s.add_argument("-m", "--model", required=True, help="GGUF of the configuration(s) to measure")
    s.add_argument("-k", "--n-expert-used", type=int, nargs="+", metavar="K",
                   help="top-k values to measure (each one a configuration; ARCH.expert_used_count override)")
    s.add_argument("--override-kv", action="append", default=[], metavar="KEY=TYPE:VALUE",
                   help="extra llama.cpp --override-kv for the configuration(s) (repeatable)")
    s.add_argument("--ref", help="reference GGUF (KL divergence is measured against it)")
    s.add_argument("--ref-k", type=int, help="top-k of the reference (if it is a MoE)")
    s.add_argument("--ref-override-kv", action="append", default=[], metavar="KEY=TYPE:VALUE",
                   help="--override-kv for the reference (repeatable)")
    s.add_argument("-f", "--file", default="heldout", help="text: heldout (Vim user manual usr_01-08, default), "
                   "vim-all, calibration, or a file")
    s.add_argument("-c", "--ctx-size", type=int, default=256, help="context size (default: 256)")
    s.add_argument("-b", "--batch-size", type=int, help="batch size (llama-perplexity's default otherwise)")
    s.add_argument("--chunks", type=int, help="only the first N chunks")
    s.add_argument("-t", "--threads", type=int, help="CPU threads")
    s.add_argument("--json", help="also write the results as JSON here")
    s.set_defaults(fn=_cmd_quality)
