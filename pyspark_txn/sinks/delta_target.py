"""The Delta target of the two-phase protocol: phase 2 is one delta-rs commit.

Phase 2 commits the staged files' add actions together with
``txn(appId=sink id, version=batch id)`` on the same ``DeltaTable`` snapshot it
checked, so a replay is a no-op (``committed version >= batch id``) and two
racing phase 2s cannot both land. delta-rs validates nothing about the files
it is given, so files and schema are checked here before the record, and the
table phase 2 commits on is checked again (:mod:`.delta_recheck`): someone may
have changed it since.

Over ~700 lines on purpose: it is one class whose methods share the table it opens
and what it checked; its schema rules are in :mod:`.delta_target_schema`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..errors import CheckpointMismatchError, ConfigError, CorruptSnapshotError, TargetGoneError
from ..state import SnapshotRecord, TxnHandle
from ..storage import fs as _fs
from ..storage.delta_tables import (
    note_own_commit,
    open_table,
    read_table,
)
from ..storage.options import StorageOptions
from .delta_commit import (  # noqa: F401 (re-exported: callers import them from here)
    _NO_HOOKS,
    APP_VERSION_CATCH_UP,
    DEFAULT_CHECKPOINT_INTERVAL,
    _app_version,
    _app_versions,
    add_actions,
    checkpoint_interval,
    maintain_log,
)
from .delta_recheck import refuse_changed_table
from .delta_target_schema import (  # noqa: F401 (re-exported: callers import them from here)
    CDF_COLUMNS,
    as_nullable,
    batch_nulls,
    cdf_reserved,
    check_table_features,
    check_writable_schema,
    schema_drift,
    schema_from_b64,
    schema_to_b64,
    table_arrow_schema,
)
from .staging import (
    MARKER_SUFFIX,
    STAGING_ROOT,
    data_file_prefix,
    parse_snapshot_dir,
    snapshot_dir,
)
from .target import RESTORE_THE_TABLE, Target, TargetTerms, held_batches

log = logging.getLogger(__name__)

META_PREFIX = "pyspark_txn."


_SCHEMA_CHECKS: set[tuple] = set()  # (uri, version, schema, settings) that passed


class DeltaTarget(Target):
    terms = TargetTerms(
        "delta", "file", "files", "table version {}", "no Delta commit (empty batch)"
    )
    #: Whether a batch without rows changes the table (complete mode: it empties it).
    commits_empty_batches = False
    #: How a batch's staged files go into the table (complete mode: ``overwrite``).
    write_mode = "append"

    def __init__(
        self,
        uri: str,
        sink_id: str,
        *,
        partition_by: Sequence[str] = (),
        storage_options: Mapping[str, str] | None = None,
        fs_options: Mapping[str, Any] | None = None,
        storage: StorageOptions | None = None,
        table_properties: Mapping[str, str] | None = None,
        table_name: str | None = None,
        table_description: str | None = None,
        user_metadata: str | None = None,
    ) -> None:
        self.uri = uri
        self.sink_id = sink_id
        self.partition_by = list(partition_by)
        self.table_properties = dict(table_properties or {})
        self.table_name = table_name
        self.table_description = table_description
        self.user_metadata = user_metadata
        # one storage configuration for delta-rs and the fsspec IO (pyspark_txn.storage)
        self.storage = storage or StorageOptions.of(storage_options, fs_options)
        self.storage_options = self.storage.for_delta()
        self.fs, self.root = _fs.filesystem(uri, self.storage)
        # (snapshot id, token, files) of the last verify_staged that passed: phase 2
        # right after it need not read the files again
        self._verified: tuple[int, str, tuple] | None = None

    # --- reading --------------------------------------------------------------

    def open(self, refresh: bool = True):
        """The table now; ``refresh=False`` accepts this thread's copy of a few seconds
        ago, for checks that the phase 2 commit makes again on a fresh one."""
        return open_table(self.uri, self.storage_options, refresh=refresh)

    def _app_version_in(self, sink_id: str, refresh: bool = True) -> tuple[Any, int | None]:
        """The table and ``sink_id``'s app version in it. A cached table whose log files
        another writer has cleaned up since is opened afresh (storage.delta_tables)."""
        return read_table(
            self.uri,
            self.storage_options,
            lambda dt: _app_version(dt, self.uri, sink_id, self.storage_options),
            refresh=refresh,
        )

    def committed_batch(self, sink_id: str) -> int | None:
        return self._app_version_in(sink_id)[1]

    def committed_batch_recent(self, sink_id: str) -> int | None:
        # a deleted or re-created table is not the cached one
        return self._app_version_in(sink_id, refresh=False)[1]

    def location(self) -> str:
        return f"the table at {self.uri}"

    def commits_nothing(self, record: SnapshotRecord) -> bool:
        return not record.txns and not self.commits_empty_batches

    def gone(self) -> str | None:
        if self.open() is not None:
            return None
        return f"there is no Delta table at {self.uri} (no _delta_log there)"

    def check_stream_schema(self, stream_schema, merge_schema: bool) -> None:
        """Refuse schema drift and partitioning changes before anything is staged."""
        # On an object store "is it a file" costs a HEAD and a LIST of the table root
        # (every data file at the root): asked only where no table opens there.
        local = _fs.is_local(self.uri)
        if local:
            self._refuse_file_root()
        dt = self.open(refresh=False)
        if dt is None and not local:
            self._refuse_file_root()
        config = self.table_properties if dt is None else dt.metadata().configuration or {}
        reserved = cdf_reserved(config, stream_schema.names)
        if reserved:
            raise ConfigError(
                f"the Delta table at {self.uri} has delta.enableChangeDataFeed=true, which "
                f"reserves the column names {sorted(CDF_COLUMNS)}; the stream has "
                f"{reserved}: rename them (the change feed could not be read otherwise)"
            )
        if dt is None:  # partition columns were checked against the stream by the options
            self._check_no_foreign_files()
            self._check_writable()
            return
        # The writer checks at every batch and the commit again: once per table
        # version, schema and settings is enough in a process.
        passed = (
            self.uri,
            dt.metadata().id,  # a re-created table has a new id
            dt.version(),
            stream_schema.serialize().to_pybytes(),
            merge_schema,
            tuple(self.partition_by),
            tuple(sorted(self.table_properties.items())),
        )
        if passed in _SCHEMA_CHECKS:
            return
        self._check_table_against(dt, stream_schema, merge_schema)
        if len(_SCHEMA_CHECKS) > 64:
            _SCHEMA_CHECKS.clear()
        _SCHEMA_CHECKS.add(passed)

    def _refuse_file_root(self) -> None:
        if self.fs.isfile(self.root):
            raise ConfigError(
                f"option path={self.uri!r} is a file, not a directory: the target must be a "
                "Delta table or a new (or empty) directory"
            )

    def _check_table_against(self, dt, stream_schema, merge_schema: bool) -> None:
        check_table_features(dt, self.uri)
        config = dt.metadata().configuration or {}
        differ = {k: v for k, v in self.table_properties.items() if config.get(k) != v}
        if differ:
            raise ConfigError(
                f"the Delta table at {self.uri} exists with "
                + ", ".join(f"{k}={config.get(k)!r}" for k in differ)
                + f"; the sink's options say {differ}. Table properties are set when the sink "
                "creates the table: change the table (ALTER TABLE ... SET TBLPROPERTIES) or "
                "drop the options"
            )
        table_parts = list(dt.metadata().partition_columns)
        if table_parts != self.partition_by:
            raise ConfigError(
                f"option partitionBy={self.partition_by} but the Delta table at {self.uri} is "
                f"partitioned by {table_parts}; use the table's partitioning"
            )
        added, problems = schema_drift(table_arrow_schema(dt), stream_schema)
        if problems or (added and not merge_schema):
            detail = "; ".join(problems + [f"the stream adds column {c!r}" for c in added])
            hint = "" if problems else " Set option mergeSchema=true to add new nullable columns."
            raise ConfigError(
                f"the stream's schema does not match the Delta table at {self.uri}: {detail}.{hint}"
            )

    def _check_writable(self) -> None:
        """A new table's folder can be made and written (local disks: a read-only
        filesystem, /proc, a file on the way), said by name before anything is staged,
        not as a bare OSError of a write task."""
        if not _fs.is_local(self.uri):
            return
        made: list[str] = []  # the folders this check makes, deepest last: removed again if empty
        folder = self.root
        while not os.path.exists(folder) and os.path.dirname(folder) != folder:
            made.insert(0, folder)
            folder = os.path.dirname(folder)
        probe = _fs.join(self.root, f".pyspark-txn-probe-{os.getpid()}-{threading.get_ident()}")
        try:
            os.makedirs(self.root, exist_ok=True)
            with open(probe, "wb"):
                pass
            os.remove(probe)
        except OSError as e:
            raise ConfigError(
                f"option path={self.uri!r}: cannot create or write the table's folder there "
                f"({type(e).__name__}: {e}); give a writable location"
            ) from e
        for path in reversed(made):
            try:
                os.rmdir(path)
            except OSError:  # another writer put something there meanwhile: it stays
                break

    def _check_no_foreign_files(self) -> None:
        """A new table is created only where nothing but this sink's own files are: its
        staging area, and data files of earlier attempts (a first batch that crashed
        before the table was created leaves them in the root or ``col=value/`` folders)."""
        if not self.fs.isdir(self.root):
            return
        root = self.root.rstrip("/") + "/"
        # Staged files of every sink with an attempt in the staging area are ours too:
        # two queries started together into a new path stage side by side, and one of
        # them creates the table (the other joins it at commit).
        sinks = {self.sink_id}
        staging = _fs.join(self.root, STAGING_ROOT)
        if self.fs.isdir(staging):
            sinks |= {p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(staging, detail=False)}
        ours = tuple(f"part-{sid}-" for sid in sinks)
        foreign = []
        for path in self.fs.find(self.root):
            rel = path[len(root) :] if path.startswith(root) else path
            top = rel.split("/", 1)[0]
            if (
                top in (STAGING_ROOT, "_delta_log")
                or top.startswith(ours)  # the fast path's folder of one attempt
                or os.path.basename(rel).startswith(ours)
            ):
                continue
            foreign.append(rel)
            if len(foreign) > 5:
                break
        if foreign:
            shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
            raise ConfigError(
                f"option path={self.uri!r} exists and is not a Delta table (it holds {shown}); "
                "refusing to create a table over files we do not know. Use an empty directory, "
                "or convert the data to Delta first"
            )

    # --- staged files -----------------------------------------------------------

    def _abs(self, rel: str) -> str:
        return _fs.join(self.root, rel)

    def _markers(self, snapshot_id: int, token: str) -> dict[str, int]:
        """Everything in an attempt's staging folder: marker path -> size (relative)."""
        base = self._abs(snapshot_dir(self.sink_id, snapshot_id, token))
        # find() alone: an "exists" first costs a HEAD and a LIST more on object stores
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        prefix = self.root.rstrip("/") + "/"
        return {
            (path[len(prefix) :] if path.startswith(prefix) else path): info["size"]
            for path, info in found.items()
            if info.get("type", "file") == "file"
        }

    def _attempt_files(
        self,
        snapshot_id: int,
        token: str,
        committed: Iterable[str] = (),
        own_folders: list[str] | None = None,
    ) -> dict[str, int]:
        """Relative path -> size of every data file of one attempt, found through its
        markers. Folders marked only by task attempts whose files are all in
        ``committed`` are not listed: a task that finished has no other files.
        The attempt's own folders found (the fast path's) are added to ``own_folders``."""
        prefix = data_file_prefix(self.sink_id, snapshot_id, token)
        done_attempts = finished_task_attempts(committed, prefix)
        files: dict[str, int] = {}
        folders: set[str] = set()
        for rel, size in self._markers(snapshot_id, token).items():
            name = os.path.basename(rel)
            if not name.endswith(MARKER_SUFFIX):
                files[rel] = size  # the earlier layout: data files in the attempt's folder
                continue
            if _marker_task_attempt(name) in done_attempts:
                continue
            folders.add(_fs.read_text(self.fs, self._abs(rel)))
        root = self.root.rstrip("/") + "/"
        for folder in folders:
            path = self._abs(folder) if folder else self.root
            if not self.fs.isdir(path):
                continue
            if os.path.basename(folder).startswith(prefix):
                # a folder of the attempt's own (the fast path's Spark output, written
                # in place): every file under it is the attempt's, Spark's leftovers too
                if own_folders is not None:
                    own_folders.append(folder)
                for entry, info in self.fs.find(path, detail=True).items():
                    files[entry[len(root) :] if entry.startswith(root) else entry] = info["size"]
                continue
            for info in self.fs.ls(path, detail=True):
                entry = info["name"]
                if os.path.basename(entry).startswith(prefix):
                    files[entry[len(root) :] if entry.startswith(root) else entry] = info["size"]
        return files

    def verify_staged(self, snapshot_id: int, token: str, txns: Sequence[TxnHandle]) -> None:
        """Every file is there with its size, and its parquet footer has the promised rows."""
        found = list(_map_io(self._staged_problem, txns, remote=not _fs.is_local(self.uri)))
        bad = [problem for problem in found if problem is not None]
        if bad:
            gone = not self.fs.exists(self.root)
            raise CorruptSnapshotError(
                f"sink {self.sink_id!r}, snapshot {snapshot_id}: "
                + (
                    f"the folder {self.uri} is gone (deleted or moved): the table is gone, "
                    "and the files staged in it with it: "
                    if gone
                    else f"staged files are missing or changed in {self.uri}: "
                )
                + ", ".join(bad)
            )
        self._verified = (snapshot_id, token, _txn_key(txns))

    def _staged_problem(self, t: TxnHandle) -> str | None:
        """What is wrong with one staged file, or None: its size and footer from one
        GET of its end where the store allows (a HEAD and a GET otherwise)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = self._abs(t.handle)
        try:
            size, tail = _fs.read_tail(self.fs, path, FOOTER_READ)
        except FileNotFoundError:
            size, tail = None, b""
        except Exception as e:
            return f"{t.handle} (unreadable: {e})"
        if size != t.bytes:
            found = "nothing" if size is None else size
            return f"{t.handle} (expected {t.bytes} bytes, found {found})"
        try:
            footer = int.from_bytes(tail[-8:-4], "little") + 8 if len(tail) >= 8 else size
            if footer > len(tail):  # a footer larger than the first read
                tail = self.fs.cat_file(path, start=max(0, size - footer), end=size)
            rows = pq.read_metadata(pa.BufferReader(tail)).num_rows
        except Exception as e:
            return f"{t.handle} (unreadable parquet footer: {e})"
        if rows != t.rows:
            return f"{t.handle} (expected {t.rows} rows, its footer says {rows})"
        return None

    def _staged_rows(self, t: TxnHandle):
        """One staged file's rows (phase 2 reads them only to evaluate a CHECK
        constraint added after the record)."""
        import pyarrow.parquet as pq

        with self.fs.open(self._abs(t.handle), "rb") as f:
            return pq.ParquetFile(f).read()  # not read_table: see delta_tables.read_rows

    def discard(self, snapshot_id: int, token: str, keep: Iterable[str] = ()) -> None:
        self._remove_staged(snapshot_id, token, keep, "uncommitted")

    def _remove_staged(self, snapshot_id: int, token: str, keep: Iterable[str], what: str) -> None:
        keep = set(keep)
        own: list[str] = []
        stray = [
            self._abs(rel)
            for rel in self._attempt_files(snapshot_id, token, committed=keep, own_folders=own)
            if rel not in keep
        ]
        if stray:
            log.info(
                "sink %s: removing %d %s files of snapshot %d",
                self.sink_id,
                len(stray),
                what,
                snapshot_id,
            )
            self.fs.rm(stray)
        # An attempt's own folder with no committed file in it goes whole (the empty
        # folders of Spark's output, its _temporary/ included).
        for folder in own:
            if not any(k.startswith(folder + "/") for k in keep):
                _fs.remove_tree(self.fs, self._abs(folder))

    def forget(self, snapshot_id: int, token: str) -> None:
        markers = [
            self._abs(rel)
            for rel in self._markers(snapshot_id, token)
            if rel.endswith(MARKER_SUFFIX)
        ]
        if markers:
            self.fs.rm(markers)
        base = self._abs(snapshot_dir(self.sink_id, snapshot_id, token))
        try:
            if not self.fs.exists(base):
                return
            # Folders left empty inside it (the fast path's Spark output folder after a
            # failed write), deepest first, then the attempt's own folder.
            found = self.fs.find(base, withdirs=True, detail=True)
            dirs = {p for p, info in found.items() if info.get("type") == "directory"}
            for d in sorted(dirs - {base}, key=len, reverse=True) + [base]:
                if not self.fs.ls(d, detail=False):
                    self.fs.rmdir(d)
        except OSError:  # a late marker, or a folder of the earlier layout: keep it
            log.debug("sink %s: staging folder %s kept", self.sink_id, base, exc_info=True)

    def staged_attempts(self) -> set[tuple[int, str]]:
        base = self._abs(f"{STAGING_ROOT}/{self.sink_id}")
        if not self.fs.exists(base):
            return set()
        attempts = set()
        for entry in self.fs.ls(base, detail=False):
            parsed = parse_snapshot_dir(entry)
            if parsed is not None:
                attempts.add(parsed)
        return attempts

    # --- before the record ------------------------------------------------------------

    def base(self) -> dict[str, Any]:
        """The table a record is made against (kept in the record's target meta): its
        version now and the sink's batch in it (lower bounds both: an older copy is fine;
        phase 2's commit will be above them). Phase 2 refuses a table below either:
        deleted, re-created, or put back to an older copy."""
        dt, batch = self._app_version_in(self.sink_id, refresh=False)
        if dt is None:
            return {"base_version": None}
        return {"base_version": dt.version(), "base_batch": batch}

    def preflight(self, record: SnapshotRecord) -> None:
        """What phase 2 would refuse, found before the record is written."""
        stream_schema = schema_from_b64(record.target["arrow_schema"])
        check_writable_schema(stream_schema)
        dt = self.open(refresh=False)
        if dt is None:
            return
        self.check_stream_schema(stream_schema, bool(record.target.get("merge_schema")))
        not_null = [f.name for f in table_arrow_schema(dt) if not f.nullable]
        nulls = batch_nulls(not_null, record.txns)
        if nulls:
            raise ConfigError(
                f"the Delta table at {self.uri} declares {sorted(nulls)} NOT NULL, but "
                f"batch {record.batch_id} has nulls there ({nulls}); nothing was committed"
            )

    def check_new_sink(self, sink_id: str, query_id: str | None, depth: int = 1000) -> None:
        """A sink with no history must not continue a query another sink wrote for."""
        if query_id is None:
            return
        dt = self.open()
        if dt is None:
            return
        for entry in dt.history(depth):
            other = entry.get(META_PREFIX + "sink_id")
            if entry.get(META_PREFIX + "query_id") == query_id and other and other != sink_id:
                raise CheckpointMismatchError(
                    f"the Delta table at {self.uri} holds commits of streaming query {query_id} "
                    f"made by sink {other!r} (version {entry.get('version')}), but this "
                    f"checkpoint now writes as sink {sink_id!r} with no history: its "
                    "pyspark_txn folder or record table was lost or replaced. Continuing would "
                    "duplicate data. Restore them, or start a new query with a new checkpoint."
                )

    # --- phase 2 ------------------------------------------------------------------

    def _held(self, batch_id: int):
        """The table (None if there is none yet) and the version of this sink's app
        transaction when it already holds ``batch_id`` (None: not committed yet)."""
        dt, done = self._app_version_in(self.sink_id)
        return dt, (done if done is not None and done >= batch_id else None)

    def commit(self, record: SnapshotRecord) -> int | None:
        dt, done = self._held(record.batch_id)
        if done is not None:
            return self._own_commit(dt, record, done)
        self._refuse_replaced(dt, record)
        if dt is not None and not record.txns and not self.commits_empty_batches:
            return None  # an empty batch: no empty Delta commit
        verified, self._verified = self._verified, None
        if verified != (record.snapshot_id, record.token, _txn_key(record.txns)):
            # Not what this target verified last, moments ago before the record (the
            # steady path's commit): recovery, a replay, a retried phase 2.
            self.verify_staged(record.snapshot_id, record.token, record.txns)
        before = None if dt is None else dt.version()
        dt = self._write_commit(
            dt,
            record.batch_id,
            record.txns,
            record.target,
            {
                "snapshot_id": record.snapshot_id,
                "query_id": record.query_id or "",
                "record_id": record.record_id,
            },
            # the table may have changed since the record: checked on the one committed to
            lambda table: refuse_changed_table(
                table, record, uri=self.uri, sink_id=self.sink_id, read_rows=self._staged_rows
            ),
        )
        if dt is None:
            return 0
        if before is not None and dt.version() == before + 1:
            return before + 1  # the only commit since the one ours was built on: ours
        return self._own_commit(dt, record, record.batch_id)

    def _refuse_replaced(self, dt, record: SnapshotRecord) -> None:
        """The table phase 2 found must be the one the record was made against: the
        checks for a lost table come before the record, and the table can go between
        them and phase 2. A new table there (or none: phase 2 would create one) would
        take this batch without the earlier ones, and every later batch would agree."""
        base = record.target.get("base_version")
        if base is None:
            return  # no table when the record was made: phase 2 creates it
        # Not the table's id: a table replaced in place (CREATE OR REPLACE) gets a new
        # one and keeps its log, history and app transactions: it is the same table.
        base_batch = record.target.get("base_batch")
        held = _app_version(dt, self.uri, self.sink_id, self.storage_options)
        if dt is None:
            now = "there is no table there now"
        elif dt.version() < int(base):
            now = f"it is at version {dt.version()} now: re-created or restored"
        elif base_batch is not None and (held is None or held < int(base_batch)):
            now = (
                f"it holds {held_batches(held)}, where it held batch {base_batch}: re-created "
                "or restored"
            )
        else:
            return
        raise TargetGoneError(
            f"sink {self.sink_id!r}: the Delta table at {self.uri} was at version {base} "
            f"when the record of batch {record.batch_id} (snapshot {record.snapshot_id}) was "
            f"written, and {now}. Phase 2 did not write: the batches before it would be "
            f"missing from the table. {RESTORE_THE_TABLE}"
        )

    def commit_batch(
        self,
        batch_id: int,
        txns: Sequence[TxnHandle],
        query_id: str | None,
        target_meta: Mapping[str, Any],
    ) -> tuple[int | None, bool]:
        """Light mode's phase 2, with no record: commit unless the table already holds
        ``batch_id`` of this sink. Returns (new version, whether it held it already)."""
        dt, done = self._held(batch_id)
        if done is not None:
            self._check_held_by(dt, done, query_id)
            return None, True
        if dt is not None and not txns and not self.commits_empty_batches:
            return None, False
        dt = self._write_commit(
            dt, batch_id, txns, target_meta, {"query_id": query_id or "", "mode": "light"}
        )
        return (0 if dt is None else dt.version()), False

    def _check_held_by(self, dt, done: int, query_id: str | None) -> None:
        """Light mode has no record: a batch the table holds is a replay only if this
        query wrote it. A new query (a new or reset checkpoint) writing as a sink id the
        table has seen would otherwise drop every batch up to ``done`` as "already there".
        The commit of the sink's latest batch names its query (``pyspark_txn.query_id``)."""
        if not query_id:
            return
        entry = None
        for limit in (10, 100, LIGHT_HISTORY_SCAN):  # each commit read is a GET on a store
            entry = next(
                (e for e in dt.history(limit) if e.get(META_PREFIX + "sink_id") == self.sink_id),
                None,
            )
            if entry is not None or limit > dt.version():
                break
        if entry is not None:
            writer = entry.get(META_PREFIX + "query_id") or None
            if writer is None or writer == query_id:
                return
            raise CheckpointMismatchError(
                f"sink {self.sink_id!r} (mode=light): the Delta table at {self.uri} already "
                f"holds batches up to {done} of this sink, written by query {writer}; this "
                f"query is {query_id} (another or a reset checkpoint). Its batches up to "
                f"{done} would be dropped as already written. Give this query its own sinkId, "
                "or run it on the checkpoint of the query that wrote them"
            )
        log.warning(
            "sink %s (light): the table holds batch %d of this sink, but none of its last %d "
            "commits names the query that wrote it; treating batch %d as a replay",
            self.sink_id,
            done,
            LIGHT_HISTORY_SCAN,
            done,
        )

    def _write_commit(
        self,
        dt,
        batch_id: int,
        txns: Sequence[TxnHandle],
        target_meta: Mapping[str, Any],
        stamps: Mapping[str, Any],
        recheck: Callable[[Any], None] | None = None,
    ):
        """One Delta commit adding ``txns`` with the sink's app transaction, creating
        the table (or adding merged columns) as the stream's schema says. ``recheck``
        is given the table the commit is built on, before anything is written to it
        (phase 2 of a record: :func:`.delta_recheck.refuse_changed_table`).

        Returns None when this commit created the table (as version 0), else the
        table it appended to. Creation is a race one writer wins: version 0 is
        written once, without delta-rs's commit retries (which would turn a lost
        race into a second ``metaData`` at version 1, DESIGN.md §8); the loser
        reloads the winner's table, checks the stream against it and appends.
        """
        props = self._commit_properties(batch_id, stamps)
        dt = self._table_for_commit(dt, target_meta, recheck, (add_actions(txns), props))
        if dt is None:
            return None  # created with the batch's files
        before = dt.version()
        self._apply(dt, txns, target_meta, props)
        return self._after_commit(dt, before, batch_id)

    def _commit_properties(self, batch_id: int, stamps: Mapping[str, Any]):
        """The sink's app transaction and stamps: what every phase 2 commit carries."""
        from deltalake.transaction import CommitProperties, Transaction

        return CommitProperties(
            app_transactions=[Transaction(app_id=self.sink_id, version=batch_id)],
            custom_metadata={
                META_PREFIX + "sink_id": self.sink_id,
                META_PREFIX + "batch_id": batch_id,
                **{META_PREFIX + k: v for k, v in stamps.items()},
                **({"userMetadata": self.user_metadata} if self.user_metadata else {}),
            },
        )

    def _table_for_commit(
        self,
        dt,
        target_meta: Mapping[str, Any],
        recheck: Callable[[Any], None] | None,
        create_with: tuple[Sequence[Any], Any] | None,
    ):
        """The table phase 2 commits to, checked (``recheck``) and with the stream's new
        columns where ``mergeSchema`` allows them. Where there is none yet it is created
        from the stream's schema: with ``create_with`` (add actions, commit properties)
        in the creating commit itself (then None is returned), else empty."""
        from deltalake import Schema
        from deltalake.transaction import CommitProperties, create_table_with_add_actions

        stream_schema = schema_from_b64(target_meta["arrow_schema"])
        if dt is None:
            adds, props = create_with if create_with is not None else ([], None)
            try:
                create_table_with_add_actions(
                    self.uri,
                    Schema.from_arrow(as_nullable(stream_schema)),
                    list(adds),
                    mode="error",
                    partition_by=self.partition_by or None,
                    name=self.table_name,
                    description=self.table_description,
                    configuration=self.table_properties or None,
                    storage_options=self.storage_options,
                    commit_properties=CommitProperties(
                        app_transactions=props.app_transactions if props else None,
                        custom_metadata=props.custom_metadata if props else None,
                        max_commit_retries=0,
                    ),
                )
                if create_with is not None:
                    return None
                dt = self.open()
            except Exception as e:
                dt = self.open()
                if dt is None:  # not a lost race: the creation itself failed
                    raise
                log.info(
                    "sink %s: another writer created the Delta table at %s first (%s); "
                    "writing to it",
                    self.sink_id,
                    self.uri,
                    e,
                )
                self._check_table_against(dt, stream_schema, bool(target_meta.get("merge_schema")))
        if recheck is not None:
            recheck(dt)
        added, _ = schema_drift(table_arrow_schema(dt), stream_schema)
        if added and target_meta.get("merge_schema"):
            from deltalake.schema import Field

            # as Spark's Delta sink does: rows already in the table have no value there
            dt.alter.add_columns(
                [Field.from_arrow(stream_schema.field(c).with_nullable(True)) for c in added]
            )
        return dt

    def _apply(self, dt, txns: Sequence[TxnHandle], target_meta: Mapping[str, Any], props) -> None:
        """How a batch's staged files change the table, in one commit carrying ``props``:
        added as :attr:`write_mode` says (a subclass may merge them by key instead)."""
        dt.create_write_transaction(
            add_actions(txns),
            mode=self.write_mode,
            schema=dt.schema(),
            partition_by=self.partition_by or None,
            commit_properties=props,
            post_commithook_properties=_NO_HOOKS(),
        )

    def _after_commit(self, dt, before: int, batch_id: int):
        """Bookkeeping after phase 2's commit on ``dt`` (read at ``before``)."""
        dt.update_incremental()
        if dt.version() == before + 1:  # ours is the only commit since: its txn is known
            _app_versions()[(self.uri, self.sink_id)] = (dt, dt.version(), batch_id)
        # (with others' commits after ours too: the object has just read them all)
        note_own_commit(self.uri, self.storage_options, dt)
        maintain_log(dt, self.uri, self.storage_options)
        return dt

    def committed_version(self, record: SnapshotRecord) -> int | None:
        """The table version that holds ``record``'s commit (by its stamp); None if the
        table does not hold it."""
        dt, done = self._held(record.batch_id)
        if done is None:
            return None
        try:
            return self._own_commit(dt, record, done)
        except CheckpointMismatchError:
            return None

    def commit_stamps(self, versions: Iterable[int]) -> dict[int, str | None]:
        """Version -> the record id stamped on its commit (None: not ours), for the
        versions the table still has."""
        dt = self.open()
        wanted = set(versions)
        if dt is None or not wanted:
            return {}
        out: dict[int, str | None] = {}
        for entry in dt.history(max(1, dt.version() - min(wanted) + 1)):
            v = entry.get("version")
            if v in wanted:
                out[v] = entry.get(META_PREFIX + "record_id")
        return out

    def _own_commit(self, dt, record: SnapshotRecord, done: int) -> int:
        """The version whose commit carries ``record``'s stamp, searched above the version
        the record was made at. The app transaction alone cannot tell: another query
        writing as the same sink id moves it too."""
        base = record.target.get("base_version")
        since = -1 if base is None else int(base)
        for entry in dt.history(max(1, dt.version() - since)):
            if entry.get("version", -1) <= since:
                break
            stamp = entry.get(META_PREFIX + "record_id")
            if stamp == record.record_id or (
                stamp is None  # committed by a version that did not stamp record ids
                and entry.get(META_PREFIX + "sink_id") == self.sink_id
                and entry.get(META_PREFIX + "batch_id") == record.batch_id
            ):
                return entry["version"]
        raise CheckpointMismatchError(
            f"sink {self.sink_id!r}: the Delta table at {self.uri} says batch {done} >= "
            f"{record.batch_id} of this sink is committed, but no commit since version "
            f"{since} carries snapshot {record.snapshot_id} (record {record.record_id}): "
            "another query writes to this table as the same sink id. Give every query its "
            "own sinkId; then abandon this snapshot (`pyspark-txn abandon`) or restore."
        )


#: Bytes read from the end of a staged file to check its footer (one GET where the
#: store takes suffix ranges); a larger footer costs a second read.
FOOTER_READ = 64 * 1024

#: Staged files checked at once on an object store (each check waits on a request).
VERIFY_THREADS = 16


def _map_io(fn, items: Sequence[Any], *, remote: bool):
    """``map(fn, items)``, on a few threads where each call waits on an object store."""
    if not remote or len(items) < 2:
        return map(fn, items)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(VERIFY_THREADS, len(items))) as pool:
        return list(pool.map(fn, items))


#: How many of the table's latest commits light mode reads for the one that holds the
#: sink's latest batch (only when a batch is already there: a replay or another query).
LIGHT_HISTORY_SCAN = 1000


def _txn_key(txns: Sequence[TxnHandle]) -> tuple:
    return tuple(sorted((t.handle, t.bytes, t.rows) for t in txns))


def finished_task_attempts(committed: Iterable[str], prefix: str) -> set[str]:
    """``<partition>-<attempt>`` of every task attempt that wrote a committed file:
    a file under a folder of the attempt's own (the fast path's, named with
    ``prefix``), or a file named with ``prefix`` in the table's folders (a flat
    table's files are at the top, where the name itself starts with ``prefix``:
    read as a folder, it named no attempt, and every commit listed the whole
    table's folder)."""
    return {
        _folder_task_attempt(top)
        if "/" in h and top.startswith(prefix)
        else _file_task_attempt(os.path.basename(h))
        for h in committed
        for top in [h.split("/", 1)[0]]
    }


def _file_task_attempt(name: str) -> str:
    """``<partition>-<attempt>`` of a data file ``part-...-<partition>-<attempt>-<n>.parquet``."""
    return "-".join(name.rsplit("-", 3)[1:3])


def _folder_task_attempt(name: str) -> str:
    """``<partition>-<attempt>`` of an attempt's folder ``part-...-<partition>-<attempt>``."""
    return "-".join(name.rsplit("-", 2)[1:3])


def _marker_task_attempt(name: str) -> str:
    """``<partition>-<attempt>`` of a marker ``<partition>-<attempt>-<k>.dir``."""
    return "-".join(name.split("-")[:2])
