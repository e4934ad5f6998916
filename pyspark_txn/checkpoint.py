"""Reading Spark's own checkpoint files (metadata, offsets) with fsspec, no Spark needed."""

from __future__ import annotations

import json
import uuid
from typing import Any

from . import _fs
from .errors import ConfigError


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


SINK_FILE = ("pyspark_txn", "sink.json")


def persisted_sink_id(
    checkpoint: str, derived: str, explicit: str | None = None, fs_options=None
) -> str:
    """The sink id kept inside the checkpoint, written there on first use.

    The id travels with the checkpoint: a copied or moved checkpoint, or the
    same location spelled another way (``s3://`` vs ``s3a://``, a trailing
    slash, a relative path), keeps its sink and so its history. ``derived`` is
    used on first use when no ``explicit`` id is given; an explicit id that
    differs from the kept one is refused.
    """
    fs, root = _fs.filesystem(checkpoint, fs_options)
    path = _fs.join(root, *SINK_FILE)
    if fs.exists(path):
        with fs.open(path, "r") as f:
            kept = json.load(f)["sink_id"]
        if explicit is not None and explicit != kept:
            raise ConfigError(
                f"option sinkId={explicit!r}, but the checkpoint {checkpoint} belongs to sink "
                f"{kept!r} ({_fs.join(checkpoint, *SINK_FILE)}); a checkpoint's sink id never "
                "changes. Drop the option, or start the query with a new checkpoint."
            )
        return kept
    sink_id = explicit or derived
    fs.makedirs(_fs.join(root, SINK_FILE[0]), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with fs.open(tmp, "w") as f:
        json.dump({"sink_id": sink_id, "format_version": 1}, f)
    try:
        fs.mv(tmp, path)
    except Exception:
        fs.rm(tmp)
        raise
    with fs.open(path, "r") as f:  # a racing first use wrote its own: the file decides
        return json.load(f)["sink_id"]
