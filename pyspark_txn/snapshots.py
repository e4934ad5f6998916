"""Named snapshots: a sink's committed state exported as standalone Delta tables.

An export pins one committed snapshot of a ``txn-delta`` sink (by default
the latest), copies the target table *as of the Delta version that commit
made* into ``<to>/data`` (a Delta table of its own: it stays readable after
the source table is vacuumed or dropped), writes ``<to>/manifest`` (one row
per source: Spark's offsets of that batch, ids, counts, checksum), and only
then registers the name in the sink's record table. A crash before the
registration leaves no registry entry, but what it wrote stays under ``<to>``
(loose files, or committed ``data``/``manifest`` tables if it died after
committing them) with the export marker: only the registry says which exports
exist. The next export to the same place removes that copy first, when the
marker's writer is provably dead (same host, its pid gone) or with
``replace_unfinished=True``; it never removes what a live export may own.

Export-only: nothing of the running query is committed or rolled back; the
export takes its own snapshot id (never reused) from the sink's stream, so a
running query only sees one more event in its record table.

Three cuts (docs/snapshots.md): :func:`export` (the latest committed batch,
now), :func:`request_export` (the batch the sink commits next, exported
inside that commit) and :func:`stop_and_export` (a terminal snapshot: the
query is stopped and its sink settled first). :func:`prepare_query` makes a
new query start exactly at a snapshot.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
import uuid
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any
from urllib.parse import unquote

from . import admin
from .errors import ConfigError, CorruptSnapshotError, IndeterminateCommitError, TxnError
from .spark.options import check_location
from .state import SinkState, SnapshotRecord, allocate, fold_sink
from .state.core import (
    EXPORT_TOKEN_PREFIX,
    ExportRequest,
    NamedSnapshot,
    check_snapshot_name,
    delete_named,
    fail_export,
    new_token,
    register_named,
)
from .state.core import abandon as abandon_event
from .state.core import request_export as request_export_event
from .state_export import has_state
from .storage import fs as _fs
from .storage.checkpoint import SINK_FILE, latest_batch
from .storage.options import StorageOptions, current, takes_storage_options

log = logging.getLogger(__name__)

#: Written first into an export's folder: whose export it is and which process
#: writes it. A folder with this file and no registry entry is an unfinished
#: export: the next export there removes it once its writer is provably dead.
EXPORT_MARKER = ".pyspark-txn-export.json"
CHUNK_BYTES = admin.CHUNK_BYTES

Progress = Callable[[int, int], None]


def _open(location: str, sink: str | None, command: str) -> admin.SinkHandle:
    """The sink, refused by name unless it writes to a Delta table: a named snapshot is
    a copy of a Delta table's files."""
    handle = admin.open_sink(location, sink)
    handle.require_delta(command)
    return handle


def _registry(handle: admin.SinkHandle) -> Mapping[str, NamedSnapshot]:
    return handle.load().named


@takes_storage_options
def list_snapshots(
    location: str,
    sink: str | None = None,
    *,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> list[NamedSnapshot]:
    """Every named snapshot of the sink, oldest first."""
    handle = _open(location, sink, "snapshots list")
    return sorted(_registry(handle).values(), key=lambda n: n.snapshot_id)


@takes_storage_options
def list_requests(
    location: str,
    sink: str | None = None,
    *,
    command: str = "snapshots list",
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> list[ExportRequest]:
    """Every export requested for the sink's next commit and not served yet, oldest first."""
    handle = _open(location, sink, command)
    return sorted(handle.load().export_requests.values(), key=lambda r: r.requested_seq)


@takes_storage_options
def show(
    location: str,
    name: str,
    sink: str | None = None,
    *,
    command: str = "snapshots show",
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> NamedSnapshot:
    handle = _open(location, sink, command)
    state = handle.load()
    named = state.named
    if name not in named:
        if name in state.export_requests:
            request = state.export_requests[name]
            raise ConfigError(
                f"sink {handle.sink_id!r}: {name!r} is not exported yet: it is requested for "
                f"the next commit (to {request.location}); wait for it, or cancel it with "
                "cancel_request / `pyspark-txn snapshots cancel`"
            )
        raise ConfigError(
            f"sink {handle.sink_id!r} has no snapshot named {name!r}; it has: "
            f"{', '.join(sorted(named)) or 'none'}"
            + (
                f" (requested, not exported yet: {', '.join(sorted(state.export_requests))})"
                if state.export_requests
                else ""
            )
        )
    return named[name]


# --- export -------------------------------------------------------------------

#: ``state=`` of :func:`export`: whether the state of a stateful query is exported.
STATE_CHOICES = ("auto", "include", "skip")


def _read_marker(fs, root: str) -> dict[str, Any] | None:
    path = _fs.join(root, EXPORT_MARKER)
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        text = f.read()
    try:
        marker = json.loads(text)
    except ValueError:
        return {"unreadable": text[:200]}
    return marker if isinstance(marker, dict) else {"unreadable": text[:200]}


#: Tokens of the exports this process is running now (a marker with our pid and
#: a token not in here is one of ours that failed and could not clean up).
_LIVE_TOKENS: set[str] = set()


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (Linux: clock ticks since boot), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


def _owner() -> dict[str, Any]:
    """Who writes an export marker: enough to tell later whether that process is dead."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_start": _process_start(os.getpid()),
        "token": uuid.uuid4().hex,
        "at": datetime.now(timezone.utc).isoformat(),
    }


def _describe_owner(owner: Mapping[str, Any] | None) -> str:
    if not owner:
        return "an unknown process (the marker does not say who wrote it)"
    return f"pid {owner.get('pid')} on host {owner.get('host')!r}, started {owner.get('at')}"


def _owner_is_dead(owner: Mapping[str, Any] | None) -> bool:
    """True only when the marker's writer provably no longer runs: same host, and its
    pid is gone or now belongs to another process. Anything else might still be alive."""
    if not owner or owner.get("host") != socket.gethostname():
        return False
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():
        same = owner.get("process_start") == _process_start(pid)
        return not same or owner.get("token") not in _LIVE_TOKENS
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it runs, as another user
        pass
    start = owner.get("process_start")
    now = _process_start(pid)
    return start is not None and now is not None and start != now


def _inspect_location(
    fs, root: str, handle: admin.SinkHandle, uri: str, replace_unfinished: bool = False
) -> dict[str, Any] | None:
    """Check that ``root`` may take an export, writing nothing.

    New or empty: None. The partial copy of an export of this sink that never
    registered, whose writer is provably dead (or ``replace_unfinished``): its
    marker (the caller removes it). Anything else is refused.
    """
    if not fs.exists(root):
        return None
    if not fs.isdir(root):
        raise ConfigError(f"--to {uri}: is a file; choose a new or empty directory")
    entries = fs.ls(root, detail=False)
    if not entries:
        return None
    marker = _read_marker(fs, root)
    named = _registry(handle)
    if marker is None or marker.get("sink_id") != handle.sink_id:
        raise ConfigError(
            f"--to {uri}: is not empty and holds no unfinished export of sink "
            f"{handle.sink_id!r}; choose a new or empty directory"
        )
    owner = [n.name for n in named.values() if n.snapshot_id == marker.get("snapshot_id")]
    if owner:
        raise ConfigError(f"--to {uri}: holds the named snapshot {owner[0]!r}; delete it first")
    if replace_unfinished or _owner_is_dead(marker.get("owner")):
        return marker
    raise ConfigError(
        f"--to {uri}: holds an unfinished export {marker.get('name')!r} (snapshot id "
        f"{marker.get('snapshot_id')}) of sink {handle.sink_id!r} by "
        f"{_describe_owner(marker.get('owner'))}, which may still be running; it is left "
        "alone. If you know that export is dead, pass --replace-unfinished "
        "(replace_unfinished=True) to remove its partial copy and export there"
    )


def _prepare_location(
    fs, root: str, handle: admin.SinkHandle, uri: str, replace_unfinished: bool = False
) -> None:
    """``root`` must be new or empty, or a dead export's partial copy (then it is wiped)."""
    marker = _inspect_location(fs, root, handle, uri, replace_unfinished)
    if marker is not None:
        log.warning(
            "export to %s: removing the partial copy of export %r (snapshot id %s) by %s, "
            "which never finished",
            uri,
            marker.get("name"),
            marker.get("snapshot_id"),
            _describe_owner(marker.get("owner")),
        )
        _remove_export(fs, root, uri)


def _check_name_free(state: SinkState, name: str, serving: bool = False) -> None:
    check_snapshot_name(name)
    if name in state.named:
        raise ConfigError(
            f"sink {state.sink_id!r} already has a snapshot named {name!r}; delete it "
            "first or choose another name"
        )
    if name in state.export_requests and not serving:
        raise ConfigError(
            f"sink {state.sink_id!r}: an export named {name!r} is requested for the next "
            "commit; wait for it (wait_for_export), cancel it (cancel_request, `pyspark-txn "
            "snapshots cancel`) or choose another name"
        )


def _relation(a: str, b: str) -> str | None:
    """How location ``a`` relates to ``b``: "is", "is inside", "contains" or None."""
    ra, rb = _fs.location_key(a), _fs.location_key(b)
    if ra == rb:
        return "is"
    if ra.startswith(rb.rstrip("/") + "/"):
        return "is inside"
    if rb.startswith(ra.rstrip("/") + "/"):
        return "contains"
    return None


def _check_to(
    handle: admin.SinkHandle,
    to: str,
    state: SinkState | None = None,
    *,
    serving: str | None = None,
) -> str:
    """``to`` as a URI; refused when it is, is inside or contains the sink's target,
    checkpoint or record table, a registered snapshot's location or a requested
    export's (``serving``: the request being served, whose own location is fine)."""
    if handle.target_uri is None:
        raise ConfigError(f"sink {handle.sink_id!r} has no target yet: nothing to export")
    if not isinstance(to, str) or not to.strip():
        raise ConfigError("--to: must name a directory")
    check_location("--to", to)
    uri = _fs.normalize_uri(to)
    state = handle.load() if state is None else state
    places = [
        ("the sink's target", handle.target_uri),
        ("the query's checkpoint", handle.checkpoint),
        ("the sink's record table", handle.record_table),
    ]
    places += [
        (f"the location of snapshot {n.name!r}", n.location)
        for n in sorted(state.named.values(), key=lambda n: n.name)
    ]
    places += [
        (f"the location requested for export {r.name!r}", r.location)
        for r in sorted(state.export_requests.values(), key=lambda r: r.name)
        if r.name != serving
    ]
    for what, where in places:
        if where is None:
            continue
        how = _relation(uri, where)
        if how is not None:
            raise ConfigError(
                f"--to {to}: {how} {what} ({where}); an export needs a location of its own, "
                "outside and not around the sink's tables and other exports"
            )
    enclosing = _enclosing_folder(uri)
    if enclosing is not None:
        what, where = enclosing
        raise ConfigError(
            f"--to {to}: is inside {what} ({where}), whose own removal or maintenance "
            "(delete, a failed export's cleanup, VACUUM) would take this export with it; "
            "choose a location outside it"
        )
    return uri


def _enclosing_folder(uri: str) -> tuple[str, str] | None:
    """The nearest folder above ``uri`` that is an export (of any sink, finished or not),
    a Delta table or a query's checkpoint (Spark's, or one a sink of ours keeps its id
    in), as (what, where); None if there is none."""
    fs, root = _fs.filesystem(_fs.resolved(uri))
    path = root.rstrip("/")
    while True:
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        if not parent or parent == path:
            return None
        path = parent
        if fs.exists(f"{path}/{EXPORT_MARKER}"):
            return "an export folder", path
        if fs.exists(f"{path}/_delta_log"):
            return "a Delta table", path
        if fs.exists("/".join((path, *SINK_FILE))) or (
            fs.exists(f"{path}/metadata") and fs.exists(f"{path}/offsets")
        ):
            return "a query's checkpoint", path


#: What an export writes under its location; removing an export removes these alone.
_EXPORT_PARTS = ("data", "manifest", "state", EXPORT_MARKER)


def _remove_export(fs, root: str, uri: str) -> None:
    """Remove what an export wrote at ``root`` (its parts, then the folder if that left
    it empty): anything else found there is not the export's and stays, with a warning."""
    for part in _EXPORT_PARTS:
        path = _fs.join(root, part)
        if fs.exists(path):
            fs.rm(path, recursive=True)
    left = fs.ls(root, detail=False) if fs.exists(root) else []
    if left:
        log.warning("%s: left in place what the export did not write: %s", uri, sorted(left)[:10])
    elif fs.exists(root):
        fs.rm(root, recursive=True)


def _pin(state: SinkState, target, snapshot: int | None) -> tuple[SnapshotRecord, int]:
    """The committed record to export and the target version that holds its data.

    A batch that wrote no rows is a snapshot too (its offsets and operator
    state moved on): it pins the version of the newest earlier batch that
    made a commit, since the table did not change in between.
    """
    records = sorted(state.records.values(), key=lambda r: r.snapshot_id, reverse=True)
    if snapshot is not None:
        ids = [r.snapshot_id for r in records]
        if snapshot not in ids:
            raise ConfigError(
                f"sink {state.sink_id!r} has no kept record of snapshot {snapshot} (it was "
                "never recorded, was abandoned, or retention summarized it away)"
            )
        records = records[ids.index(snapshot) :]
    pinned: SnapshotRecord | None = None
    for rec in records:
        version = state.committed.get(rec.snapshot_id)
        if version is None:  # not confirmed yet: its commit stamp in the target (an empty
            # first batch's commit creates the table)
            version = target.committed_version(rec)
        if pinned is None:
            if version is None and rec.txns:  # its phase 2 has not landed (yet)
                if snapshot is not None:
                    raise ConfigError(
                        f"snapshot {snapshot} of sink {state.sink_id!r} is not committed"
                    )
                continue
            pinned = rec
        if version is not None:
            return pinned, version
    if pinned is not None:
        raise ConfigError(
            f"sink {state.sink_id!r}: batch {pinned.batch_id} (snapshot {pinned.snapshot_id}) "
            "and every kept batch before it wrote no rows: there is no table version to "
            "export yet"
        )
    raise ConfigError(f"sink {state.sink_id!r} has no committed snapshot to export yet")


def _state_session(handle: admin.SinkHandle, state: str, spark):
    """The SparkSession that reads the query's state, or None when no state is exported."""
    if state not in STATE_CHOICES:
        raise ConfigError(f"state={state!r}: choose one of {', '.join(STATE_CHOICES)}")
    if state == "skip":
        return None
    checkpoint = handle.checkpoint
    stateful = checkpoint is not None and has_state(checkpoint, handle.storage)
    if not stateful:
        if state == "include":
            raise ConfigError(
                "state=include: "
                + (
                    f"the checkpoint {checkpoint} holds no operator state"
                    if checkpoint
                    else "give the query's checkpoint location, not its record table"
                )
            )
        return None
    if spark is None:
        from pyspark.sql import SparkSession

        spark = SparkSession.getActiveSession()
    if spark is None:
        raise ConfigError(
            f"the query at {checkpoint} is stateful: exporting its state tables needs a "
            "SparkSession (pass spark=...; the CLI starts a local one), or pass state='skip' "
            "(--state skip) to export the data and manifest only"
        )
    return spark


def _partition_string(value: Any) -> str | None:
    """A typed partition value as the Delta log writes it."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S.%f")
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def _copy(src_fs, src: str, dst_fs, dst: str, advance: Callable[[int], None]) -> tuple[int, str]:
    """Copy one file; its size and the CRC32 of the bytes written."""
    from fsspec.implementations.local import LocalFileSystem

    crc = size = 0
    dst_fs.makedirs(dst.rsplit("/", 1)[0], exist_ok=True)
    if isinstance(src_fs, LocalFileSystem) and isinstance(dst_fs, LocalFileSystem):
        # the kernel copies (copy_file_range); the checksum reads the copy back
        shutil.copyfile(src, dst)
        return os.path.getsize(dst), admin.crc32_of(dst_fs, dst, advance)
    with src_fs.open(src, "rb") as fin, dst_fs.open(dst, "wb") as fout:
        while chunk := fin.read(CHUNK_BYTES):
            fout.write(chunk)
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
            advance(len(chunk))
    return size, f"crc32:{crc:08x}"


@dataclass(frozen=True)
class TableCopy:
    """What :func:`copy_table` copied: every file with its size and CRC32."""

    files: list[list[Any]]  # [path, size, "crc32:…"]
    rows: int
    bytes: int

    @property
    def checksum(self) -> str:
        return f"crc32:{zlib.crc32(json.dumps(sorted(self.files)).encode()):08x}"


def copy_table(
    source_uri: str,
    version: int | None,
    dest_uri: str,
    *,
    storage_options: Mapping[str, str] | None = None,
    name: str | None = None,
    description: str | None = None,
    progress: Progress | None = None,
    check_owner: Callable[[], None] | None = None,
) -> TableCopy:
    """Copy a Delta table as of ``version`` into a new table at ``dest_uri``: the same
    files (checked against the log's sizes), partition values and schema, with
    statistics recomputed from the footers. The new log is written after every file.

    ``check_owner`` runs before each file and before the log, and raises when the
    destination is no longer this copy's (an export replaced meanwhile stops there
    instead of overwriting its replacement's files)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from deltalake import DeltaTable
    from deltalake.transaction import AddAction, create_table_with_add_actions

    from .sinks.staging import delta_stats

    options = dict(storage_options or {}) or None
    try:
        source = DeltaTable(source_uri, version=version, storage_options=options)
    except Exception as e:
        raise CorruptSnapshotError(
            f"the table {source_uri} can no longer be read at version {version}: {e}"
        ) from e
    adds = pa.table(source.get_add_actions(flatten=False)).to_pylist()
    if any(a.get("deletionVector") or a.get("deletion_vector") for a in adds):
        raise ConfigError(
            f"{source_uri} at version {version} has deletion vectors: copying them is not "
            "supported yet"
        )
    total = sum(a["size_bytes"] for a in adds)
    advance = admin.byte_progress(total, progress)
    src_fs, src_root = _fs.filesystem(source_uri)
    fs, root = _fs.filesystem(dest_uri)
    files, actions, rows = [], [], 0
    for a in adds:
        if check_owner is not None:
            check_owner()
        rel = unquote(a["path"])
        try:
            size, crc = _copy(src_fs, _fs.join(src_root, rel), fs, _fs.join(root, rel), advance)
        except FileNotFoundError as e:
            raise CorruptSnapshotError(
                f"{source_uri} at version {version}: its file {rel} is gone (a VACUUM with a "
                "retention shorter than the snapshot's age removes the files of older "
                "versions; OPTIMIZE rewrites them first): this version can no longer be "
                "copied. Export a newer snapshot, and keep VACUUM's retention longer than "
                "the exports you may still want"
            ) from e
        if size != a["size_bytes"]:
            raise CorruptSnapshotError(
                f"{rel}: the log says {a['size_bytes']} bytes, the file has {size}"
            )
        with fs.open(_fs.join(root, rel), "rb") as f:
            footer = pq.ParquetFile(f)
            stats = delta_stats(footer.metadata, footer.schema_arrow)
            rows += footer.metadata.num_rows
        files.append([a["path"], size, crc])
        actions.append(
            AddAction(
                rel,  # delta-rs percent-encodes it into the log, as the source log has it
                size,
                {k: _partition_string(v) for k, v in (a.get("partition") or {}).items()},
                int(a["modification_time"]),
                True,
                stats,
            )
        )
    if check_owner is not None:
        check_owner()
    create_table_with_add_actions(
        dest_uri,
        source.schema(),
        actions,
        mode="error",
        partition_by=list(source.metadata().partition_columns) or None,
        name=name,
        description=description,
        storage_options=options,
    )
    return TableCopy(files, rows, total)


def _check_destination(
    handle: admin.SinkHandle, sink_state: SinkState, name: str, to: str, replace_unfinished: bool
) -> None:
    """The name is free and ``to`` is a place of its own: new, empty or a dead export's
    partial copy (writes nothing)."""
    _check_name_free(sink_state, name)
    uri = _check_to(handle, to, sink_state)
    fs, root = _fs.filesystem(uri)
    _inspect_location(fs, root, handle, uri, replace_unfinished)


@takes_storage_options
def check_export(
    location: str,
    name: str,
    to: str,
    snapshot: int | None = None,
    *,
    sink: str | None = None,
    replace_unfinished: bool = False,
    batch: int | None = None,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> tuple[SnapshotRecord, int]:
    """Every check of :func:`export` that needs no Spark and writes nothing: the name
    is free, ``to`` is a place of its own that is new, empty or a dead export's
    partial copy, and there is a committed snapshot. Returns what it pins."""
    handle = _open(location, sink, "snapshots export")
    sink_state = handle.load()
    _check_destination(handle, sink_state, name, to, replace_unfinished)
    if batch is not None:
        if snapshot is not None:
            raise ConfigError("snapshot= and batch= exclude each other: give one")
        snapshot = _snapshot_of_batch(sink_state, batch)
    return _pin(sink_state, handle.target(), snapshot)


def _snapshot_of_batch(state: SinkState, batch: int) -> int:
    """The snapshot id of the kept record of Spark's batch ``batch`` (the last, if the
    batch was recorded more than once)."""
    ids = [r.snapshot_id for r in state.records.values() if r.batch_id == batch]
    if not ids:
        kept = sorted(r.batch_id for r in state.records.values())
        raise ConfigError(
            f"sink {state.sink_id!r} has no kept record of batch {batch}"
            + (f" (kept: batches {kept[0]} to {kept[-1]})" if kept else " (no batch recorded)")
        )
    return max(ids)


@takes_storage_options
def export(
    location: str,
    name: str,
    to: str,
    snapshot: int | None = None,
    *,
    sink: str | None = None,
    progress: Progress | None = None,
    state: str = "auto",
    spark=None,
    replace_unfinished: bool = False,
    batch: int | None = None,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> NamedSnapshot:
    """Export a committed snapshot of the sink at ``location`` under ``name`` to ``to``.

    ``snapshot`` is the sink's snapshot id; ``batch`` names it by Spark's batch id
    instead (give at most one; neither: the latest committed batch).

    ``state``: ``auto`` exports the state tables of a stateful query (with
    ``spark`` or the active SparkSession), ``include`` requires them,
    ``skip`` leaves them out. ``replace_unfinished``: remove the partial copy
    of an unfinished export at ``to`` even when its writer may still run (only
    when you know it is dead; a writer provably dead on this host is removed
    without it).
    """
    handle = _open(location, sink, "snapshots export")
    if state not in STATE_CHOICES:
        raise ConfigError(f"state={state!r}: choose one of {', '.join(STATE_CHOICES)}")
    record, version = check_export(
        location, name, to, snapshot, sink=sink, replace_unfinished=replace_unfinished, batch=batch
    )
    session = _state_session(handle, state, spark)
    return _export_pinned(
        handle,
        name,
        to,
        record,
        version,
        progress=progress,
        spark=session,
        replace_unfinished=replace_unfinished,
    )


def _write_marker(fs, root: str, marker: Mapping[str, Any], uri: str) -> None:
    """Write the export marker; on a local disk only if no other export wrote one first."""
    path = _fs.join(root, EXPORT_MARKER)
    text = json.dumps(dict(marker))
    if _fs.is_local(uri):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            other = _read_marker(fs, root) or {}
            raise ConfigError(
                f"--to {uri}: another export ({other.get('name')!r} by "
                f"{_describe_owner(other.get('owner'))}) started there at the same time; "
                "choose another location"
            ) from None
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return
    with fs.open(path, "w") as f:
        f.write(text)
    if (_read_marker(fs, root) or {}).get("owner") != marker["owner"]:
        raise ConfigError(f"--to {uri}: another export started there at the same time")


def _still_ours(fs, root: str, token: str) -> bool:
    try:
        marker = _read_marker(fs, root)
    except FileNotFoundError:
        return False
    if not marker:
        return False
    return (marker.get("owner") or {}).get("token") == token


def _table_files(uri: str, options: Mapping[str, str] | None) -> list[list[Any]]:
    """Every file of the Delta table at ``uri`` with its size and CRC32."""
    import pyarrow as pa
    from deltalake import DeltaTable

    table = DeltaTable(uri, storage_options=dict(options) if options else None)
    adds = pa.table(table.get_add_actions(flatten=False))
    fs, root = _fs.filesystem(uri)
    files = []
    for path in sorted(adds.column("path").to_pylist()):
        full = _fs.join(root, unquote(path))
        files.append([path, fs.info(full)["size"], admin.crc32_of(fs, full, lambda _n: None)])
    return files


def _export_pinned(
    handle: admin.SinkHandle,
    name: str,
    to: str,
    record: SnapshotRecord,
    version: int,
    *,
    progress: Progress | None = None,
    spark=None,
    serving: bool = False,
    details: Mapping[str, Any] | None = None,
    replace_unfinished: bool = False,
) -> NamedSnapshot:
    """Export ``record`` (whose commit made target ``version``): allocate, mark, copy,
    write the manifest, register last (refused if the marker is no longer this export's,
    or the location or name was taken meanwhile)."""
    sink_state = handle.load()
    _check_name_free(sink_state, name, serving=serving)
    uri = _check_to(handle, to, sink_state, serving=name if serving else None)
    fs, root = _fs.filesystem(uri)
    _prepare_location(fs, root, handle, uri, replace_unfinished)
    existed = fs.exists(root)
    _check_writable(fs, root, uri, existed)  # before anything is allocated or written
    store = handle.record_store()
    allocated, _ = store.update(
        handle.sink_id, fold_sink, lambda s: allocate(s, EXPORT_TOKEN_PREFIX + new_token())
    )
    assert allocated is not None and allocated.snapshot_id is not None  # allocate always appends
    snapshot_id: int = allocated.snapshot_id
    fs.makedirs(root, exist_ok=True)
    owner = _owner()
    token = owner["token"]
    marker = {"sink_id": handle.sink_id, "snapshot_id": snapshot_id, "name": name, "owner": owner}
    _write_marker(fs, root, marker, uri)
    _LIVE_TOKENS.add(token)
    registering = [False]  # set once the registration may have landed
    try:
        return _copy_and_register(
            handle,
            name,
            uri,
            fs,
            root,
            token,
            record,
            version,
            snapshot_id,
            progress=progress,
            spark=spark,
            serving=serving,
            details=details,
            registering=registering,
        )
    except BaseException as e:
        determinate = isinstance(e, TxnError) and not isinstance(e, IndeterminateCommitError)
        if registering[0] and not determinate:
            # outcome unknown (a lost reply, Ctrl-C): the registry decides, never a guess
            landed = _registered_after_unknown(handle, name, uri, snapshot_id, e)
            if landed is not None:
                if isinstance(e, Exception):
                    log.warning(
                        "export %r: its registration landed although the reply was lost (%r)",
                        name,
                        e,
                    )
                    return landed
                raise  # Ctrl-C after it landed: a registered snapshot, its copy stays
            if isinstance(e, IndeterminateCommitError):
                _remove_own_copy(fs, root, token, uri, name, existed)
                _withdraw_export_id(handle, snapshot_id, name, e)
                raise TxnError(
                    f"export {name!r} to {uri}: whether its registration was written stayed "
                    f"unknown ({type(e).__name__}); the registry, read again, does not list "
                    "it: nothing was registered and the copy was removed. Export again."
                ) from e
        _remove_own_copy(fs, root, token, uri, name, existed)
        _withdraw_export_id(handle, snapshot_id, name, e)
        raise
    finally:
        _LIVE_TOKENS.discard(token)


def _withdraw_export_id(
    handle: admin.SinkHandle, snapshot_id: int, name: str, error: BaseException
) -> None:
    """Withdraw the id of an export that failed and registered nothing, so that no
    status shows it as open; a failure to do so is logged (status then shows it as a
    failed or killed export's id, with its remedy), never raised over ``error``."""
    reason = f"export {name!r} failed: {type(error).__name__}: {error}"[:500]
    try:
        handle.record_store().update(
            handle.sink_id, fold_sink, lambda s: abandon_event(s, snapshot_id, reason)
        )
    except Exception as e:  # noqa: BLE001 - the export's own error is the one to report
        log.error("export %r: could not withdraw its snapshot id %d: %r", name, snapshot_id, e)


def _registered_after_unknown(
    handle: admin.SinkHandle, name: str, uri: str, snapshot_id: int, error: BaseException
) -> NamedSnapshot | None:
    """After a registration of unknown outcome: this export's entry if it landed, None if
    the registry (read again) does not hold it. Raises when the registry stays unreadable:
    the copy is then kept, since it may be a registered snapshot's data."""
    last: Exception | None = None
    for attempt in range(4):
        if attempt:
            time.sleep(0.1 * 2**attempt)
        try:
            entry = handle.load().named.get(name)
        except Exception as reread:  # noqa: BLE001 - retried, then reported
            last = reread
            continue
        return entry if entry is not None and entry.snapshot_id == snapshot_id else None
    log.error("export %r: the registry could not be read again: %r", name, last)
    raise IndeterminateCommitError(
        f"export {name!r} to {uri}: whether its registration landed is unknown ({error!r}), "
        f"and the record table could not be read again ({last!r}). The copy is kept: "
        f"`pyspark-txn snapshots list` shows whether {name!r} exists; if it does not, "
        "export again with --replace-unfinished."
    ) from error


def _remove_own_copy(fs, root: str, token: str, uri: str, name: str, existed: bool) -> None:
    if _still_ours(fs, root, token):  # our own partial copy: nobody else needs it
        log.warning("export %r to %s failed: removing its partial copy", name, uri)
        try:
            _remove_export(fs, root, uri)
            if existed:
                fs.makedirs(root, exist_ok=True)
        except Exception as e:  # noqa: BLE001 - the marker says what is left
            log.error("could not remove the partial copy at %s: %r", uri, e)


def _check_writable(fs, root: str, uri: str, existed: bool) -> None:
    """``--to`` can be made and written (a read-only filesystem, /proc, a file on the way,
    no permission): a ConfigError naming it, instead of an OSError half way."""
    probe = _fs.join(root, f".pyspark-txn-probe-{uuid.uuid4().hex[:8]}")
    try:
        fs.makedirs(root, exist_ok=True)
        with fs.open(probe, "wb") as f:
            f.write(b"")
        fs.rm(probe)
    except OSError as e:
        if not existed:
            try:
                fs.rmdir(root)
            except OSError:
                pass
        raise ConfigError(
            f"--to={uri!r}: cannot create or write a folder there ({type(e).__name__}: {e}); "
            "give a writable location"
        ) from e


def _copy_and_register(
    handle: admin.SinkHandle,
    name: str,
    uri: str,
    fs,
    root: str,
    token: str,
    record: SnapshotRecord,
    version: int,
    snapshot_id: int,
    *,
    progress: Progress | None,
    spark,
    serving: bool,
    details: Mapping[str, Any] | None,
    registering: list[bool],
) -> NamedSnapshot:
    import pyarrow as pa
    from deltalake import write_deltalake

    store = handle.record_store()
    options = dict(handle.storage_options) or None
    assert handle.target_uri is not None  # _check_to

    def check_owner() -> None:
        if not _still_ours(fs, root, token):
            raise TxnError(
                f"export {name!r} to {uri}: its export marker was replaced by another "
                "export (--replace-unfinished?) while it copied; it stopped, and the data "
                "there is left to that export"
            )

    copied = copy_table(
        handle.target_uri,
        version,
        _fs.join(uri, "data"),
        storage_options=options,
        name=name,
        description=f"pyspark-txn named snapshot {name!r} of sink {handle.sink_id}, "
        f"batch {record.batch_id} (table version {version})",
        progress=progress,
        check_owner=check_owner,
    )
    state_tables: list[Any] = []
    if spark is not None and handle.checkpoint is not None:
        from . import state_export

        state_tables = state_export.export_state(
            spark, handle.checkpoint, record.batch_id, uri, storage_options=options
        )
    # each state file's size and CRC32, checked by verify like the data files
    state_json = [
        {**t.to_json(), "files": _table_files(_fs.join(uri, t.path), options)} for t in state_tables
    ]
    created = datetime.now(timezone.utc)
    offsets = list(record.source_offsets) or [None]
    n = len(offsets)
    manifest = pa.table(
        {
            "source_index": list(range(n)),
            "source_offset": [json.dumps(o, sort_keys=True) for o in offsets],
            "name": [name] * n,
            "snapshot_id": [snapshot_id] * n,
            "of_snapshot_id": [record.snapshot_id] * n,
            "batch_id": [record.batch_id] * n,
            "sink_id": [handle.sink_id] * n,
            "query_id": [record.query_id] * n,
            "table_version": [version] * n,
            "rows": [copied.rows] * n,
            "files": [len(copied.files)] * n,
            "bytes": [copied.bytes] * n,
            "data_checksum": [copied.checksum] * n,
            "state_tables": [json.dumps(state_json)] * n,
            "created_at": pa.array([created] * n, pa.timestamp("us", tz="UTC")),
        }
    )
    write_deltalake(_fs.join(uri, "manifest"), manifest, mode="error", storage_options=options)
    entry = NamedSnapshot(
        name=name,
        snapshot_id=snapshot_id,
        of_snapshot_id=record.snapshot_id,
        batch_id=record.batch_id,
        location=uri,
        target_version=version,
        details={
            "rows": copied.rows,
            "bytes": copied.bytes,
            "files": copied.files,
            "data_checksum": copied.checksum,
            "source_offsets": list(record.source_offsets),
            "query_id": record.query_id,
            "target_uri": handle.target_uri,
            "checkpoint": handle.checkpoint,
            "stateful": handle.checkpoint is not None
            and has_state(handle.checkpoint, handle.storage),
            "state_tables": state_json,
            **(details or {}),
        },
    )

    def register(s: SinkState):
        check_owner()
        if serving and name not in s.export_requests:
            raise ExportCancelled(f"the requested export {name!r} was cancelled while it ran")
        for other in s.named.values():
            how = _relation(uri, other.location)
            if how is not None:
                raise TxnError(
                    f"export {name!r}: {uri} {how} the location of snapshot {other.name!r} "
                    f"({other.location}), registered while this export copied; not registered"
                )
        return register_named(s, entry)

    registering[0] = True
    _, after = store.update(handle.sink_id, fold_sink, register)
    log.info(
        "sink %s: exported snapshot %r (batch %d, table version %d): %d rows, %d files, "
        "%d bytes, %d state tables to %s",
        handle.sink_id,
        name,
        record.batch_id,
        version,
        copied.rows,
        len(copied.files),
        copied.bytes,
        len(state_tables),
        uri,
    )
    return after.named[name]


# --- at the next commit, and terminal -----------------------------------------------


@takes_storage_options
def request_export(
    location: str,
    name: str,
    to: str,
    *,
    sink: str | None = None,
    state: str = "auto",
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> ExportRequest:
    """Ask the running query's sink to export the batch it commits next.

    The sink exports right after that batch's phase 2, inside its commit, so
    the cut is exactly that batch. It runs where Spark commits (a Python
    worker without a SparkSession), so it cannot read state tables: for a
    stateful query pass ``state="skip"`` or use :func:`stop_and_export`.
    """
    if state not in STATE_CHOICES:
        raise ConfigError(f"state={state!r}: choose one of {', '.join(STATE_CHOICES)}")
    handle = _open(location, sink, "snapshots export --at-next-commit")
    sink_state = handle.load()
    _check_name_free(sink_state, name)
    uri = _check_to(handle, to, sink_state)
    fs, root = _fs.filesystem(uri)
    if _inspect_location(fs, root, handle, uri) is not None:
        raise ConfigError(
            f"--to {uri}: holds the partial copy of an export that never finished; a "
            "requested export does not remove it: export there now (it is removed first) "
            "or choose another location"
        )
    checkpoint = handle.checkpoint
    if state != "skip" and checkpoint is not None and has_state(checkpoint, handle.storage):
        raise ConfigError(
            f"the query at {checkpoint} is stateful and a requested export runs inside the "
            "sink, where no SparkSession can read its state: use stop_and_export (or export "
            "from a driver), or pass state='skip' (--state skip) to export data and manifest"
        )
    if state == "include":
        raise ConfigError("state=include: a requested export cannot read state tables")

    def requested(s: SinkState):
        _check_to(handle, uri, s)  # nobody took the place since
        return request_export_event(s, name, uri)

    _, after = handle.record_store().update(handle.sink_id, fold_sink, requested, sink_state)
    log.info("sink %s: export %r to %s requested for the next commit", handle.sink_id, name, uri)
    return after.export_requests[name]


@takes_storage_options
def cancel_request(
    location: str,
    name: str,
    *,
    sink: str | None = None,
    reason: str | None = None,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> ExportRequest:
    """Withdraw a pending :func:`request_export` (an ``export_failed`` event saying it was
    cancelled, written safely). Refused once the export ran: delete the snapshot then."""
    handle = _open(location, sink, "snapshots cancel")
    text = "cancelled" + (f": {reason}" if reason else " by cancel_request")
    taken: list[ExportRequest] = []

    def cancel(s: SinkState):
        if name in s.named:
            raise ConfigError(
                f"sink {s.sink_id!r}: export {name!r} already ran (it is snapshot "
                f"{s.named[name].snapshot_id}); delete it instead"
            )
        if name not in s.export_requests:
            raise ConfigError(
                f"sink {s.sink_id!r} has no export {name!r} requested; requested: "
                f"{', '.join(sorted(s.export_requests)) or 'none'}"
            )
        taken[:] = [s.export_requests[name]]
        return fail_export(s, name, text)

    handle.record_store().update(handle.sink_id, fold_sink, cancel)
    log.info("sink %s: requested export %r cancelled", handle.sink_id, name)
    return taken[0]


class ExportCancelled(TxnError):
    """A requested export was cancelled while the sink was running it."""


def serve_export_requests(
    handle: admin.SinkHandle, state: SinkState, record: SnapshotRecord, version: int | None
) -> None:
    """Run by the sink after a batch's phase 2: export it for every pending request.
    A failure is recorded (``export_failed``) and never fails the batch."""
    pinned: tuple[SnapshotRecord, int] | None = (record, version) if version is not None else None
    for request in sorted(state.export_requests.values(), key=lambda r: r.requested_seq):
        try:
            if pinned is None:  # an empty batch made no Delta commit: the last one that did
                pinned = _pin(handle.load(), handle.target(), record.snapshot_id)
            _export_pinned(
                handle,
                request.name,
                request.location,
                *pinned,
                serving=True,
                details={"requested_seq": request.requested_seq},
            )
        except ExportCancelled as e:  # the user's cancel: nothing failed
            log.info("sink %s: %s", handle.sink_id, e)
        except Exception as e:
            log.error("sink %s: requested export %r failed: %r", handle.sink_id, request.name, e)

            def failed(s: SinkState, name: str = request.name, error: str = repr(e)):
                return fail_export(s, name, error)

            handle.record_store().update(handle.sink_id, fold_sink, failed)


@takes_storage_options
def wait_for_export(
    location: str,
    name: str,
    *,
    sink: str | None = None,
    timeout: float | None = None,
    query=None,
    poll_s: float = 0.5,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> NamedSnapshot:
    """Wait until a requested export is registered; raise if it failed, the query
    stopped first, or ``timeout`` seconds passed."""
    handle = _open(location, sink, "snapshots export --wait")
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        state = handle.load()
        if name in state.named:
            return state.named[name]
        if name in state.export_failures:
            failure = state.export_failures[name]
            if failure.startswith("cancelled"):
                raise TxnError(f"the requested export {name!r} was {failure}")
            raise TxnError(f"the requested export {name!r} failed: {failure}")
        if name not in state.export_requests:
            raise ConfigError(f"sink {handle.sink_id!r} has no export {name!r} requested")
        if query is not None and not query.isActive:
            raise TxnError(
                f"the query stopped before it committed another batch; export {name!r} is "
                "still requested and runs at the query's next commit"
            )
        if deadline is not None and time.monotonic() > deadline:
            raise TxnError(
                f"export {name!r} was not taken within {timeout} s: the sink exports at its "
                "next commit, and no batch committed since the request. It is still "
                "requested; cancel it with cancel_request (`pyspark-txn snapshots cancel`)"
            )
        time.sleep(poll_s)


def query_checkpoint(query) -> str:
    """The checkpoint location of a running ``StreamingQuery`` (classic PySpark)."""
    try:
        return str(query._jsq.streamingQuery().resolvedCheckpointRoot())
    except Exception as e:
        raise ConfigError(
            "cannot read the query's checkpoint location (Spark Connect?): pass checkpoint="
        ) from e


@takes_storage_options
def stop_and_export(
    query,
    name: str,
    to: str,
    *,
    checkpoint: str | None = None,
    sink: str | None = None,
    state: str = "auto",
    spark=None,
    progress: Progress | None = None,
    replace_unfinished: bool = False,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> NamedSnapshot:
    """A terminal snapshot: stop ``query``, settle its sink, export its last committed batch.

    Spark interrupts the batch in flight; settling takes the sink's epoch (the
    stopped run can never record again), finishes phase 2 of a safe record and
    deletes what unrecorded attempts staged. The export is then the query's
    last batch; restarted from its checkpoint, the query continues after it.
    """
    location = checkpoint or query_checkpoint(query)
    handle = _open(location, sink, "stop_and_export")
    _check_destination(handle, handle.load(), name, to, replace_unfinished)
    session = _state_session(handle, state, spark)
    query.stop()
    admin.settle(location, sink, reason=f"stop_and_export {name!r}")
    sink_state = handle.load()
    newest = _spark_committed(handle, sink_state, session)
    record, version = _pin(sink_state, handle.target(), newest)
    return _export_pinned(
        handle,
        name,
        to,
        record,
        version,
        progress=progress,
        spark=session,
        details={"terminal": True},
        replace_unfinished=replace_unfinished,
    )


def _spark_committed(handle: admin.SinkHandle, state: SinkState, session) -> int | None:
    """With state tables: the snapshot id of the newest record in Spark's commit log.

    Spark's state reader reads committed batches only, and a stop can fall between
    the sink's commit of a batch and Spark's commit-log entry for it: the cut is then
    the batch before (Spark replays the newer one, a no-op for the sink, at restart).
    None (the sink's newest committed record) without state.
    """
    if session is None or handle.checkpoint is None:
        return None
    done = latest_batch(handle.checkpoint, "commits", handle.storage)
    kept = [r for r in state.records.values() if done is not None and r.batch_id <= done]
    return max(kept, key=lambda r: r.snapshot_id).snapshot_id if kept else None


# --- verify and delete -----------------------------------------------------------


@dataclass(frozen=True)
class ExportCheck:
    """``verify``'s answer: every mismatch between an export and its registry entry."""

    name: str
    location: str
    rows: int | None
    files: int
    problems: tuple[str, ...] = field(default_factory=tuple)
    readable: bool = True  # False: the data table could not be read at all

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "location": self.location,
            "ok": self.ok,
            "readable": self.readable,
            "rows": self.rows if self.readable else "unreadable",
            "files": self.files if self.readable else "unreadable",
            "problems": list(self.problems),
        }


@takes_storage_options
def verify(
    location: str,
    name: str,
    sink: str | None = None,
    progress: Progress | None = None,
    *,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> ExportCheck:
    """Re-read the export and compare it with the registry entry: the data table's
    files with the same sizes and CRC32s and the same row count in their footers,
    every row of the manifest table, and each state table's files (sizes and CRC32s;
    entries written before those were recorded: the row count)."""
    import pyarrow.parquet as pq
    from deltalake import DeltaTable

    sink_id = _open(location, sink, "snapshots verify").sink_id
    entry = show(location, name, sink, command="snapshots verify")
    expected = {path: (size, crc) for path, size, crc in entry.details.get("files", [])}
    data_uri = _fs.join(entry.location, "data")
    problems: list[str] = []
    try:
        import pyarrow as pa

        adds = pa.table(
            DeltaTable(data_uri, storage_options=current().for_delta()).get_add_actions(
                flatten=False
            )
        ).to_pylist()
    except Exception as e:
        problems = [f"{data_uri}: unreadable: {e}"]
        problems += _check_manifest(entry, sink_id)
        problems += _check_state_tables(entry)
        return ExportCheck(name, entry.location, None, 0, tuple(problems), readable=False)
    listed = {a["path"] for a in adds}
    for path in sorted(set(expected) - listed):
        problems.append(f"{path}: missing from the exported table's log")
    for path in sorted(listed - set(expected)):
        problems.append(f"{path}: in the exported table but not in the snapshot")
    fs, root = _fs.filesystem(_fs.join(entry.location, "data"))
    advance = admin.byte_progress(sum(size for size, _ in expected.values()), progress)
    rows = 0

    for path in sorted(set(expected) & listed):
        size, crc = expected[path]
        full = _fs.join(root, unquote(path))
        try:
            got_size = fs.info(full)["size"]
        except FileNotFoundError:
            problems.append(f"{path}: file is missing")
            advance(size)
            continue
        if got_size != size:
            problems.append(f"{path}: {got_size} bytes, the snapshot says {size}")
            advance(size)
            continue
        got = admin.crc32_of(fs, full, advance)
        if got != crc:
            problems.append(f"{path}: CRC32 {got}, the snapshot says {crc}")
            continue
        with fs.open(full, "rb") as f:
            rows += pq.ParquetFile(f).metadata.num_rows
    if not problems and rows != entry.details.get("rows"):
        problems.append(f"{rows} rows in the files, the snapshot says {entry.details.get('rows')}")
    problems.extend(_check_manifest(entry, sink_id))
    problems.extend(_check_state_tables(entry))
    return ExportCheck(name, entry.location, rows, len(listed), tuple(problems))


def _check_manifest(entry: NamedSnapshot, sink_id: str) -> list[str]:
    """Every row of ``<to>/manifest`` says what the registry entry says."""
    from deltalake import DeltaTable

    uri = _fs.join(entry.location, "manifest")
    try:
        rows = DeltaTable(uri, storage_options=current().for_delta()).to_pyarrow_table().to_pylist()
    except Exception as e:
        return [f"{uri}: unreadable manifest: {e}"]
    d = entry.details
    offsets = list(d.get("source_offsets") or []) or [None]
    problems = []
    if len(rows) != len(offsets):
        problems.append(
            f"manifest: {len(rows)} rows, the snapshot has {len(offsets)} source(s) (one row each)"
        )
    state_tables = list(d.get("state_tables") or [])
    expected_all = {
        "name": entry.name,
        "snapshot_id": entry.snapshot_id,
        "of_snapshot_id": entry.of_snapshot_id,
        "batch_id": entry.batch_id,
        "sink_id": sink_id,
        "query_id": d.get("query_id"),
        "table_version": entry.target_version,
        "rows": d.get("rows"),
        "files": len(d.get("files") or []),
        "bytes": d.get("bytes"),
        "data_checksum": d.get("data_checksum"),
    }
    for row in sorted(rows, key=lambda r: (r.get("source_index") is None, r.get("source_index"))):
        i = row.get("source_index")
        where = f"manifest row of source {i}"
        if not isinstance(i, int) or not 0 <= i < len(offsets):
            problems.append(f"manifest: a row names source {i!r}, the snapshot has {len(offsets)}")
            continue
        expected = {
            **expected_all,
            "source_offset": json.dumps(offsets[i], sort_keys=True),
        }
        for key, want in expected.items():
            if row.get(key) != want:
                problems.append(f"{where}: {key} is {row.get(key)!r}, the snapshot says {want!r}")
        try:
            got_state = json.loads(row.get("state_tables") or "[]")
        except ValueError:
            got_state = row.get("state_tables")
        if got_state != state_tables:
            problems.append(f"{where}: state_tables differ from the snapshot's")
    return problems


def _check_files(uri: str, label: str, files: list[list[Any]]) -> list[str]:
    """The table at ``uri`` lists exactly ``files``, each with its recorded size and CRC32."""
    import pyarrow as pa
    from deltalake import DeltaTable

    try:
        listed = set(
            pa.table(
                DeltaTable(uri, storage_options=current().for_delta()).get_add_actions(
                    flatten=False
                )
            ).column("path")
        )
        listed = {str(p) for p in listed}
    except Exception as e:
        return [f"{label}: unreadable table: {e}"]
    fs, root = _fs.filesystem(uri)
    expected = {path: (size, crc) for path, size, crc in files}
    problems = [
        f"{label}/{p}: missing from the table's log" for p in sorted(set(expected) - listed)
    ]
    problems += [
        f"{label}/{p}: in the table but not in the snapshot" for p in sorted(listed - set(expected))
    ]
    for path in sorted(set(expected) & listed):
        size, crc = expected[path]
        full = _fs.join(root, unquote(path))
        try:
            got_size = fs.info(full)["size"]
        except FileNotFoundError:
            problems.append(f"{label}/{path}: file is missing")
            continue
        if got_size != size:
            problems.append(f"{label}/{path}: {got_size} bytes, the snapshot says {size}")
            continue
        got = admin.crc32_of(fs, full, lambda _n: None)
        if got != crc:
            problems.append(f"{label}/{path}: CRC32 {got}, the snapshot says {crc}")
    return problems


def _check_state_tables(entry: NamedSnapshot) -> list[str]:
    """Each exported state table still reads, with the row count recorded at export."""
    from deltalake import DeltaTable

    problems = []
    for table in entry.details.get("state_tables", []):
        uri = _fs.join(entry.location, table["path"])
        if table.get("files") is not None:
            problems.extend(_check_files(uri, table["path"], table["files"]))
        try:  # counting reads every file's footer: a missing or truncated file fails here
            rows = (
                DeltaTable(uri, storage_options=current().for_delta())
                .to_pyarrow_dataset()
                .count_rows()
            )
        except Exception as e:
            problems.append(f"{table['path']}: unreadable state table: {e}")
            continue
        if rows != table["rows"]:
            problems.append(f"{table['path']}: {rows} rows, the snapshot says {table['rows']}")
    return problems


@takes_storage_options
def delete(
    location: str,
    name: str,
    sink: str | None = None,
    *,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> NamedSnapshot:
    """Unregister ``name`` (a safe event), then remove its export folder."""
    handle = _open(location, sink, "snapshots delete")
    entry = show(location, name, sink)

    def deleted(s: SinkState):
        # an older entry may sit inside this one's folder (registered before the checks)
        for other in s.named.values():
            if other.name != name and _relation(other.location, entry.location) in (
                "is",
                "is inside",
            ):
                raise ConfigError(
                    f"snapshot {name!r}: its folder {entry.location} holds the location of "
                    f"snapshot {other.name!r} ({other.location}); delete {other.name!r} "
                    "first (nothing was deleted)"
                )
        return delete_named(s, name)

    handle.record_store().update(handle.sink_id, fold_sink, deleted)
    location = entry.location
    if _fs.is_local(location) and os.path.islink(location):  # the copy, not only the link
        location = os.path.realpath(location)
        os.unlink(entry.location)
    fs, root = _fs.filesystem(location)
    marker = _read_marker(fs, root) if fs.exists(root) else None
    if marker is not None and marker.get("snapshot_id") == entry.snapshot_id:
        _remove_export(fs, root, location)
    elif fs.exists(root):
        raise TxnError(
            f"snapshot {name!r} is unregistered, but {entry.location} does not carry its "
            "export marker any more; it was left in place: remove it yourself"
        )
    return replace(entry)


# --- start a new query from a snapshot ----------------------------------------------


@dataclass(frozen=True)
class PreparedQuery:
    """What :func:`prepare_query` made: start a query with these and it resumes there."""

    checkpoint: str
    path: str
    batch_id: int  # the snapshot's batch: the new query runs batch_id + 1 next
    source_offsets: tuple[Any, ...]
    rows: int


@takes_storage_options
def source_offsets(
    location: str,
    name: str,
    sink: str | None = None,
    *,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> list[str | None]:
    """Spark's offset of every source of the snapshot's batch, as JSON (None: no offset).

    For Kafka the string is the source's ``startingOffsets`` JSON; for ``rate`` or
    file sources it is what their offset log holds (not enough to resume them:
    they keep more under the checkpoint's ``sources/``).
    """
    entry = show(location, name, sink, command="snapshots offsets")
    return [
        None if o is None else (o if isinstance(o, str) else json.dumps(o, sort_keys=True))
        for o in entry.details.get("source_offsets") or []
    ]


@takes_storage_options
def kafka_starting_offsets(
    location: str,
    name: str,
    source: int = 0,
    sink: str | None = None,
    *,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
):
    """The ``startingOffsets`` option that makes a Kafka source begin right after the
    snapshot's batch: ``{"topic": {"partition": offset}}``, as Spark logged it."""
    offsets = source_offsets(location, name, sink)
    if not 0 <= source < len(offsets):
        raise ConfigError(
            f"source={source}: snapshot {name!r} has {len(offsets)} source(s), numbered from 0"
        )
    raw = offsets[source]
    parsed = json.loads(raw) if raw else None
    if not (
        isinstance(parsed, dict)
        and parsed
        and all(
            isinstance(parts, dict) and all(isinstance(v, int) for v in parts.values())
            for parts in parsed.values()
        )
    ):
        raise ConfigError(
            f"source {source} of snapshot {name!r} is not a Kafka source: its offset is {raw}"
        )
    return raw


def _write_text(fs, path: str, text: str) -> None:
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "w") as f:
        f.write(text)


def _new_location(fs, root: str, option: str, uri: str) -> None:
    if _fs.is_local(uri) and os.path.islink(uri) and not os.path.exists(uri):
        raise ConfigError(
            f"{option} {uri}: is a symbolic link to {os.readlink(uri)!r}, which does not "
            "exist; give a new or empty directory"
        )
    if fs.exists(root) and (not fs.isdir(root) or fs.ls(root, detail=False)):
        raise ConfigError(f"{option} {uri}: must be a new or empty directory")


def _offset_dict(offset: Any) -> dict | None:
    if isinstance(offset, str):
        try:
            offset = json.loads(offset)
        except ValueError:
            return None
    return offset if isinstance(offset, dict) else None


def _is_file_source_offset(offset: Any) -> bool:
    """Spark's file source writes ``{"logOffset": n}``: an index into its own log."""
    d = _offset_dict(offset)
    return d is not None and set(d) == {"logOffset"}


def _claim_log_source(offset: Any) -> str | None:
    """The claim log source id of an acknowledging source's offset (``txn-redis``:
    ``{"claim": n, "source": "redis:<group>:<streams>"}``), else None."""
    d = _offset_dict(offset)
    if d is None or set(d) != {"claim", "source"}:
        return None
    return str(d["source"])


@takes_storage_options
def prepare_query(
    location: str,
    name: str,
    checkpoint: str,
    path: str,
    *,
    sink: str | None = None,
    progress: Progress | None = None,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> PreparedQuery:
    """Make a new query start exactly at a named snapshot.

    Copies the exported data into a new table at ``path`` and writes a Spark
    checkpoint at ``checkpoint`` whose last committed batch is the snapshot's,
    with its offsets: a query with the same sources, started with this
    checkpoint and a ``txn-delta`` sink on ``path``, reads on from there and
    continues the table. Only for sources whose offset alone is their position
    (this package's sources, Kafka), not ``rate`` or the file source, which
    keep more under the checkpoint's ``sources/`` (not exported), nor acknowledging
    sources (``txn-redis``), whose offset is a position in a claim log that is not
    exported: both are refused before anything is written. Stateful queries are
    refused: Spark cannot load state from the exported tables.
    """
    entry = show(location, name, sink, command="snapshots prepare-query")
    if entry.details.get("stateful") or entry.details.get("state_tables"):
        raise ConfigError(
            f"snapshot {name!r} is of a stateful query: its exported state tables can be read "
            "but Spark cannot start a query from them"
        )
    for i, offset in enumerate(entry.details.get("source_offsets") or []):
        if _is_file_source_offset(offset):
            raise ConfigError(
                f"source {i} of snapshot {name!r} is Spark's file source (offset {offset}): its "
                f"position is the file log under the checkpoint's sources/{i}/, which is not "
                "exported, so a new query cannot start from this snapshot (read the exported "
                "table instead, or use a source whose offset is its position: Kafka, "
                "txn-delta, txn-sequence)"
            )
        claims = _claim_log_source(offset)
        if claims is not None:
            raise ConfigError(
                f"source {i} of snapshot {name!r} is an acknowledging source ({claims}, e.g. "
                f"txn-redis; offset {offset}): its offset is a claim number in the claim log "
                "under the original query's checkpoint (or its claimLog), which is not "
                "exported, and the broker acknowledges messages once their batch commits, so "
                "a new query cannot start from this snapshot. Restart the original query "
                "from its checkpoint, or start a new one with its own group and startId"
            )
    from .sinks.delta import DeltaSinkOptions

    # the sink's own check of the pair (same folder, checkpoint inside the table, ...):
    # a prepared query it would refuse is refused before anything is written
    try:
        DeltaSinkOptions.parse({"path": path, "checkpointLocation": checkpoint})
    except ConfigError as e:
        raise ConfigError(
            f"checkpoint {checkpoint} and path {path}: the txn-delta sink refuses this pair, "
            f"so the prepared query could not start: {e}"
        ) from e
    chk_uri, path_uri = _fs.normalize_uri(checkpoint), _fs.normalize_uri(path)
    chk_fs, chk_root = _fs.filesystem(chk_uri)
    path_fs, path_root = _fs.filesystem(path_uri)
    _new_location(chk_fs, chk_root, "checkpoint", chk_uri)
    _new_location(path_fs, path_root, "path", path_uri)
    check = verify(location, name, sink)
    if not check.ok:
        raise CorruptSnapshotError(
            f"snapshot {name!r} does not verify: " + "; ".join(check.problems[:5])
        )
    copied = copy_table(
        _fs.join(entry.location, "data"),
        None,
        path_uri,
        name=None,
        description=f"started from pyspark-txn snapshot {name!r} (batch {entry.batch_id})",
        progress=progress,
    )
    batch = entry.batch_id
    offsets = entry.details.get("source_offsets") or []
    lines = [
        "v1",
        json.dumps({"batchWatermarkMs": 0, "batchTimestampMs": int(time.time() * 1000)}),
        *("-" if o is None else (o if isinstance(o, str) else json.dumps(o)) for o in offsets),
    ]
    # The lineage first, Spark's logs last: a half-written checkpoint has no commit.
    _write_text(
        chk_fs,
        _fs.join(chk_root, "pyspark_txn", "started_from.json"),
        json.dumps({**entry.to_json(), "details": None, "from": location}, default=str),
    )
    _write_text(chk_fs, _fs.join(chk_root, "metadata"), json.dumps({"id": str(uuid.uuid4())}))
    if batch > 0:  # Spark reads the batch before the last too (it takes the last's over)
        _write_text(chk_fs, _fs.join(chk_root, "offsets", str(batch - 1)), "\n".join(lines))
    _write_text(chk_fs, _fs.join(chk_root, "offsets", str(batch)), "\n".join(lines))
    _write_text(
        chk_fs,
        _fs.join(chk_root, "commits", str(batch)),
        "v1\n" + json.dumps({"nextBatchWatermarkMs": 0}),
    )
    log.info(
        "prepared a query from snapshot %r: checkpoint %s (next batch %d), table %s (%d rows)",
        name,
        chk_uri,
        batch + 1,
        path_uri,
        copied.rows,
    )
    return PreparedQuery(chk_uri, path_uri, batch, tuple(offsets), copied.rows)
