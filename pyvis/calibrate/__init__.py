"""Offline calibration: the files the runtime's lossy options read (``pyvis calibrate WHAT``).

    buddies    buddy lists and TAE quantiles for --moe-substitute buddy / --moe-sub-tae pN
               (pyvis.calibrate.buddies; format: pyvis.runtime.profile, docs/substitution.md)
    predictor  co-activation tables for --moe-predict coact (and with --mlp the lookahead MLP for --moe-predict mlp,
               pyvis.calibrate.mlp), with held-out recall / precision / bytes wasted
               (pyvis.calibrate.predictor; format: pyvis.runtime.predict_profile, docs/prediction-calibration.md)
    modality   per layer and expert, the routing of image and of text tokens, the visual share and a visual / text /
               shared label (pyvis.calibrate.modality; format: pyvis.runtime.modality_profile, docs/modality.md)

A new kind of calibration is a module with ``register(sub)`` that adds its parser to ``sub`` (the subparsers of
``pyvis calibrate``) and sets ``fn``; list it in :data:`SUBCOMMANDS`.  ``pyvis report-buddies`` (the buddy graph
of one layer) lives in :mod:`pyvis.calibrate.graph`.
"""
from __future__ import annotations

import importlib

SUBCOMMANDS = ("buddies", "predictor", "modality")    # modules of this package, in help order


def register(sub) -> None:
    """``pyvis calibrate`` and its subcommands (``sub``: the top-level subparsers of ``pyvis``)."""
    p = sub.add_parser("calibrate", help="offline calibration files (buddy, predictor and modality profiles)",
                       description="Fit the files that the runtime's lossy options read. "
                       "Run `pyvis calibrate WHAT --help` for one kind's options.")
    what = p.add_subparsers(dest="calibrate_cmd", metavar="WHAT")
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(what)

    def _help(args) -> int:
        p.print_help()
        return 0
    p.set_defaults(fn=_help)
