"""Calibration and held-out text for the MoE testbed, from files installed by packages.

No data set can be downloaded here, so both texts come from documentation
that Debian or Python ship on every machine of this project:

  ===========  ==============================================================
  text          source
  ===========  ==============================================================
  held-out      the Vim user manual, ``usr_01.txt`` .. ``usr_08.txt`` ("Getting
                Started", about 41.8k SmolLM2 tokens) from Debian's
                ``vim-runtime`` (``/usr/share/vim/vim*/doc``). ``heldout("vim-all")``
                is every ``usr_*.txt`` (about 185k tokens).
  calibration   docstrings (module, class and function) of a fixed list of
                pure-Python standard-library modules of the running interpreter
                (``sysconfig.get_paths()["stdlib"]``), read with :mod:`ast`
                (nothing is imported).
  ===========  ==============================================================

The two never overlap: every calibration line whose normalised form (length
>= 24 characters) also occurs in the held-out text is dropped, and
:func:`check_disjoint` verifies it.  :class:`Text` records exactly which files
were read and the sha256 of the resulting text, so a report can say what was
used.  A missing source raises :class:`CorpusError` with the fix.
"""
from __future__ import annotations

import ast
import glob
import hashlib
import os
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path


class CorpusError(RuntimeError):
    pass


@dataclass
class Text:
    name: str
    text: str
    files: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def describe(self) -> dict:
        return {"name": self.name, "chars": len(self.text), "sha256": self.sha256,
                "files": self.files, "note": self.note}

    def write(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.text, encoding="utf-8")
        return p


# --------------------------------------------------------------------------
# held-out: the Vim user manual
# --------------------------------------------------------------------------
VIM_GETTING_STARTED = [f"usr_{i:02d}.txt" for i in range(1, 9)]


def vim_doc_dir() -> Path:
    env = os.environ.get("VIS_VIM_DOC_DIR")
    cands = [Path(env)] if env else []
    cands += [Path(p) for p in sorted(glob.glob("/usr/share/vim/vim*/doc"), reverse=True)]
    for d in cands:
        if (d / "usr_01.txt").is_file():
            return d
    raise CorpusError("the Vim user manual (usr_01.txt ...) was not found under /usr/share/vim/vim*/doc.\n"
                      "  Fix: `apt-get install vim-runtime` (Debian), or set VIS_VIM_DOC_DIR to a directory "
                      "holding usr_*.txt.")


def heldout(name: str = "vim") -> Text:
    """Held-out evaluation text. ``vim``: usr_01..usr_08; ``vim-all``: every usr_*.txt."""
    d = vim_doc_dir()
    if name == "vim":
        files = [d / f for f in VIM_GETTING_STARTED]
    elif name == "vim-all":
        files = sorted(d.glob("usr_*.txt"))
    else:
        raise CorpusError(f"unknown held-out text {name!r}; choose vim or vim-all")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CorpusError(f"held-out text {name!r}: missing {', '.join(missing)} (reinstall vim-runtime)")
    parts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    return Text(name=f"heldout:{name}", text="".join(parts), files=[str(f) for f in files],
                note="Vim user manual (Debian vim-runtime)")


def vim_training() -> Text:
    """The rest of the Vim user manual (every ``usr_*.txt`` but usr_01..usr_08), for training
    (``pyvis testbed train``): same domain as the held-out text, other files.  Lines whose normalised form
    (24 characters or more) occurs in the held-out text are dropped, as for the calibration text."""
    d = vim_doc_dir()
    held = set(VIM_GETTING_STARTED)
    files = [f for f in sorted(d.glob("usr_*.txt")) if f.name not in held]
    if not files:
        raise CorpusError(f"no usr_*.txt beyond usr_01..usr_08 under {d} (reinstall vim-runtime)")
    banned = {n for n in (_norm_line(x) for x in heldout("vim").text.splitlines()) if len(n) >= 24}
    kept, dropped = [], 0
    for f in files:
        for line in f.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
            if _norm_line(line) in banned:
                dropped += 1
                continue
            kept.append(line)
    return Text(name="train:vim-usr-09-up", text="".join(kept), files=[str(f) for f in files],
                note=f"Vim user manual usr_09.. (Debian vim-runtime); {dropped} lines dropped because they "
                     "also occur in the held-out usr_01..usr_08")


# --------------------------------------------------------------------------
# calibration: Python standard-library docstrings
# --------------------------------------------------------------------------
# Pure-Python modules present in CPython 3.10-3.13; order matters (it is the text order).
STDLIB_MODULES = [
    "argparse.py", "logging/__init__.py", "logging/handlers.py", "collections/__init__.py", "functools.py",
    "textwrap.py", "string.py", "json/__init__.py", "json/decoder.py", "json/encoder.py", "csv.py",
    "fractions.py", "statistics.py", "random.py", "heapq.py", "bisect.py", "pathlib.py", "shutil.py",
    "subprocess.py", "threading.py", "queue.py", "sched.py", "typing.py", "dataclasses.py", "enum.py",
    "inspect.py", "pydoc.py", "difflib.py", "unittest/case.py", "unittest/mock.py", "doctest.py",
    "email/message.py", "email/utils.py", "http/client.py", "http/server.py", "http/cookiejar.py",
    "urllib/parse.py", "urllib/request.py", "zipfile.py", "tarfile.py", "configparser.py", "optparse.py",
    "pickle.py", "copy.py", "shlex.py", "smtplib.py", "ftplib.py", "imaplib.py", "tempfile.py", "glob.py",
    "fnmatch.py", "calendar.py", "locale.py", "gettext.py", "codecs.py", "contextlib.py", "abc.py",
    "numbers.py", "ipaddress.py", "asyncio/events.py", "asyncio/tasks.py", "asyncio/streams.py",
    "concurrent/futures/_base.py", "multiprocessing/pool.py", "selectors.py", "socket.py", "ssl.py",
    "xml/dom/minidom.py", "xml/etree/ElementTree.py", "datetime.py", "_pydecimal.py", "operator.py",
    "weakref.py", "trace.py", "timeit.py", "pdb.py", "cmd.py", "code.py", "filecmp.py", "gzip.py",
    "base64.py", "hashlib.py", "hmac.py", "secrets.py", "uuid.py", "platform.py", "sysconfig.py",
    "os.py", "posixpath.py", "reprlib.py", "pprint.py", "traceback.py", "warnings.py", "tokenize.py",
    "ast.py", "dis.py", "importlib/__init__.py", "importlib/metadata/__init__.py", "zipimport.py",
    "mailbox.py", "mimetypes.py", "netrc.py", "nntplib.py", "poplib.py", "quopri.py", "socketserver.py",
    "stringprep.py", "struct.py", "symtable.py", "tabnanny.py", "telnetlib.py", "turtle.py", "wave.py",
    "webbrowser.py", "xmlrpc/client.py", "xmlrpc/server.py", "graphlib.py", "getopt.py", "getpass.py",
    "linecache.py", "plistlib.py", "py_compile.py", "compileall.py", "runpy.py", "site.py", "stat.py",
]


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _docstrings(src: str) -> list[str]:
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 40:
                out.append(doc.strip())
    return out


def _norm_line(s: str) -> str:
    return re.sub(r"\s+", " ", s).strip().lower()


def _heldout_lines(min_len: int = 24) -> set[str]:
    try:
        t = heldout("vim-all").text
    except CorpusError:
        return set()
    return {n for n in (_norm_line(x) for x in t.splitlines()) if len(n) >= min_len}


def calibration(max_chars: int | None = None) -> Text:
    """Calibration text: stdlib docstrings, minus any line that also occurs in the Vim manual."""
    d = stdlib_dir()
    if not d.is_dir():
        raise CorpusError(f"the Python standard library was not found at {d}")
    banned = _heldout_lines()
    parts, files, dropped = [], [], 0
    total = 0
    for rel in STDLIB_MODULES:
        f = d / rel
        if not f.is_file():
            continue
        docs = _docstrings(f.read_text(encoding="utf-8", errors="replace"))
        if not docs:
            continue
        files.append(str(f))
        for doc in docs:
            lines = []
            for line in doc.splitlines():
                if _norm_line(line) in banned:
                    dropped += 1
                    continue
                lines.append(line)
            chunk = "\n".join(lines).strip()
            if chunk:
                parts.append(chunk + "\n\n")
                total += len(parts[-1])
        if max_chars is not None and total >= max_chars:
            break
    if not parts:
        raise CorpusError(f"no docstrings could be read from the standard library at {d}; "
                          "is this a stripped Python install?")
    text = "".join(parts)
    if max_chars is not None:
        text = text[:max_chars]
    return Text(name="calibration:python-stdlib-docstrings", text=text, files=files,
                note=f"docstrings (>= 40 chars) of {len(files)} stdlib modules of Python at {d}; "
                     f"{dropped} lines dropped because they also occur in the Vim manual")


def check_disjoint(a: Text, b: Text, min_len: int = 24) -> int:
    """Number of normalised lines (>= min_len chars) the two texts share (0 = disjoint)."""
    la = {n for n in (_norm_line(x) for x in a.text.splitlines()) if len(n) >= min_len}
    lb = {n for n in (_norm_line(x) for x in b.text.splitlines()) if len(n) >= min_len}
    return len(la & lb)


def load_text(spec: str) -> Text:
    """A text named on the command line: ``heldout``/``vim``/``vim-all``, ``calibration``, or a file path."""
    if spec in ("heldout", "vim"):
        return heldout("vim")
    if spec == "vim-all":
        return heldout("vim-all")
    if spec in ("calibration", "calib", "stdlib"):
        return calibration()
    p = Path(spec)
    if not p.is_file():
        raise CorpusError(f"text {spec!r}: not a file, and not one of heldout, vim-all, calibration")
    return Text(name=f"file:{p}", text=p.read_text(encoding="utf-8", errors="replace"), files=[str(p.resolve())])
