"""A `llama_cpp.Llama` with the fork's expert cache: `pyvis.moe.load(path, MoeConfig(...))`.

    from pyvis.moe import MoeConfig, load, stats
    llm = load("model.gguf", MoeConfig(mem="auto", pinned_layers=1), n_ctx=2048)
    llm("Hello", max_tokens=16)
    print(stats(llm))          # totals; layer_stats(llm, layer) per layer

:class:`MoeConfig` (:mod:`pyvis.runtime.config`) holds every --moe-* setting of the C tools, one typed field per row of
the C settings table (docs/knobs.md, docs/residency.md, docs/paging.md).  It applies to this load only, on this thread
(:func:`pyvis.runtime.config.applied`): settings made before the call, by this thread or process-wide, are in force
again after it, and other threads loading at the same time keep theirs.

This module is the package's public entry point for the expert cache; it sits above :mod:`pyvis.runtime` (whose
modules it wraps) and nothing in :mod:`pyvis.runtime` imports it.
"""
from __future__ import annotations

import warnings

from .runtime import native
from .runtime.config import MoeConfig, VisTypeError, applied
from .runtime.native import MoeStats, VisError, llama_cpp

__all__ = ["load", "stats", "layer_stats", "io_stats", "overlap_stats", "sub_stats", "prec_stats", "cap_stats", "prefetch_stats",
           "reset_stats", "MoeConfig", "MoeStats", "VisError", "VisTypeError"]

# the keywords of the old form, load(path, slots=..., ...): MoeConfig's fields (moe_stats is its stats)
_OLD_NAMES = {"moe_stats": "stats"}
_OLD_KEYWORDS = ("slots cache_mib pinned_layers moe_stats trace store host_mib mem io_threads direct_io unified "
                 "mlock substitute sub_profile sub_tae sub_margin sub_beta sub_budget sub_weight sub_rank "
                 "sub_prefill sub_drop_share sub_renorm sub_drop_read mode predict lookahead prefetch_budget "
                 "prefetch_tune predict_profile shadow precision prec_vision prec_gate prec_target prec_refetch "
                 "shadow_slots capacity cap_rho cap_delta cap_drop cap_profile topk csv").split()


def load(model_path: str, config: MoeConfig | None = None, **llama_kwargs) -> "llama_cpp.Llama":
    """Load a model with the expert cache configured by ``config`` (None: ``MoeConfig()``, the settings in force);
    the keywords go to llama_cpp.Llama (n_ctx, n_threads, ...).  A bad setting raises VisError (VisTypeError for a
    wrong type) naming the field and its flag; a bad profile or sidecar, VisError naming the file and the fix.

    Deprecated, for one release: the old form ``load(path, slots=8, mem=2048, ...)`` with the settings as keywords
    (the names of MoeConfig's fields; ``moe_stats`` for ``stats``) still works, with a DeprecationWarning; it means
    ``load(path, MoeConfig(...))`` with every one of the old form's 44 settings given (the ones not passed at their
    defaults), as before."""
    old = {k: llama_kwargs.pop(k) for k in list(llama_kwargs) if k in _OLD_KEYWORDS}
    if config is not None and not isinstance(config, MoeConfig):
        raise VisTypeError(f"pyvis.moe.load(): config must be a pyvis.moe.MoeConfig, got {type(config).__name__}"
                           + (" (the old keyword form takes the settings as keywords: slots=8)" if
                              isinstance(config, (int, str)) else ""))
    if old:
        if config is not None:
            raise TypeError(f"pyvis.moe.load(): give the settings in the MoeConfig, not also as keywords "
                            f"({', '.join(sorted(old))})")
        config = _from_keywords(old)
    _check_llama_kwargs(llama_kwargs)
    with applied(config if config is not None else MoeConfig()):
        try:
            return llama_cpp.Llama(model_path=str(model_path), **llama_kwargs)
        except ValueError as e:
            err = native.last_error()       # cleared by applied(): only this load's own error
            if err:
                raise VisError(err) from e
            raise


def _from_keywords(old: dict) -> MoeConfig:
    """The MoeConfig of the old keyword form, with a DeprecationWarning saying how to write it."""
    base = MoeConfig()
    kw = {_OLD_NAMES.get(n, n): getattr(base, _OLD_NAMES.get(n, n)) for n in _OLD_KEYWORDS}
    kw.update({_OLD_NAMES.get(n, n): v for n, v in old.items()})
    # the old form's integers for words: mem 0 = off, host_mib -1 = planned (auto)
    if type(kw["mem"]) is int and kw["mem"] == 0:
        kw["mem"] = "off"
    if type(kw["host_mib"]) is int and kw["host_mib"] == -1:
        kw["host_mib"] = "auto"
    given = ", ".join(f"{_OLD_NAMES.get(n, n)}={v!r}" for n, v in old.items())
    warnings.warn(f"pyvis.moe.load(path, {', '.join(f'{n}=' for n in old)}...) is deprecated and goes in the next "
                  f"release: write pyvis.moe.load(path, pyvis.moe.MoeConfig({given}))", DeprecationWarning,
                  stacklevel=3)
    return MoeConfig(**kw)


def _check_llama_kwargs(kw: dict) -> None:
    """TypeError for a keyword that is neither ours nor a named parameter of llama_cpp.Llama (which would swallow it
    in its **kwargs: ``slotz=3`` would load the model fully resident without a word)."""
    import inspect
    named = {n for n, p in inspect.signature(llama_cpp.Llama.__init__).parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self", "model_path"}
    unknown = sorted(set(kw) - named)
    if unknown:
        raise TypeError(f"pyvis.moe.load() got unknown keyword argument(s) {', '.join(unknown)}: neither a setting of "
                        f"the expert cache (pyvis.moe.MoeConfig's fields) nor a parameter of llama_cpp.Llama")


def stats(llm) -> MoeStats | None:
    return native.moe_stats(llm, -1)


def layer_stats(llm, layer: int) -> MoeStats | None:
    return native.moe_stats(llm, layer)


def io_stats(llm) -> dict | None:
    """Per-tier stats: slab/host hits, file reads, bytes read, I/O wait, peak RSS (docs/paging.md)."""
    return native.io_stats(llm)


def overlap_stats(llm, layer: int = -1) -> dict | None:
    """Decode misses read while their layer computed (VIS_MOE_OVERLAP, docs/paging.md): totals, or one layer."""
    return native.overlap_stats(llm, layer)


def sub_stats(llm, layer: int = -1) -> dict | None:
    """Substitution on a miss: missing (token, expert) pairs by outcome, bytes and stall saved, background reads
    (docs/substitution.md); totals, or one layer."""
    return native.sub_stats(llm, layer)


def prec_stats(llm, layer: int = -1) -> dict | None:
    """Shadow experts and the precision policy: eligible and served misses, shadow hits and reads, bytes read and
    left off the critical path, refetches, the controller's share and switches (docs/precision.md); totals, or one
    layer."""
    return native.prec_stats(llm, layer)


def cap_stats(llm, layer: int = -1) -> dict | None:
    """Entropy-weighted capacity: image ubatches seen, mean capacity and R_v, missing image-only experts loaded /
    over capacity / forced, pairs rerouted / dropped, bytes not read (docs/precision.md); totals, or one layer."""
    return native.cap_stats(llm, layer)


def prefetch_stats(llm, layer: int = -1) -> dict | None:
    """Lookahead prefetch: the next layer's prediction, reads ahead used / wasted / late, bytes, wait and saved
    time (docs/prediction.md); totals, or one layer."""
    return native.prefetch_stats(llm, layer)


def reset_stats(llm) -> None:
    native.moe_reset_stats(llm)
