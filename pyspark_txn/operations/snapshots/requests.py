"""Exports cut at a commit: :func:`request_export` (the batch the sink commits next, served
inside that commit by :func:`serve_export_requests`) and :func:`stop_and_export` (a
terminal snapshot: the query is stopped and its sink settled first)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from ...errors import ConfigError, TxnError
from ...sinks.hooks import ExportSite
from ...state import SinkState, SnapshotRecord, fold_sink
from ...state.core import (
    ExportRequest,
    NamedSnapshot,
    fail_export,
)
from ...state.core import request_export as request_export_event
from ...storage import fs as _fs
from ...storage.checkpoint import latest_batch
from ...storage.options import StorageOptions, takes_storage_options
from ..handle import SinkHandle
from ..repair import settle
from ..state_export import has_state
from .copy import _check_destination, _pin, _state_session
from .exports import ExportCancelled, _export_pinned
from .location import STATE_CHOICES, _check_name_free, _check_to, _inspect_location
from .registry import Progress, _open

log = logging.getLogger(__name__)


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

    def requested(s: SinkState) -> Any:
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

    def cancel(s: SinkState) -> Any:
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


def serve_export_requests(
    handle: SinkHandle, state: SinkState, record: SnapshotRecord, version: int | None
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

            def failed(s: SinkState, name: str = request.name, error: str = repr(e)) -> Any:
                return fail_export(s, name, error)

            handle.record_store().update(handle.sink_id, fold_sink, failed)


def serve_sink_exports(
    site: ExportSite, state: SinkState, record: SnapshotRecord, version: int | None
) -> None:
    """The export server a sink calls through :mod:`pyspark_txn.sinks.hooks` (installed
    by ``pyspark_txn/__init__.py``): :func:`serve_export_requests` on its handle."""
    handle = SinkHandle(
        record_table=site.record_table,
        sink_id=site.sink_id,
        target_uri=site.target_uri,
        storage_options=dict(site.storage_options),
        fs_overrides=site.fs_overrides,
        partition_by=site.partition_by,
        checkpoint=site.checkpoint,
    )
    serve_export_requests(handle, state, record, version)


@takes_storage_options
def wait_for_export(
    location: str,
    name: str,
    *,
    sink: str | None = None,
    timeout: float | None = None,
    query: Any = None,
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


def query_checkpoint(query: Any) -> str:
    """The checkpoint location of a running ``StreamingQuery`` (classic PySpark)."""
    try:
        return str(query._jsq.streamingQuery().resolvedCheckpointRoot())
    except Exception as e:
        raise ConfigError(
            "cannot read the query's checkpoint location (Spark Connect?): pass checkpoint="
        ) from e


@takes_storage_options
def stop_and_export(
    query: Any,
    name: str,
    to: str,
    *,
    checkpoint: str | None = None,
    sink: str | None = None,
    state: str = "auto",
    spark: Any = None,
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
    settle(location, sink, reason=f"stop_and_export {name!r}")
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


def _spark_committed(handle: SinkHandle, state: SinkState, session: Any) -> int | None:
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
