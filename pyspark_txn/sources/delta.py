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
unchanged rows can come twice), or ``skipChangeCommits=true``, which skips such
commits whole, as Delta's option does. Compactions (``dataChange=false``) are skipped.

With ``readChangeFeed=true`` the stream is the table's change data feed instead
(``delta_cdf``): a version's change set is its ``cdc`` files, or its adds and removes
as inserts and deletes, and rows carry ``_change_type``, ``_commit_version`` and
``_commit_timestamp``. Its offsets say ``"changeFeed": true``: an index counts another
kind of change set, so a checkpoint is never read in the other mode.
``maxFilesPerBatch`` and ``maxBytesPerBatch`` (soft, as Delta's) bound a batch in
both modes.
A schema change the stream's schema cannot carry (a new or retyped column, a
rename, a column-mapping mode change) or a reader feature this source does not
implement stops the stream *at* that version, after everything before it was
served: restart the query to pick up the new schema (files written before the
change read the new columns as null).

Modules: this one (the options and the reader), ``delta_schema`` (logical to physical
schema, compatible changes, reading a data file into the stream's schema),
``delta_commits`` (the Delta log: protocol checks, commits, a snapshot's deletion vectors),
``delta_cdf`` (the change data feed: a version's change files, the three columns)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition

from ..errors import ConfigError, SourceError
from ..spark.arrow import spark_to_arrow_schema
from ..spark.options import check_location, parse_storage_options, reject_unknown_options
from ..storage import fs as _fs
from ..storage.delta_tables import open_table
from ..storage.options import StorageOptions
from ._common import SupportsTriggerAvailableNow, canonical, check_batch_order
from ._deletion_vectors import load_deletion_vector
from ._partition_values import parse_partition_value
from .delta_cdf import (
    CHANGE_FIELDS,
    CHANGE_TYPE,
    change_feed_schema,
    commit_changes,
    commit_timestamp_ms,
    kept_rows,
    no_change_data,
    records_change_data,
    snapshot_changes,
)
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

log = logging.getLogger(__name__)

DELTA_SOURCE_OPTIONS = {
    "path": "Delta table URI (required)",
    "startingVersion": "'snapshot' (default: the table as of the start, then its appends), "
    "a version number (appends from that commit on) or 'latest' (only new appends)",
    "maxFilesPerBatch": "most data files per micro-batch (default 1000)",
    "maxBytesPerBatch": "about this many bytes of data files per micro-batch (a soft limit: "
    "a batch takes files while it holds fewer bytes, at least one; e.g. 512m, 1g)",
    "ignoreChanges": "true: don't stop at commits that remove data; their removes are ignored "
    "and the files they add are streamed (rewritten rows come again), as Delta's ignoreChanges",
    "skipChangeCommits": "true: skip commits that remove or rewrite rows, whole (their adds "
    "too), as Delta's skipChangeCommits",
    "readChangeFeed": "true: stream the table's change data feed (rows plus _change_type, "
    "_commit_version, _commit_timestamp), as Delta's readChangeFeed",
    "storageOptions": "JSON object of delta-rs storage options",
}

_SIZE = re.compile(r"(\d+)\s*([kmgt]?)(?:i?b)?")


def _flag(opts: Mapping[str, str], name: str) -> bool:
    raw = opts.get(name.lower(), "false").strip().lower()
    if raw not in ("true", "false"):
        raise ConfigError(
            f"txn-delta source: option {name}={opts[name.lower()]!r}: expected true or false"
        )
    return raw == "true"


def _size(raw: str | None) -> int | None:
    """A byte size as Spark writes them: ``1048576``, ``512k``, ``64m``, ``1g`` (powers of 1024)."""
    if raw is None:
        return None
    m = _SIZE.fullmatch(raw.strip().lower())
    value = int(m[1]) << (10 * " kmgt".index(m[2] or " ")) if m else 0
    if value < 1:
        raise ConfigError(
            f"txn-delta source: option maxBytesPerBatch={raw!r}: expected a size of at least "
            "1 byte: a number of bytes, or with k, m, g or t (1024-based), e.g. 512m"
        )
    return value


@dataclass(frozen=True)
class DeltaSourceOptions:
    path: str
    starting: str = "snapshot"  # 'snapshot' | 'latest' | a version number
    max_files_per_batch: int = 1000
    max_bytes_per_batch: int | None = None
    ignore_changes: bool = False
    skip_change_commits: bool = False
    read_change_feed: bool = False
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
        flags = {
            name: _flag(opts, name)
            for name in ("ignoreChanges", "skipChangeCommits", "readChangeFeed")
        }
        for a, b in (
            ("readChangeFeed", "ignoreChanges"),
            ("readChangeFeed", "skipChangeCommits"),
            ("ignoreChanges", "skipChangeCommits"),
        ):
            if flags[a] and flags[b]:
                raise ConfigError(
                    f"txn-delta source: options {a}=true and {b}=true exclude each other: "
                    + _EXCLUSIVE[a, b]
                )
        max_bytes = _size(opts.get("maxbytesperbatch"))
        check_location("path", opts["path"])
        return cls(
            path=_fs.normalize_uri(opts["path"]),
            starting=starting,
            max_files_per_batch=int(raw_max),
            max_bytes_per_batch=max_bytes,
            ignore_changes=flags["ignoreChanges"],
            skip_change_commits=flags["skipChangeCommits"],
            read_change_feed=flags["readChangeFeed"],
            storage_options=parse_storage_options(
                opts.get("storageoptions"), "txn-delta source", "storageOptions"
            ),
            fs_options=tuple(sorted((k[3:], v) for k, v in opts.items() if k.startswith("fs."))),
        )

    def table(self, version: int | None = None):
        """The table at ``version``, or at its latest: then this thread's cached object,
        caught up (``storage.delta_tables.open_table``: a check of the last commit file
        and the new commits, not a replay of the log at every planning call)."""
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        if version is None:
            try:
                latest = open_table(self.path, dict(self.storage_options) or None)
            except Exception:  # DeltaTable below says why, in the words of this source
                latest = None
            if latest is not None:
                return latest
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
        """The stream's Spark schema: the table's, without Delta's internal column metadata
        (with ``readChangeFeed``: and the change feed's three columns)."""
        from pyspark.sql.types import StructType

        schema = _strip_delta_metadata(json.loads(self.table().schema().to_json()))
        if self.read_change_feed:
            schema = change_feed_schema(schema, self.path)
        return StructType.fromJson(schema)


_EXCLUSIVE = {
    ("readChangeFeed", "ignoreChanges"): "the change feed already streams what commits "
    "remove and rewrite, as deletes and updates; drop ignoreChanges",
    ("readChangeFeed", "skipChangeCommits"): "the change feed streams the commits that "
    "skipChangeCommits would skip; drop one",
    ("ignoreChanges", "skipChangeCommits"): "one streams the files such commits add, the "
    "other skips those commits whole; choose one",
}


def _position(offset: Mapping[str, Any]) -> tuple[int, int, int]:
    """Where an offset stands in the stream: the snapshot of version v (its files in
    order) comes after every change up to v and before those of v + 1."""
    if offset.get("snapshot"):
        return offset["version"] + 1, -1, offset["index"]
    return offset["version"], 0, offset["index"]


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
        self.partition_columns = list(dt.metadata().partition_columns or [])
        self.configuration = dict(dt.metadata().configuration or {})
        self.mode = _mapping_mode(self.configuration, self.protocol)
        # the Delta schema the stream was built from (physical names, ids, types)
        self.table_schema = json.loads(dt.schema().to_json())
        self.schema_version = dt.version()
        self.change_feed = opts.read_change_feed
        # readChangeFeed: whether the table records change data, by version (see
        # _records_change_data); the three columns of the feed, as Delta fields
        self._feed_on: dict[int, bool] = {}
        extra: dict[str, dict] = {}
        if self.change_feed:
            change_feed_schema(self.table_schema, opts.path)  # refuses a clash of names
            self._feed_on[self.schema_version] = records_change_data(self.configuration)
            extra = CHANGE_FIELDS
        by_name = {f["name"]: f for f in self.table_schema["fields"]}
        by_lower = {f["name"].lower(): f for f in self.table_schema["fields"]}
        self.fields: list[dict] = []
        for field in self.arrow_schema:
            df = (
                extra.get(field.name) or by_name.get(field.name) or by_lower.get(field.name.lower())
            )
            if df is None:
                raise SourceError(
                    f"txn-delta source: column {field.name!r} of the stream's schema is not in "
                    f"the Delta table {opts.path} (columns: {sorted(by_name)})"
                )
            self.fields.append(df)
        # the stream's column -> its Delta type
        self.types = {
            field.name: df["type"] for field, df in zip(self.arrow_schema, self.fields, strict=True)
        }
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

    def _file(
        self, rel: str, partition_values: Mapping[str, Any], dv, size: int | None = 0
    ) -> DeltaFile:
        from urllib.parse import unquote

        uri = rel if "://" in rel else _fs.join(self.opts.path, unquote(rel))
        pv = tuple(sorted(partition_values.items()))
        return DeltaFile(uri, pv, None if not dv else tuple(sorted(dv.items())), int(size or 0))

    def _action_file(self, action: Mapping[str, Any]) -> DeltaFile:
        """The file of an ``add``, ``remove`` or ``cdc`` action: partition values typed
        from the log's strings, keyed by the stream's columns."""
        values = {}
        for key, raw in (action.get("partitionValues") or {}).items():
            name = self.column_of_physical.get(key)
            if name is not None:
                values[name] = parse_partition_value(raw, self.types[name])
        return self._file(action["path"], values, action.get("deletionVector"), action.get("size"))

    def _change_set(self, version: int, snapshot: bool) -> ChangeSet:
        key = (version, snapshot)
        if key not in self._changes:
            if self.change_feed:
                self._changes[key] = self._feed_files(version, snapshot)
            else:
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
        sizes = actions.column("size_bytes").to_pylist()
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
        for path, parts, size in zip(paths, partitions, sizes, strict=True):
            values = {}
            for key, value in (parts or {}).items():
                name = self.column_of_physical.get(physical.get(key, key))
                if name is not None:
                    values[name] = value
            files.append(self._file(path, values, dvs.get(path), size))
        return ChangeSet(tuple(sorted(files, key=lambda f: f.uri)))

    def _commit_files(self, version: int) -> ChangeSet:
        actions = _read_commit(self.fs, self.root, version, self.opts.path)
        files = []
        problem = self._commit_problem(version, actions)
        if problem:
            return self._stop(version, problem)
        if self.opts.skip_change_commits and any(
            a["remove"].get("dataChange", True) for a in actions if "remove" in a
        ):
            log.info(
                "txn-delta source: skipping version %d of %s: it removes or rewrites rows "
                "(skipChangeCommits=true)",
                version,
                self.opts.path,
            )
            return ChangeSet(())
        for action in actions:
            if "remove" in action and action["remove"].get("dataChange", True):
                if self.opts.ignore_changes:
                    continue
                return self._stop(
                    version,
                    f"it removes data ({action['remove']['path']}); only appends can be "
                    "streamed. Set option ignoreChanges=true to stream the files such commits "
                    "add and ignore what they remove, skipChangeCommits=true to skip such "
                    "commits, or readChangeFeed=true to stream the table's change data feed.",
                )
            add = action.get("add")
            if add and add.get("dataChange", True):
                files.append(self._action_file(add))
        return ChangeSet(tuple(files))

    # --- readChangeFeed: change sets from delta_cdf ------------------------------

    def _feed_files(self, version: int, snapshot: bool) -> ChangeSet:
        """The change set of ``version`` in the change feed (``delta_cdf``): with
        ``snapshot``, the table's files then as inserts."""
        if snapshot:
            files = self._snapshot_files(version)
            if files.error:
                return files
            actions = _read_commit(self.fs, self.root, version, self.opts.path)
            return ChangeSet(snapshot_changes(files.files, version, commit_timestamp_ms(actions)))
        actions = _read_commit(self.fs, self.root, version, self.opts.path)
        problem = self._commit_problem(version, actions)
        if problem:
            return self._stop(version, problem)
        meta = next((a["metaData"] for a in actions if "metaData" in a), None)
        if meta is not None:
            self._feed_on[version] = records_change_data(meta.get("configuration"))
        elif version - 1 in self._feed_on:
            self._feed_on[version] = self._feed_on[version - 1]
        partitioned = bool(meta["partitionColumns"] if meta else self.partition_columns)
        changes = commit_changes(
            version,
            actions,
            self._action_file,
            partitioned,
            lambda: self._records_change_data(version),
        )
        return self._stop(version, changes.error) if changes.error else changes

    def _records_change_data(self, version: int) -> bool:
        """Whether the table records change data at ``version``: from the metaData in
        effect (known along the versions read in order, else from the version's commit or,
        without a metaData action there, its table). A commit cleaned from the log is the
        clear ``SourceError`` of ``_read_commit``."""
        if version not in self._feed_on:
            actions = _read_commit(self.fs, self.root, version, self.opts.path)
            meta = next((a["metaData"] for a in actions if "metaData" in a), None)
            if meta is None:
                meta = {"configuration": self.opts.table(version).metadata().configuration}
            self._feed_on[version] = records_change_data(meta.get("configuration"))
        return self._feed_on[version]

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
        dt = self.opts.table()
        latest = dt.version()
        if self.opts.starting == "snapshot":
            offset = self._offset(latest, 0, True)
        elif self.opts.starting == "latest":
            offset = self._offset(latest + 1, 0, False)
        else:
            version = int(self.opts.starting)
            if version > latest + 1:
                raise SourceError(
                    f"option startingVersion={version}: the Delta table at {self.opts.path} is "
                    f"at version {latest}; start at most at {latest + 1} (the next commit), or "
                    "use 'latest'"
                )
            offset = self._offset(version, 0, False)
        if self.change_feed:  # the table must record change data where the feed starts
            at = min(offset["version"], latest)
            if at == latest:
                self._feed_on[at] = records_change_data(dt.metadata().configuration)
            if not self._records_change_data(at):
                raise no_change_data(self.opts.path, at)
        return offset

    def _offset(self, version: int, index: int, snapshot: bool) -> dict:
        offset = {
            "version": version,
            "index": index,
            "snapshot": snapshot,
            "tableId": self.table_id,
        }
        if self.change_feed:  # its indexes count change files, not adds: see _check_table
            offset["changeFeed"] = True
        return canonical(offset)

    def _check_table(self, offset: Mapping[str, Any], table_id: str | None = None) -> None:
        """An offset of another Delta table than the one at ``path`` is refused (offsets
        without ``tableId``, written before ids were, are taken as they are), and so is one
        made in the other mode (the index of a change-feed offset counts a version's change
        files, that of an append offset its adds: read in the other mode, it would skip or
        repeat rows)."""
        made = bool(offset.get("changeFeed", False))
        if made != self.change_feed:
            raise SourceError(
                f"txn-delta source: this query's checkpoint holds offsets made with "
                f"readChangeFeed={str(made).lower()}, but the source now reads with "
                f"readChangeFeed={str(self.change_feed).lower()}: their positions count other "
                "files, so it would skip or repeat rows. Set readChangeFeed as the checkpoint "
                "was made, or start a new query (a new checkpoint)"
            )
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
        taken, size, end = 0, 0, self._offset(latest + 1, 0, False)
        max_bytes = self.opts.max_bytes_per_batch
        for (v, i, snap), item in self._files_from(start, latest):
            if isinstance(item, ChangeSet):  # stop before it; fail once nothing precedes it
                if not taken:
                    raise SourceError(item.error)
                end = self._offset(v, 0, snap)
                break
            # maxBytesPerBatch is soft, as Delta's: files are taken while the batch holds
            # fewer bytes than the limit (the last may cross it), and always one
            if taken == self.opts.max_files_per_batch or (
                max_bytes is not None and taken and size >= max_bytes
            ):
                end = self._offset(v, i, snap)
                break
            taken += 1
            size += item.size
        self.current = end if taken else start
        return self.current

    def prepareForTriggerAvailableNow(self) -> None:
        self.target_version = self.opts.table().version()

    def partitions(self, start: dict, end: dict) -> list[DeltaFiles]:
        self._check_table(start)
        self._check_table(end)
        start = self._first_batch_start(start, end)
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

    def _first_batch_start(self, start: dict, end: dict) -> dict:
        """The start of a query's first batch, re-planned after a restart: Spark logs a
        batch's end, not the first batch's start, and asks ``initialOffset`` again, which
        (``startingVersion=snapshot``, the default) is the table's version *now*. A
        table that moved on since the first start would put the start past the logged
        end. The logged end says where the snapshot was: at its own version while it
        was inside the snapshot; otherwise the batch read the whole snapshot and the
        appends up to its end, and the snapshot of the version before the end holds
        what they held (the plain stream reads append-only versions; the change feed
        starts there as inserts, a start as valid as the first one). A first batch that failed before
        Spark committed it is all a restart re-plans, so any of them is exact."""
        if not start.get("snapshot") or _position(start) <= _position(end):
            return start
        version = end["version"] if end.get("snapshot") else end["version"] - 1
        log.info(
            "txn-delta source: the first batch is re-planned after a restart; the table "
            "moved on since its first start (version %d now), so its snapshot is read at "
            "version %d, where the logged end %s says it was",
            start["version"],
            version,
            end,
        )
        return {**start, "version": version, "index": 0}

    def read(self, partition: DeltaFiles):  # type: ignore[override]  # our partitions
        for f in partition.files:
            yield from self._read_file(f)

    def _read_file(self, f: DeltaFile):
        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        deleted = kept = None
        if f.deletion_vector:
            deleted = load_deletion_vector(self.opts.path, dict(f.deletion_vector), self.fs)
        select = getattr(f, "select", None)  # a change file between two deletion vectors
        if select is not None:
            kept = kept_rows(select, lambda dv: load_deletion_vector(self.opts.path, dv, self.fs))
            if not len(kept):
                return
        values = f.constants()
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
                if df is CHANGE_FIELDS[CHANGE_TYPE]:  # a cdc file's own column, by its name
                    i = next(
                        (k for k, ff in enumerate(file_fields) if ff.name == CHANGE_TYPE), None
                    )
                    if i is None:
                        raise SourceError(
                            f"txn-delta source: change data file {f.uri} of {self.opts.path} "
                            f"has no {CHANGE_TYPE} column"
                        )
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
                if kept is not None:
                    lo, hi = np.searchsorted(kept, [row, row + n])
                    keep = np.zeros(n, dtype=bool)
                    keep[(kept[lo:hi] - row).astype(np.int64)] = True
                    out = out.filter(pa.array(keep))
                elif deleted is not None and len(deleted):
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
        self._feed_on = {k: v for k, v in self._feed_on.items() if k >= end["version"] - 1}
