"""The one way pyvis gets matplotlib for a plot (``pyvis cachesim --plot``, ``pyvis report RUN.csv -o``):
the Agg backend, or a clear error when this Python has no matplotlib (the project's venv does not install it)."""
from __future__ import annotations


def pyplot(flag: str):
    """matplotlib.pyplot on the Agg backend; SystemExit naming ``flag`` and the fix when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(f"error: {flag} needs matplotlib, which this Python does not have "
                         "(pip install matplotlib, or run scripts/setup.sh to install the project's dependencies)") from None
    return plt
