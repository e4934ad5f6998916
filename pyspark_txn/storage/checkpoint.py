"""Reading Spark's own checkpoint files (metadata, offsets) with fsspec, no Spark needed."""

from __future__ import annotations

import json
import uuid
from typing import Any

from ..errors import ConfigError
from . import fs as _fs


def read_query_id(checkpoint: str, fs_options=None) -> str | None:
    """The streaming query id Spark keeps in ``<checkpoint>/metadata``; None if absent."""
    fs, root = _fs.filesystem(checkpoint, fs_options)
    try:
        text = _fs.read_text(fs, _fs.join(root, "metadata"))
    except FileNotFoundError:
        return None
    first = text.split("\n", 1)[0]
    return json.loads(first).get("id") if first.strip() else None


def read_batch_offsets(checkpoint: str, batch_id: int, fs_options=None) -> list[Any] | None:
    """Every source's end offset of ``batch_id`` as Spark logged it (JVM sources too).

    The offset log file is ``v1``, a metadata line, then one line per source
    (``-`` for a source with no offset). None if Spark has no such file.
    """
    fs, root = _fs.filesystem(checkpoint, fs_options)
    try:
        lines = _fs.read_text(fs, _fs.join(root, "offsets", str(batch_id))).splitlines()
    except FileNotFoundError:
        return None
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


def latest_batch(checkpoint: str, log: str = "offsets", fs_options=None) -> int | None:
    """The highest batch id in Spark's ``offsets`` (planned) or ``commits`` (done) log."""
    fs, root = _fs.filesystem(checkpoint, fs_options)
    path = _fs.join(root, log)
    if not fs.exists(path):
        return None
    names = (p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
    return max((int(n) for n in names if n.isdigit()), default=None)


SINK_FILE = ("pyspark_txn", "sink.json")
RECORDS_DIR = ("pyspark_txn", "records")


def default_record_table(checkpoint: str) -> str:
    """Where a sink keeps its record table unless told otherwise: inside the checkpoint,
    so it moves and is copied with it."""
    return _fs.join(checkpoint, *RECORDS_DIR)


def read_sink_file(checkpoint: str, fs_options=None) -> dict[str, Any] | None:
    """What ``<checkpoint>/pyspark_txn/sink.json`` keeps (sink id, record table), or None."""
    fs, root = _fs.filesystem(checkpoint, fs_options)
    try:
        return json.loads(_fs.read_text(fs, _fs.join(root, *SINK_FILE)))
    except FileNotFoundError:
        return None


#: The mark ``backups restore`` keeps in each checkpoint it writes: which backup, and
#: whether the member's restore finished (then the restored table's version and id).
RESTORE_FILE = ("pyspark_txn", "restore.json")


def read_restore_mark(checkpoint: str, fs_options=None) -> dict[str, Any] | None:
    """The restore mark of ``checkpoint`` (None: no restore wrote it)."""
    fs, root = _fs.filesystem(checkpoint, fs_options)
    try:
        mark = json.loads(_fs.read_text(fs, _fs.join(root, *RESTORE_FILE)))
    except FileNotFoundError:
        return None
    return mark if isinstance(mark, dict) else None


def unfinished_restore(mark: dict[str, Any] | None) -> str | None:
    """What to say of a checkpoint whose restore did not finish (None: it did, or there
    was none): its query must not start, or it would write the part's rows again."""
    if mark is None or mark.get("done"):
        return None
    how = "--in-place" if mark.get("in_place") else "--into DIR"
    return (
        f"the restore of backup {mark.get('backup_id')} (from {mark.get('to')}) into it is "
        f"unfinished: run `pyspark-txn backups restore {mark.get('backup_id')} --to "
        f"{mark.get('to')} {how}` again (as it was started) before starting its query; "
        "started now, it would write the restored rows a second time"
    )


def persisted_sink_id(
    checkpoint: str,
    derived: str,
    explicit: str | None = None,
    fs_options=None,
    record_table: str | None = None,
    mode: str = "snapshots",
    target: dict[str, Any] | None = None,
) -> str:
    """The sink id kept inside the checkpoint, written there on first use.

    The id travels with the checkpoint: a copied or moved checkpoint, or the
    same location spelled another way (``s3://`` vs ``s3a://``, a trailing
    slash, a relative path), keeps its sink and so its history. ``derived`` is
    used on first use when no ``explicit`` id is given; an explicit id that
    differs from the kept one is refused. A record table outside the checkpoint
    (option ``recordTable``) is named there too, so tools find a sink's history
    from its checkpoint alone; the default one is not: it is wherever the
    checkpoint is now. So is the sink's ``mode``: a checkpoint keeps the mode it
    started with (files from before modes existed are ``snapshots``). ``target``
    describes where a target other than Delta writes (its records say it too), so
    tools find it before the first record; it is kept as first written.
    """
    kept = read_sink_file(checkpoint, fs_options)
    if kept is None:  # first use: a restore into this checkpoint must have finished
        unfinished = unfinished_restore(read_restore_mark(checkpoint, fs_options))
        if unfinished is not None:
            raise ConfigError(f"checkpoint {checkpoint}: {unfinished}")
    if kept is not None:
        kept_mode = kept.get("mode", "snapshots")
        if kept_mode != mode:
            raise ConfigError(
                f"option mode={mode}, but the checkpoint {checkpoint} ran with mode={kept_mode} "
                f"({_fs.join(checkpoint, *SINK_FILE)}): a checkpoint keeps its mode (a light "
                "sink keeps no records to continue from; a light query would skip a snapshot "
                f"sink's history). Use mode={kept_mode}, or start the query with a new "
                "checkpoint (docs/modes.md)."
            )
        if explicit is not None and explicit != kept["sink_id"]:
            raise ConfigError(
                f"option sinkId={explicit!r}, but the checkpoint {checkpoint} belongs to sink "
                f"{kept['sink_id']!r} ({_fs.join(checkpoint, *SINK_FILE)}); a checkpoint's sink "
                "id never changes. Drop the option, or start the query with a new checkpoint."
            )
        return kept["sink_id"]
    fs, root = _fs.filesystem(checkpoint, fs_options)
    path = _fs.join(root, *SINK_FILE)
    fs.makedirs(_fs.join(root, SINK_FILE[0]), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    content: dict[str, Any] = {
        "sink_id": explicit or derived,
        "record_table": record_table,
        "mode": mode,
        "format_version": 1,
    }
    if target is not None:
        content["target"] = target
    with fs.open(tmp, "w") as f:
        json.dump(content, f)
    try:
        fs.mv(tmp, path)
    except Exception:
        fs.rm(tmp)
        raise
    kept = read_sink_file(checkpoint, fs_options)  # a racing first use: the file decides
    if kept is None:
        raise ConfigError(f"{checkpoint}: the sink file vanished right after it was written")
    if kept.get("mode", "snapshots") != mode:
        return persisted_sink_id(
            checkpoint, derived, explicit, fs_options, record_table, mode, target
        )
    return kept["sink_id"]
