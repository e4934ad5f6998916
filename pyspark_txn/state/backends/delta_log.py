"""The record table as a Delta table.

Conditional append: each event is one Delta commit carrying the app transaction
``txn(appId=stream, version=seq)``. Where the table is one this package writes
itself (record_commits: reader 1, writer 2, no features or partitions, a store
with conditional PUTs), the commit is written here, put-if-absent on the version
after the one just checked, and the seq checked against the events of that
version: any commit in between makes it fail, and the appender reads it and
tries again only if its seq is still free. Compaction and deletes of summarized
events are rewrites committed the same way. Elsewhere delta-rs appends
(``write_deltalake`` on the ``DeltaTable`` snapshot the check was made on: a
racing writer of the same stream loses with ``CommitFailedError``), compacts
(``optimize``) and deletes. delta-rs always creates, checkpoints, cleans up and
vacuums the table, every ``compact_every`` versions, so reads, commits and the
folder stay small over any number of batches.

Measured (deltalake 1.6.6, local disk): with delta-rs's post-commit hooks on
and a day of log retention, one append cost 9 ms on a fresh table and 58 ms
after 500 versions (the log folder is listed and replayed at every commit);
with the hooks off and maintenance here, ~9 ms flat; written here, the record
append of a batch ~3.3 ms (benchmarks/protocol_batches.py --profile).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError
from ...storage import fs as _fs
from ...storage.delta_tables import (
    commit_file_marker,
    commit_markers_from,
    forget_table,
    note_own_commit,
    open_table,
    put_marker,
    read_commit,
)
from ...storage.options import canonical_settings, object_store_fs
from ..events import Event, arrow_schema, events_to_arrow
from ..store import AppendRejected, EventLog
from .record_commits import (
    LogView,
    apply_actions,
    commit_bytes,
    data_file_name,
    metadata_writable,
    now_ms,
    protocol_writable,
    rewrite_bytes,
)

log = logging.getLogger(__name__)


@dataclass
class _TableCache:
    """Per process and table URI: the events of every data file already read.

    Data files are immutable and carry a UUID in their name, so events cached by
    file path can never go stale, even if the table is deleted and recreated;
    a read opens only the files added since the previous read. Measured on
    local disk: a sink read went from ~40-150 ms to a few ms.
    """

    filesystem: Any = None
    events: dict[str, list[Event]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # the data files of the last table object and version listed (listing them costs
    # ms: an append and the next read share one listing)
    listed: tuple[Any, int, list[str]] | None = None
    # the table as this process last checked it, where it reads and appends itself
    view: LogView | None = None
    # the events of the last files read, each once (callers only read the list)
    all_events: tuple[tuple[str, ...], list[Event]] | None = None

    def files(self, dt) -> list[str]:
        """The paths of ``dt``'s data files (relative, as the log has them)."""
        import pyarrow as pa

        version = dt.version()
        if self.listed is not None and self.listed[0] is dt and self.listed[1] == version:
            return self.listed[2]
        paths = pa.table(dt.get_add_actions(flatten=False)).column("path").to_pylist()
        self.listed = (dt, version, paths)
        return paths

    def last_seq(self, dt, stream: str) -> int | None:
        """The stream's last seq in ``dt`` from the cached events, if they are all of
        ``dt`` at its version (the read before an append): else None.

        Every append commits its event with ``txn(stream, seq)``, and deleting
        summarized events keeps the summary (the newest), so the highest seq of the
        stream's events is its app transaction's version. delta-rs finds that version
        by replaying the log since the checkpoint at each call (on an object store a
        GET of each of those commits); None (a stream with no events) asks it."""
        with self.lock:
            listed = self.listed
            if listed is None or listed[0] is not dt or listed[1] != dt.version():
                return None
            seqs: list[int] = []
            for f in listed[2]:
                events = self.events.get(f)
                if events is None:
                    return None
                seqs.extend(e.seq for e in events if e.stream == stream)
            return max(seqs, default=None)


_CACHES: dict[str, _TableCache] = {}
_CACHES_LOCK = threading.Lock()

#: Log retention of record tables this version creates on local disk. Short is
#: safe there because every append checks it is visible (:func:`_check_visible`).
#: Elsewhere a writer stalled for longer than the retention between its read and
#: its commit could recreate a cleaned-up version that no reader sees: a day.
LOG_RETENTION_LOCAL = "interval 1 minutes"
LOG_RETENTION_REMOTE = "interval 1 days"

#: Every this many compactions the compacted files go by delta-rs' vacuum, which also
#: deletes what an earlier compaction removed but did not get to delete (a crash or a
#: failed delete in between), while its tombstone is kept
#: (``delta.deletedFileRetentionDuration``); between, they are deleted directly.
#: Neither deletes files no commit ever listed (the data file of an append that failed
#: after writing it): vacuum's "lite" mode, as before.
VACUUM_EVERY = 8

#: Storage options under which delta-rs commits otherwise than by a conditional PUT (a
#: DynamoDB lock, an unsafe rename): commits written here would not take part in it.
_DELTA_RS_COMMITS = frozenset(
    {"aws_s3_locking_provider", "delta_dynamo_table_name", "aws_s3_allow_unsafe_rename"}
)

#: How many times an append written here reads the commits that took its version and
#: tries the next one before it gives up (AppendRejected: the caller re-reads).
OWN_APPEND_TRIES = 8


class InvisibleCommit(Exception):
    """A commit landed at or below the table's last checkpoint: readers that start there
    may never see it. The outcome is unknown; the caller re-reads to decide."""


def _last_checkpoint_version(uri: str) -> int | None:
    try:
        with open(os.path.join(uri, "_delta_log", "_last_checkpoint")) as f:
            return int(json.load(f)["version"])
    except (OSError, ValueError, KeyError):
        return None


def _write_data_file(fs: Any, path: str, data: bytes, *, local: bool) -> None:
    """An event's data file, durable before the commit that names it (local: fsynced;
    object stores: one PUT). Its name is new (a UUID): nothing else writes there."""
    if local:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _fs.fsync_dir(os.path.dirname(path))  # its name too, before a commit names it
        return
    fs.pipe_file(path, data)


def _above_checkpoint(io: tuple[Any, str], version: int) -> bool:
    """Whether commit ``version`` is above the table's last checkpoint (one GET)."""
    fs, root = io
    try:
        last = json.loads(_fs.read_bytes(fs, _fs.join(root, "_delta_log", "_last_checkpoint")))
    except FileNotFoundError:
        return True
    return int(last["version"]) < version


def _commit_path(root: str, version: int) -> str:
    return _fs.join(root, "_delta_log", f"{version:020d}.json")


def _unique(events: list[Event]) -> list[Event]:
    """``events`` without repeats of one event (by id), in order. A table compacted by
    two processes at once through delta-rs 1.6.6's ``optimize`` holds some events
    twice (both new files held them; see record_commits.rewrite_bytes)."""
    seen: set[str] = set()
    out = []
    for e in events:
        if e.event_id not in seen:
            seen.add(e.event_id)
            out.append(e)
    return out


def _compaction(
    files: Sequence[str], events: Mapping[str, list[Event]]
) -> tuple[list[str], list[Event]]:
    """Every file into one, each event once, ordered by stream and seq."""
    if len(files) < 2:
        return [], []
    kept = _unique([e for f in files for e in events[f]])
    return list(files), sorted(kept, key=lambda e: (e.stream, e.seq))


def _summarized(stream: str, below_seq: int):
    """The files holding events of ``stream`` below ``below_seq`` (a summary restates
    them), rewritten without those."""

    def select(
        files: Sequence[str], events: Mapping[str, list[Event]]
    ) -> tuple[list[str], list[Event]]:
        def dropped(e: Event) -> bool:
            return e.stream == stream and e.seq < below_seq

        hit = [f for f in files if any(dropped(e) for e in events[f])]
        kept = _unique([e for f in hit for e in events[f] if not dropped(e)])
        return hit, sorted(kept, key=lambda e: (e.stream, e.seq))

    return select


def _NO_HOOKS():  # noqa: N802 - reads as a constant
    """Checkpoints and log cleanup happen in ``_maintain``, not after every event."""
    from deltalake.transaction import PostCommitHookProperties

    return PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False)


class DeltaEventLog(EventLog):
    def __init__(
        self,
        uri: str,
        storage_options: Mapping[str, str] | None = None,
        *,
        compact_every: int = 32,
    ) -> None:
        self.uri = uri
        self.storage_options = dict(storage_options or {}) or None
        self.compact_every = compact_every

    def __repr__(self) -> str:
        return f"DeltaEventLog({self.uri!r})"

    def memo_key(self):
        return ("delta", self.uri)

    def location(self) -> str:
        return "delta:" + _fs.location_identity(self.uri, self.storage_options)

    def _open(self, refresh: bool = True, for_write: bool = False):
        return open_table(self.uri, self.storage_options, refresh=refresh, for_write=for_write)

    def _cache(self) -> _TableCache:
        with _CACHES_LOCK:
            return _CACHES.setdefault(self.uri, _TableCache())

    def create_if_missing(self) -> None:
        """Create the table (idempotent). Concurrent creators race for version 0, which is
        written without delta-rs's commit retries (a retried creation would land as a
        second ``metaData`` at version 1): one wins, the others find its table."""
        from deltalake import DeltaTable
        from deltalake.transaction import CommitProperties

        if self._open() is not None:
            return
        try:
            DeltaTable.create(
                self.uri,
                arrow_schema(),
                mode="ignore",
                name="pyspark_txn_records",
                description="pyspark-txn record table (append-only event log)",
                # The history lives in the rows; old log files only slow down listing.
                # A writer stalled longer than this between its read and its commit
                # could recreate a cleaned-up version: far beyond any protocol step.
                configuration=self._properties(),
                storage_options=self.storage_options,
                commit_properties=CommitProperties(max_commit_retries=0),
            )
        except Exception as e:
            if self._open() is not None:
                return  # a lost race: the winner's table is ours too
            if not _fs.is_local(self.uri):
                raise  # a remote store's error may be transient
            # a read-only filesystem, /proc, a file on the way, no permission: said
            # here, not as delta-rs' TableNotFoundError (inside Spark's pickling)
            raise ConfigError(
                f"the record table at {self.uri} cannot be created ({e}); the sink's "
                "recordTable (default: <checkpointLocation>/pyspark_txn/records) must "
                "be a writable location"
            ) from e

    def _properties(self) -> dict[str, str]:
        return {
            "delta.logRetentionDuration": (
                LOG_RETENTION_LOCAL if _fs.is_local(self.uri) else LOG_RETENTION_REMOTE
            ),
            # Compacted-away files are vacuumed at once; their tombstones would only
            # make every checkpoint grow with the number of events ever written.
            "delta.deletedFileRetentionDuration": "interval 1 minutes",
            "delta.checkpointInterval": str(self._checkpoint_every()),
        }

    def _checkpoint_every(self) -> int:
        """Checkpoints come with compaction only, on every store. The processes that
        use the table keep it open and catch up commit by commit; each checkpoint made
        every one of them read it again (on S3 a dozen ranged GETs per process: with a
        checkpoint every 10 versions, 4-5 requests per batch of ~45). What it costs: a
        process opening the table from scratch GETs up to ``compact_every`` commits.
        On local disk each checkpoint also rewrote the table's state (measured: a
        record table 2.8x the bytes at 600 batches, no faster)."""
        return max(0, self.compact_every)

    def append(self, event: Event) -> None:
        io = self._own_io()
        if io is None or not self._append_own(event, io):
            self._append_through_delta_rs(event)

    def _own_io(self) -> tuple[Any, str] | None:
        """The filesystem and root through which this process appends and catches up
        itself (record_commits), or None where delta-rs does: a store obstore lacks,
        keys only delta-rs knows (a DynamoDB lock, unsafe renames), conditional PUTs
        configured other than by ETag."""
        if _fs.is_local(self.uri):
            import fsspec

            return fsspec.filesystem("file"), self.uri
        given = {k.lower(): str(v) for k, v in (self.storage_options or {}).items()}
        if _DELTA_RS_COMMITS.intersection(given):
            return None  # delta-rs commits through a lock or a rename: so must we
        conditional = canonical_settings(self.storage_options).get("aws_conditional_put")
        if conditional is not None and conditional.strip().lower() != "etag":
            return None
        return object_store_fs(self.uri, self.storage_options)

    def _view(self, cache: _TableCache, io: tuple[Any, str]) -> LogView | None:
        """The table at its latest version (None: no table), caught up from the view this
        process holds, else opened afresh through delta-rs. Holds ``cache.lock``."""
        view = cache.view
        if view is not None:
            caught = self._caught_up(view, io)
            if caught is not None:
                cache.view = caught
                return caught
            log.debug(
                "record table %s: opened afresh (log moved past version %d in a way "
                "a catch-up does not follow)",
                self.uri,
                view.version,
            )
        cache.view = None
        dt = self._open()
        if dt is None:
            return None
        protocol = dt.protocol()
        metadata = dt.metadata()
        writable = protocol_writable(
            protocol.min_reader_version,
            protocol.min_writer_version,
            [*(protocol.reader_features or ()), *(protocol.writer_features or ())],
        ) and metadata_writable(metadata.partition_columns, metadata.configuration or {})
        marker = commit_file_marker(self.uri, dt.version(), self.storage_options)
        view = LogView(
            dt.version(), marker, tuple(cache.files(dt)), writable and marker is not None
        )
        if marker is not None:  # else nothing to check the next catch-up against: open again
            cache.view = view
        return view

    def _caught_up(self, view: LogView, io: tuple[Any, str]) -> LogView | None:
        """``view`` moved over the commits since, or None where that cannot be done: the
        commit file at its version is not the one seen (the table deleted and created
        again, or that file cleaned up), a gap, or a commit this view cannot follow."""
        markers = commit_markers_from(self.uri, view.version, self.storage_options)
        if markers.get(view.version) != view.marker:
            return None
        newer = sorted(v for v in markers if v > view.version)
        if not newer:
            return view
        if newer != list(range(view.version + 1, newer[-1] + 1)):
            return None
        files = dict.fromkeys(view.files)
        fs, root = io
        for v in newer:
            try:
                actions = read_commit(fs, root, v)
            except FileNotFoundError:  # cleaned up under us
                return None
            if not apply_actions(files, actions):
                return None
        return LogView(newer[-1], markers[newer[-1]], tuple(files), view.writable)

    def _append_own(self, event: Event, io: tuple[Any, str]) -> bool:
        """Append ``event`` with a commit written here (record_commits); False where the
        table must be appended to through delta-rs (its protocol)."""
        fs, root = io
        cache = self._cache()
        name = data_file_name()
        data: bytes | None = None
        landed: int | None = None  # the version of our commit, where we know it
        for _ in range(OWN_APPEND_TRIES):
            with cache.lock:
                view = self._view(cache, io)
                if view is not None and not view.writable:
                    return False
                table_there = view is not None
                if view is not None:
                    if name in view.files:
                        break  # our commit landed, though its answer was lost: somewhere up to here
                    try:
                        self._load_events(cache, view.files, io)
                    except FileNotFoundError:  # compacted and deleted since: catch up again
                        continue
                    ours = [
                        e for f in view.files for e in cache.events[f] if e.stream == event.stream
                    ]
                    if data is not None and any(e.event_id == event.event_id for e in ours):
                        # this call's commit landed, its answer lost, and a compaction took
                        # its file since (another call's event: the caller re-reads)
                        break
                    seqs = [e.seq for e in ours]
                    if seqs:
                        expected = max(seqs) + 1
                    else:  # no events (a new stream): its app transaction, if any, decides
                        dt = self._open()
                        current = None if dt is None else dt.transaction_version(event.stream)
                        expected = 0 if current is None else current + 1
                    if event.seq != expected:
                        raise AppendRejected(
                            f"{event.stream}#{event.seq} cannot land: the next free seq is {expected}"
                        )
                    if data is None:
                        data = self._write_events_file(io, name, [event])
                    version = view.version + 1
                    commit = commit_bytes([event], name, len(data), now_ms=now_ms())
                    created, e_tag = _fs.create_new(fs, _commit_path(root, version), commit)
                    if created:
                        landed = version
                        marker = put_marker(
                            self.uri, version, len(commit), e_tag
                        ) or commit_file_marker(self.uri, version, self.storage_options)
                        cache.events[name] = [event]
                        cache.view = (
                            None
                            if marker is None
                            else LogView(version, marker, (*view.files, name), True)
                        )
                        break
            if not table_there:
                self.create_if_missing()
            # another commit took the version: read it, then try again
        else:
            raise AppendRejected(
                f"{event.stream}#{event.seq}: {OWN_APPEND_TRIES} other commits of the record "
                "table landed first"
            )
        if landed is not None:
            self._check_visible(event, landed)
        self._maintain(landed if landed is not None else view.version)
        return True

    def _write_events_file(self, io: tuple[Any, str], name: str, events: list[Event]) -> bytes:
        """Write ``events`` as the new data file ``name``; its bytes (their size goes
        into the commit)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        sink = pa.BufferOutputStream()
        pq.write_table(events_to_arrow(events), sink, compression="snappy")
        data: bytes = sink.getvalue().to_pybytes()
        fs, root = io
        _write_data_file(fs, _fs.join(root, name), data, local=_fs.is_local(self.uri))
        return data

    def _rewrite(
        self,
        io: tuple[Any, str],
        operation: str,
        select: Callable[[Sequence[str], Mapping[str, list[Event]]], tuple[list[str], list[Event]]],
    ) -> tuple[str, list[str]]:
        """Replace the files ``select`` picks with one file of the events it keeps, the
        commit written put-if-absent on the version just read (record_commits.
        rewrite_bytes). ``("done", removed paths)``, ``("lost", [])`` where another
        commit came first or there was nothing to do, ``("delta-rs", [])`` where the
        table's protocol is not one written here."""
        fs, root = io
        cache = self._cache()
        with cache.lock:
            view = self._view(cache, io)
            if view is None:
                return "lost", []
            if not view.writable:
                return "delta-rs", []
            try:
                self._load_events(cache, view.files, io)
            except FileNotFoundError:  # compacted and deleted meanwhile: the next one
                return "lost", []
            removed, kept = select(view.files, cache.events)
            if not removed:
                return "lost", []
            added = None
            if kept:
                name = data_file_name()
                data = self._write_events_file(io, name, kept)
                added = (name, len(data), kept)
            commit = rewrite_bytes(
                operation,
                removed,
                added,
                now_ms=now_ms(),
                data_change=operation != "OPTIMIZE",
            )
            # Commits that only added files since (appends) leave this rewrite as valid
            # on the version after theirs: tried there. One that removed any of these
            # files (another rewrite) wins, and this one is dropped.
            for _ in range(OWN_APPEND_TRIES):
                version = view.version + 1
                if _fs.write_new(fs, _commit_path(root, version), commit):
                    break
                after = self._view(cache, io)
                if after is not None and added is not None and added[0] in after.files:
                    return "lost", []  # ours landed, its answer lost: the next vacuum deletes
                if after is None or not after.writable or not set(removed) <= set(after.files):
                    if added is not None and after is not None:
                        _fs.delete_files(fs, [_fs.join(root, added[0])])  # never listed: ours
                    return "lost", []
                view = after
            else:
                return "lost", []
            if not _above_checkpoint(io, version):
                # written again after the log was cleaned up there: readers that start at
                # the checkpoint never see it, and would miss the files it removes
                log.warning(
                    "record table %s: %s landed as version %d, not above the last checkpoint;"
                    " its files are kept",
                    self.uri,
                    operation,
                    version,
                )
                cache.view = None
                return "lost", []
            gone = set(removed)
            files = [f for f in view.files if f not in gone]
            if added is not None:
                files.append(added[0])
                cache.events[added[0]] = list(kept)
            marker = commit_file_marker(self.uri, version, self.storage_options)
            cache.view = None if marker is None else LogView(version, marker, tuple(files), True)
        log.debug("record table %s: %s at version %d", self.uri, operation, version)
        return "done", [_fs.join(root, f) for f in removed]

    def _check_visible(self, event: Event, version: int) -> None:
        """A commit at or below the last checkpoint may never be seen by readers that
        start there (short log retention, local disk only): its outcome is unknown."""
        if not _fs.is_local(self.uri):
            return
        checkpoint = _last_checkpoint_version(self.uri)
        if checkpoint is not None and checkpoint >= version:
            forget_table(self.uri, self.storage_options)
            self._cache().view = None
            raise InvisibleCommit(
                f"{event.stream}#{event.seq} committed as version {version}, not above "
                f"the last checkpoint {checkpoint}"
            )

    def _append_through_delta_rs(self, event: Event) -> None:
        from deltalake import write_deltalake
        from deltalake.exceptions import CommitFailedError
        from deltalake.transaction import CommitProperties, Transaction

        # The table as this thread last read it: a stale snapshot is safe (the
        # commit then conflicts on the app transaction and the caller re-reads).
        dt = self._open(refresh=False, for_write=True)
        if dt is None:
            self.create_if_missing()
            dt = self._open()
        current = self._cache().last_seq(dt, event.stream)
        if current is None:
            current = dt.transaction_version(event.stream)
        expected = 0 if current is None else current + 1
        if event.seq != expected:
            raise AppendRejected(
                f"{event.stream}#{event.seq} cannot land: the next free seq is {expected}"
            )
        rows = events_to_arrow([event])
        before = dt.version()
        try:
            write_deltalake(
                dt,
                rows,
                mode="append",
                commit_properties=CommitProperties(
                    app_transactions=[Transaction(app_id=event.stream, version=event.seq)],
                    custom_metadata={"pyspark_txn.event": event.kind.value},
                ),
                post_commithook_properties=_NO_HOOKS(),
            )
        except CommitFailedError as e:
            raise AppendRejected(str(e)) from e
        self._remember_own(dt, before, rows)
        if dt.version() == before + 1:  # ours alone: later checks compare against it
            note_own_commit(self.uri, self.storage_options, dt)
        self._check_visible(event, dt.version())
        self._maintain(dt.version())

    def _remember_own(self, dt, before: int, rows) -> None:
        """Cache the events of the file this append just wrote, so this process does not
        read its own write back (on an object store: a GET per append saved). Only when
        the table moved by exactly our one commit and every other file of it is cached
        (the table this append was built on is the one the last read listed): then the
        one file the cache lacks is ours."""
        if dt.version() != before + 1:
            return
        cache = self._cache()
        with cache.lock:
            new = [f for f in cache.files(dt) if f not in cache.events]
            if len(new) == 1:
                cache.events[new[0]] = [Event.from_row(r) for r in rows.to_pylist()]

    def _removed_by(self, before: int, after: int, operation: str) -> tuple[Any, list[str]] | None:
        """The filesystem and the files that the ``operation`` (``OPTIMIZE``, ``DELETE``)
        commits after ``before`` up to ``after`` removed (one GET a commit): deleting
        those is what a vacuum would delete of them, without its reading the log again
        and its two commits (47 requests on S3, measured). None where a commit cannot
        be read this way: a vacuum takes them later."""
        from urllib.parse import unquote

        if _fs.is_local(self.uri):
            import fsspec

            fs, root = fsspec.filesystem("file"), self.uri
        else:
            found = object_store_fs(self.uri, self.storage_options)
            if found is None:
                return None
            fs, root = found
        removed: list[str] = []
        for v in range(before + 1, after + 1):
            try:  # through the filesystem above (read_commit_actions would make a client a commit)
                actions = read_commit(fs, root, v)
            except Exception:  # gone, unreachable, not JSON
                log.debug("reading commit %d of %s failed", v, self.uri, exc_info=True)
                return None
            info: dict[str, Any] = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
            if info.get("operation") != operation:
                continue  # an append: it removed nothing
            removed.extend(
                _fs.join(root, unquote(a["remove"]["path"])) for a in actions if "remove" in a
            )
        return fs, removed

    def _maintain(self, version: int) -> None:
        """Upkeep due after our commit at ``version``: compaction (written here where the
        table is, else delta-rs's ``optimize``), then delta-rs's checkpoint and log
        clean-up, then the compacted files deleted."""
        if self.compact_every <= 0 or version % self.compact_every:
            return
        io = self._own_io()
        try:
            status, removed = (
                ("delta-rs", []) if io is None else self._rewrite(io, "OPTIMIZE", _compaction)
            )
            if status == "lost":
                return  # another commit came first: the next compaction takes these
            dt = self._open()
            if dt is None:
                return
            wanted = self._properties()
            config = dt.metadata().configuration or {}
            if any(config.get(k) != v for k, v in wanted.items()):
                # a table created by an older version: bring its retention up to date
                dt.alter.set_table_properties(wanted, raise_if_not_exists=False)
            compacted: tuple[Any, list[str]] | None
            if status == "done":
                assert io is not None
                compacted = (io[0], removed)
            else:
                before = dt.version()
                dt.optimize.compact(post_commithook_properties=_NO_HOOKS())
                compacted = self._removed_by(before, dt.version(), "OPTIMIZE")
            dt.create_checkpoint()
            dt.cleanup_metadata()
            # Compaction only un-lists the small files; without deleting them a table
            # with one commit per event keeps one file per event forever. A reader
            # still listing the old files retries on the new ones (_all_events).
            if compacted is None or (version // self.compact_every) % VACUUM_EVERY == 0:
                dt.vacuum(retention_hours=0, dry_run=False, enforce_retention_duration=False)
            else:
                _fs.delete_files(*compacted)
            forget_table(self.uri, self.storage_options)  # reopen from the new checkpoint
        except Exception as e:  # an optimisation only: the events are already safe
            log.warning(
                "record table %s: compaction at version %d failed: %r", self.uri, version, e
            )

    def truncate(self, stream: str, below_seq: int) -> None:
        io = self._own_io()
        if io is not None:
            status, removed = self._rewrite(io, "DELETE", _summarized(stream, int(below_seq)))
            if status == "done":
                # deleted now: the vacuum comes only every VACUUM_EVERY compactions, after
                # their tombstones may have expired
                try:
                    _fs.delete_files(io[0], removed)
                except Exception as e:  # an optimisation only: the next vacuum may take them
                    log.warning("record table %s: deleting rewritten files failed: %r", self.uri, e)
            if status != "delta-rs":
                return  # done, or lost a race with another commit: the next summary retries
        self._truncate_through_delta_rs(stream, below_seq)

    def _truncate_through_delta_rs(self, stream: str, below_seq: int) -> None:
        from deltalake.exceptions import CommitFailedError

        dt = self._open()
        if dt is None:
            return
        quoted = stream.replace("'", "''")
        before = dt.version()
        try:
            dt.delete(
                f"stream = '{quoted}' AND seq < {int(below_seq)}",
                post_commithook_properties=_NO_HOOKS(),
            )
        except CommitFailedError as e:  # a race (the next summary retries), or refused
            log.info("record table %s: summarized events not deleted: %s", self.uri, e)
            return
        # The files the delete rewrote, deleted now: the vacuum comes only every
        # VACUUM_EVERY compactions, after their tombstones may have expired.
        try:
            rewritten = self._removed_by(before, dt.version(), "DELETE")
            if rewritten is not None:
                _fs.delete_files(*rewritten)
        except Exception as e:  # an optimisation only: the next vacuum may take them
            log.warning("record table %s: deleting rewritten files failed: %r", self.uri, e)

    def _all_events(self) -> list[Event]:
        for attempt in range(3):
            try:
                return self._read_all_events()
            except FileNotFoundError:  # compacted and vacuumed while listed: read again
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _read_all_events(self) -> list[Event]:
        cache = self._cache()
        io = self._own_io()
        with cache.lock:
            if io is not None:
                view = self._view(cache, io)
                if view is None:
                    return []
                files: Sequence[str] = view.files
            else:
                dt = self._open()
                if dt is None:
                    return []
                files = cache.files(dt)
                if any(f not in cache.events for f in files):
                    # one GET per file through obstore (delta-rs' pyarrow filesystem costs
                    # a LIST, three HEADs and two GETs); else delta-rs' store: any URI
                    io = (
                        None
                        if _fs.is_local(self.uri)
                        else object_store_fs(self.uri, self.storage_options)
                    )
                    if io is None and not _fs.is_local(self.uri) and cache.filesystem is None:
                        cache.filesystem = dt.to_pyarrow_dataset().filesystem
            key = tuple(files)
            if cache.all_events is not None and cache.all_events[0] == key:
                return cache.all_events[1]  # the same files: the same events
            self._load_events(cache, files, io)
            live = set(files)
            for f in [f for f in cache.events if f not in live]:
                del cache.events[f]  # compacted away: its events live on in the new file
            events = _unique([e for f in files for e in cache.events[f]])
            cache.all_events = (key, events)
            return events

    def _load_events(
        self, cache: _TableCache, files: Sequence[str], io: tuple[Any, str] | None
    ) -> None:
        """Read the events of the ``files`` this process has not read yet (data files
        are immutable and UUID-named: what is cached never goes stale). Holds
        ``cache.lock``; ``FileNotFoundError`` where one was compacted away meanwhile."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        for f in files:
            if f in cache.events:
                continue
            if _fs.is_local(self.uri):  # pyarrow's own reader: 3x faster than fsspec's
                table = pq.ParquetFile(_fs.join(self.uri, f)).read(use_threads=False)
            elif io is not None:
                fs, root = io
                data = fs.cat_file(_fs.join(root, f))
                table = pq.ParquetFile(pa.BufferReader(data)).read(use_threads=False)
            else:
                with cache.filesystem.open_input_file(f) as fh:
                    table = pq.ParquetFile(fh).read(use_threads=False)
            cache.events[f] = [Event.from_row(r) for r in table.to_pylist()]

    def read(self, stream: str) -> list[Event]:
        events = [e for e in self._all_events() if e.stream == stream]
        events.sort(key=lambda e: e.seq)
        return events

    def streams(self) -> list[str]:
        return sorted({e.stream for e in self._all_events()})
