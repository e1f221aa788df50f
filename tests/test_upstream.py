"""The pinned-upstream step: verified sdist, ordered patches, named failures, idempotence."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "upstream.py"


def upstream(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def sdist() -> Path:
    r = upstream("--print-sdist")
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip())


def test_our_patches_apply_and_rerun_is_idempotent(tmp_path, sdist):
    dest = tmp_path / "vendor" / "llama.cpp"
    r = upstream("--sdist", sdist, "--dest", dest)
    assert r.returncode == 0, r.stderr
    for p in sorted((ROOT / "ggml-patches").glob("*.patch")):
        assert f"applied {p.name}" in r.stdout
    assert "llama_vis_system_info()" in (dest / "src" / "llama.cpp").read_text()
    mtime = (dest / "src" / "llama.cpp").stat().st_mtime_ns
    r2 = upstream("--sdist", sdist, "--dest", dest)
    assert r2.returncode == 0 and "up to date" in r2.stdout, r2.stdout + r2.stderr
    assert (dest / "src" / "llama.cpp").stat().st_mtime_ns == mtime


def test_changed_patch_resyncs_only_changed_files(tmp_path, sdist):
    patches = tmp_path / "patches"
    shutil.copytree(ROOT / "ggml-patches", patches)
    dest = tmp_path / "vendor" / "llama.cpp"
    assert upstream("--sdist", sdist, "--dest", dest, "--patches", patches).returncode == 0
    untouched = dest / "src" / "llama-vocab.cpp"
    before = untouched.stat().st_mtime_ns
    # drop our patch: upstream's llama.cpp must come back, and nothing else may be rewritten
    for p in patches.glob("*.patch"):
        p.unlink()
    r = upstream("--sdist", sdist, "--dest", dest, "--patches", patches)
    assert r.returncode == 0, r.stderr
    assert "llama_vis_system_info" not in (dest / "src" / "llama.cpp").read_text()
    touched = set()
    for p in (ROOT / "ggml-patches").glob("*.patch"):
        touched |= {l[6:].strip() for l in p.read_text().splitlines() if l.startswith("+++ b/")}
    assert f"{len(touched)} files changed" in r.stdout  # exactly the files our patches touch
    assert untouched.stat().st_mtime_ns == before


def test_broken_patch_is_named(tmp_path, sdist):
    patches = tmp_path / "patches"
    shutil.copytree(ROOT / "ggml-patches", patches)
    (patches / "0099-broken.patch").write_text(
        "a patch whose context does not exist upstream\n\n"
        "--- a/src/llama.cpp\n+++ b/src/llama.cpp\n@@ -1,3 +1,4 @@\n"
        " this line is not in llama.cpp\n+added\n nor this one\n and not this one\n")
    dest = tmp_path / "vendor" / "llama.cpp"
    r = upstream("--sdist", sdist, "--dest", dest, "--patches", patches)
    assert r.returncode == 1
    assert "0099-broken.patch" in r.stderr and "does not apply" in r.stderr
    assert not (dest.parent / ".llama.cpp-stamp").exists()  # a failed run never looks up to date


def test_wrong_sdist_is_refused(tmp_path):
    bogus = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    bogus.write_bytes(b"not the sdist")
    r = upstream("--sdist", bogus, "--dest", tmp_path / "vendor" / "llama.cpp")
    assert r.returncode == 1
    assert "sha256" in r.stderr and "does not match" in r.stderr
