"""Accuracy harness for visual-token pruning (``pyvis prune-eval``).

A *dataset* is a folder with ``items.jsonl`` (one JSON object per line) or ``items.tsv``
(``image<TAB>question<TAB>answer``, ``#`` comments allowed)::

    {"image": "img/0001.png", "question": "What color is the car?", "answer": "red"}
    {"image": ["a.png", "b.png"], "question": "Which is larger?", "answer": ["left", "the left one"]}

Image paths are relative to the folder. ``answer`` may be a list of accepted answers.

For every method and keep ratio, one session (fresh expert cache) answers every item: the prompt
is ``--template`` with ``{question}`` filled in, generation is greedy up to ``-n`` tokens and the
prediction is the first line of the output. **Exact match** compares normalised strings: lower
case, surrounding whitespace and trailing ``.``/``!``/``?`` removed, inner whitespace collapsed
(``--match prefix`` accepts a prediction that starts with the answer followed by a word boundary).
Latency per item: prefill (tokenize, encode, score, probe, decode) and total (with generation).
"""
from __future__ import annotations

import csv
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import prune

DEFAULT_TEMPLATE = "{question}\nAnswer with a single word or phrase."


class EvalError(ValueError):
    pass


@dataclass
class Item:
    images: list[str]
    question: str
    answers: list[str]


def load_items(folder) -> list[Item]:
    d = Path(folder)
    if not d.is_dir():
        raise EvalError(f"dataset folder not found: {d}")
    jl, tsv = d / "items.jsonl", d / "items.tsv"
    items: list[Item] = []
    if jl.is_file():
        for n, line in enumerate(jl.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                o = json.loads(line)
                img, q, a = o["image"], o["question"], o["answer"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise EvalError(f"{jl}:{n}: expected a JSON object with image, question, answer ({e})") from e
            items.append(Item([img] if isinstance(img, str) else list(img), str(q),
                              [a] if isinstance(a, str) else [str(x) for x in a]))
    elif tsv.is_file():
        with open(tsv, newline="") as f:
            for n, row in enumerate(csv.reader(f, delimiter="\t"), 1):
                if not row or row[0].startswith("#"):
                    continue
                if len(row) < 3:
                    raise EvalError(f"{tsv}:{n}: expected image<TAB>question<TAB>answer")
                items.append(Item([row[0]], row[1], [row[2]]))
    else:
        raise EvalError(f"{d} has neither items.jsonl nor items.tsv")
    if not items:
        raise EvalError(f"{d}: no items")
    for it in items:
        it.images = [str((d / p) if not Path(p).is_absolute() else Path(p)) for p in it.images]
        for p in it.images:
            if not Path(p).is_file():
                raise EvalError(f"image not found: {p}")
    return items


def normalize(s: str) -> str:
    s = re.sub(r"\s+", " ", s.strip().lower())
    return s.rstrip(".!?").strip()


def is_match(prediction: str, answers: list[str], mode: str = "exact") -> bool:
    p = normalize(prediction)
    for a in answers:
        a = normalize(a)
        if p == a or (mode == "prefix" and a and p.startswith(a) and (len(p) == len(a) or not p[len(a)].isalnum())):
            return True
    return False


def evaluate(model, mmproj, items: list[Item], method: str, keep_ratio: float, *, n_predict: int = 16,
             template: str = DEFAULT_TEMPLATE, match: str = "exact", session_kw=None, progress=None,
             **prep_kw) -> dict:
    from .. import vlm
    rows = []
    with vlm.Session(model, mmproj, **(session_kw or {})) as s:
        for i, it in enumerate(items):
            t0 = time.perf_counter()
            p = s.prepare(template.format(question=it.question), it.images, keep_ratio=keep_ratio, method=method,
                          **prep_kw)
            text = p.generate(n_predict)
            total = (time.perf_counter() - t0) * 1000
            pred = text.strip().split("\n")[0] if text.strip() else ""
            rows.append({"question": it.question, "answers": it.answers, "prediction": pred,
                         "correct": is_match(pred, it.answers, match), "prefill_ms": p.timings_ms["prefill"],
                         "total_ms": total, "n_image_tokens": p.n_image_tokens, "n_image_kept": p.n_image_kept})
            if progress:
                progress(i + 1, len(items))
    n = len(rows)
    return {"method": method, "keep_ratio": keep_ratio, "n": n, "correct": sum(r["correct"] for r in rows),
            "accuracy": sum(r["correct"] for r in rows) / n,
            "prefill_ms_mean": statistics.fmean(r["prefill_ms"] for r in rows),
            "total_ms_mean": statistics.fmean(r["total_ms"] for r in rows),
            "kept_mean": statistics.fmean(r["n_image_kept"] for r in rows),
            "image_tokens_mean": statistics.fmean(r["n_image_tokens"] for r in rows), "items": rows}


def format_table(results: list[dict]) -> str:
    out = [f"{'method':9s} {'keep':>5s} {'accuracy':>8s} {'correct':>9s} {'img tok kept':>13s} "
           f"{'prefill ms':>10s} {'total ms':>9s}"]
    for r in results:
        out.append(f"{r['method']:9s} {r['keep_ratio']:5.2f} {r['accuracy']:8.3f} {r['correct']:4d}/{r['n']:<4d} "
                   f"{r['kept_mean']:6.1f}/{r['image_tokens_mean']:<6.1f} {r['prefill_ms_mean']:10.1f} "
                   f"{r['total_ms_mean']:9.1f}")
    return "\n".join(out)


def _cmd(args) -> int:
    from .. import vlm
    from .chat import session_config
    try:
        items = load_items(args.items)
    except EvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    # accuracy with shadow experts / capacity on, too (docs/precision.md)
    session_kw = dict(config=session_config(args), n_ctx=args.ctx_size, n_batch=args.batch_size,
                      n_ubatch=args.ubatch_size, n_threads=args.threads, verbose=args.verbose)
    prep = dict(alpha=args.alpha, lam=args.lam, prefix_layers=args.prefix_layers, saliency=args.saliency,
                seed=args.seed, chat_template=not args.no_chat_template)
    ratios = sorted(set(args.keep_ratio), reverse=True)
    configs = [("none", 1.0)] + [(m, b) for b in ratios for m in args.methods if m != "none" and b < 1.0]
    results = []
    for ci, (m, b) in enumerate(configs):
        label = f"[prune-eval] {ci + 1}/{len(configs)} {m} keep {b:g}"

        def progress(done, total, label=label):
            end = "\n" if done == total or not sys.stderr.isatty() else "\r"
            if done == total or sys.stderr.isatty() or done % max(1, total // 10) == 0:
                bar = "#" * int(30 * done / total)
                sys.stderr.write(f"{label} [{bar:<30}] {done}/{total}{end}")
                sys.stderr.flush()
        try:
            results.append(evaluate(args.model, args.mmproj, items, m, b, n_predict=args.n_predict,
                                    template=args.template, match=args.match, session_kw=session_kw,
                                    progress=progress, **prep))
        except (vlm.VLMError, prune.PruneError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    print(f"prune-eval: {Path(args.model).name}, {len(items)} items from {args.items}, match = {args.match}")
    print(format_table(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": args.model, "mmproj": args.mmproj, "items": str(args.items),
                                               "template": args.template, "results": results}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def register(sub) -> None:
    from .chat import add_common_args
    s = sub.add_parser("prune-eval", help="accuracy and latency of each pruning method on image/question/answer items",
                       description="Answer every item of a dataset folder (items.jsonl or items.tsv: image, question, "
                       "answer) with each pruning method at each keep ratio, and report exact-match accuracy and "
                       "latency. Format and matching rules: pyvis/vlm/evaluate.py, docs/pruning.md.")
    s.add_argument("--items", required=True, help="dataset folder with items.jsonl or items.tsv")
    s.add_argument("--methods", nargs="+", default=["random", "saliency", "entropy", "affinity"],
                   choices=list(prune.METHODS), help="methods compared with none (default: all)")
    s.add_argument("--keep-ratio", type=float, nargs="+", default=[0.7, 0.5],
                   help="keep ratios (default: 0.7 0.5; the unpruned run is always included)")
    s.add_argument("-n", "--n-predict", type=int, default=16, help="max tokens per answer (default: 16)")
    s.add_argument("--template", default=DEFAULT_TEMPLATE, help="prompt template with {question} "
                   "(default: %(default)r)")
    s.add_argument("--match", default="exact", choices=["exact", "prefix"], help="answer matching (default: exact)")
    s.add_argument("--json", help="write every prediction and number here")
    add_common_args(s, lossy=True)
    s.set_defaults(fn=_cmd)
