"""``txn-delta`` as a streaming sink: a two-phase transactional Delta writer.

Per micro-batch Spark calls ``streamWriter()`` in the driver's Python process
and pickles the writer for the tasks. The snapshot id is allocated (and made
safe) when that driver-side writer is first pickled, i.e. before any task can
stage a byte; tasks stage parquet files (phase 1); ``commit`` runs in a
separate Python worker on a fresh writer and gets everything it needs from
the commit messages and the options.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql.datasource import WriterCommitMessage

from .. import _fs
from ..checkpoint import read_batch_offsets, read_query_id
from ..errors import ConfigError
from ..faults import FaultPlan
from ..state import DeltaEventLog, RecordStore, TxnHandle
from .delta_target import DeltaTarget, schema_to_b64
from .staging import PARQUET_CODECS, StagingConfig, stage_partition
from .twophase import TwoPhaseCommitter

log = logging.getLogger(__name__)

try:  # PySpark >= 4.1
    from pyspark.sql.datasource import DataSourceStreamArrowWriter as _WriterBase
except ImportError:  # 4.0: an Arrow writer mixed into the stream writer works there
    from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamWriter

    class _WriterBase(DataSourceArrowWriter, DataSourceStreamWriter):  # type: ignore[no-redef]
        pass


SINK_OPTIONS = {
    "path": "target Delta table URI (required)",
    "checkpointlocation": "set by Spark from writeStream.option('checkpointLocation')",
    "queryname": "set by Spark from queryName()",
    "recordtable": "record table URI (default <checkpointLocation>/pyspark_txn/records)",
    "sinkid": "the sink's id (default derived from the checkpoint location)",
    "sinkidprefix": "prefix of the derived sink id (default 'txn')",
    "partitionby": "comma-separated partition columns",
    "storageoptions": "JSON object of delta-rs storage options",
    "mergeschema": "true|false: add new nullable stream columns to the table",
    "rowgrouprows": "rows per parquet row group (default 1000000)",
    "compression": "parquet codec of staged files: snappy (default), zstd, lz4, gzip or none",
    "targetfilerows": "rows per staged file before rolling over (default 8000000)",
    "faultinjection": "TESTS ONLY: crash plan, see pyspark_txn.faults",
}
_SINK_ID_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def _parse_bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    raise ConfigError(f"option {name}={value!r}: expected true or false")


def _parse_positive_int(name: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n <= 0:
        raise ConfigError(f"option {name}={value!r}: expected a positive integer")
    return n


def _parse_compression(value: str) -> str:
    codec = value.strip().lower()
    if codec == "uncompressed":
        codec = "none"
    if codec not in PARQUET_CODECS:
        raise ConfigError(
            f"option compression={value!r}: expected one of {', '.join(PARQUET_CODECS)}"
        )
    return codec


def _check_sink_id(sink_id: str, option: str) -> str:
    if not sink_id or not set(sink_id) <= _SINK_ID_CHARS or sink_id.startswith("."):
        raise ConfigError(
            f"option {option}={sink_id!r}: use letters, digits, '-', '_' and '.' only "
            "(it names folders and Delta app transactions)"
        )
    return sink_id


@dataclass(frozen=True)
class DeltaSinkOptions:
    """The sink's options, parsed and validated once. Plain data: safe to pickle."""

    path: str
    checkpoint_location: str
    record_table: str
    sink_id: str
    query_name: str | None = None
    partition_by: tuple[str, ...] = ()
    storage_options: tuple[tuple[str, str], ...] = ()
    fs_options: tuple[tuple[str, str], ...] = ()
    merge_schema: bool = False
    row_group_rows: int = 1_000_000
    compression: str = "snappy"
    target_file_rows: int = 8_000_000
    faults: FaultPlan = field(default_factory=FaultPlan)

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> DeltaSinkOptions:
        opts = {k.lower(): v for k, v in options.items()}
        unknown = sorted(k for k in opts if k not in SINK_OPTIONS and not k.startswith("fs."))
        if unknown:
            allowed = ", ".join(sorted(SINK_OPTIONS)) + ", fs.<fsspec option>"
            raise ConfigError(f"txn-delta sink: unknown option(s) {unknown}; allowed: {allowed}")
        if not opts.get("path"):
            raise ConfigError(
                "txn-delta sink: option path (the target Delta table) is required: "
                ".option('path', '/data/table') or .start('/data/table')"
            )
        if not opts.get("checkpointlocation"):
            raise ConfigError(
                "txn-delta sink: option checkpointLocation is required: exactly-once needs "
                "Spark's checkpoint"
            )
        path = _fs.normalize_uri(opts["path"])
        checkpoint = _fs.normalize_uri(opts["checkpointlocation"])
        prefix = _check_sink_id(opts.get("sinkidprefix", "txn"), "sinkIdPrefix")
        if "sinkid" in opts:
            sink_id = _check_sink_id(opts["sinkid"], "sinkId")
        else:
            digest = hashlib.sha256(checkpoint.encode()).hexdigest()[:16]
            sink_id = f"{prefix}-{digest}"
        record_table = _fs.normalize_uri(
            opts.get("recordtable") or _fs.join(checkpoint, "pyspark_txn", "records")
        )
        storage: dict[str, Any] = {}
        if opts.get("storageoptions"):
            try:
                storage = json.loads(opts["storageoptions"])
            except ValueError as e:
                raise ConfigError(f"option storageOptions is not valid JSON: {e}") from None
            if not isinstance(storage, dict) or not all(
                isinstance(v, str) for v in storage.values()
            ):
                raise ConfigError(
                    "option storageOptions: expected a JSON object of string values, e.g. "
                    '{"AWS_REGION": "eu-west-1"}'
                )
        partition_by = tuple(c.strip() for c in opts.get("partitionby", "").split(",") if c.strip())
        if len(set(partition_by)) != len(partition_by):
            raise ConfigError(f"option partitionBy={opts['partitionby']!r} repeats a column")
        return cls(
            path=path,
            checkpoint_location=checkpoint,
            record_table=record_table,
            sink_id=sink_id,
            query_name=opts.get("queryname"),
            partition_by=partition_by,
            storage_options=tuple(sorted(storage.items())),
            fs_options=tuple(sorted((k[3:], v) for k, v in opts.items() if k.startswith("fs."))),
            merge_schema=_parse_bool("mergeSchema", opts.get("mergeschema", "false")),
            row_group_rows=_parse_positive_int("rowGroupRows", opts.get("rowgrouprows", "1000000")),
            compression=_parse_compression(opts.get("compression", "snappy")),
            target_file_rows=_parse_positive_int(
                "targetFileRows", opts.get("targetfilerows", "8000000")
            ),
            faults=FaultPlan.parse(opts.get("faultinjection")),
        )

    def check_schema(self, arrow_schema) -> None:
        names = arrow_schema.names
        missing = [c for c in self.partition_by if c not in names]
        if missing:
            raise ConfigError(
                f"option partitionBy: columns {missing} are not in the stream {names}"
            )
        import pyarrow as pa

        for c in self.partition_by:
            t = arrow_schema.field(c).type
            if not (
                pa.types.is_integer(t)
                or pa.types.is_string(t)
                or pa.types.is_large_string(t)
                or pa.types.is_date32(t)
                or pa.types.is_boolean(t)
            ):
                raise ConfigError(
                    f"option partitionBy: column {c!r} has type {t}; partition columns must be "
                    "string, integer, date or boolean"
                )
        if len(self.partition_by) == len(names):
            raise ConfigError(
                "option partitionBy: at least one column must not be a partition column"
            )

    def record_store(self) -> RecordStore:
        return RecordStore(DeltaEventLog(self.record_table, dict(self.storage_options)))

    def target(self) -> DeltaTarget:
        return DeltaTarget(
            self.path,
            self.sink_id,
            partition_by=self.partition_by,
            storage_options=dict(self.storage_options),
            fs_options=dict(self.fs_options),
        )

    def committer(self) -> TwoPhaseCommitter:
        return TwoPhaseCommitter(
            self.record_store(), self.target(), self.sink_id, faults=self.faults
        )

    def staging(self) -> StagingConfig:
        return StagingConfig(
            table_uri=self.path,
            sink_id=self.sink_id,
            partition_by=self.partition_by,
            fs_options=self.fs_options,
            row_group_rows=self.row_group_rows,
            compression=self.compression,
            target_file_rows=self.target_file_rows,
        )


@dataclass
class TxnCommitMessage(WriterCommitMessage):
    sink_id: str
    snapshot_id: int
    epoch: int
    partition: int
    txns: list[dict[str, Any]]


# Spark calls streamWriter() and pickles the writer in one long-lived Python
# worker per driver JVM (not the user's process: measured on 4.2). A run is
# that worker's lifetime; its epochs: (record table, sink id, query id) -> epoch.
_RUNS: dict[tuple[str, str, str | None], int] = {}
_RUNS_LOCK = threading.Lock()
_RUN_OWNER = uuid.uuid4().hex


def prepare_attempt(opts: DeltaSinkOptions, arrow_schema) -> tuple[int, int]:
    """Driver side, before phase 1: take over the sink if this is a new run, then
    allocate this batch's snapshot id. Returns (epoch, snapshot id)."""
    query_id = read_query_id(opts.checkpoint_location, dict(opts.fs_options))
    key = (opts.record_table, opts.sink_id, query_id)
    committer = opts.committer()
    with _RUNS_LOCK:
        epoch = _RUNS.get(key)
        if epoch is None:
            committer.target.check_stream_schema(arrow_schema, opts.merge_schema)
            committer.store.log.create_if_missing()
            epoch = committer.begin_run(_RUN_OWNER, query_id, opts.query_name)
            _RUNS[key] = epoch
    return epoch, committer.allocate(epoch)


class TxnDeltaStreamWriter(_WriterBase):
    def __init__(self, opts: DeltaSinkOptions, spark_schema) -> None:
        from pyspark.sql.pandas.types import to_arrow_schema

        self.opts = opts
        self.arrow_schema = to_arrow_schema(spark_schema)
        opts.check_schema(self.arrow_schema)
        self._attempt: tuple[int, int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Pickling happens in the driver, once per batch, before any task runs:
        # the one place a snapshot id can be made safe before phase 1.
        if self._attempt is None:
            self._attempt = prepare_attempt(self.opts, self.arrow_schema)
        return self.__dict__

    def write(self, iterator) -> TxnCommitMessage:
        from pyspark import TaskContext

        epoch, snapshot_id = self._attempt
        ctx = TaskContext.get()
        partition = ctx.partitionId() if ctx is not None else 0
        handles = stage_partition(
            _as_arrow(iterator, self.arrow_schema),
            self.opts.staging(),
            snapshot_id,
            partition,
            self.arrow_schema,
        )
        self.opts.faults.hit("phase1", snapshot=snapshot_id, partition=partition)
        return TxnCommitMessage(
            sink_id=self.opts.sink_id,
            snapshot_id=snapshot_id,
            epoch=epoch,
            partition=partition,
            txns=[h.to_json() for h in handles],
        )

    def commit(self, messages, batchId: int) -> None:
        msgs = [m for m in messages if m is not None]
        committer = self.opts.committer()
        if not msgs:  # no task ran: nothing was staged, so allocating here is safe
            state = committer.load()
            epoch = state.epoch
            snapshot_id = committer.allocate(epoch)
        else:
            attempts = {(m.snapshot_id, m.epoch) for m in msgs}
            if len(attempts) != 1:
                raise ConfigError(f"batch {batchId}: tasks of several attempts {attempts}")
            snapshot_id, epoch = attempts.pop()
        txns = [TxnHandle.from_json(t) for m in msgs for t in m.txns]
        committer.commit(
            batchId,
            snapshot_id,
            epoch,
            txns,
            source_offsets=read_batch_offsets(
                self.opts.checkpoint_location, batchId, dict(self.opts.fs_options)
            )
            or (),
            query_id=read_query_id(self.opts.checkpoint_location, dict(self.opts.fs_options)),
            target_meta={
                "uri": self.opts.path,
                "arrow_schema": schema_to_b64(self.arrow_schema),
                "partition_by": list(self.opts.partition_by),
                "merge_schema": self.opts.merge_schema,
            },
        )

    def abort(self, messages, batchId: int) -> None:
        committer = self.opts.committer()
        for snapshot_id in sorted({m.snapshot_id for m in messages if m is not None}):
            committer.abort(snapshot_id)


def _as_arrow(iterator, arrow_schema, chunk_rows: int = 65536):
    """Arrow batches from whatever the installed PySpark hands the writer."""
    import pyarrow as pa

    rows: list = []
    for item in iterator:
        if isinstance(item, pa.RecordBatch):
            yield item
            continue
        rows.append(item.asDict(recursive=True))
        if len(rows) >= chunk_rows:
            yield pa.RecordBatch.from_pylist(rows, schema=arrow_schema)
            rows = []
    if rows:
        yield pa.RecordBatch.from_pylist(rows, schema=arrow_schema)
