"""The GGUF file(s) of one model, as pyvis commands that take a model read them (plan, shadow, calibrate, info).

A split model (``llama-gguf-split``) is ``NAME-00001-of-0000N.gguf`` .. ``NAME-0000N-of-0000N.gguf``, named by its
first shard as llama.cpp names it; :func:`shard_paths` lists every shard (each checked present), so a command reads
the whole model, never only the first shard's tensors.  A later shard, or a file that is no language model (an
mmproj projector, a vis sidecar), is a :class:`ModelFileError` that says what the file is and what to pass instead
(:func:`what_it_is`).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

_SHARD = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class ModelFileError(ValueError):
    """A model path that names no whole model: a later shard, a missing shard, an mmproj, a sidecar."""


def shard_paths(path: str | os.PathLike) -> list[Path]:
    """``[path]`` for a single-file model; every shard, in order, for the first shard of a split model."""
    path = Path(path)
    m = _SHARD.match(path.name)
    if not m:
        return [path]
    no, count = int(m["no"]), int(m["count"])
    first = path.with_name(f"{m['prefix']}-00001-of-{m['count']}.gguf")
    if no != 1:
        raise ModelFileError(f"{path}: shard {no} of {count} of a split GGUF; give the first shard, {first}, "
                             "which names the whole model")
    paths = [path.with_name(f"{m['prefix']}-{i:05d}-of-{m['count']}.gguf") for i in range(1, count + 1)]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ModelFileError(f"{path}: split GGUF of {count} shards, but {', '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} missing; put every shard beside the first")
    return paths


def what_it_is(path: str | os.PathLike, reader=None) -> str | None:
    """Why the GGUF at ``path`` (``reader``: its GGUFReader, if open) is no model a pyvis command can load, with the
    fix; None if it looks like one (or is not a readable GGUF at all: the caller's own error says that)."""
    import gguf
    path = Path(path)
    try:
        shard_paths(path)
    except ModelFileError as e:
        return str(e)
    try:
        r = reader if reader is not None else gguf.GGUFReader(str(path))
    except Exception:  # noqa: BLE001 - not a GGUF, truncated: the caller's message
        return None
    f = r.fields.get("general.architecture")
    arch = f.contents() if f is not None else None
    if arch == "clip":
        return (f"{path} is a multimodal projector (mmproj), not a language model: pass it with --mmproj next to "
                "the model it belongs to")
    kind = r.fields.get("vis.profile.kind")
    if kind is not None:
        return (f"{path} is a vis '{kind.contents()}' sidecar, not a model: pass it with its flag next to the model "
                "it was made for")
    return None
