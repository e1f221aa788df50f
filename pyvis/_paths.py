"""Where our build lives: native libraries, binaries, caches.

Resolution order for the directory holding libllama/libmtmd and the tools:
  1. $VIS_LIB_DIR (a directory with libllama.so, libmtmd.so and llama-* binaries)
  2. $VIS_BUILD_DIR/bin
  3. <repo>/build/bin, <repo>/build-cuda/bin, <repo>/build-jetson/bin (first that exists)
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
_LIB_NAME = {"linux": "libllama.so", "darwin": "libllama.dylib"}.get(sys.platform, "libllama.so")


class BuildNotFound(RuntimeError):
    pass


def cache_dir() -> Path:
    base = os.environ.get("VIS_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "vis-moe"


def _candidates() -> list[Path]:
    out = []
    if os.environ.get("VIS_LIB_DIR"):
        return [Path(os.environ["VIS_LIB_DIR"])]
    if os.environ.get("VIS_BUILD_DIR"):
        return [Path(os.environ["VIS_BUILD_DIR"]) / "bin"]
    for d in ("build", "build-cuda", "build-jetson"):
        out.append(REPO_ROOT / d / "bin")
    return out


def lib_dir(required: bool = True) -> Path | None:
    for d in _candidates():
        if (d / _LIB_NAME).is_file():
            return d
    if required:
        tried = ", ".join(str(d) for d in _candidates())
        raise BuildNotFound(
            f"the vis-moe native build was not found (looked for {_LIB_NAME} in: {tried}).\n"
            "  Fix: run scripts/setup.sh (or `cmake --preset cpu && cmake --build --preset cpu`), "
            "or point VIS_LIB_DIR at a directory holding libllama.so and libmtmd.so.")
    return None


def bin_path(name: str) -> Path:
    p = lib_dir() / name
    if not p.is_file():
        raise BuildNotFound(f"{name} is not in {p.parent}; rebuild with `cmake --build --preset cpu`.")
    return p


def configure_native_env() -> Path | None:
    """Point llama-cpp-python at our libraries before `llama_cpp` is imported."""
    d = lib_dir(required=False)
    if d is None:
        return None
    if "llama_cpp" in sys.modules and os.environ.get("LLAMA_CPP_LIB_PATH") != str(d):
        import warnings
        warnings.warn("llama_cpp was imported before pyvis; it may be bound to another libllama. "
                      "Import pyvis first.", RuntimeWarning, stacklevel=3)
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(d))
    os.environ.setdefault("MTMD_CPP_LIB", str(d))
    return d
