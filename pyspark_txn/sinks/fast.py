"""The fast path: ``foreachBatch`` with Spark's own parquet writer as phase 1.

``txn-delta`` moves every row from the JVM to a Python worker to write it;
here Spark's parquet writer stages the batch on the executors and only the
driver runs Python: allocate, stage, record, phase 2 -- the same
:class:`TwoPhaseCommitter`, :class:`DeltaTarget`, options and record table as
``txn-delta``, so fencing, recovery, retention and snapshots behave the same.

Per batch (all in the driver, in the ``foreachBatch`` callback):

1. a batch Spark already asked for (at or below the last record) is handed
   to the committer with nothing staged: a replay is a no-op, and nothing is
   written for it;
2. allocate a snapshot id and token (safe);
3. write the attempt's marker naming the table root into
   ``txn-staged/<sink>/<snapshot>-<token>/``, then run Spark's write into
   ``txn-staged/<sink>/<snapshot>-<token>/spark/`` -- every file Spark leaves
   there (task temporaries, a failed job's leftovers) is under the attempt's
   staging folder, which the sweep and ``discard`` already list;
4. rename each non-empty parquet file into the table root under the staging
   layout's name ``part-<sink>-<snapshot>-<token>-00000-<attempt>-<n>.parquet``
   (found through the marker if anything fails from here on), read its bytes
   for size, CRC32 and footer (rows, Delta stats), fsync (local disks);
5. ``committer.commit`` with Spark's offsets of the batch and Spark's run id;
   on any failure before that returns, ``committer.abort`` (as Spark's abort
   does for ``txn-delta``).

A whole attempt is one "task attempt" in the staging layout (partition
``00000``), so ``discard(keep=committed)`` knows the root holds no other file
of it and does not list the table root after phase 2.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .. import _fs
from ..checkpoint import read_batch_offsets, read_query_id
from ..errors import ConfigError
from ..state import TxnHandle
from .delta import DeltaSinkOptions, spark_to_arrow_schema
from .delta_target import check_writable_schema, schema_to_b64
from .staging import (
    MARKER_SUFFIX,
    data_file_prefix,
    delta_stats,
    dictionary_columns,
    snapshot_dir,
)
from .twophase import TwoPhaseCommitter

log = logging.getLogger(__name__)

SPARK_DIR = "spark"
# Spark's names for our codecs (lz4: the raw codec every parquet reader has).
_SPARK_CODECS = {
    "snappy": "snappy",
    "zstd": "zstd",
    "lz4": "lz4_raw",
    "gzip": "gzip",
    "none": "none",
}
# Options of txn-delta the fast path cannot honour yet: refused by name, not ignored.
_UNSUPPORTED = {
    "partitionby": "partitionBy (partitioned tables: use format('txn-delta') for now)",
    "rowgrouprows": "rowGroupRows (Spark's parquet writer sizes row groups by bytes: "
    "set spark.hadoop.parquet.block.size)",
    "mode": "mode (the fast path keeps snapshot records; light mode is txn-delta only)",
}


def delta_batch_writer(path: str, checkpoint: str, **options: Any) -> DeltaBatchWriter:
    """A ``foreachBatch`` function that appends each micro-batch to the Delta table at
    ``path`` exactly once, staging with Spark's own parquet writer.

    ``checkpoint`` must be the query's ``checkpointLocation`` (Spark's offsets of each
    batch and its query id are read there). Other options are ``txn-delta``'s
    (``sinkId``, ``recordTable``, ``mergeSchema``, ``compression``, ``targetFileRows``,
    ``retainSnapshots``, ``storageOptions``, ``fs.*``, ``delta.*`` ...)::

        df.writeStream.foreachBatch(pyspark_txn.delta_batch_writer(
            path="/data/t", checkpoint="/chk/q")).option("checkpointLocation", "/chk/q").start()
    """
    raw = {k: str(v) for k, v in options.items()}
    lower = {k.lower() for k in raw}
    for key in ("path", "checkpointlocation"):
        if key in lower:
            raise ConfigError(
                f"delta_batch_writer: give {key} as the argument "
                f"{'path' if key == 'path' else 'checkpoint'}=..., not as an option"
            )
    bad = [desc for key, desc in _UNSUPPORTED.items() if key in lower]
    if bad:
        raise ConfigError(f"delta_batch_writer: option {'; '.join(bad)} is not supported")
    opts = DeltaSinkOptions.parse({"path": path, "checkpointLocation": checkpoint, **raw})
    return DeltaBatchWriter(opts)


@dataclass(frozen=True)
class _SparkJob:
    """What Spark's job description says about the batch being run (set by
    StreamExecution for every batch: the query id, the run id, the batch id)."""

    query_id: str | None
    run_id: str | None
    batch_id: int | None
    query_name: str | None


def _is_connect(spark) -> bool:
    return type(spark).__module__.startswith("pyspark.sql.connect")


def _spark_job(spark, connect_run: str | None) -> _SparkJob:
    """Read in the ``foreachBatch`` callback: it runs on the stream's own thread, whose
    local properties carry the batch's job description (measured on 4.3).

    Spark Connect runs the callback in a Python process of the query run, with no
    access to the JVM's properties: there the run is the writer's own unpickling
    (``connect_run``; see :meth:`DeltaBatchWriter.__setstate__`).
    """
    if _is_connect(spark):
        return _SparkJob(query_id=None, run_id=connect_run, batch_id=None, query_name=None)
    sc = spark.sparkContext
    description = sc.getLocalProperty("spark.job.description") or ""
    fields: dict[str, str] = {}
    name = None
    for i, line in enumerate(description.splitlines()):
        key, sep, value = line.partition("=")
        if sep:
            fields[key.strip()] = value.strip()
        elif i == 0 and line.strip():
            name = line.strip()
    run_id = fields.get("runId") or sc.getLocalProperty("spark.jobGroup.id") or None
    batch = fields.get("batch")
    return _SparkJob(
        query_id=fields.get("id"),
        run_id=run_id,
        batch_id=int(batch) if batch and batch.isdigit() else None,
        query_name=name if name and name != "null" else None,
    )


class DeltaBatchWriter:
    """The ``foreachBatch`` callable. Holds only options; every batch reads the record
    table afresh (nothing per process stands for a run)."""

    def __init__(self, opts: DeltaSinkOptions) -> None:
        self._given = opts
        self._opts: DeltaSinkOptions | None = None
        self._record_table_ready = False
        self._connect_run: str | None = None

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Spark Connect pickles the function at start() and unpickles it once, in the
        # Python process that runs every batch of that query run (measured on 4.3: one
        # process and one unpickling per run, a new one at each restart). So a fresh id
        # per unpickling identifies the run, and two runs still fence each other.
        self.__dict__.update(state)
        self._connect_run = f"connect-{uuid.uuid4()}"

    @property
    def opts(self) -> DeltaSinkOptions:
        if self._opts is None:  # the checkpoint's sink id, written there on first use
            self._opts = self._given.with_checkpoint_sink_id()
        return self._opts

    def __call__(self, df, batch_id: int) -> None:
        opts = self._given  # nothing is written to the checkpoint before it is checked
        fs_options = dict(opts.fs_options)
        job = _spark_job(df.sparkSession, self._connect_run)
        query_id = read_query_id(opts.checkpoint_location, fs_options)
        if job.query_id is not None and query_id is not None and job.query_id != query_id:
            raise ConfigError(
                f"delta_batch_writer: checkpoint={opts.checkpoint_location!r} belongs to query "
                f"{query_id}, but this batch is of query {job.query_id}: pass the query's own "
                "checkpointLocation as checkpoint="
            )
        if job.run_id is None:
            raise ConfigError(
                "delta_batch_writer: Spark's run id of this batch is not visible (its job "
                "description and job group are missing): call the writer directly in the "
                "foreachBatch function, on Spark's thread, not in a thread of your own "
                "(on Spark Connect: pass the writer itself to foreachBatch, or call it from "
                "a function that holds it). Without it two runs of one checkpoint cannot "
                "fence each other"
            )
        if job.batch_id is not None and job.batch_id != batch_id:
            raise ConfigError(
                f"delta_batch_writer: Spark runs batch {job.batch_id} but the callback got "
                f"{batch_id}; call the writer with foreachBatch's own (df, batch_id)"
            )
        offsets = read_batch_offsets(opts.checkpoint_location, batch_id, fs_options)
        if query_id is None or offsets is None:
            # Spark writes both before it runs a batch; without them replays could not be
            # told from a reset checkpoint.
            raise ConfigError(
                f"delta_batch_writer: checkpoint={opts.checkpoint_location!r} has no Spark "
                f"{'metadata' if query_id is None else f'offsets/{batch_id}'}: pass the "
                "query's own checkpointLocation as checkpoint= (asynchronous progress "
                "tracking, which writes offsets late, is not supported)"
            )
        opts = self.opts
        committer = opts.committer()
        if not self._record_table_ready:
            committer.store.log.create_if_missing()
            self._record_table_ready = True
        arrow_schema = spark_to_arrow_schema(df.schema)
        check_writable_schema(arrow_schema)
        target = opts.target()
        target.check_stream_schema(arrow_schema, opts.merge_schema)
        commit_kw: dict[str, Any] = dict(
            run_id=job.run_id,
            source_offsets=offsets,
            query_id=query_id,
            query_name=job.query_name or opts.query_name,
        )
        last = committer.load().last_record
        replay = last is not None and batch_id <= last.batch_id
        snapshot_id, token = committer.allocate()
        try:
            if replay:
                # Decided before: the committer recognises the replay (or a checkpoint
                # that went back) from the record; Spark's write never runs.
                txns: list[TxnHandle] = []
            else:
                txns = self._stage(df, snapshot_id, token)
                opts.faults.hit("phase1", snapshot=snapshot_id)
            committer.commit(
                batch_id,
                snapshot_id,
                token,
                txns,
                target_meta={
                    "uri": opts.path,
                    "arrow_schema": schema_to_b64(arrow_schema),
                    "partition_by": [],
                    "merge_schema": opts.merge_schema,
                    "base_version": target.base_version(),
                },
                **commit_kw,
            )
        except BaseException:
            _abort(committer, snapshot_id, token)
            raise

    # --- phase 1 ------------------------------------------------------------------

    def _stage(self, df, snapshot_id: int, token: str) -> list[TxnHandle]:
        """Run Spark's parquet write for the attempt; return the staged files' handles."""
        opts = self.opts
        fs, root = _fs.filesystem(opts.path, dict(opts.fs_options))
        local = _fs.is_local(opts.path)
        attempt = uuid.uuid4().hex[:8]
        base = snapshot_dir(opts.sink_id, snapshot_id, token)
        # The marker first: from the first renamed file on, discard finds them by it.
        marker = _fs.join(root, base, f"00000-{attempt}-0000{MARKER_SUFFIX}")
        _write_marker(fs, marker, local)
        spark_dir = _fs.join(root, base, SPARK_DIR)
        writer = (
            df.write.mode("error")
            .option("compression", _SPARK_CODECS[opts.compression])
            .option("mapreduce.fileoutputcommitter.marksuccessfuljobs", "false")
            .options(**_encoding_options(df.schema))
        )
        if opts.target_file_rows:
            writer = writer.option("maxRecordsPerFile", str(opts.target_file_rows))
        started = time.perf_counter()
        conf = df.sparkSession.conf
        key = "spark.sql.parquet.outputTimestampType"
        previous = conf.get(key, None)
        conf.set(key, "TIMESTAMP_MICROS")  # INT96 has no Delta stats; delta-rs reads micros
        try:
            writer.parquet(_spark_uri(spark_dir))
        finally:
            if previous is None:
                conf.unset(key)
            else:
                conf.set(key, previous)
        wrote = time.perf_counter()
        written = sorted(
            p
            for p in fs.ls(spark_dir, detail=False)
            if os.path.basename(p).startswith("part-") and p.endswith(".parquet")
        )
        prefix = data_file_prefix(opts.sink_id, snapshot_id, token)
        moves = []
        for n, src in enumerate(written):
            name = f"{prefix}00000-{attempt}-{n:04d}.parquet"
            moves.append((src, _fs.join(root, name), name, _spark_partition(src)))
        for src, dst, _, _ in moves:
            fs.mv(src, dst)
        file_schema = spark_to_arrow_schema(df.schema)
        with ThreadPoolExecutor(min(8, max(1, len(moves)))) as pool:
            handles = list(
                pool.map(lambda m: _measure(fs, m[1], m[2], m[3], local, file_schema), moves)
            )
        if local:
            _fs.fsync_dir(root)
        # Spark's leftovers (.crc files, empty task folders) go now; a crash leaves
        # them under the attempt's folder, where discard finds them.
        fs.rm(spark_dir, recursive=True)
        log.info(
            "sink %s: snapshot %d staged by Spark: %d files; Spark's write %.0f ms, "
            "rename/CRC/footers/fsync %.0f ms",
            opts.sink_id,
            snapshot_id,
            len(handles),
            (wrote - started) * 1000,
            (time.perf_counter() - wrote) * 1000,
        )
        empty = [h for h in handles if h.rows == 0]
        if empty:  # Spark writes a schema-only file for an empty batch: never committed
            fs.rm([_fs.join(root, h.handle) for h in empty])
        return [h for h in handles if h.rows > 0]


def _abort(committer: TwoPhaseCommitter, snapshot_id: int, token: str) -> None:
    try:
        committer.abort(snapshot_id, token)
    except Exception as e:  # the first error is the one to report; recovery sweeps
        log.warning(
            "sink %s: rolling back snapshot %d after a failure failed: %r",
            committer.sink_id,
            snapshot_id,
            e,
        )


def _write_marker(fs, path: str, local: bool) -> None:
    if local:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:  # names the table root
            f.flush()
            os.fsync(f.fileno())
        _fs.fsync_dir(os.path.dirname(path))
        return
    fs.makedirs(os.path.dirname(path), exist_ok=True)
    with fs.open(path, "w") as f:
        f.write("")


def _encoding_options(spark_schema) -> dict[str, str]:
    """Dictionary encoding for string and binary columns only, as txn-delta writes
    (``dictionary_columns``): for numbers it costs about an eighth of Spark's write
    time (4M rows of int64, measured) and rarely pays off. parquet-mr takes it per
    column as ``parquet.enable.dictionary#<column>``."""
    options = {"parquet.enable.dictionary": "false"}
    for name in dictionary_columns(spark_to_arrow_schema(spark_schema)) or []:
        options[f"parquet.enable.dictionary#{name}"] = "true"
    return options


def _spark_uri(path: str) -> str:
    return f"file://{path}" if _fs.is_local(path) else path


def _spark_partition(path: str) -> int:
    """The task partition in Spark's file name ``part-00003-<uuid>-c000...``."""
    parts = os.path.basename(path).split("-")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def _measure(fs, path: str, rel: str, partition: int, local: bool, schema) -> TxnHandle:
    """Size, CRC32, rows and Delta stats of one staged file, from one read of it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if local:
        with open(path, "rb") as f:
            data = f.read()
            os.fsync(f.fileno())
    else:
        with fs.open(path, "rb") as f:
            data = f.read()
    metadata = pq.ParquetFile(pa.BufferReader(data)).metadata
    return TxnHandle(
        partition=partition,
        handle=rel,
        rows=metadata.num_rows,
        bytes=len(data),
        checksum=f"crc32:{zlib.crc32(data):08x}",
        meta={
            "partition_values": {},
            "stats": delta_stats(metadata, schema),
            "mtime": int(time.time() * 1000),
        },
    )
