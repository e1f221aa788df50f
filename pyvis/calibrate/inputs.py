"""The routing every ``pyvis calibrate`` kind learns from: ``--trace`` files, or a text run through our
``llama-perplexity --moe-trace`` (``--corpus``); the shared options, the corpus run and the output checks."""
from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from ..runtime.trace import MAGIC, Trace, load

DEFAULT_CTX = 512


class CalibrationError(ValueError):
    """Inputs that cannot be calibrated (traces of another model, bad parameters, a failed corpus run)."""


def log(msg: str) -> None:
    sys.stderr.write(f"[calibrate] {msg}\n")
    sys.stderr.flush()


def is_trace(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def corpus_trace(model: str, text: str, trace_path: Path, ctx: int = DEFAULT_CTX, chunks: int | None = None,
                 threads: int | None = None, timeout: float | None = None, k: int | None = None) -> tuple[Path, str]:
    """Run ``llama-perplexity --moe-trace`` over ``text`` (a file, or a named text of pyvis.testbed.corpus), at top-k
    ``k`` if given (``--override-kv ARCH.expert_used_count=int:K``); returns (the text file, its sha256)."""
    from ..testbed import quality
    from ..testbed.corpus import CorpusError
    try:
        f, sha = quality._text_file(text)
    except (CorpusError, OSError) as e:
        raise CalibrationError(f"--corpus {text}: {e}") from e
    args = quality._base_args(quality.with_k(model, k), ctx, threads, None)
    args += ["-f", str(f), "--moe-trace", str(trace_path), "--no-warmup"]    # the warm-up decode is not text
    if chunks:
        args += ["--chunks", str(chunks)]
    try:
        quality._run(args, timeout)
    except quality.QualityError as e:
        raise CalibrationError(str(e)) from e
    return f, sha


def traces_from_files(paths: list[str], progress=None) -> tuple[list[Trace], str]:
    """``(traces, source)`` of ``--trace`` files (source: paths and sha256s, for the profile); ``progress(done,
    total)`` over the bytes of all the files if given (``pyvis.cli.Progress``)."""
    from ..assets import sha256_file
    sizes = [Path(p).stat().st_size if Path(p).is_file() else 0 for p in paths]
    traces = [load(p, progress and (lambda done, _n, base=sum(sizes[:i]): progress(base + done, sum(sizes))))
              for i, p in enumerate(paths)]
    return traces, "traces " + ", ".join(f"{p} sha256:{sha256_file(Path(p))}" for p in paths)


def traces_from_corpus(model: str, text: str, ctx: int, chunks: int | None, threads: int | None,
                       trace_out: str | None = None, k: int | None = None) -> tuple[list[Trace], str]:
    """``(traces, source)`` of a ``--corpus`` run (the trace is kept at ``trace_out`` if given)."""
    if trace_out and Path(trace_out).exists() and not is_trace(Path(trace_out)):
        raise CalibrationError(f"--trace-out: refusing to overwrite {trace_out}: it exists and is not a routing trace")
    tmp = Path(tempfile.mkdtemp(prefix="vis-calibrate-"))
    try:
        tpath = tmp / "corpus.trace"
        run = f"llama-perplexity -c {ctx}" + (f" --chunks {chunks}" if chunks else "") + (f" top-{k}" if k else "")
        log(f"{run} on {text}, tracing the routing ...")
        t0 = time.monotonic()
        f, sha = corpus_trace(model, text, tpath, ctx, chunks, threads, k=k)
        log(f"traced in {time.monotonic() - t0:.1f} s ({tpath.stat().st_size / (1 << 20):.1f} MiB)")
        if trace_out:
            shutil.copyfile(tpath, trace_out)
            log(f"trace saved to {trace_out}")
        return [load(tpath)], f"corpus {f} sha256:{sha} ({run})"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def traces_from_args(args) -> tuple[list[Trace], str]:
    """The calibration routing of a command registered with :func:`add_input_args`."""
    if args.trace:
        return traces_from_files(args.trace)
    return traces_from_corpus(args.model, args.corpus, args.ctx, args.chunks, args.threads, args.trace_out,
                              args.n_expert_used)


def check_traces(traces: list[Trace], n_layer: int, n_expert: int) -> int:
    """The traces' common top-k (0 if empty); CalibrationError for traces of another model or of mixed top-k."""
    if not traces:
        raise CalibrationError("no routing traces")
    ks = {t.k for t in traces if len(t)}
    if len(ks) > 1:
        raise CalibrationError(f"the traces route different top-k ({sorted(ks)}); calibrate one k at a time")
    for t in traces:
        src = t.meta.get("source", "a trace")
        if t.n_expert != n_expert:
            raise CalibrationError(f"{src}: {t.n_expert} experts per layer, the model has {n_expert}: "
                                   "a trace of another model")
        if len(t) and (t.layer.min() < 0 or t.layer.max() >= n_layer):
            raise CalibrationError(f"{src}: layer {int(t.layer.max())} is out of range for a model of {n_layer} layers:"
                                   " a trace of another model")
    return ks.pop() if ks else 0


def add_input_args(s, what: str) -> None:
    """``-m``, ``--trace`` | ``--corpus``, ``--out``, and the corpus run's ``-c``, ``--chunks``, ``-t``, ``-k``,
    ``--trace-out``."""
    s.add_argument("-m", "--model", required=True, metavar="FNAME", help=f"MoE GGUF the {what} is for")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", action="append", metavar="FNAME",
                     help="routing trace of this model (--moe-trace file or .npz); repeat for several")
    src.add_argument("--corpus", metavar="FNAME", help="text to run through llama-perplexity with --moe-trace "
                     "(a file, or a named text: calibration, heldout, vim-all)")
    s.add_argument("-o", "--out", required=True, metavar="FNAME", help="profile to write (never a model or another "
                   "existing file that is not a profile)")
    s.add_argument("--force", action="store_true", help="replace an existing vis sidecar of another kind at --out")
    s.add_argument("-c", "--ctx", type=int, default=DEFAULT_CTX, metavar="N",
                   help=f"corpus runs: context size of llama-perplexity (default: {DEFAULT_CTX})")
    s.add_argument("--chunks", type=int, metavar="N", help="corpus runs: use this many chunks (default: all)")
    s.add_argument("-t", "--threads", type=int, metavar="N", help="corpus runs: CPU threads (default: up to 8)")
    s.add_argument("-k", "--n-expert-used", type=int, metavar="K", help="corpus runs: route top-K instead of the "
                   "model's default (--override-kv ARCH.expert_used_count=int:K)")
    s.add_argument("--trace-out", metavar="FNAME", help="--corpus: keep the trace of the run here")
