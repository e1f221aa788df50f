"""The docs' relative links resolve: every `[text](path#anchor)` in README.md and docs/*.md names a file of the repo
and, where it has an anchor into a Markdown file, a heading of that file (GitHub's slug rule: lower case, punctuation
dropped, spaces to hyphens).  Two such links pointed at headings that had been renamed until stop 44."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.*)$", re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _text(path: Path) -> str:
    return FENCE.sub("", path.read_text(encoding="utf-8"))  # a '# comment' in a code block is no heading


def _anchors(path: Path) -> set[str]:
    out: set[str] = set()
    for h in HEADING.findall(_text(path)):
        s, n = slug(h), 1
        while s in out:          # GitHub numbers repeated headings: name, name-1, ...
            s, n = f"{slug(h)}-{n}", n + 1
        out.add(s)
    return out


def _broken() -> list[str]:
    bad = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(_text(doc)):
            if re.match(r"[a-z]+:", target):          # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    return bad


def test_the_slug_rule():
    assert slug("Stop 44: the 4 GiB A/B with borrowed slots on, and fast") == \
        "stop-44-the-4-gib-ab-with-borrowed-slots-on-and-fast"
    assert slug("Profile format (GGUF sidecar)") == "profile-format-gguf-sidecar"


def test_every_relative_link_resolves():
    bad = _broken()
    assert not bad, "\n".join(bad)
