"""``txn-delta`` as a streaming source: the appends of a Delta table, by version.

The offset ``{"version": v, "index": i, "snapshot": s}`` names the next file
to read: file ``i`` of version ``v``'s change set, where the change set of a
commit is its ``add`` actions with ``dataChange=true`` in log order, and (with
``snapshot`` true) the change set is the whole table at ``v``, sorted by path.
A file list for a version never changes, so a range of offsets always names
the same files: replayable for as long as the Delta log keeps those versions.
Commits that remove data (overwrite, delete, merge) are refused unless
``ignoreChanges=true``; compactions (``dataChange=false``) are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition

from .. import _fs
from ..errors import ConfigError, SourceError
from ._common import SupportsTriggerAvailableNow, canonical

DELTA_SOURCE_OPTIONS = {
    "path": "Delta table URI (required)",
    "startingversion": "'snapshot' (default: the table as of the start, then its appends), "
    "a version number (appends from that commit on) or 'latest' (only new appends)",
    "maxfilesperbatch": "most data files per micro-batch (default 1000)",
    "ignorechanges": "true: skip commits that remove data instead of failing",
    "storageoptions": "JSON object of delta-rs storage options",
}


@dataclass(frozen=True)
class DeltaFile:
    uri: str
    partition_values: tuple[tuple[str, str | None], ...]


@dataclass(frozen=True)
class DeltaSourceOptions:
    path: str
    starting: str = "snapshot"  # 'snapshot' | 'latest' | a version number
    max_files_per_batch: int = 1000
    ignore_changes: bool = False
    storage_options: tuple[tuple[str, str], ...] = ()
    fs_options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> DeltaSourceOptions:
        opts = {k.lower(): v for k, v in options.items()}
        unknown = sorted(
            k for k in opts if k not in DELTA_SOURCE_OPTIONS and not k.startswith("fs.")
        )
        if unknown:
            raise ConfigError(
                f"txn-delta source: unknown option(s) {unknown}; allowed: "
                f"{sorted(DELTA_SOURCE_OPTIONS)} and fs.<fsspec option>"
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
        storage = json.loads(opts["storageoptions"]) if opts.get("storageoptions") else {}
        return cls(
            path=_fs.normalize_uri(opts["path"]),
            starting=starting,
            max_files_per_batch=int(raw_max),
            ignore_changes=ignore == "true",
            storage_options=tuple(sorted(storage.items())),
            fs_options=tuple(sorted((k[3:], v) for k, v in opts.items() if k.startswith("fs."))),
        )

    def table(self, version: int | None = None):
        from deltalake import DeltaTable

        try:
            return DeltaTable(
                self.path, version=version, storage_options=dict(self.storage_options) or None
            )
        except Exception as e:
            raise SourceError(
                f"txn-delta source: cannot open {self.path} at version {version}: {e}"
            ) from e

    def spark_schema_ddl(self):
        from pyspark.sql.types import StructType

        return StructType.fromJson(json.loads(self.table().schema().to_json()))


class DeltaFiles(InputPartition):
    def __init__(self, files: list[DeltaFile]) -> None:
        self.files = files


class DeltaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, opts: DeltaSourceOptions, schema) -> None:
        from pyspark.sql.pandas.types import to_arrow_schema

        self.opts = opts
        self.arrow_schema = to_arrow_schema(schema)
        self.partition_columns = list(opts.table().metadata().partition_columns)
        self._changes: dict[tuple[int, bool], list[DeltaFile]] = {}
        self.target_version: int | None = None
        self.current: dict | None = None
        self.fs, self.root = _fs.filesystem(opts.path, dict(opts.fs_options))

    # --- file lists per version (cached: they never change) ---------------------

    def _file(self, rel: str, partition_values: Mapping[str, Any]) -> DeltaFile:
        from urllib.parse import unquote

        uri = rel if "://" in rel else _fs.join(self.opts.path, unquote(rel))
        pv = tuple(sorted((k, None if v is None else str(v)) for k, v in partition_values.items()))
        return DeltaFile(uri, pv)

    def _change_set(self, version: int, snapshot: bool) -> list[DeltaFile]:
        key = (version, snapshot)
        if key not in self._changes:
            self._changes[key] = (
                self._snapshot_files(version) if snapshot else self._commit_files(version)
            )
        return self._changes[key]

    def _snapshot_files(self, version: int) -> list[DeltaFile]:
        dt = self.opts.table(version)
        import pyarrow as pa

        actions = pa.table(dt.get_add_actions(flatten=False)).to_pylist()
        if any(a.get("deletionVector") for a in actions):
            raise SourceError(
                f"txn-delta source: {self.opts.path} uses deletion vectors (unsupported)"
            )
        files = [self._file(a["path"], a.get("partition_values") or {}) for a in actions]
        return sorted(files, key=lambda f: f.uri)

    def _commit_files(self, version: int) -> list[DeltaFile]:
        path = _fs.join(self.root, "_delta_log", f"{version:020d}.json")
        if not self.fs.exists(path):
            raise SourceError(
                f"txn-delta source: commit {version} of {self.opts.path} is no longer in the Delta "
                "log (log retention cleaned it up): those offsets cannot be replayed. Restart from "
                "a snapshot (startingVersion=snapshot with a new checkpoint)."
            )
        with self.fs.open(path, "r") as f:
            actions = [json.loads(line) for line in f if line.strip()]
        files = []
        for action in actions:
            if "remove" in action and action["remove"].get("dataChange", True):
                if self.opts.ignore_changes:
                    continue
                raise SourceError(
                    f"txn-delta source: commit {version} of {self.opts.path} removes data "
                    f"({action['remove']['path']}); only appends can be streamed. Set option "
                    "ignoreChanges=true to skip such commits."
                )
            add = action.get("add")
            if add and add.get("dataChange", True):
                if add.get("deletionVector"):
                    raise SourceError(
                        f"txn-delta source: commit {version} uses deletion vectors (unsupported)"
                    )
                files.append(self._file(add["path"], add.get("partitionValues") or {}))
        return files

    # --- offsets ----------------------------------------------------------------

    def initialOffset(self) -> dict:
        latest = self.opts.table().version()
        if self.opts.starting == "snapshot":
            return canonical({"version": latest, "index": 0, "snapshot": True})
        if self.opts.starting == "latest":
            return canonical({"version": latest + 1, "index": 0, "snapshot": False})
        return canonical({"version": int(self.opts.starting), "index": 0, "snapshot": False})

    def _files_from(self, start: dict, last_version: int):
        """(position, file) from ``start`` through ``last_version``, in offset order."""
        version, index, snap = start["version"], start["index"], start["snapshot"]
        while version <= last_version:
            files = self._change_set(version, snap)
            for i in range(index, len(files)):
                yield (version, i, snap), files[i]
            version, index, snap = version + 1, 0, False

    def latestOffset(self, start: dict | None = None, limit: Any = None) -> dict:
        start = start or self.current or self.initialOffset()
        latest = self.opts.table().version()
        if self.target_version is not None:
            latest = min(latest, self.target_version)
        taken, end = 0, {"version": latest + 1, "index": 0, "snapshot": False}
        for (v, i, snap), _ in self._files_from(start, latest):
            if taken == self.opts.max_files_per_batch:
                end = {"version": v, "index": i, "snapshot": snap}
                break
            taken += 1
        self.current = canonical(end) if taken else start
        return self.current

    def prepareForTriggerAvailableNow(self) -> None:
        self.target_version = self.opts.table().version()

    def partitions(self, start: dict, end: dict) -> list[DeltaFiles]:
        stop = (end["version"], end["index"], end["snapshot"])
        last = end["version"] if end["index"] or end["snapshot"] else end["version"] - 1
        files = []
        for pos, f in self._files_from(start, last):
            if pos == stop:
                break
            files.append(f)
        return [DeltaFiles([f]) for f in files]

    def read(self, partition: DeltaFiles):
        import pyarrow as pa
        import pyarrow.parquet as pq

        fs, _ = _fs.filesystem(self.opts.path, dict(self.opts.fs_options))
        data_names = [n for n in self.arrow_schema.names if n not in self.partition_columns]
        for f in partition.files:
            with fs.open(f.uri.removeprefix("file://"), "rb") as fh:
                pf = pq.ParquetFile(fh)
                for batch in pf.iter_batches(batch_size=65536, columns=data_names):
                    cols = []
                    values = dict(f.partition_values)
                    for field in self.arrow_schema:
                        if field.name in values:
                            cols.append(
                                pa.array([values[field.name]] * batch.num_rows).cast(field.type)
                            )
                        else:
                            cols.append(batch.column(field.name).cast(field.type))
                    yield pa.RecordBatch.from_arrays(cols, schema=self.arrow_schema)

    def commit(self, end: dict) -> None:
        pass  # replayable: nothing to acknowledge
