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
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from ..errors import ConfigError
from ..faults import FaultPlan
from ..spark.options import check_location, parse_storage_options, reject_unknown_options
from ..state import DEFAULT_RETAIN_SNAPSHOTS, DeltaEventLog, RecordStore, TxnHandle, new_token
from ..storage import fs as _fs
from ..storage.checkpoint import (
    default_record_table,
    persisted_sink_id,
    read_query_id,
)
from ..storage.delta_tables import one_check_per_step
from ..storage.options import StorageOptions, store_errors, using
from ._spark import (
    TxnCommitMessage,
    WriterBase,
    abort_attempts,
    as_arrow,
    batch_attempt,
    check_sink_id,
    commit_batch,
    commit_message,
    parse_bool,
    parse_log_level,
    parse_positive_int,
    prepare_attempt,
    spark_to_arrow_schema,
    task_slot,
    worker_logging,
)
from .delta_target import DeltaTarget, check_writable_schema, schema_to_b64
from .hooks import ExportSite, serve_exports
from .light import LIGHT_SNAPSHOT_ID, LightCommitter
from .staging import PARQUET_CODECS, StagingConfig, stage_partition
from .twophase import TwoPhaseCommitter
from .upsert import UPSERT_OPTIONS, UpsertSpec

log = logging.getLogger(__name__)

MODES = ("snapshots", "light")
#: Options that only mean something when snapshot records are kept.
_SNAPSHOT_ONLY_OPTIONS = {"recordtable": "recordTable", "retainsnapshots": "retainSnapshots"}
# Delta table properties the sink may set when it creates the table, as
# `.option("delta.appendOnly", "true")`. Spark lowercases option keys; the log
# needs the exact spelling, so the keys are known here. Value check per kind.
TABLE_PROPERTIES = {
    "delta.appendOnly": "bool",
    "delta.enableChangeDataFeed": "bool",
    "delta.checkpointInterval": "int",
    "delta.dataSkippingNumIndexedCols": "int",
    "delta.dataSkippingStatsColumns": "text",
    "delta.logRetentionDuration": "interval",
    "delta.deletedFileRetentionDuration": "interval",
    "delta.enableExpiredLogCleanup": "bool",
    "delta.checkpoint.writeStatsAsJson": "bool",
    "delta.checkpoint.writeStatsAsStruct": "bool",
    "delta.targetFileSize": "int",
}
_PROPERTY_BY_KEY = {k.lower(): k for k in TABLE_PROPERTIES}


def _parse_table_properties(opts: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    out = []
    for key, value in sorted(opts.items()):
        if not key.startswith("delta."):
            continue
        name = _PROPERTY_BY_KEY.get(key)
        if name is None:
            raise ConfigError(
                f"option {key}: not a Delta table property this sink sets; allowed: "
                f"{', '.join(sorted(TABLE_PROPERTIES))}"
            )
        kind, v = TABLE_PROPERTIES[name], value.strip()
        ok = (
            (kind == "bool" and v.lower() in ("true", "false"))
            or (kind == "int" and v.isdigit())
            or (kind == "interval" and re.fullmatch(r"interval \d+ \w+", v.lower()) is not None)
            or kind == "text"
        )
        if not ok:
            expected = {"bool": "true or false", "int": "a number", "interval": "'interval 7 days'"}
            raise ConfigError(f"option {name}={value!r}: expected {expected.get(kind, kind)}")
        out.append((name, v.lower() if kind == "bool" else v))
    return tuple(out)


def _parse_compression(value: str) -> str:
    codec = value.strip().lower()
    if codec == "uncompressed":
        codec = "none"
    if codec not in PARQUET_CODECS:
        raise ConfigError(
            f"option compression={value!r}: expected one of {', '.join(PARQUET_CODECS)}"
        )
    return codec


@dataclass(frozen=True)
class DeltaSinkOptions:
    """The sink's options, parsed and validated once. Plain data: safe to pickle."""

    path: str
    checkpoint_location: str
    record_table: str
    sink_id: str
    explicit_sink_id: bool = False
    query_name: str | None = None
    partition_by: tuple[str, ...] = ()
    storage_options: tuple[tuple[str, str], ...] = ()
    fs_options: tuple[tuple[str, str], ...] = ()
    merge_schema: bool = False
    row_group_rows: int = 1_000_000
    compression: str = "snappy"
    target_file_rows: int = 8_000_000
    faults: FaultPlan = field(default_factory=FaultPlan)
    table_properties: tuple[tuple[str, str], ...] = ()
    table_name: str | None = None
    table_description: str | None = None
    user_metadata: str | None = None
    mode: str = "snapshots"
    retain_snapshots: int = DEFAULT_RETAIN_SNAPSHOTS
    log_level: str = "INFO"
    upsert: UpsertSpec | None = None  # keys: batches are merged by key (delta_merge_target)
    complete: bool = False  # outputMode complete: each batch replaces the table's rows
    sink_id_prefix: ClassVar[str] = "txn"

    @property
    def storage(self) -> StorageOptions:
        """``storageOptions`` and ``fs.*`` as one storage configuration."""
        return StorageOptions.of(self.storage_options, self.fs_options)

    @property
    def light(self) -> bool:
        return self.mode == "light"

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> DeltaSinkOptions:
        opts = {k.lower(): v for k, v in options.items()}
        reject_unknown_options(
            "txn-delta sink",
            opts,
            SINK_OPTIONS,
            {"fs.": "fs.<fsspec option>", "delta.": "delta.<table property>"},
        )
        if not opts.get("path"):
            raise ConfigError(
                "txn-delta sink: option path (the target Delta table) is required: "
                ".option('path', '/data/table') or .start('/data/table')"
            )
        if not opts.get("checkpointlocation"):
            raise ConfigError(
                "txn-delta sink: option checkpointLocation is required: exactly-once needs "
                "Spark's checkpoint. Set it on the writer: .writeStream.option("
                "'checkpointLocation', '/chk/my_query'); Python sinks do not see a location "
                "that Spark derives from spark.sql.streaming.checkpointLocation"
            )
        mode = opts.get("mode", cls.mode).strip().lower()
        if mode not in MODES:
            raise ConfigError(f"option mode={opts['mode']!r}: expected one of {', '.join(MODES)}")
        if mode == "light":
            given = [name for key, name in _SNAPSHOT_ONLY_OPTIONS.items() if key in opts]
            if given:
                raise ConfigError(
                    f"option {', '.join(given)} applies to mode=snapshots only: a light sink "
                    "keeps no snapshot records (docs/modes.md)"
                )
        log_level = parse_log_level(opts.get("loglevel", cls.log_level))
        for key, name in (("path", "path"), ("checkpointlocation", "checkpointLocation")):
            check_location(name, opts[key])
        if opts.get("recordtable"):
            check_location("recordTable", opts["recordtable"])
        path = _fs.normalize_uri(opts["path"])
        checkpoint = _fs.normalize_uri(opts["checkpointlocation"])
        prefix = check_sink_id(opts.get("sinkidprefix", cls.sink_id_prefix), "sinkIdPrefix")
        explicit = check_sink_id(opts["sinkid"], "sinkId") if "sinkid" in opts else None
        digest = hashlib.sha256(checkpoint.encode()).hexdigest()[:16]
        sink_id = explicit or f"{prefix}-{digest}"
        record_table = _fs.normalize_uri(
            opts.get("recordtable") or default_record_table(checkpoint)
        )
        real_records, real_path = _fs.location_key(record_table), _fs.location_key(path)
        for inner, outer in ((real_records, real_path), (real_path, real_records)):
            if inner == outer or inner.startswith(outer.rstrip("/") + "/"):
                raise ConfigError(
                    f"option recordTable={record_table!r} and path={path!r} overlap: the record "
                    "table must live outside the target table (default: inside the checkpoint)"
                )
        partition_by = tuple(c.strip() for c in opts.get("partitionby", "").split(",") if c.strip())
        if len(set(partition_by)) != len(partition_by):
            raise ConfigError(f"option partitionBy={opts['partitionby']!r} repeats a column")
        upsert = UpsertSpec.parse(opts)
        if upsert is not None and mode == "light":
            raise ConfigError(
                "option keys needs mode=snapshots: a merge's staged change records are spent "
                "by phase 2, which light mode runs without a record to redo it from"
            )
        return cls(
            path=path,
            checkpoint_location=checkpoint,
            record_table=record_table,
            sink_id=sink_id,
            explicit_sink_id=explicit is not None,
            query_name=opts.get("queryname"),
            partition_by=partition_by,
            storage_options=parse_storage_options(
                opts.get("storageoptions"), "txn-delta sink", "storageOptions"
            ),
            fs_options=tuple(sorted((k[3:], v) for k, v in opts.items() if k.startswith("fs."))),
            merge_schema=parse_bool("mergeSchema", opts.get("mergeschema", str(cls.merge_schema))),
            row_group_rows=parse_positive_int(
                "rowGroupRows", opts.get("rowgrouprows", str(cls.row_group_rows))
            ),
            compression=_parse_compression(opts.get("compression", cls.compression)),
            target_file_rows=parse_positive_int(
                "targetFileRows", opts.get("targetfilerows", str(cls.target_file_rows))
            ),
            faults=FaultPlan.parse(opts.get("faultinjection")),
            table_properties=_parse_table_properties(opts),
            table_name=opts.get("tablename"),
            table_description=opts.get("tabledescription"),
            user_metadata=opts.get("usermetadata"),
            mode=mode,
            log_level=log_level,
            retain_snapshots=parse_positive_int(
                "retainSnapshots", opts.get("retainsnapshots", str(cls.retain_snapshots))
            ),
            upsert=upsert,
        )

    def for_complete_mode(self) -> DeltaSinkOptions:
        """These options for ``outputMode("complete")``: every batch is the whole result."""
        if self.upsert is not None:
            raise ConfigError(
                "option keys with outputMode complete: complete mode replaces the table's rows "
                "with each batch's whole result, so there is nothing to merge by key; drop "
                "keys, or use update mode through pyspark_txn.delta_batch_writer(..., keys=...)"
            )
        return replace(self, complete=True)

    def with_checkpoint_sink_id(self) -> DeltaSinkOptions:
        """The sink id kept in the checkpoint (written there on first use): it moves with
        the checkpoint, whatever the location is called now."""
        sink_id = persisted_sink_id(
            self.checkpoint_location,
            self.sink_id,
            self.sink_id if self.explicit_sink_id else None,
            self.storage,
            record_table=(
                None
                if self.record_table == default_record_table(self.checkpoint_location)
                else self.record_table
            ),
            mode=self.mode,
            # a light sink keeps no record naming its table: its checkpoint does (status)
            target={"kind": "delta", "uri": self.path} if self.light else None,
        )
        return replace(self, sink_id=sink_id)

    def check_schema(self, arrow_schema) -> None:
        if self.upsert is not None:
            self.upsert.check_schema(arrow_schema, self.partition_by)
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

    def table_schema(self, arrow_schema):
        """The columns a batch of the stream ``arrow_schema`` writes to the table (an
        upsert's: less ``exceptColumns``, with SCD type 2's validity columns)."""
        return arrow_schema if self.upsert is None else self.upsert.table_schema(arrow_schema)

    def write_meta(self) -> dict[str, Any]:
        """Where and how phase 2 writes, as records keep it (twophase.WRITE_KEYS): a
        restart that changes how is refused, naming both."""
        meta: dict[str, Any] = {"uri": self.path}
        if self.upsert is not None:
            meta["upsert"] = self.upsert.to_json()
        if self.complete:
            meta["output_mode"] = "complete"
        return meta

    def target_meta(self, arrow_schema, base: Mapping[str, Any] | None) -> dict[str, Any]:
        """What phase 2 needs of the stream besides the files (kept in the record): the
        schema it writes to the table. ``base``: :meth:`DeltaTarget.base` when a record is
        made (None for light mode)."""
        return {
            **self.write_meta(),
            "arrow_schema": schema_to_b64(self.table_schema(arrow_schema)),
            "partition_by": list(self.partition_by),
            "merge_schema": self.merge_schema,
            **(base or {"base_version": None}),
        }

    def record_store(self) -> RecordStore:
        return RecordStore(DeltaEventLog(self.record_table, dict(self.storage_options)))

    def target(self) -> DeltaTarget:
        """The target phase 2 writes: appended, merged by key, or overwritten."""
        if self.upsert is not None:
            from .delta_merge_target import DeltaMergeTarget

            return DeltaMergeTarget(
                self.path,
                self.sink_id,
                spec=self.upsert,
                faults=self.faults,
                **self._target_options(),
            )
        if self.complete:
            from .delta_overwrite_target import DeltaOverwriteTarget

            return DeltaOverwriteTarget(self.path, self.sink_id, **self._target_options())
        return DeltaTarget(self.path, self.sink_id, **self._target_options())

    def _target_options(self) -> dict[str, Any]:
        return dict(
            partition_by=self.partition_by,
            storage=self.storage,
            table_properties=dict(self.table_properties),
            table_name=self.table_name,
            table_description=self.table_description,
            user_metadata=self.user_metadata,
        )

    def committer(self) -> TwoPhaseCommitter:
        return TwoPhaseCommitter(
            self.record_store(),
            self.target(),
            self.sink_id,
            faults=self.faults,
            retain_snapshots=self.retain_snapshots,
            serve_exports=self._serve_exports,
        )

    def _serve_exports(self, state, record, version) -> None:
        site = ExportSite(
            record_table=self.record_table,
            sink_id=self.sink_id,
            target_uri=self.path,
            storage_options=dict(self.storage_options),
            fs_overrides=self.storage.fs_overrides,
            partition_by=self.partition_by,
            checkpoint=self.checkpoint_location,
        )
        with using(self.storage):  # every store the export touches
            serve_exports(site, state, record, version)

    def light_committer(self) -> LightCommitter:
        return LightCommitter(self.target(), self.sink_id, self.faults)

    def staging(self) -> StagingConfig:
        return StagingConfig(
            table_uri=self.path,
            sink_id=self.sink_id,
            partition_by=self.partition_by,
            storage=self.storage,
            row_group_rows=self.row_group_rows,
            compression=self.compression,
            target_file_rows=self.target_file_rows,
        )


_D = DeltaSinkOptions  # the defaults, defined once: the dataclass's
SINK_OPTIONS = {
    "path": "target Delta table URI (required)",
    "checkpointLocation": "set by Spark from writeStream.option('checkpointLocation')",
    "queryName": "set by Spark from queryName()",
    "recordTable": "record table URI (default <checkpointLocation>/pyspark_txn/records)",
    "sinkId": "the sink's id (default derived from the checkpoint location)",
    "sinkIdPrefix": f"prefix of the derived sink id (default {_D.sink_id_prefix!r})",
    "partitionBy": "comma-separated partition columns",
    "storageOptions": "JSON object of delta-rs storage options",
    "mergeSchema": "true|false: add new nullable stream columns to the table",
    "rowGroupRows": f"rows per parquet row group (default {_D.row_group_rows})",
    "compression": f"parquet codec of staged files: {', '.join(PARQUET_CODECS)} "
    f"(default {_D.compression})",
    "targetFileRows": f"rows per staged file before rolling over (default {_D.target_file_rows})",
    "userMetadata": "text kept in every commit's commitInfo.userMetadata (as delta-spark)",
    "tableName": "name of the table when the sink creates it",
    "tableDescription": "description of the table when the sink creates it",
    "logLevel": "what Spark's Python workers log to stderr (the driver's log in local mode): "
    "INFO (default: one line per batch), WARNING (or WARN), ERROR, DEBUG or OFF",
    "mode": "snapshots (default: snapshot records, fencing) or light (see docs/modes.md)",
    "retainSnapshots": f"snapshot records the record table keeps (default {_D.retain_snapshots}; "
    "older are summarized)",
    **UPSERT_OPTIONS,
    "faultInjection": "TESTS ONLY: crash plan, see pyspark_txn.faults",
}


def _delta_target(committer: TwoPhaseCommitter) -> DeltaTarget:
    target = committer.target
    assert isinstance(target, DeltaTarget)
    return target


def _prepare_attempt(opts: DeltaSinkOptions) -> tuple[int, str]:
    """Allocate the batch's snapshot id before phase 1 (see ``_spark.prepare_attempt``)."""
    return prepare_attempt(opts.committer(), opts.record_table, target_meta=opts.write_meta())


class TxnDeltaStreamWriter(WriterBase):
    def __init__(self, opts: DeltaSinkOptions, spark_schema) -> None:
        self.opts = opts
        self.arrow_schema = spark_to_arrow_schema(spark_schema)
        # Checked here, where Spark reports a plain "failed to initialize" error, rather
        # than at pickling, where it would be buried in a PicklingError.
        opts.check_schema(self.arrow_schema)
        check_writable_schema(self.arrow_schema)
        # One step per writer and process (Spark builds one per batch in the planner and
        # one in the commit worker): tables checked here are not checked again in it.
        self._checked: set = set()
        with one_check_per_step(self._checked):
            opts.target().check_stream_schema(
                opts.table_schema(self.arrow_schema), opts.merge_schema
            )
        self._attempt: tuple[int, str] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Pickling happens in the driver, once per batch, before any task runs:
        # the one place a snapshot id can be made safe before phase 1.
        if self._attempt is None:
            worker_logging(self.opts.log_level)
            with store_errors(), one_check_per_step(self._checked):
                self._attempt = (
                    (LIGHT_SNAPSHOT_ID, new_token())
                    if self.opts.light
                    else _prepare_attempt(self.opts)
                )
        return {k: v for k, v in self.__dict__.items() if k != "_checked"}

    def write(self, iterator) -> TxnCommitMessage:
        worker_logging(self.opts.log_level)
        assert self._attempt is not None, "the writer was pickled without an attempt"
        snapshot_id, token = self._attempt
        partition, _ = task_slot()
        handles = stage_partition(
            as_arrow(iterator, self.arrow_schema),
            self.opts.staging(),
            snapshot_id,
            token,
            partition,
            self.arrow_schema,
        )
        self.opts.faults.hit("phase1", snapshot=snapshot_id, partition=partition)
        return commit_message(self.opts.sink_id, snapshot_id, token, partition, handles)

    def commit(self, messages, batchId: int) -> None:
        worker_logging(self.opts.log_level)
        with store_errors(), one_check_per_step(getattr(self, "_checked", None)):
            self._commit(messages, batchId)

    def _commit(self, messages, batchId: int) -> None:
        msgs = [m for m in messages if m is not None]
        if self.opts.light:
            fs_options = self.opts.storage
            self.opts.light_committer().commit(
                batchId,
                msgs[0].token if msgs else "",
                [TxnHandle.from_json(t) for m in msgs for t in m.txns],
                query_id=read_query_id(self.opts.checkpoint_location, fs_options),
                target_meta=self.opts.target_meta(self.arrow_schema, None),
            )
            return
        committer = self.opts.committer()
        commit_batch(
            committer,
            msgs,
            batchId,
            batch_attempt(committer, msgs, batchId),
            self.opts.checkpoint_location,
            self.opts.query_name,
            lambda: self.opts.target_meta(self.arrow_schema, _delta_target(committer).base()),
            self.opts.storage,
        )

    def abort(self, messages, batchId: int) -> None:
        worker_logging(self.opts.log_level)
        if self.opts.light:
            for token in sorted({m.token for m in messages if m}):
                self.opts.light_committer().abort(token, batchId)
            return
        abort_attempts(self.opts.committer(), messages)
