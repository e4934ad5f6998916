"""The Delta target of the two-phase protocol: phase 2 is one delta-rs commit.

Phase 2 commits the staged files' add actions together with
``txn(appId=sink id, version=batch id)`` on the same ``DeltaTable`` snapshot it
checked, so a replay is a no-op (``committed version >= batch id``) and two
racing phase 2s cannot both land. delta-rs validates nothing about the files
it is given, so files and schema are checked here before anything commits.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .. import _fs
from .._delta import open_table
from ..errors import ConfigError, CorruptSnapshotError
from ..state import SnapshotRecord, TxnHandle
from .staging import STAGING_ROOT, parse_snapshot_dir, snapshot_dir
from .twophase import Target

log = logging.getLogger(__name__)

META_PREFIX = "pyspark_txn."


def schema_to_b64(schema) -> str:
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def schema_from_b64(text: str):
    import pyarrow as pa

    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def _normal_type(t):
    import pyarrow as pa

    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return pa.binary()
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", tz="UTC" if t.tz else None)
    return t


def table_arrow_schema(dt):
    """The table's schema as a pyarrow schema (delta-rs returns arro3 objects)."""
    import pyarrow as pa

    return pa.schema(dt.schema().to_arrow())


def schema_drift(table_schema, stream_schema) -> tuple[list[str], list[str]]:
    """(columns the stream adds, human-readable incompatibilities)."""
    table = {f.name: f for f in table_schema}
    added, problems = [], []
    for f in stream_schema:
        old = table.pop(f.name, None)
        if old is None:
            added.append(f.name)
        elif _normal_type(old.type) != _normal_type(f.type):
            problems.append(
                f"column {f.name!r} is {old.type} in the table but {f.type} in the stream"
            )
    problems += [f"column {name!r} of the table is missing from the stream" for name in table]
    return added, problems


class DeltaTarget(Target):
    def __init__(
        self,
        uri: str,
        sink_id: str,
        *,
        partition_by: Sequence[str] = (),
        storage_options: Mapping[str, str] | None = None,
        fs_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.uri = uri
        self.sink_id = sink_id
        self.partition_by = list(partition_by)
        self.storage_options = dict(storage_options or {}) or None
        self.fs, self.root = _fs.filesystem(uri, fs_options)

    # --- reading --------------------------------------------------------------

    def open(self):
        return open_table(self.uri, self.storage_options)

    def committed_batch(self, sink_id: str) -> int | None:
        dt = self.open()
        return None if dt is None else dt.transaction_version(sink_id)

    def check_stream_schema(self, stream_schema, merge_schema: bool) -> None:
        """Refuse schema drift and partitioning changes before anything is staged."""
        dt = self.open()
        if dt is None:  # partition columns were checked against the stream by the options
            return
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
        not_null = [c for c in added if not stream_schema.field(c).nullable]
        if not_null:
            raise ConfigError(
                f"mergeSchema can only add nullable columns; {not_null} are declared NOT NULL"
            )

    # --- staged files -----------------------------------------------------------

    def _abs(self, rel: str) -> str:
        return _fs.join(self.root, rel)

    def _staged_files(self, snapshot_id: int) -> dict[str, int]:
        """Relative path -> size of every file staged for ``snapshot_id``."""
        base = self._abs(snapshot_dir(self.sink_id, snapshot_id))
        if not self.fs.exists(base):
            return {}
        found = self.fs.find(base, detail=True)
        prefix = self.root.rstrip("/") + "/"
        out = {}
        for path, info in found.items():
            rel = path[len(prefix) :] if path.startswith(prefix) else path
            out[rel] = info["size"]
        return out

    def verify_staged(self, snapshot_id: int, txns: Sequence[TxnHandle]) -> None:
        present = self._staged_files(snapshot_id)
        bad = [
            f"{t.handle} (expected {t.bytes} bytes, found "
            f"{'nothing' if t.handle not in present else present[t.handle]})"
            for t in txns
            if present.get(t.handle) != t.bytes
        ]
        if bad:
            raise CorruptSnapshotError(
                f"sink {self.sink_id!r}, snapshot {snapshot_id}: staged files are missing or "
                f"changed in {self.uri}: {', '.join(bad)}"
            )

    def discard(self, snapshot_id: int, keep: Iterable[str] = ()) -> None:
        keep = set(keep)
        base = self._abs(snapshot_dir(self.sink_id, snapshot_id))
        if not keep:
            if self.fs.exists(base):
                self.fs.rm(base, recursive=True)
            return
        stray = [self._abs(rel) for rel in self._staged_files(snapshot_id) if rel not in keep]
        if stray:
            log.info(
                "sink %s: removing %d stray staged files of snapshot %d",
                self.sink_id,
                len(stray),
                snapshot_id,
            )
            self.fs.rm(stray)

    def staged_snapshot_ids(self) -> set[int]:
        base = self._abs(f"{STAGING_ROOT}/{self.sink_id}")
        if not self.fs.exists(base):
            return set()
        ids = set()
        for entry in self.fs.ls(base, detail=False):
            sid = parse_snapshot_dir(entry)
            if sid is not None:
                ids.add(sid)
        return ids

    # --- phase 2 ------------------------------------------------------------------

    def commit(self, record: SnapshotRecord) -> int | None:
        from deltalake import Schema
        from deltalake.transaction import (
            AddAction,
            CommitProperties,
            Transaction,
            create_table_with_add_actions,
        )

        dt = self.open()
        if dt is not None:
            done = dt.transaction_version(self.sink_id)
            if done is not None and done >= record.batch_id:
                return self._version_of(dt, record)
        self.verify_staged(record.snapshot_id, record.txns)
        adds = [
            AddAction(
                path=t.handle,
                size=t.bytes,
                partition_values=dict(t.meta.get("partition_values", {})),
                modification_time=t.meta["mtime"],
                data_change=True,
                stats=t.meta["stats"],
            )
            for t in record.txns
        ]
        props = CommitProperties(
            app_transactions=[Transaction(app_id=self.sink_id, version=record.batch_id)],
            custom_metadata={
                META_PREFIX + "sink_id": self.sink_id,
                META_PREFIX + "snapshot_id": record.snapshot_id,
                META_PREFIX + "batch_id": record.batch_id,
                META_PREFIX + "query_id": record.query_id or "",
            },
        )
        stream_schema = schema_from_b64(record.target["arrow_schema"])
        if dt is None:
            create_table_with_add_actions(
                self.uri,
                Schema.from_arrow(stream_schema),
                adds,
                mode="error",
                partition_by=self.partition_by or None,
                storage_options=self.storage_options,
                commit_properties=props,
            )
            return 0
        added, _ = schema_drift(table_arrow_schema(dt), stream_schema)
        if added and record.target.get("merge_schema"):
            from deltalake.schema import Field

            dt.alter.add_columns([Field.from_arrow(stream_schema.field(c)) for c in added])
        dt.create_write_transaction(
            adds,
            mode="append",
            schema=dt.schema(),
            partition_by=self.partition_by or None,
            commit_properties=props,
        )
        return self._version_of(dt, record)

    def _version_of(self, dt, record: SnapshotRecord, depth: int = 50) -> int | None:
        """The table version that committed ``record`` (found by its commit metadata)."""
        dt.update_incremental()
        for entry in dt.history(depth):
            if (
                entry.get(META_PREFIX + "sink_id") == self.sink_id
                and entry.get(META_PREFIX + "batch_id") == record.batch_id
            ):
                return entry["version"]
        return None
