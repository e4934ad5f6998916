"""``txn-delta`` as a streaming source: the appends of a Delta table, by version.

The offset ``{"version": v, "index": i, "snapshot": s, "tableId": t}`` names the
next file to read: file ``i`` of version ``v``'s change set, where the change set of a
commit is its ``add`` actions with ``dataChange=true`` in log order, and (with
``snapshot`` true) the change set is the whole table at ``v``, sorted by path.
A file list for a version never changes, so a range of offsets always names
the same files: replayable for as long as the Delta log keeps those versions
(an offset at a version whose commit was cleaned from the log is a
``SourceError``, never a silent skip). ``tableId`` is the Delta table's id (its
``metaData.id``, Delta's own streaming source calls it ``reservoirId``): an offset
names a version *of one table*, so a checkpoint started on another table (a
restored checkpoint on the original upstream, a table re-created at the same path)
is refused instead of reading that table's versions as if they were its own.
Offsets written before ids were (no ``tableId``) are accepted as they are.

What a file contributes is fixed by its ``add`` action, so replays are exact:
- partition values come from the action (strings in the log, converted to
  the column type as PROTOCOL.md "Partition Value Serialization" says: an
  empty string is null; a timestamp without a zone is read as UTC);
- its deletion vector (inline, ``u`` or ``p`` file) is decoded and the deleted
  rows are skipped (the ``deletionVectors`` reader feature);
- with column mapping (``name`` or ``id``) data columns are resolved by
  physical name or parquet field id, nested fields included; a column a file
  does not have reads as null;
- files are read in bounded record batches, never whole.

Commits that remove data (overwrite, delete, merge) stop the stream unless
``ignoreChanges=true``, which, like Delta's option of that name, ignores their
removes and streams the files they add (rewritten files are read again:
unchanged rows can come twice). Compactions (``dataChange=false``) are skipped.
A schema change the stream's schema cannot carry (a new or retyped column, a
rename, a column-mapping mode change) or a reader feature this source does not
implement stops the stream *at* that version, after everything before it was
served: restart the query to pick up the new schema (files written before the
change read the new columns as null).

Modules: this one (the options and the reader), ``delta_schema`` (logical to physical
schema, compatible changes, reading a data file into the stream's schema),
``delta_commits`` (the Delta log: protocol checks, commits, a snapshot's deletion vectors)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition

from ..errors import ConfigError, SourceError
from ..spark.arrow import spark_to_arrow_schema
from ..spark.options import check_location, parse_storage_options, reject_unknown_options
from ..storage import fs as _fs
from ..storage.options import StorageOptions
from ._common import SupportsTriggerAvailableNow, canonical, check_batch_order
from ._deletion_vectors import load_deletion_vector
from ._partition_values import parse_partition_value
from .delta_commits import (
    ChangeSet,
    DeltaFile,
    _mapping_mode,
    _Protocol,
    _protocol_problem,
    _read_commit,
    _snapshot_deletion_vectors,
)
from .delta_schema import (
    READ_BATCH_ROWS,
    _conform,
    _lookup,
    _partition_column,
    _physical,
    _source_fields,
    _struct_change,
)

DELTA_SOURCE_OPTIONS = {
    "path": "Delta table URI (required)",
    "startingVersion": "'snapshot' (default: the table as of the start, then its appends), "
    "a version number (appends from that commit on) or 'latest' (only new appends)",
    "maxFilesPerBatch": "most data files per micro-batch (default 1000)",
    "ignoreChanges": "true: don't stop at commits that remove data; their removes are ignored "
    "and the files they add are streamed (rewritten rows come again), as Delta's ignoreChanges",
    "storageOptions": "JSON object of delta-rs storage options",
}


@dataclass(frozen=True)
class DeltaSourceOptions:
    path: str
    starting: str = "snapshot"  # 'snapshot' | 'latest' | a version number
    max_files_per_batch: int = 1000
    ignore_changes: bool = False
    storage_options: tuple[tuple[str, str], ...] = ()
    fs_options: tuple[tuple[str, str], ...] = ()

    @property
    def storage(self) -> StorageOptions:
        """``storageOptions`` and ``fs.*`` as one storage configuration."""
        return StorageOptions.of(self.storage_options, self.fs_options)

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> DeltaSourceOptions:
        opts = {k.lower(): v for k, v in options.items()}
        reject_unknown_options(
            "txn-delta source", opts, DELTA_SOURCE_OPTIONS, {"fs.": "fs.<fsspec option>"}
        )
        if not opts.get("path"):
            raise ConfigError("txn-delta source: option path (the Delta table to read) is required")
        starting = opts.get("startingversion", "snapshot").strip().lower()
        if starting not in ("snapshot", "latest") and not starting.isdigit():
            raise ConfigError(
                f"txn-delta source: option startingVersion={opts['startingversion']!r}: expected "
                "'snapshot', 'latest' or a version number >= 0"
            )
        raw_max = opts.get("maxfilesperbatch", "1000")
        if not raw_max.isdigit() or int(raw_max) < 1:
            raise ConfigError(
                f"txn-delta source: option maxFilesPerBatch={raw_max!r}: expected an integer >= 1"
            )
        ignore = opts.get("ignorechanges", "false").lower()
        if ignore not in ("true", "false"):
            raise ConfigError(
                f"txn-delta source: option ignoreChanges={ignore!r}: expected true or false"
            )
        check_location("path", opts["path"])
        return cls(
            path=_fs.normalize_uri(opts["path"]),
            starting=starting,
            max_files_per_batch=int(raw_max),
            ignore_changes=ignore == "true",
            storage_options=parse_storage_options(
                opts.get("storageoptions"), "txn-delta source", "storageOptions"
            ),
            fs_options=tuple(sorted((k[3:], v) for k, v in opts.items() if k.startswith("fs."))),
        )

    def table(self, version: int | None = None):
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        try:
            return DeltaTable(
                self.path, version=version, storage_options=dict(self.storage_options) or None
            )
        except TableNotFoundError as e:
            if version is None and "No files in log segment" in str(e):
                # delta-rs' words for a folder without commits: say it in the user's terms
                raise SourceError(
                    f"txn-delta source: cannot open the Delta table {self.path}: option "
                    f"path={self.path!r} is not a Delta table (no commits in its _delta_log/; "
                    f"delta-rs: {e}). Give the folder that holds the table's _delta_log/"
                ) from e
            if version is None:
                raise SourceError(
                    f"txn-delta source: cannot open the Delta table {self.path}: option "
                    f"path={self.path!r}: no table there ({e})"
                ) from e
            raise SourceError(
                f"txn-delta source: cannot open the Delta table {self.path} at version "
                f"{version}: {e}"
            ) from e
        except Exception as e:
            at = "its latest version" if version is None else f"version {version}"
            hint = (
                ""
                if version is None
                else " (if log retention cleaned that version's commits, the offsets cannot be "
                "replayed: restart from a snapshot with startingVersion=snapshot and a new "
                "checkpoint)"
            )
            raise SourceError(
                f"txn-delta source: cannot open the Delta table {self.path} at {at}: {e}{hint}"
            ) from e

    def spark_schema_ddl(self):
        """The stream's Spark schema: the table's, without Delta's internal column metadata."""
        from pyspark.sql.types import StructType

        return StructType.fromJson(
            _strip_delta_metadata(json.loads(self.table().schema().to_json()))
        )


def _strip_delta_metadata(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _strip_delta_metadata(v) for k, v in node.items()}
        if isinstance(out.get("metadata"), dict):
            out["metadata"] = {
                k: v for k, v in out["metadata"].items() if not k.startswith("delta.")
            }
        return out
    if isinstance(node, list):
        return [_strip_delta_metadata(v) for v in node]
    return node


class DeltaFiles(InputPartition):
    def __init__(self, files: list[DeltaFile]) -> None:
        self.files = files


class DeltaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, opts: DeltaSourceOptions, schema) -> None:
        self.opts = opts
        self.arrow_schema = spark_to_arrow_schema(schema)
        dt = opts.table()
        self.protocol = _Protocol.of(dt.protocol())
        problem = _protocol_problem(self.protocol)
        if problem:
            raise SourceError(f"txn-delta source: {opts.path} {problem}")
        self.table_id = str(dt.metadata().id)
        self.configuration = dict(dt.metadata().configuration or {})
        self.mode = _mapping_mode(self.configuration, self.protocol)
        # the Delta schema the stream was built from (physical names, ids, types)
        self.table_schema = json.loads(dt.schema().to_json())
        self.schema_version = dt.version()
        by_name = {f["name"]: f for f in self.table_schema["fields"]}
        by_lower = {f["name"].lower(): f for f in self.table_schema["fields"]}
        self.fields: list[dict] = []
        for field in self.arrow_schema:
            df = by_name.get(field.name) or by_lower.get(field.name.lower())
            if df is None:
                raise SourceError(
                    f"txn-delta source: column {field.name!r} of the stream's schema is not in "
                    f"the Delta table {opts.path} (columns: {sorted(by_name)})"
                )
            self.fields.append(df)
        # physical name (a partition value's key in the log) -> the stream's column
        self.column_of_physical = {
            _physical(df, self.mode): field.name
            for field, df in zip(self.arrow_schema, self.fields, strict=True)
        }
        self._changes: dict[tuple[int, bool], ChangeSet] = {}
        self.target_version: int | None = None
        self.current: dict | None = None
        self.fs, self.root = _fs.filesystem(opts.path, opts.storage)

    def __getstate__(self) -> dict[str, Any]:
        # read() runs on executors from a pickled copy: the file lists stay on the driver
        state = dict(self.__dict__)
        state["_changes"] = {}
        state.pop("fs", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.fs, self.root = _fs.filesystem(self.opts.path, self.opts.storage)

    # --- file lists per version (cached: they never change) ---------------------

    def _file(self, rel: str, partition_values: Mapping[str, Any], dv) -> DeltaFile:
        from urllib.parse import unquote

        uri = rel if "://" in rel else _fs.join(self.opts.path, unquote(rel))
        pv = tuple(sorted(partition_values.items()))
        return DeltaFile(uri, pv, None if not dv else tuple(sorted(dv.items())))

    def _change_set(self, version: int, snapshot: bool) -> ChangeSet:
        key = (version, snapshot)
        if key not in self._changes:
            self._changes[key] = (
                self._snapshot_files(version) if snapshot else self._commit_files(version)
            )
        return self._changes[key]

    def _table_problem(
        self, version: int, protocol: _Protocol, configuration: Mapping, schema: Mapping
    ) -> str | None:
        """Why a version with this protocol, configuration and schema cannot be streamed.

        The stream's schema is the table's at ``schema_version``. Files of versions up to
        there are read by that schema's mapping (physical names never move; a column a file
        lacks is null): that is how a restarted query replays a renamed or widened history.
        A later version whose schema the stream's cannot carry stops the stream.
        """
        problem = _protocol_problem(protocol)
        if problem:
            return problem
        if version <= self.schema_version:
            return None
        mode = _mapping_mode(configuration, protocol)
        change: str | None
        if mode != self.mode:
            change = f"column mapping mode changed from {self.mode!r} to {mode!r}"
        else:
            change = _struct_change(schema, self.table_schema, self.mode)
        return f"{change}. Restart the query to read the new schema." if change else None

    def _stop(self, version: int, why: str) -> ChangeSet:
        return ChangeSet(
            (),
            f"txn-delta source: version {version} of {self.opts.path} cannot be streamed: {why}",
        )

    def _snapshot_files(self, version: int) -> ChangeSet:
        import pyarrow as pa

        dt = self.opts.table(version)
        protocol = _Protocol.of(dt.protocol())
        configuration = dt.metadata().configuration or {}
        schema = json.loads(dt.schema().to_json())
        problem = self._table_problem(version, protocol, configuration, schema)
        if problem:
            return self._stop(version, problem)
        # deltalake lists partition values by the logical names of this version: to the
        # stream's columns through the physical names, which a rename does not move
        mode = _mapping_mode(configuration, protocol)
        physical = {f["name"]: _physical(f, mode) for f in schema["fields"]}
        actions = pa.table(dt.get_add_actions(flatten=False))
        paths = actions.column("path").to_pylist()
        if "partition" in actions.column_names:
            partitions = actions.column("partition").to_pylist()
        else:
            partitions = [{}] * len(paths)
        dvs: dict[str, Any] = {}
        if protocol.min_reader_version == 3 and "deletionVectors" in (
            protocol.reader_features or []
        ):
            dvs = _snapshot_deletion_vectors(self.fs, self.root, version, paths)
        files = []
        for path, parts in zip(paths, partitions, strict=True):
            values = {}
            for key, value in (parts or {}).items():
                name = self.column_of_physical.get(physical.get(key, key))
                if name is not None:
                    values[name] = value
            files.append(self._file(path, values, dvs.get(path)))
        return ChangeSet(tuple(sorted(files, key=lambda f: f.uri)))

    def _commit_files(self, version: int) -> ChangeSet:
        actions = _read_commit(self.fs, self.root, version, self.opts.path)
        files = []
        types = {
            field.name: df["type"] for field, df in zip(self.arrow_schema, self.fields, strict=True)
        }
        problem = self._commit_problem(version, actions)
        if problem:
            return self._stop(version, problem)
        for action in actions:
            if "remove" in action and action["remove"].get("dataChange", True):
                if self.opts.ignore_changes:
                    continue
                return self._stop(
                    version,
                    f"it removes data ({action['remove']['path']}); only appends can be "
                    "streamed. Set option ignoreChanges=true to stream the files such commits "
                    "add and ignore what they remove.",
                )
            add = action.get("add")
            if add and add.get("dataChange", True):
                values = {}
                for key, raw in (add.get("partitionValues") or {}).items():
                    name = self.column_of_physical.get(key)
                    if name is not None:
                        values[name] = parse_partition_value(raw, types[name])
                files.append(self._file(add["path"], values, add.get("deletionVector")))
        return ChangeSet(tuple(files))

    def _commit_problem(self, version: int, actions: list[dict]) -> str | None:
        protocol = next((a["protocol"] for a in actions if "protocol" in a), None)
        meta = next((a["metaData"] for a in actions if "metaData" in a), None)
        if protocol is None and meta is None:
            return None
        if version <= self.schema_version:  # read by the stream's (newer) schema: see above
            return _protocol_problem(_Protocol.of(protocol)) if protocol else None
        # the version's own snapshot knows the protocol and metadata in effect together
        # (column mapping is honoured only with its feature); the actions, if it is gone
        try:
            dt = self.opts.table(version)
        except SourceError:
            dt = None
        if dt is not None:
            return self._table_problem(
                version,
                _Protocol.of(dt.protocol()),
                dt.metadata().configuration or {},
                json.loads(dt.schema().to_json()),
            )
        return self._table_problem(
            version,
            _Protocol.of(protocol) if protocol else self.protocol,
            (meta or {}).get("configuration") or self.configuration,
            json.loads(meta["schemaString"]) if meta else self.table_schema,
        )

    # --- offsets ----------------------------------------------------------------

    def initialOffset(self) -> dict:
        # Spark asks again when it runs the first batch (to get its start): with
        # 'snapshot' or 'latest' the table may have moved on by then, and a second
        # answer past the batch's end would make that batch read nothing.
        if getattr(self, "_initial", None) is None:
            self._initial = self._initial_offset()
        return self._initial

    def _initial_offset(self) -> dict:
        latest = self.opts.table().version()
        if self.opts.starting == "snapshot":
            return self._offset(latest, 0, True)
        if self.opts.starting == "latest":
            return self._offset(latest + 1, 0, False)
        version = int(self.opts.starting)
        if version > latest + 1:
            raise SourceError(
                f"option startingVersion={version}: the Delta table at {self.opts.path} is at "
                f"version {latest}; start at most at {latest + 1} (the next commit), or use "
                "'latest'"
            )
        return self._offset(version, 0, False)

    def _offset(self, version: int, index: int, snapshot: bool) -> dict:
        return canonical(
            {"version": version, "index": index, "snapshot": snapshot, "tableId": self.table_id}
        )

    def _check_table(self, offset: Mapping[str, Any], table_id: str | None = None) -> None:
        """An offset of another Delta table than the one at ``path`` is refused (offsets
        without ``tableId``, written before ids were, are taken as they are)."""
        want = offset.get("tableId")
        got = table_id or self.table_id
        if want is not None and want != got:
            raise SourceError(
                f"txn-delta source: this query's checkpoint holds offsets of the Delta table "
                f"with id {want}, but option path={self.opts.path!r} is the table with id "
                f"{got}: it would read another table's versions as its own (duplicates or "
                "holes). Start the source on the table the checkpoint was made for (a "
                "checkpoint restored from a backup reads the restored upstream table: "
                "`backups restore` printed it, <checkpoint>/pyspark_txn/started_from.json "
                "names it), or start a new query (a new checkpoint)"
            )

    def _files_from(self, start: dict, last_version: int) -> Iterator[tuple[tuple, Any]]:
        """(position, file) from ``start`` through ``last_version``, in offset order.

        A version that cannot be streamed yields ``(position, ChangeSet)`` and ends the walk.
        """
        version, index, snap = start["version"], start["index"], start["snapshot"]
        while version <= last_version:
            changes = self._change_set(version, snap)
            if changes.error:
                yield (version, 0, snap), changes
                return
            for i in range(index, len(changes.files)):
                yield (version, i, snap), changes.files[i]
            version, index, snap = version + 1, 0, False

    def latestOffset(self, start: dict | None = None, limit: Any = None) -> dict:
        # PySpark < 4.2 passes no start: where this process planned last (a restarted
        # query re-plans its last batch first, see partitions), else the initial offset
        start = start or self.current or self.initialOffset()
        dt = self.opts.table()
        self._check_table(start, str(dt.metadata().id))
        latest = dt.version()
        if self.target_version is not None:
            latest = min(latest, self.target_version)
        taken, end = 0, self._offset(latest + 1, 0, False)
        for (v, i, snap), item in self._files_from(start, latest):
            if isinstance(item, ChangeSet):  # stop before it; fail once nothing precedes it
                if not taken:
                    raise SourceError(item.error)
                end = self._offset(v, 0, snap)
                break
            if taken == self.opts.max_files_per_batch:
                end = self._offset(v, i, snap)
                break
            taken += 1
        self.current = end if taken else start
        return self.current

    def prepareForTriggerAvailableNow(self) -> None:
        self.target_version = self.opts.table().version()

    def partitions(self, start: dict, end: dict) -> list[DeltaFiles]:
        self._check_table(start)
        self._check_table(end)
        check_batch_order(
            "txn-delta source",
            (start["version"], start["index"]),
            (end["version"], end["index"]),
        )
        self.current = canonical(end)
        stop = (end["version"], end["index"], end["snapshot"])
        last = end["version"] if end["index"] or end["snapshot"] else end["version"] - 1
        files = []
        for pos, f in self._files_from(start, last):
            if pos == stop:
                break
            if isinstance(f, ChangeSet):
                raise SourceError(f.error)
            files.append(f)
        return [DeltaFiles([f]) for f in files]

    def read(self, partition: DeltaFiles):  # type: ignore[override]  # our partitions
        for f in partition.files:
            yield from self._read_file(f)

    def _read_file(self, f: DeltaFile):
        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        deleted = None
        if f.deletion_vector:
            deleted = load_deletion_vector(self.opts.path, dict(f.deletion_vector), self.fs)
        values = dict(f.partition_values)
        try:
            fh = self.fs.open(f.uri.removeprefix("file://"), "rb")
        except FileNotFoundError as e:
            raise SourceError(
                f"txn-delta source: data file {f.uri} of the table at {self.opts.path} is gone "
                "(VACUUM, or the table was deleted or replaced) but a batch of this query "
                "names it: the rows it held cannot be read again. Restore the file, or start "
                "a new query (new checkpoint) from a later startingVersion; keep VACUUM's "
                "retention longer than any reader of this table lags"
            ) from e
        with fh:
            try:
                pf = pq.ParquetFile(fh, coerce_int96_timestamp_unit="us")
            except Exception as e:
                raise SourceError(f"txn-delta source: cannot read data file {f.uri}: {e}") from e
            file_fields = list(pf.schema_arrow)
            index = _source_fields(file_fields, self.mode)
            if self.mode == "id" and not index and file_fields:
                raise SourceError(
                    f"txn-delta source: data file {f.uri} has no parquet field ids, which column "
                    "mapping mode 'id' needs to resolve its columns"
                )
            plan: list[
                tuple[Any, ...]
            ] = []  # per stream column: ('part', value) | ('file', i) | ('null',)
            wanted: list[int] = []
            for field, df in zip(self.arrow_schema, self.fields, strict=True):
                if field.name in values:
                    plan.append(("part", values[field.name]))
                    continue
                i = _lookup(index, df, self.mode)
                if i is None:
                    plan.append(("null",))
                else:
                    plan.append(("file", len(wanted)))
                    wanted.append(i)
            names = [file_fields[i].name for i in wanted]
            row = 0
            for batch in pf.iter_batches(batch_size=READ_BATCH_ROWS, columns=names):
                n = batch.num_rows
                cols = []
                for field, df, step in zip(self.arrow_schema, self.fields, plan, strict=True):
                    where = f"column {field.name!r} of {f.uri}"
                    if step[0] == "part":
                        cols.append(_partition_column(step[1], field.type, n, where))
                    elif step[0] == "null":
                        cols.append(pa.nulls(n, field.type))
                    else:
                        column = batch.column(names[step[1]])
                        cols.append(_conform(column, field.type, df["type"], self.mode, where))
                out = pa.RecordBatch.from_arrays(cols, schema=self.arrow_schema)
                if deleted is not None and len(deleted):
                    lo, hi = np.searchsorted(deleted, [row, row + n])
                    if hi > lo:
                        keep = np.ones(n, dtype=bool)
                        keep[(deleted[lo:hi] - row).astype(np.int64)] = False
                        out = out.filter(pa.array(keep))
                row += n
                if out.num_rows:
                    yield out

    def commit(self, end: dict) -> None:
        # replayable: nothing to acknowledge; file lists before ``end`` are not asked again
        # (a replay would just list them again), so a long-running query's cache stays small
        self._changes = {k: v for k, v in self._changes.items() if k[0] >= end["version"]}
