"""Reading Spark's own checkpoint files (metadata, offsets) with fsspec, no Spark needed."""

from __future__ import annotations

import json
from typing import Any

from . import _fs


def read_query_id(checkpoint: str, fs_options=None) -> str | None:
    """The streaming query id Spark keeps in ``<checkpoint>/metadata``; None if absent."""
    fs, root = _fs.filesystem(checkpoint, fs_options)
    path = _fs.join(root, "metadata")
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        first = f.readline()
    return json.loads(first).get("id") if first.strip() else None


def read_batch_offsets(checkpoint: str, batch_id: int, fs_options=None) -> list[Any] | None:
    """Every source's end offset of ``batch_id`` as Spark logged it (JVM sources too).

    The offset log file is ``v1``, a metadata line, then one line per source
    (``-`` for a source with no offset). None if Spark has no such file.
    """
    fs, root = _fs.filesystem(checkpoint, fs_options)
    path = _fs.join(root, "offsets", str(batch_id))
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        lines = f.read().splitlines()
    out: list[Any] = []
    for line in lines[2:]:
        if line == "-":
            out.append(None)
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append(line)
    return out
