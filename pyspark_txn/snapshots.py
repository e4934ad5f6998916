"""Named snapshots: a sink's committed state exported as standalone Delta tables.

An export pins one committed snapshot of a ``txn-delta`` sink (by default
the latest), copies the target table *as of the Delta version that commit
made* into ``<to>/data`` (a Delta table of its own: it stays readable after
the source table is vacuumed or dropped), writes ``<to>/manifest`` (one row
per source: Spark's offsets of that batch, ids, counts, checksum), and only
then registers the name in the sink's record table. A crash before the
registration leaves no registry entry and no Delta table under ``<to>``
(tables are committed after their files are copied); the next export to the
same place removes the partial copy first.

Export-only: nothing of the running query is committed or rolled back; the
export takes its own snapshot id (never reused) from the sink's stream, so a
running query only sees one more event in its record table.

Not yet: ``state/`` tables of stateful queries, an export requested from a
running query at its next batch boundary, ``stop_and_export`` and starting a
query from a snapshot (issue 11, docs/snapshots.md).
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any
from urllib.parse import unquote

from . import _fs, admin
from .errors import ConfigError, CorruptSnapshotError, TxnError
from .state import allocate, fold_sink
from .state.core import NamedSnapshot, check_snapshot_name, delete_named, register_named

log = logging.getLogger(__name__)

#: Written first into an export's folder: whose export it is. A folder with
#: this file and no registry entry is a crashed export, removed by the next one.
EXPORT_MARKER = ".pyspark-txn-export.json"
CHUNK_BYTES = admin.CHUNK_BYTES

Progress = Callable[[int, int], None]


def _registry(handle: admin.SinkHandle) -> Mapping[str, NamedSnapshot]:
    return handle.load().named


def list_snapshots(location: str, sink: str | None = None) -> list[NamedSnapshot]:
    """Every named snapshot of the sink, oldest first."""
    handle = admin.open_sink(location, sink)
    return sorted(_registry(handle).values(), key=lambda n: n.snapshot_id)


def show(location: str, name: str, sink: str | None = None) -> NamedSnapshot:
    handle = admin.open_sink(location, sink)
    named = _registry(handle)
    if name not in named:
        raise ConfigError(
            f"sink {handle.sink_id!r} has no snapshot named {name!r}; it has: "
            f"{', '.join(sorted(named)) or 'none'}"
        )
    return named[name]


# --- export -------------------------------------------------------------------


def _read_marker(fs, root: str) -> dict[str, Any] | None:
    path = _fs.join(root, EXPORT_MARKER)
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        return json.loads(f.read())


def _prepare_location(fs, root: str, handle: admin.SinkHandle, uri: str) -> None:
    """``root`` must be new or empty, or a crashed export of this sink (then it is wiped)."""
    if not fs.exists(root):
        return
    if not fs.isdir(root):
        raise ConfigError(f"--to {uri}: is a file; choose a new or empty directory")
    entries = fs.ls(root, detail=False)
    if not entries:
        return
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
    log.warning("export to %s: removing the partial copy of an export that never finished", uri)
    fs.rm(root, recursive=True)


def _pin(handle: admin.SinkHandle, snapshot: int | None):
    """The committed record to export and the target version its commit made."""
    state = handle.load()
    target = handle.target()
    records = sorted(state.records.values(), key=lambda r: r.snapshot_id, reverse=True)
    if snapshot is not None:
        records = [r for r in records if r.snapshot_id == snapshot]
        if not records:
            raise ConfigError(
                f"sink {handle.sink_id!r} has no kept record of snapshot {snapshot} (it was "
                "never recorded, was abandoned, or retention summarized it away)"
            )
    for rec in records:
        version = state.committed.get(rec.snapshot_id)
        if version is None:
            version = target.committed_version(rec)
        if version is not None:
            return rec, version
        if snapshot is not None:
            raise ConfigError(f"snapshot {snapshot} of sink {handle.sink_id!r} is not committed")
    raise ConfigError(f"sink {handle.sink_id!r} has no committed snapshot to export yet")


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
    crc = size = 0
    dst_fs.makedirs(dst.rsplit("/", 1)[0], exist_ok=True)
    with src_fs.open(src, "rb") as fin, dst_fs.open(dst, "wb") as fout:
        while chunk := fin.read(CHUNK_BYTES):
            fout.write(chunk)
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
            advance(len(chunk))
    return size, f"crc32:{crc:08x}"


def export(
    location: str,
    name: str,
    to: str,
    snapshot: int | None = None,
    *,
    sink: str | None = None,
    progress: Progress | None = None,
) -> NamedSnapshot:
    """Export a committed snapshot of the sink at ``location`` under ``name`` to ``to``."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from deltalake import DeltaTable, write_deltalake
    from deltalake.transaction import AddAction, create_table_with_add_actions

    from .sinks.staging import delta_stats

    check_snapshot_name(name)
    handle = admin.open_sink(location, sink)
    if name in _registry(handle):
        raise ConfigError(
            f"sink {handle.sink_id!r} already has a snapshot named {name!r}; delete it "
            "first or choose another name"
        )
    if handle.target_uri is None:
        raise ConfigError(f"sink {handle.sink_id!r} has no target yet: nothing to export")
    uri = _fs.normalize_uri(to)
    target_root = handle.target_uri.rstrip("/")
    if uri == target_root or uri.startswith(target_root + "/"):
        raise ConfigError(f"--to {to}: must not be inside the sink's target {target_root}")
    fs, root = _fs.filesystem(uri)
    _prepare_location(fs, root, handle, uri)
    record, version = _pin(handle, snapshot)
    store = handle.record_store()
    allocated, _ = store.update(handle.sink_id, fold_sink, allocate)
    snapshot_id = allocated.snapshot_id
    fs.makedirs(root, exist_ok=True)
    with fs.open(_fs.join(root, EXPORT_MARKER), "w") as f:
        f.write(json.dumps({"sink_id": handle.sink_id, "snapshot_id": snapshot_id, "name": name}))

    options = dict(handle.storage_options) or None
    try:
        source = DeltaTable(handle.target_uri, version=version, storage_options=options)
    except Exception as e:
        raise CorruptSnapshotError(
            f"the sink's target {handle.target_uri} can no longer be read at version "
            f"{version} (snapshot {record.snapshot_id}): {e}"
        ) from e
    adds = pa.table(source.get_add_actions(flatten=False)).to_pylist()
    if any(a.get("deletionVector") or a.get("deletion_vector") for a in adds):
        raise ConfigError(
            f"the target at version {version} has deletion vectors: exporting them is not "
            "supported yet"
        )
    total = sum(a["size_bytes"] for a in adds)
    advance = admin.byte_progress(total, progress)
    src_fs, src_root = _fs.filesystem(handle.target_uri)
    files, actions, rows = [], [], 0
    for a in adds:
        rel = unquote(a["path"])
        size, crc = _copy(src_fs, _fs.join(src_root, rel), fs, _fs.join(root, "data", rel), advance)
        if size != a["size_bytes"]:
            raise CorruptSnapshotError(
                f"{rel}: the log says {a['size_bytes']} bytes, the file has {size}"
            )
        with fs.open(_fs.join(root, "data", rel), "rb") as f:
            footer = pq.ParquetFile(f)
            stats = delta_stats(footer.metadata, footer.schema_arrow)
            rows += footer.metadata.num_rows
        files.append([a["path"], size, crc])
        actions.append(
            AddAction(
                a["path"],
                size,
                {k: _partition_string(v) for k, v in (a.get("partition") or {}).items()},
                int(a["modification_time"]),
                True,
                stats,
            )
        )
    meta = source.metadata()
    create_table_with_add_actions(
        _fs.join(uri, "data"),
        source.schema(),
        actions,
        mode="error",
        partition_by=list(meta.partition_columns) or None,
        name=name,
        description=f"pyspark-txn named snapshot {name!r} of sink {handle.sink_id}, "
        f"batch {record.batch_id} (table version {version})",
        storage_options=options,
    )
    data_checksum = f"crc32:{zlib.crc32(json.dumps(sorted(files)).encode()):08x}"
    created = datetime.now(timezone.utc)
    offsets = list(record.source_offsets) or [None]
    manifest = pa.table(
        {
            "source_index": list(range(len(offsets))),
            "source_offset": [json.dumps(o, sort_keys=True) for o in offsets],
            "name": [name] * len(offsets),
            "snapshot_id": [snapshot_id] * len(offsets),
            "of_snapshot_id": [record.snapshot_id] * len(offsets),
            "batch_id": [record.batch_id] * len(offsets),
            "sink_id": [handle.sink_id] * len(offsets),
            "query_id": [record.query_id] * len(offsets),
            "table_version": [version] * len(offsets),
            "rows": [rows] * len(offsets),
            "files": [len(files)] * len(offsets),
            "bytes": [total] * len(offsets),
            "data_checksum": [data_checksum] * len(offsets),
            "created_at": pa.array([created] * len(offsets), pa.timestamp("us", tz="UTC")),
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
            "rows": rows,
            "bytes": total,
            "files": files,
            "data_checksum": data_checksum,
            "source_offsets": list(record.source_offsets),
            "query_id": record.query_id,
            "target_uri": handle.target_uri,
        },
    )
    _, state = store.update(handle.sink_id, fold_sink, lambda s: register_named(s, entry))
    log.info(
        "sink %s: exported snapshot %r (batch %d, table version %d): %d rows, %d files, "
        "%d bytes to %s",
        handle.sink_id,
        name,
        record.batch_id,
        version,
        rows,
        len(files),
        total,
        uri,
    )
    return state.named[name]


# --- verify and delete -----------------------------------------------------------


@dataclass(frozen=True)
class ExportCheck:
    """``verify``'s answer: every mismatch between an export and its registry entry."""

    name: str
    location: str
    rows: int | None
    files: int
    problems: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "location": self.location,
            "ok": self.ok,
            "rows": self.rows,
            "files": self.files,
            "problems": list(self.problems),
        }


def verify(
    location: str, name: str, sink: str | None = None, progress: Progress | None = None
) -> ExportCheck:
    """Re-read the export's data table and compare it with the registry entry: the same
    files with the same sizes and CRC32s, and the same row count in their footers."""
    import pyarrow.parquet as pq
    from deltalake import DeltaTable

    entry = show(location, name, sink)
    expected = {path: (size, crc) for path, size, crc in entry.details.get("files", [])}
    data_uri = _fs.join(entry.location, "data")
    problems: list[str] = []
    try:
        import pyarrow as pa

        adds = pa.table(DeltaTable(data_uri).get_add_actions(flatten=False)).to_pylist()
    except Exception as e:
        return ExportCheck(name, entry.location, None, 0, (f"{data_uri}: unreadable: {e}",))
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
    return ExportCheck(name, entry.location, rows, len(listed), tuple(problems))


def delete(location: str, name: str, sink: str | None = None) -> NamedSnapshot:
    """Unregister ``name`` (a safe event), then remove its export folder."""
    handle = admin.open_sink(location, sink)
    entry = show(location, name, sink)
    handle.record_store().update(handle.sink_id, fold_sink, lambda s: delete_named(s, name))
    fs, root = _fs.filesystem(entry.location)
    marker = _read_marker(fs, root) if fs.exists(root) else None
    if marker is not None and marker.get("snapshot_id") == entry.snapshot_id:
        fs.rm(root, recursive=True)
    elif fs.exists(root):
        raise TxnError(
            f"snapshot {name!r} is unregistered, but {entry.location} does not carry its "
            "export marker any more; it was left in place: remove it yourself"
        )
    return replace(entry)
