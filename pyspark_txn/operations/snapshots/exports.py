""":func:`export`: the latest committed batch (or a named one), now. Copies, writes the
manifest, then registers the name in the record table; a crash before the registration
leaves only a marked, unregistered copy."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any
from urllib.parse import unquote

from ...errors import ConfigError, IndeterminateCommitError, TxnError
from ...sinks.twophase import WRITE_KEYS
from ...state import SinkState, SnapshotRecord, allocate, fold_sink
from ...state.core import (
    EXPORT_TOKEN_PREFIX,
    NamedSnapshot,
    new_token,
    register_named,
)
from ...state.core import abandon as abandon_event
from ...storage import fs as _fs
from ...storage.options import StorageOptions, takes_storage_options
from ..handle import SinkHandle
from ..state_export import has_state
from ..verify import crc32_of
from .copy import _state_session, check_export, copy_table
from .location import (
    _LIVE_TOKENS,
    STATE_CHOICES,
    TOMBSTONES,
    _check_name_free,
    _check_to,
    _describe_owner,
    _owner,
    _prepare_location,
    _read_marker,
    _relation,
    _remove_export,
)
from .registry import EXPORT_MARKER, Progress, _open

log = logging.getLogger(__name__)


class ExportCancelled(TxnError):
    """A requested export was cancelled while the sink was running it."""


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
    spark: Any = None,
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


def _write_marker(fs: Any, root: str, marker: Mapping[str, Any], uri: str) -> None:
    """Write the export marker only if no other export wrote one first, on every store
    (a create-if-absent: two exports to one location cannot both go ahead)."""
    path = _fs.join(root, EXPORT_MARKER)
    if _fs.write_new(fs, path, json.dumps(dict(marker)).encode()):
        return
    other = _read_marker(fs, root) or {}
    token = (marker.get("owner") or {}).get("token")
    if token is not None and (other.get("owner") or {}).get("token") == token:
        return  # ours: a PUT whose response was lost, and its retry found it
    raise ConfigError(
        f"--to {uri}: another export ({other.get('name')!r} by "
        f"{_describe_owner(other.get('owner'))}) started there at the same time; "
        "choose another location"
    )


def _still_ours(fs: Any, root: str, token: str) -> bool:
    try:
        marker = _read_marker(fs, root)
    except FileNotFoundError:
        return False
    if not marker:
        return False
    return (marker.get("owner") or {}).get("token") == token


def _copy_tombstones(
    handle: SinkHandle,
    record: SnapshotRecord,
    uri: str,
    options: Mapping[str, str] | None,
    check_owner: Any,
) -> dict[str, Any] | None:
    """The deletes an upserting sink remembered as of the record's batch, copied to
    ``<to>/tombstones`` (a query started from the snapshot inherits them): its rows and
    files, or None where the sink keeps none (appends, no ``deleteWhen``)."""
    from ...sinks.tombstones import tombstones_as_of

    assert handle.target_uri is not None
    found = tombstones_as_of(handle.target_uri, handle.sink_id, record.batch_id, options)
    if found is None:
        return None
    copied = copy_table(
        found[0],
        found[1],
        _fs.join(uri, TOMBSTONES),
        storage_options=options,
        name=None,
        description=f"tombstones of sink {handle.sink_id} as of batch {record.batch_id}",
        check_owner=check_owner,
    )
    return {"path": TOMBSTONES, "rows": copied.rows, "files": copied.files}


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
        files.append([path, fs.info(full)["size"], crc32_of(fs, full, lambda _n: None)])
    return files


def _export_pinned(
    handle: SinkHandle,
    name: str,
    to: str,
    record: SnapshotRecord,
    version: int,
    *,
    progress: Progress | None = None,
    spark: Any = None,
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
    handle: SinkHandle, snapshot_id: int, name: str, error: BaseException
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
    handle: SinkHandle, name: str, uri: str, snapshot_id: int, error: BaseException
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


def _remove_own_copy(fs: Any, root: str, token: str, uri: str, name: str, existed: bool) -> None:
    if _still_ours(fs, root, token):  # our own partial copy: nobody else needs it
        log.warning("export %r to %s failed: removing its partial copy", name, uri)
        try:
            _remove_export(fs, root, uri)
            if existed:
                fs.makedirs(root, exist_ok=True)
        except Exception as e:  # noqa: BLE001 - the marker says what is left
            log.error("could not remove the partial copy at %s: %r", uri, e)


def _check_writable(fs: Any, root: str, uri: str, existed: bool) -> None:
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
    handle: SinkHandle,
    name: str,
    uri: str,
    fs: Any,
    root: str,
    token: str,
    record: SnapshotRecord,
    version: int,
    snapshot_id: int,
    *,
    progress: Progress | None,
    spark: Any,
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
    tombstones = _copy_tombstones(handle, record, uri, options, check_owner)
    state_tables: list[Any] = []
    if spark is not None and handle.checkpoint is not None:
        from .. import state_export

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
            **({"tombstones": tombstones} if tombstones else {}),
            # how the sink writes its table (merged by key, complete mode): whether a
            # stateful query may start anew from this snapshot (prepare.rederives)
            "writes": {k: record.target[k] for k in WRITE_KEYS if record.target.get(k)},
            **(details or {}),
        },
    )

    def register(s: SinkState) -> Any:
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
