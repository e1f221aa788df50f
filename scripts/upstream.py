#!/usr/bin/env python3
"""Fetch the pinned upstream llama.cpp and apply our patch series.

Upstream is taken from the llama-cpp-python sdist on PyPI (its vendor/llama.cpp
is llama.cpp commit 0c1e570, 2026-10-01).  Nothing of it is committed here:

  1. download the sdist once, cache it by sha256 under ~/.cache/vis-moe/sdist/
     (or $VIS_CACHE_DIR) and check it against UPSTREAM_SHA256 below;
  2. extract vendor/llama.cpp into a scratch tree and apply ggml-patches/*.patch
     in lexical order (0001-..., 0002-...); a patch that does not apply stops
     with a message naming it;
  3. sync the result into vendor/llama.cpp (git-ignored), rewriting only files
     whose bytes changed, so the build stays incremental when a patch changes.

A stamp file records the sdist hash and every patch hash; when they match,
nothing is done (idempotent).  Standard library only: this runs before any
virtual environment exists.

Usage: scripts/upstream.py [--sdist FILE] [--force] [--check-only]
"""
from __future__ import annotations

import argparse
import filecmp
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

UPSTREAM_PACKAGE = "llama-cpp-python"
UPSTREAM_VERSION = "0.3.36"
UPSTREAM_FILENAME = "llama_cpp_python-0.3.36.tar.gz"
UPSTREAM_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
UPSTREAM_LLAMA_COMMIT = "0c1e570"
VENDOR_PREFIX = "llama_cpp_python-0.3.36/vendor/llama.cpp/"

ROOT = Path(__file__).resolve().parent.parent
PATCH_DIR = ROOT / "ggml-patches"
DEST = ROOT / "vendor" / "llama.cpp"


class SetupError(RuntimeError):
    pass


def cache_dir() -> Path:
    base = os.environ.get("VIS_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "vis-moe"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def log(msg: str) -> None:
    print(f"[upstream] {msg}", flush=True)


def _index_url() -> str:
    # honour a mirror configured for pip; default to PyPI's simple index
    url = os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple"
    return url.rstrip("/")


def download_sdist() -> Path:
    """Return the cached sdist path, downloading it on first use."""
    target = cache_dir() / "sdist" / UPSTREAM_SHA256 / UPSTREAM_FILENAME
    if target.is_file():
        if sha256_file(target) == UPSTREAM_SHA256:
            return target
        log(f"cached sdist {target} is corrupt; downloading again")
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    index = f"{_index_url()}/{UPSTREAM_PACKAGE}/"
    log(f"looking up {UPSTREAM_FILENAME} in {index}")
    try:
        page = urllib.request.urlopen(index, timeout=60).read().decode("utf-8", "replace")
    except Exception as e:  # noqa: BLE001 - report any network failure plainly
        raise SetupError(
            f"cannot reach the package index {index}: {e}\n"
            f"  Fix: check the network, or download {UPSTREAM_FILENAME} yourself "
            f"(pip download --no-binary :all: --no-deps {UPSTREAM_PACKAGE}=={UPSTREAM_VERSION}) "
            f"and pass it with --sdist FILE."
        ) from e
    m = re.search(r'href="([^"#]*%s)(#[^"]*)?"' % re.escape(UPSTREAM_FILENAME), page)
    if not m:
        raise SetupError(f"{UPSTREAM_FILENAME} is not listed on {index}")
    url = urllib.request.urljoin(index, m.group(1))
    tmp = target.with_suffix(".part")
    log(f"downloading {url}")
    try:
        with urllib.request.urlopen(url, timeout=300) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
    except Exception as e:  # noqa: BLE001
        tmp.unlink(missing_ok=True)
        raise SetupError(f"download of {url} failed: {e}") from e
    got = sha256_file(tmp)
    if got != UPSTREAM_SHA256:
        tmp.unlink()
        raise SetupError(
            f"sha256 mismatch for {UPSTREAM_FILENAME}: expected {UPSTREAM_SHA256}, got {got}.\n"
            "  The index served a different file; refusing to build on unverified upstream code."
        )
    tmp.rename(target)
    return target


def patch_series(patch_dir: Path) -> list[Path]:
    return sorted(p for p in patch_dir.glob("*.patch") if p.is_file())


def stamp_path(dest: Path) -> Path:
    return dest.parent / f".{dest.name}-stamp"


def wanted_stamp(sdist_sha: str, patch_dir: Path) -> str:
    lines = [f"sdist {sdist_sha}"]
    for p in patch_series(patch_dir):
        lines.append(f"patch {p.name} {sha256_file(p)}")
    return "\n".join(lines) + "\n"


def extract(sdist: Path, dest: Path) -> None:
    with tarfile.open(sdist, "r:gz") as tf:
        members = []
        for m in tf.getmembers():
            # regular files and directories only (the vendored tree has no links)
            if not m.name.startswith(VENDOR_PREFIX) or not (m.isfile() or m.isdir()):
                continue
            m.name = m.name[len(VENDOR_PREFIX):]
            if m.name:
                members.append(m)
        if not members:
            raise SetupError(f"{sdist} has no {VENDOR_PREFIX}; is it the right sdist?")
        tf.extractall(dest, members=members, filter="data")


def apply_patches(tree: Path, patch_dir: Path) -> None:
    for p in patch_series(patch_dir):
        dry = subprocess.run(
            ["patch", "-p1", "--fuzz=0", "--dry-run", "--batch", "--forward", "-d", str(tree), "-i", str(p)],
            capture_output=True, text=True,
        )
        if dry.returncode != 0:
            raise SetupError(
                f"patch {p.name} ({p}) does not apply to llama.cpp {UPSTREAM_LLAMA_COMMIT} "
                f"(from {UPSTREAM_FILENAME}):\n{dry.stdout}{dry.stderr}"
                f"  Fix: regenerate {p.name} against the pristine tree "
                f"(scripts/upstream.py --pristine DIR writes one to diff against)."
            )
        subprocess.run(
            ["patch", "-p1", "--fuzz=0", "--batch", "--forward", "--quiet", "-d", str(tree), "-i", str(p)],
            check=True,
        )
        log(f"applied {p.name}")


def sync_tree(src: Path, dst: Path) -> int:
    """Make dst identical to src, touching only files whose bytes differ."""
    changed = 0
    dst.mkdir(parents=True, exist_ok=True)
    for dirpath, dirnames, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        ddir = dst / rel
        ddir.mkdir(exist_ok=True)
        src_names = set(dirnames) | set(filenames)
        for name in os.listdir(ddir):
            if name not in src_names:
                t = ddir / name
                shutil.rmtree(t) if t.is_dir() and not t.is_symlink() else t.unlink()
                changed += 1
        for name in filenames:
            s, d = Path(dirpath) / name, ddir / name
            if d.is_file() and filecmp.cmp(s, d, shallow=False):
                continue
            if d.is_dir():
                shutil.rmtree(d)
            shutil.copy2(s, d)
            os.utime(d)  # new content gets a new mtime so the build notices
            changed += 1
    return changed


def prepare(sdist: Path | None, force: bool, patch_dir: Path = PATCH_DIR, dest: Path = DEST) -> Path:
    if sdist is None:
        sdist = download_sdist()
    else:
        got = sha256_file(sdist)
        if got != UPSTREAM_SHA256:
            raise SetupError(f"{sdist}: sha256 {got} does not match the pinned {UPSTREAM_SHA256}")
    stamp = stamp_path(dest)
    want = wanted_stamp(UPSTREAM_SHA256, patch_dir)
    n_patches = len(patch_series(patch_dir))
    if not force and dest.is_dir() and stamp.is_file() and stamp.read_text() == want:
        log(f"{dest} is up to date ({n_patches} patches)")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="vis-upstream-", dir=dest.parent) as tmp:
        scratch = Path(tmp) / "llama.cpp"
        log(f"extracting llama.cpp {UPSTREAM_LLAMA_COMMIT} from {sdist.name}")
        extract(sdist, scratch)
        apply_patches(scratch, patch_dir)
        n = sync_tree(scratch, dest)
    stamp.write_text(want)
    log(f"{dest} ready ({n_patches} patches, {n} files changed)")
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sdist", type=Path, help="use this sdist file instead of downloading")
    ap.add_argument("--force", action="store_true", help="re-extract and re-patch even if the stamp matches")
    ap.add_argument("--patches", type=Path, default=PATCH_DIR, help="patch directory (default: ggml-patches/)")
    ap.add_argument("--dest", type=Path, default=DEST, help="patched tree to write (default: vendor/llama.cpp)")
    ap.add_argument("--print-sdist", action="store_true", help="print the cached sdist path (downloading it if needed)")
    ap.add_argument("--pristine", type=Path, metavar="DIR",
                    help="extract the unpatched tree into DIR (for writing new patches) and exit")
    args = ap.parse_args(argv)
    try:
        if args.print_sdist:
            print(args.sdist or download_sdist())
            return 0
        if args.pristine:
            extract(args.sdist or download_sdist(), args.pristine)
            log(f"pristine tree in {args.pristine}")
            return 0
        prepare(args.sdist, args.force, args.patches.resolve(), args.dest.resolve())
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
