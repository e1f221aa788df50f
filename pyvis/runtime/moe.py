"""A `llama_cpp.Llama` with the fork's expert cache: `pyvis.moe.load(path, slots=...)`.

    import pyvis.moe
    llm = pyvis.moe.load("model.gguf", slots=16, pinned_layers=1, n_ctx=2048)
    llm("Hello", max_tokens=16)
    print(pyvis.moe.stats(llm))          # totals; stats(llm, layer) per layer

The options are the --moe-* flags of the C tools (docs/residency.md, docs/paging.md).  They apply to this
load only, on this thread (:func:`pyvis.runtime.settings.applied`): settings made before the call, by this
thread or process-wide, are in force again after it, and other threads loading at the same time keep theirs.
"""
from __future__ import annotations

from . import native
from .native import MoeStats, VisError, llama_cpp
from .settings import (CapacityParams, ModeParams, MoeParams, PrecisionParams, PredictParams, SubParams, TelemetryParams,
                       TierParams, TopkParams, applied)

__all__ = ["load", "stats", "layer_stats", "io_stats", "sub_stats", "prec_stats", "cap_stats", "prefetch_stats", "reset_stats", "MoeParams",
           "CapacityParams", "ModeParams", "MoeStats", "PrecisionParams", "PredictParams", "SubParams", "TelemetryParams", "TierParams",
           "TopkParams", "VisError"]


def load(model_path: str, *, slots: int = 0, cache_mib: int = 0, pinned_layers: int = 0, moe_stats: bool = False,
         trace: str | None = None, store: str = "file", host_mib: int = -1, mem: int | str = 0, io_threads: int = 4,
         direct_io: str = "auto", unified: str = "auto", mlock: bool = True, substitute: str | None = None,
         sub_profile: str | None = None, sub_tae: str = "off", sub_margin: str = "off", sub_beta: float = 1.0,
         sub_budget: int = 1, sub_weight: float = 1.0, sub_rank: int = 0, sub_prefill: bool = False,
         sub_drop_share: float = 0.5, sub_renorm: bool = False, sub_drop_read: bool = True, mode: str = "exact",
         predict: str = "off", lookahead: int = 1, prefetch_budget: int | str = "auto", prefetch_tune: bool = True,
         predict_profile: str | None = None, shadow: str | None = None, precision: str = "off",
         prec_vision: float = 0.5, prec_gate: float = 0.1, prec_target: float = 0.25, prec_refetch: bool = True,
         shadow_slots: int | str = "auto", capacity: int | str = "off", cap_rho: float = 1.0, cap_delta: float = 1.0,
         cap_drop: bool = True, cap_profile: str | None = None, topk: int = 0, csv: str | None = None,
         **llama_kwargs) -> "llama_cpp.Llama":
    """Load a model with the expert cache configured; other keywords go to llama_cpp.Llama.

    slots / cache_mib / pinned_layers: tier 1 (docs/residency.md).  store, host_mib, mem, io_threads,
    direct_io, unified, mlock: the paging tiers (docs/paging.md); with store="file" (default) the managed
    experts are not loaded at start but read from the GGUF file on demand.  substitute and sub_*: substitution
    on a miss (lossy, off by default; docs/substitution.md), as the --moe-substitute / --moe-sub-* flags.  predict,
    lookahead, prefetch_budget, prefetch_tune, predict_profile: lookahead prediction and prefetch (exact;
    docs/prediction.md), as --moe-predict / --moe-lookahead / --moe-prefetch-* / --moe-predict-profile.  shadow,
    precision, prec_*, shadow_slots: shadow experts (``pyvis shadow``) and the precision policy that serves misses
    from them (lossy, off by default; docs/precision.md), as --moe-shadow / --moe-precision / --moe-prec-* /
    --moe-shadow-slots.  capacity and cap_*: entropy-weighted capacity for image tokens (lossy, off by default;
    docs/precision.md), as --moe-capacity / --moe-cap-*.  topk: fewer experts per token (lossy, 0 = off;
    docs/topk.md), as --moe-topk.  csv: one row per ubatch of telemetry (docs/telemetry.md), as --moe-csv.  mode:
    "exact" (default) or "fast" (lossy: the measured set of lossy mechanisms, those not chosen explicitly;
    substitute=None leaves the choice to it; docs/mode.md), as --moe-mode.  A bad value raises VisError naming the option and its range; a bad
    profile or sidecar, VisError naming the file and the fix.
    """
    _check_llama_kwargs(llama_kwargs)
    params = MoeParams(slots, cache_mib, pinned_layers, moe_stats, trace)
    tier = TierParams(store, host_mib, mem, io_threads, direct_io, unified, mlock)
    sub = SubParams(substitute, sub_profile, sub_tae, sub_margin, sub_beta, sub_budget, sub_weight, sub_rank, sub_prefill,
                    sub_drop_share, sub_renorm, sub_drop_read)
    pred = PredictParams(predict, lookahead, prefetch_budget, prefetch_tune,
                         None if predict_profile is None else str(predict_profile))
    prec = PrecisionParams(None if shadow is None else str(shadow), precision, prec_vision, prec_gate, prec_target,
                           prec_refetch, shadow_slots)
    cap = CapacityParams(capacity, cap_rho, cap_delta, cap_drop, None if cap_profile is None else str(cap_profile))
    with applied(params, tier, sub, pred, prec, cap, TopkParams(topk), TelemetryParams(None if csv is None else str(csv)),
                 ModeParams(mode)):
        try:
            return llama_cpp.Llama(model_path=str(model_path), **llama_kwargs)
        except ValueError as e:
            err = native.last_error()       # cleared by applied(): only this load's own error
            if err:
                raise VisError(err) from e
            raise


def _check_llama_kwargs(kw: dict) -> None:
    """TypeError for a keyword that is neither ours nor a named parameter of llama_cpp.Llama (which would swallow it
    in its **kwargs: ``slotz=3`` would load the model fully resident without a word)."""
    import inspect
    named = {n for n, p in inspect.signature(llama_cpp.Llama.__init__).parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self", "model_path"}
    unknown = sorted(set(kw) - named)
    if unknown:
        ours = [n for n in inspect.signature(load).parameters if n not in ("model_path", "llama_kwargs")]
        raise TypeError(f"pyvis.moe.load() got unknown keyword argument(s) {', '.join(unknown)}: neither an option of "
                        f"the expert cache ({', '.join(ours)}) nor a parameter of llama_cpp.Llama")


def stats(llm) -> MoeStats | None:
    return native.moe_stats(llm, -1)


def layer_stats(llm, layer: int) -> MoeStats | None:
    return native.moe_stats(llm, layer)


def io_stats(llm) -> dict | None:
    """Per-tier stats: slab/host hits, file reads, bytes read, I/O wait, peak RSS (docs/paging.md)."""
    return native.io_stats(llm)


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
