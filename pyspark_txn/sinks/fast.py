"""The fast path: ``foreachBatch`` with Spark's own parquet writer as phase 1.

``txn-delta`` moves every row from the JVM to a Python worker to write it;
here Spark's parquet writer stages the batch on the executors and only the
driver runs Python: allocate, stage, record, phase 2 -- the same
:class:`TwoPhaseCommitter`, :class:`DeltaTarget`, options and record table as
``txn-delta``, so fencing, recovery, retention and snapshots behave the same.
``mode=light`` commits with :class:`LightCommitter` instead (app transaction
only, no records), as ``txn-delta`` does.

Per batch (all in the driver, in the ``foreachBatch`` callback):

1. a batch already decided is not written again: in snapshot mode one at or
   below the last record is handed to the committer with nothing staged (it
   recognises the replay); in light mode one the table's app transaction
   holds is skipped;
2. allocate a snapshot id and token (light mode: ``LIGHT_SNAPSHOT_ID`` and a
   fresh token);
3. write one marker into the attempt's staging folder naming the attempt's own
   folder of the table, ``part-<sink>-<snapshot>-<token>-00000-<attempt>/``
   (``spark_folder``), then run Spark's write (``partitionBy`` for partitioned
   tables, rows never leave the JVM) straight into it, with Spark's Hadoop
   commit protocol and FileOutputCommitter algorithm 1 whatever the session
   sets (``_WRITE_CONF``), so that outside ``_temporary/`` the folder holds the
   files of the task attempts Spark committed and no other. Every file Spark
   leaves there (task temporaries, a failed job's output) is in a folder the
   marker names, which the sweep and ``discard`` list whole;
4. list the folder: map each of Spark's ``c=v/`` folders to the partition
   values ``txn-delta`` would write for the same rows, remove what is no data
   file (``_temporary/``, ``_SUCCESS``), read each file's bytes for size and
   CRC32 a chunk at a time and its footer (rows, Delta stats) by itself, never
   the whole file in memory, in parallel, and fsync (local disks). Nothing is
   renamed or copied: the files are committed where Spark wrote them;
5. commit (``TwoPhaseCommitter.commit`` with Spark's offsets of the batch and
   Spark's run id, or ``LightCommitter.commit``); on any failure before that
   returns, abort as Spark's abort does for ``txn-delta``.

A whole attempt is one "task attempt" in the staging layout (partition
``00000``), so ``discard(keep=committed)`` knows no folder holds another file
of it and lists none after phase 2.

Small batches (``smallBatchRows``, issue 36) skip Spark's write job: a probe collects
at most ``smallBatchRows + 1`` rows to the driver, and a batch that fits is staged there
as ``txn-delta``'s write task stages a partition (``stage_partition``), step 3-4 above
replaced; the rest is the same. See :meth:`DeltaBatchWriter._stage` and
docs/fast_path.md, "Small batches".
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import ConfigError
from ..spark.options import reject_unknown_options
from ..state import TxnHandle, new_token
from ..storage import fs as _fs
from ..storage.checkpoint import read_batch_offsets, read_query_id
from ..storage.options import StorageOptions
from ._spark import worker_logging
from .delta import SINK_OPTIONS, DeltaSinkOptions, spark_to_arrow_schema
from .delta_target import DeltaTarget, check_writable_schema
from .fast_output import (  # noqa: F401 (re-exported: callers import them from here)
    _TAG,
    _is_string,
    _measure,
    _Move,
    collect_spark_output,
    spark_folder,
)
from .light import LIGHT_SNAPSHOT_ID
from .staging import (
    dictionary_columns,
    marker_name,
    snapshot_dir,
    stage_partition,
    write_marker,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# Spark's names for our codecs (lz4: the raw codec every parquet reader has).
_SPARK_CODECS = {
    "snappy": "snappy",
    "zstd": "zstd",
    "lz4": "lz4_raw",
    "gzip": "gzip",
    "none": "none",
}
#: The small-batch route: a batch of at most this many rows is collected to the driver
#: and staged there (``smallBatchRows``; docs/fast_path.md, "Small batches").
SMALL_BATCH_ROWS = 10_000
#: The probe's limit, smallBatchRows + 1, is a Java int in Spark.
MAX_SMALL_BATCH_ROWS = 2**31 - 2
#: The fast path's own options (txn-delta has none of them), described once with their
#: defaults.
FAST_OPTIONS = {
    "smallBatchRows": "a batch of at most this many rows is collected to the driver "
    "(toArrow) and staged there, without a Spark write job; larger ones go through "
    f"Spark's writer (default {SMALL_BATCH_ROWS}; 0: every batch through Spark's writer)",
}
# Options of txn-delta the fast path cannot honour: refused by name, not ignored.
_UNSUPPORTED = {
    "rowgrouprows": "rowGroupRows (Spark's parquet writer sizes row groups by bytes: "
    "set spark.hadoop.parquet.block.size)",
}


def delta_batch_writer(path: str, checkpoint: str, **options: Any) -> DeltaBatchWriter:
    """A ``foreachBatch`` function that appends each micro-batch to the Delta table at
    ``path`` exactly once, staging with Spark's own parquet writer.

    ``checkpoint`` must be the query's ``checkpointLocation`` (Spark's offsets of each
    batch and its query id are read there). Other options are ``txn-delta``'s
    (``partitionBy``, ``mode``, ``sinkId``, ``recordTable``, ``mergeSchema``,
    ``compression``, ``targetFileRows``, ``retainSnapshots``, ``storageOptions``,
    ``fs.*``, ``delta.*`` ...; not ``rowGroupRows``)::

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
    reject_unknown_options(  # txn-delta's options, less what the fast path takes otherwise
        "delta_batch_writer",
        raw,
        [
            *(
                k
                for k in SINK_OPTIONS
                if k.lower() not in {*_UNSUPPORTED, "path", "checkpointlocation"}
            ),
            *FAST_OPTIONS,
        ],
        {"fs.": "fs.<fsspec option>", "delta.": "delta.<table property>"},
    )
    small_rows = SMALL_BATCH_ROWS
    for key in [k for k in raw if k.lower() == "smallbatchrows"]:
        small_rows = _parse_small_batch_rows(raw.pop(key))
    opts = DeltaSinkOptions.parse({"path": path, "checkpointLocation": checkpoint, **raw})
    return DeltaBatchWriter(opts, small_rows)


def _parse_small_batch_rows(value: str) -> int:
    text = value.strip()
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_SMALL_BATCH_ROWS:
        raise ConfigError(
            f"delta_batch_writer: option smallBatchRows={value!r}: expected a whole number of "
            f"rows from 0 to {MAX_SMALL_BATCH_ROWS} (the most rows a batch may have to be "
            "staged from the driver; 0: every batch through Spark's writer)"
        )
    return int(text)


@dataclass(frozen=True)
class _SparkJob:
    """What Spark's job description says about the batch being run (set by
    StreamExecution for every batch: the query id, the run id, the batch id)."""

    query_id: str | None
    run_id: str | None
    batch_id: int | None
    query_name: str | None


def _is_uuid(text: str | None) -> bool:
    try:
        return text is not None and str(uuid.UUID(text)) == text.lower()
    except ValueError:
        return False


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
    # StreamExecution sets both to the run id; the job group is the fallback for a
    # callback that set its own job description, and only a UUID is Spark's (a group
    # the user set would merge runs, and switch fencing off)
    run_id = fields.get("runId")
    if not _is_uuid(run_id):  # (asked only then: each is a call into the JVM)
        group = sc.getLocalProperty("spark.jobGroup.id")
        run_id = group if _is_uuid(group) else None
    batch = fields.get("batch")
    return _SparkJob(
        query_id=fields.get("id"),
        run_id=run_id,
        batch_id=int(batch) if batch and batch.isdigit() else None,
        query_name=name if name and name != "null" else None,
    )


class DeltaBatchWriter:
    """The ``foreachBatch`` callable. Holds options, and the (run, batch) it committed
    last: only to skip the replay check's read of the record table for the batch
    after it (the committer reads the record table afresh for every batch). And what
    the small-batch route decides from: the rows of this writer's last staged batch,
    and whether the run's query is stateful."""

    def __init__(self, opts: DeltaSinkOptions, small_batch_rows: int = SMALL_BATCH_ROWS) -> None:
        self._given = opts
        self._opts: DeltaSinkOptions | None = None
        self._record_table_ready = False
        self._connect_run: str | None = None
        self._written: tuple[str | None, int] | None = None  # (run, batch) last written
        self._mode: tuple[str | None, str | None] | None = None  # (run, its output mode)
        self._small_rows = small_batch_rows
        self._last_rows: int | None = None  # rows of the last batch this writer staged
        self._run: str | None = None  # the run of the batch being written
        self._stateful: tuple[str, bool] | None = None  # (run, whether its query is stateful)
        self._spark_only = False  # a probe went over maxResultSize, or a persist failed

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
        worker_logging(opts.log_level)
        spark_uri(opts.path, df.sparkSession, opts.storage)  # a missing FileSystem: refuse now
        fs_options = opts.storage
        job = _spark_job(df.sparkSession, self._connect_run)
        self._run = job.run_id
        if job.run_id is not None and (job.run_id, batch_id) == self._written:
            # Spark runs a batch once per run; a second call would be taken for a replay
            # and its rows dropped
            raise ConfigError(
                f"delta_batch_writer: called a second time for batch {batch_id} in one run: a "
                "batch is written by one call (union the parts first); two tables need two "
                "writers with two checkpoints"
            )
        probe = self._probe_ahead(df, batch_id)
        query_id = read_query_id(opts.checkpoint_location, fs_options)
        if job.query_id is not None and query_id is not None and job.query_id != query_id:
            raise ConfigError(
                f"delta_batch_writer: checkpoint={opts.checkpoint_location!r} belongs to query "
                f"{query_id}, but this batch is of query {job.query_id}: pass the query's own "
                "checkpointLocation as checkpoint="
            )
        opts = self._for_output_mode(df.sparkSession, job)
        if job.run_id is None and not opts.light:
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
        arrow_schema = spark_to_arrow_schema(df.schema)
        opts.check_schema(arrow_schema)
        check_writable_schema(arrow_schema)
        opts = self.opts
        target = opts.target()
        target.check_stream_schema(opts.table_schema(arrow_schema), opts.merge_schema)
        if opts.light:
            self._light_batch(df, batch_id, target, query_id, arrow_schema, probe)
            self._written = (job.run_id, batch_id)
            return
        committer = opts.committer()
        if not self._record_table_ready:
            committer.store.log.create_if_missing()
            self._record_table_ready = True
        commit_kw: dict[str, Any] = dict(
            run_id=job.run_id,
            source_offsets=offsets,
            query_id=query_id,
            query_name=job.query_name or opts.query_name,
        )
        if job.run_id is not None and self._written == (job.run_id, batch_id - 1):
            # This run committed the batch before; Spark runs a run's batches in order,
            # so this one is no replay and the record table need not be read for it
            # here (the committer reads it anyway; a newer run fences the commit).
            replay = False
        else:
            last = committer.load().last_record
            replay = last is not None and batch_id <= last.batch_id
            if self._last_rows is None and last is not None:
                self._last_rows = last.rows  # (a restart: the route follows the last batch)
        snapshot_id, token = committer.allocate(opts.write_meta())
        try:
            # A replay was decided before: the committer recognises it (or a checkpoint
            # that went back) from the record; Spark's write never runs (a stateful
            # query's batch runs for its operators' state alone).
            if replay:
                _run_stateful_replay(df, opts, batch_id)
            txns = (
                [] if replay else self._stage(df, arrow_schema, batch_id, snapshot_id, token, probe)
            )
            committer.commit(
                batch_id,
                snapshot_id,
                token,
                txns,
                target_meta=opts.target_meta(arrow_schema, target.base()),
                **commit_kw,
            )
        except BaseException:
            _roll_back(lambda: committer.abort(snapshot_id, token), opts.sink_id, batch_id)
            raise
        self._written = (job.run_id, batch_id)

    def _for_output_mode(self, spark, job: _SparkJob) -> DeltaSinkOptions:
        """The options as the query's output mode needs them (a classic session says it;
        elsewhere the options as given: append, or a merge with keys). Update mode's
        batches hold the rows that changed: only a merge by key keeps them once. Complete
        mode's batches are the whole result: each replaces the table's rows, as txn-delta
        does in complete mode."""
        if self._mode is None or self._mode[0] != job.run_id:
            self._mode = (job.run_id, _output_mode(spark, job.query_id))
        mode = self._mode[1]
        if mode == "update" and self._given.upsert is None:
            raise ConfigError(
                "delta_batch_writer: the query runs in update mode, whose batches hold only "
                "the rows that changed: give keys=... (the grouping columns) to merge them "
                "into the table by key; appended, every update would be one more row"
            )
        if mode == "complete" and not self._given.complete:
            self._given = self._given.for_complete_mode()  # (keys are refused there)
            self._opts = None
        return self._given

    def _light_batch(
        self,
        df,
        batch_id: int,
        target: DeltaTarget,
        query_id: str | None,
        arrow_schema,
        probe: Future | None,
    ) -> None:
        """Light mode: the table's app transaction alone decides; a batch it holds is
        not written again (Spark's write never runs for it)."""
        opts = self.opts
        done = target.committed_batch(opts.sink_id)
        if done is not None and done >= batch_id:
            _run_stateful_replay(df, opts, batch_id)
            log.info(
                "sink %s (light): batch %d is already in the table (batch %d is); not "
                "written again",
                opts.sink_id,
                batch_id,
                done,
            )
            return
        committer = opts.light_committer()
        token = new_token()
        try:
            txns = self._stage(df, arrow_schema, batch_id, LIGHT_SNAPSHOT_ID, token, probe)
            meta = opts.target_meta(arrow_schema, None)
            committer.commit(batch_id, token, txns, query_id=query_id, target_meta=meta)
        except BaseException:
            _roll_back(lambda: committer.abort(token, batch_id), opts.sink_id, batch_id)
            raise

    # --- phase 1 ------------------------------------------------------------------

    def _probe_ahead(self, df, batch_id: int) -> Future | None:
        """Start building the probe DataFrame of a batch that will take the small-batch
        route, while this thread checks, allocates and reads the tables: Spark analyses
        each new DataFrame (the probe's coalesce and limit: ~5 ms of a 10-row batch's
        ~55, measured on 4.3), and that needs no Python. Only where the route and the
        probe's shape are already known: the next batch of this run after a small one,
        in a query known not to be stateful, on a classic session (Spark Connect builds
        plans on the client). Building a DataFrame runs nothing and writes nothing."""
        run = self._run
        if (
            run is None
            or self._written != (run, batch_id - 1)
            or self._stateful != (run, False)
            or self._last_rows is None
            or not self._takes_small_route(df)
            or _is_connect(df.sparkSession)
        ):
            return None
        return _in_background(lambda: self._probe_of(df, stateful=False))

    def _takes_small_route(self, df) -> bool:
        """Whether a batch may go the small-batch route (a probe then decides)."""
        small = self._small_rows
        if small <= 0 or self._spark_only or not hasattr(df, "toArrow"):  # (toArrow: 4.0 on)
            return False
        return self._last_rows is None or self._last_rows <= small

    def _stage(
        self,
        df,
        arrow_schema,
        batch_id: int,
        snapshot_id: int,
        token: str,
        probe: Future | None = None,
    ) -> list[TxnHandle]:
        """Phase 1 of the attempt; the written files' handles. A small batch is staged from
        the driver (no Spark write job: most of a tiny batch's cost), any other by Spark's
        parallel writer. Which one: a probe collects at most ``smallBatchRows + 1`` rows,
        and a result of at most ``smallBatchRows`` is the whole batch; after a batch that
        was larger the next goes to Spark's writer without a probe.

        A stateful query's batch is persisted first, so that its plan (its operators'
        state commits) runs once whichever way it is written: Spark refuses a batch whose
        state stores did not all commit (a probe cut short by its limit), and running
        the plan again would commit each state version twice."""
        if not self._takes_small_route(df):
            if self._last_rows is not None and self._last_rows > self._small_rows > 0:
                log.debug(
                    "sink %s: the last batch had %d rows, over smallBatchRows=%d: Spark's writer",
                    self.opts.sink_id,
                    self._last_rows,
                    self._small_rows,
                )
            return self._counted(self._spark_stage(df, arrow_schema, batch_id, snapshot_id, token))
        stateful = self._is_stateful(df)
        cache = stateful and not _is_persisted(df)  # (a batch the caller persisted stays so)
        # An unpartitioned batch's files go into the table root: its marker is written
        # while the probe job runs (its two fsyncs: 2-4 ms of a tiny batch, measured).
        attempt = uuid.uuid4().hex[:8]
        marker = (
            None
            if self.opts.partition_by
            else _in_background(lambda: self._mark_attempt(snapshot_id, token, attempt, ""))
        )
        if cache:
            df.persist()
        try:
            try:
                table = self._collect_small(df, stateful, None if stateful else probe)
            except BaseException as e:
                if marker is not None:  # (the probe's error is the one to report)
                    wait([marker])
                if not cache or not isinstance(e, Exception):
                    raise
                # Spark fails some persisted stateful batches as it plans them (4.3: a
                # max() of a string by key, "key not found" in InMemoryRelation): the
                # batch, unpersisted, and the writer's later stateful ones go to Spark's
                # writer, as they did before this route (its own failure, if any, is raised)
                log.warning(
                    "sink %s: the persisted stateful batch %d could not be probed (%s): "
                    "Spark's writer stages it, and this writer's stateful batches from now on",
                    self.opts.sink_id,
                    batch_id,
                    _first_line(e),
                )
                self._spark_only = True
                cache = False
                df.unpersist()
                table = None
            marked = [] if marker is None else [marker.result()]
            if table is None:
                self._unmark(marked)
                handles = self._spark_stage(df, arrow_schema, batch_id, snapshot_id, token)
            else:
                handles = self._driver_stage(
                    table, arrow_schema, batch_id, snapshot_id, token, attempt, marked
                )
        finally:
            if cache:
                df.unpersist()
        return self._counted(handles)

    def _mark_attempt(self, snapshot_id: int, token: str, attempt: str, rel_dir: str) -> str:
        """Write the first marker of task attempt ``00000-<attempt>``, naming ``rel_dir``
        (the folder its files go into, "" the table root), durably, before anything is
        written there: from then on discard and the sweep find whatever is left there.
        Returns the marker's path."""
        opts = self.opts
        fs, root = _fs.filesystem(opts.path, opts.storage)
        marker_dir = snapshot_dir(opts.sink_id, snapshot_id, token)
        path = _fs.join(root, marker_dir, marker_name(0, attempt, 0))
        write_marker(fs, path, rel_dir, _fs.is_local(opts.path))
        return path

    def _unmark(self, markers: list[str]) -> None:
        """Remove markers of a driver attempt that wrote no file (the batch went to
        Spark's writer): else every discard of the attempt would list the table root."""
        if markers:
            fs, _ = _fs.filesystem(self.opts.path, self.opts.storage)
            fs.rm(markers)

    def _counted(self, handles: list[TxnHandle]) -> list[TxnHandle]:
        self._last_rows = sum(h.rows for h in handles)
        return handles

    def _collect_small(self, df, stateful: bool, ahead: Future | None = None):
        """The batch as an Arrow table if it has at most ``smallBatchRows`` rows, else None;
        never more than ``smallBatchRows + 1`` rows come to the driver. One task reads
        the partitions in turn (no shuffle for the limit); a stateful batch, persisted,
        is computed in parallel, each partition whole. ``ahead``: the probe DataFrame,
        being built (:meth:`_probe_ahead`)."""
        limit = self._small_rows + 1
        probe = ahead.result() if ahead is not None else self._probe_of(df, stateful)
        _known_schema(probe, df.schema)
        started = time.perf_counter()
        try:
            table = probe.toArrow()
        except Exception as e:
            if not _over_result_size(e):
                raise  # (a task's own failure: Spark's writer would fail the same way)
            # Rows too wide for the driver: Spark's writer stages this batch and the
            # writer's later ones (a batch the writer can take must not fail the query)
            log.warning(
                "sink %s: the batch's first %d rows exceed spark.driver.maxResultSize: "
                "Spark's writer stages this batch and the next ones (lower smallBatchRows "
                "for rows this wide)",
                self.opts.sink_id,
                limit,
            )
            self._spark_only = True
            return None
        if table.num_rows > self._small_rows:
            log.info(
                "sink %s: the batch has over smallBatchRows=%d rows: Spark's writer stages it "
                "(probe %.0f ms)",
                self.opts.sink_id,
                self._small_rows,
                (time.perf_counter() - started) * 1000,
            )
            return None
        return table

    def _probe_of(self, df, stateful: bool):
        """The probe DataFrame: at most ``smallBatchRows + 1`` rows of the batch."""
        limit = self._small_rows + 1
        return df.limit(limit) if stateful else df.coalesce(1).limit(limit)

    def _driver_stage(
        self,
        table,
        arrow_schema,
        batch_id: int,
        snapshot_id: int,
        token: str,
        attempt: str,
        marked: list[str],
    ) -> list[TxnHandle]:
        """Stage a collected batch from the driver as txn-delta's write task stages its
        partition (``stage_partition``: markers first, parquet, CRC32, fsync), as
        partition 0 of the attempt (``marked``: the root's marker, written already)."""
        opts = self.opts
        started = time.perf_counter()
        handles = stage_partition(
            table.to_batches(),
            opts.staging(),
            snapshot_id,
            token,
            0,
            arrow_schema,
            attempt=attempt,
            marked=[""] if marked else [],
        )
        opts.faults.hit("mid_phase1", batch_id, snapshot=snapshot_id)
        log.debug(
            "sink %s: snapshot %d staged from the driver: %d rows, %d files, %.0f ms",
            opts.sink_id,
            snapshot_id,
            table.num_rows,
            len(handles),
            (time.perf_counter() - started) * 1000,
        )
        opts.faults.hit("phase1", batch_id, snapshot=snapshot_id)
        return handles

    def _is_stateful(self, df) -> bool:
        """Whether the query's batches run stateful operators (once per run: a run's plan
        keeps its operators): its checkpoint has ``state/`` (Spark writes the operators'
        metadata there when it plans the first batch), or, on a classic session, the
        batch's RDD lineage holds a state store."""
        run = self._run
        if run is not None and self._stateful is not None and self._stateful[0] == run:
            return self._stateful[1]
        found = _has_state(self.opts) or _stateful_lineage(df)
        if run is not None:
            self._stateful = (run, found)
        return found

    def _spark_stage(
        self, df, arrow_schema, batch_id: int, snapshot_id: int, token: str
    ) -> list[TxnHandle]:
        """Run Spark's parquet write for the attempt straight into its folder in the
        table; return the written files' handles."""
        opts = self.opts
        fs, root = _fs.filesystem(opts.path, opts.storage)
        local = _fs.is_local(opts.path)
        attempt = uuid.uuid4().hex[:8]
        out_rel = spark_folder(opts.sink_id, snapshot_id, token, attempt)
        self._mark_attempt(snapshot_id, token, attempt, out_rel)  # before Spark's folder
        # Spark gets the URI its Hadoop filesystem expects (s3a:// ...), checked up front
        spark_target = spark_uri(_fs.join(opts.path, out_rel), df.sparkSession, opts.storage)
        started = time.perf_counter()
        columns = [(c, arrow_schema.field(c).type) for c in opts.partition_by]
        self._spark_write(df, spark_target, [c for c, t in columns if _is_string(t)])
        wrote = time.perf_counter()
        opts.faults.hit("mid_phase1", batch_id, snapshot=snapshot_id)
        import pyarrow as pa

        file_schema = pa.schema([f for f in arrow_schema if f.name not in opts.partition_by])
        handles = collect_spark_output(fs, root, out_rel, columns, file_schema, local)
        log.info(
            "sink %s: snapshot %d written in place by Spark: %d files; Spark's write "
            "%.0f ms, list/CRC/footers/fsync %.0f ms",
            opts.sink_id,
            snapshot_id,
            len(handles),
            (wrote - started) * 1000,
            (time.perf_counter() - wrote) * 1000,
        )
        opts.faults.hit("phase1", batch_id, snapshot=snapshot_id)
        return handles

    def _spark_write(self, df, spark_dir: str, tagged: Sequence[str]) -> None:
        """Spark's write of the batch into ``spark_dir`` (string partition columns tagged,
        see ``_TAG``: the tag is in folder names only, never in a file)."""
        from pyspark.sql import functions as F

        opts = self.opts
        if tagged:
            df = df.withColumns({c: F.concat(F.lit(_TAG), F.col(_quoted(c))) for c in tagged})
        writer = (
            df.write.mode("error")
            .option("compression", _SPARK_CODECS[opts.compression])
            .option("mapreduce.fileoutputcommitter.marksuccessfuljobs", "false")
            .options(**_HADOOP_OPTIONS)
            .options(**_encoding_options(df.schema))
        )
        if opts.partition_by:
            writer = writer.partitionBy(*opts.partition_by)
        if opts.target_file_rows:
            writer = writer.option("maxRecordsPerFile", str(opts.target_file_rows))
        conf = df.sparkSession.conf  # the query's own session (Spark clones one per query)
        previous: dict[str, str | None] = {}  # what was explicitly set (None: nothing)
        for key, value in _write_conf(df.schema).items():
            if conf.get(key) == value:  # in effect already (set, or Spark's default)
                continue
            previous[key] = conf.get(key, None)
            conf.set(key, value)
        try:
            writer.parquet(spark_dir)
        finally:
            for key, own in previous.items():
                if own is None:
                    conf.unset(key)
                else:
                    conf.set(key, own)


# Session settings of Spark's parquet writer that would make files other readers get
# wrong: INT96 timestamps have no Delta stats (delta-rs reads micros), and LEGACY
# rebasing (a Spark 2 leftover) writes Julian calendar values that only Spark undoes.
#
# And the commit protocol: the staged files are what Spark's output folder holds after
# the job, so only the files of the task attempts Spark committed may be there. Spark's
# Hadoop protocol with a FileOutputCommitter (algorithm 1, _HADOOP_OPTIONS) publishes
# committed tasks' files at job commit and nothing else: a failed or lost attempt's
# files stay under _temporary/, which _spark_output skips and collect_spark_output deletes. A
# committer of the session's that writes into the output folder directly (Databricks'
# transactional protocol, any committer that is no FileOutputCommitter: Spark writes
# straight into the folder then) leaves a failed attempt's files next to the committed
# ones, and they would be committed to the table.
_WRITE_CONF = {
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    "spark.sql.parquet.datetimeRebaseModeInWrite": "CORRECTED",
    "spark.sql.parquet.int96RebaseModeInWrite": "CORRECTED",
    "spark.sql.sources.commitProtocolClass": (
        "org.apache.spark.sql.execution.datasources.SQLHadoopMapReduceCommitProtocol"
    ),
    "spark.sql.parquet.output.committer.class": "org.apache.parquet.hadoop.ParquetOutputCommitter",
}
# The settings of _WRITE_CONF that only matter for a column of dates or timestamps.
_DATETIME_CONF = frozenset(
    {
        "spark.sql.parquet.outputTimestampType",
        "spark.sql.parquet.datetimeRebaseModeInWrite",
        "spark.sql.parquet.int96RebaseModeInWrite",
    }
)


def _has_datetime(t) -> bool:
    """Whether a Spark type holds a date or timestamp anywhere (nested included)."""
    from pyspark.sql import types as T

    from ..spark.types import any_nested_type

    return any_nested_type(
        t, lambda d: isinstance(d, T.DateType | T.TimestampType | T.TimestampNTZType)
    )


def _write_conf(spark_schema) -> dict[str, str]:
    """The session settings a write of ``spark_schema`` needs (each one read and set is
    a call into the JVM: ten to fifteen per batch otherwise)."""
    if _has_datetime(spark_schema):
        return dict(_WRITE_CONF)
    return {k: v for k, v in _WRITE_CONF.items() if k not in _DATETIME_CONF}


# Hadoop settings of the write (options of the writer): algorithm 2 moves a task's files
# into the output folder at task commit, where a task that fails after its commit, or
# a commit cut half way, leaves them.
#
# And no ``.crc`` file beside each file on local disks (Hadoop's checksummed local
# FileSystem writes one, computing it as it writes): the raw local FileSystem, not
# cached, so the session's own stays as it is. (Object stores have no ``.crc``.)
_HADOOP_OPTIONS = {
    "mapreduce.fileoutputcommitter.algorithm.version": "1",
    "fs.file.impl": "org.apache.hadoop.fs.RawLocalFileSystem",
    "fs.file.impl.disable.cache": "true",
}


def _quoted(column: str) -> str:
    """A column name as Spark's parser reads it literally (dots, spaces, backticks)."""
    return "`" + column.replace("`", "``") + "`"


def _output_mode(spark, query_id: str | None) -> str | None:
    """The output mode (``append``, ``update``, ``complete``) of the streaming query
    ``query_id``, asked of the JVM: the batch's DataFrame does not say it, and the
    session ``foreachBatch`` gets is the query's clone, whose query manager does not know
    the query; the default session's does (where the query was started from it). None
    where it cannot be told (Spark Connect, another session, another Spark)."""
    if query_id is None or _is_connect(spark):
        return None
    try:
        session = spark.sparkContext._jvm.org.apache.spark.sql.SparkSession.getDefaultSession()
        if session.isEmpty():
            return None
        query = session.get().streams().get(query_id)
        if query is None:
            return None
        return str(query.streamingQuery().outputMode().toString()).lower()
    except Exception:  # a Spark whose classes differ: not known
        log.debug("output mode of query %s not found", query_id, exc_info=True)
        return None


def _run_stateful_replay(df, opts: DeltaSinkOptions, batch_id: int) -> None:
    """A replayed batch of a stateful query (aggregations, deduplication, joins: its
    checkpoint has ``state/``) still runs, rows discarded (Spark's ``noop`` sink): Spark
    commits the operators' state of a batch only where the batch runs, and refuses to go
    on without it (PySpark 4.3: STATE_STORE_COMMIT_VALIDATION_FAILED). The state it
    commits is the one the first run committed (the same offsets, the same state before).
    A stateless replay runs nothing."""
    if not _has_state(opts):
        return
    log.info(
        "sink %s: batch %d is a replay of a stateful query: run for its state only, "
        "nothing written",
        opts.sink_id,
        batch_id,
    )
    df.write.format("noop").mode("overwrite").save()


_BACKGROUND: list[ThreadPoolExecutor] = []
_BACKGROUND_LOCK = threading.Lock()


def _in_background(fn: Callable[[], T]) -> Future[T]:
    """Run ``fn`` on a thread of a small pool shared by every writer of the process
    (file IO that overlaps a Spark job of the callback's thread)."""
    with _BACKGROUND_LOCK:
        if not _BACKGROUND:
            _BACKGROUND.append(ThreadPoolExecutor(4, thread_name_prefix="txn-fast"))
        return _BACKGROUND[0].submit(fn)


def _first_line(error: BaseException) -> str:
    """The line of a (Py4J) error that says what failed: its last ``Caused by``, else its
    first line."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    causes = [ln for ln in lines if ln.startswith("Caused by:")]
    return (causes[-1] if causes else lines[0] if lines else repr(error))[:300]


def _over_result_size(error: BaseException) -> bool:
    """Whether a collect failed on ``spark.driver.maxResultSize`` (Spark's "Total size of
    serialized results ... is bigger than spark.driver.maxResultSize"), classic or Connect."""
    return "spark.driver.maxResultSize" in str(error)


def _has_state(opts: DeltaSinkOptions) -> bool:
    """Whether the query's checkpoint holds operator state (a stateful query)."""
    fs, root = _fs.filesystem(opts.checkpoint_location, opts.storage)
    return bool(fs.isdir(_fs.join(root, "state")))


def _known_schema(probe, schema) -> None:
    """Give the probe DataFrame the batch's schema (a limit and a coalesce keep it), which
    ``toArrow`` asks for: PySpark caches a DataFrame's schema on the object, and would
    fetch it from the JVM and parse it again (measured: ~3 ms of a 10-row batch, about
    half of what the probe costs over a plain ``toArrow``, on the loaded 2-core machine).
    Where this PySpark keeps it elsewhere nothing is set, and it is fetched as usual."""
    if isinstance(getattr(type(probe), "schema", None), functools.cached_property):
        probe.__dict__["schema"] = schema  # classic PySpark 4.x
    elif getattr(probe, "_cached_schema", False) is None:
        probe._cached_schema = schema  # Spark Connect


def _is_persisted(df) -> bool:
    level = df.storageLevel
    return bool(level.useMemory or level.useDisk or level.useOffHeap)


def _stateful_lineage(df) -> bool:
    """Whether the batch's RDD lineage runs a state store (classic sessions only: Spark
    Connect has no JVM to ask). ``foreachBatch`` hands the batch as a scan of the
    micro-batch's RDD, whose lineage names StateStoreRDD, ReadStateStoreRDD or
    StateStoreAwareZipPartitionsRDD where an operator keeps state."""
    if _is_connect(df.sparkSession):
        return False
    try:
        lineage = df._jdf.queryExecution().toRdd().toDebugString()
    except Exception:  # another Spark: the checkpoint's state/ decides alone
        log.debug("the batch's RDD lineage could not be read", exc_info=True)
        return False
    return "StateStore" in str(lineage)


def _roll_back(undo: Callable[[], None], sink_id: str, batch_id: int) -> None:
    try:
        undo()
    except Exception as e:  # the first error is the one to report; recovery sweeps
        log.warning(
            "sink %s: rolling back the attempt of batch %d after a failure failed: %r",
            sink_id,
            batch_id,
            e,
        )


def _encoding_options(spark_schema) -> dict[str, str]:
    """Dictionary encoding for string and binary columns only, as txn-delta writes
    (``dictionary_columns``): for numbers it costs about an eighth of Spark's write
    time (4M rows of int64, measured) and rarely pays off. parquet-mr takes it per
    column as ``parquet.enable.dictionary#<column>``."""
    options = {"parquet.enable.dictionary": "false"}
    for name in dictionary_columns(spark_to_arrow_schema(spark_schema)) or []:
        options[f"parquet.enable.dictionary#{name}"] = "true"
    return options


#: Hadoop FileSystem scheme open-source Spark uses for a store's URI scheme, and the
#: jar that provides it (named when the session has none).
_HADOOP_SCHEMES = {
    "s3": ("s3a", "hadoop-aws (org.apache.hadoop:hadoop-aws, matching Spark's Hadoop)"),
    "s3a": ("s3a", "hadoop-aws (org.apache.hadoop:hadoop-aws, matching Spark's Hadoop)"),
    "abfs": ("abfs", "hadoop-azure (org.apache.hadoop:hadoop-azure)"),
    "abfss": ("abfss", "hadoop-azure (org.apache.hadoop:hadoop-azure)"),
    "az": ("abfss", "hadoop-azure (org.apache.hadoop:hadoop-azure)"),
    "azure": ("abfss", "hadoop-azure (org.apache.hadoop:hadoop-azure)"),
    "gs": ("gs", "gcs-connector (com.google.cloud.bigdata-oss:gcs-connector)"),
    "gcs": ("gs", "gcs-connector (com.google.cloud.bigdata-oss:gcs-connector)"),
}
#: Session conf that names the scheme Spark gets for a store (e.g. ``s3`` where the
#: cluster maps s3:// itself, as Databricks and EMR do): ``<prefix>.<scheme>``.
SPARK_SCHEME_CONF = "spark.pyspark_txn.sparkScheme"


def _conf(session, key: str) -> str | None:
    try:
        value = session.conf.get(key, None)
    except Exception:  # Connect sessions refuse some keys: not set
        return None
    return None if value in (None, "") else str(value)


def _is_databricks(session) -> bool:
    return bool(
        os.environ.get("DATABRICKS_RUNTIME_VERSION")
        or _conf(session, "spark.databricks.clusterUsageTags.clusterId")
    )


def spark_uri(uri: str, session=None, storage: StorageOptions | None = None) -> str:
    """``uri`` (a txn-delta location) as Spark's Hadoop filesystem expects it.

    Local paths get ``file://``; ``s3://`` becomes ``s3a://`` on open-source Spark
    (Databricks and sessions that set ``spark.hadoop.fs.s3.impl`` keep ``s3://``);
    ``az://container/path`` becomes ``abfss://container@<account>.dfs.core.windows.net/path``
    (the account from ``AZURE_STORAGE_ACCOUNT_NAME``); ``gcs://`` becomes ``gs://``.
    ``spark.pyspark_txn.sparkScheme.<scheme>`` overrides the scheme. With a classic
    session, a scheme Spark has no FileSystem for is refused here with the jar to add.
    """
    if _fs.is_local(uri):
        return f"file://{uri}"
    scheme, rest = uri.split("://", 1)
    scheme = scheme.lower()
    if scheme not in _HADOOP_SCHEMES:
        return uri
    target, jar = _HADOOP_SCHEMES[scheme]
    override = _conf(session, f"{SPARK_SCHEME_CONF}.{scheme}") if session is not None else None
    if override:
        target = override.strip().lower().removesuffix("://")
    elif session is not None and scheme in ("s3", "abfs", "abfss", "gs"):
        if _is_databricks(session) or _conf(session, f"spark.hadoop.fs.{scheme}.impl"):
            target = scheme
    if scheme in ("az", "azure") and target in ("abfs", "abfss"):
        container, _, path = rest.partition("/")
        if "@" not in container:
            account = dict((k.lower(), v) for k, v in (storage.items if storage else ())).get(
                "azure_storage_account_name"
            ) or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
            if not account:
                raise ConfigError(
                    f"delta_batch_writer: path {uri!r}: Spark needs the storage account for "
                    "an az:// URI: write abfss://<container>@<account>.dfs.core.windows.net/"
                    "<path>, or give AZURE_STORAGE_ACCOUNT_NAME in storageOptions"
                )
            container = f"{container}@{account}.dfs.core.windows.net"
        rest = f"{container}/{path}" if path else container
    mapped = f"{target}://{rest}"
    if session is not None:
        _check_hadoop_filesystem(session, target, jar, uri, mapped)
    return mapped


def _check_hadoop_filesystem(session, scheme: str, jar: str, uri: str, mapped: str) -> None:
    """Refuse before anything is written when the session's Hadoop has no FileSystem
    for ``scheme`` (only a classic session can be asked; Connect's server is trusted)."""
    jvm = (
        getattr(getattr(session, "sparkContext", None), "_jvm", None)
        if not _is_connect(session)
        else None
    )
    if jvm is None:
        return
    try:
        conf = session.sparkContext._jsc.hadoopConfiguration()
        jvm.org.apache.hadoop.fs.FileSystem.getFileSystemClass(scheme, conf)
    except Exception as e:
        reason = " ".join(str(e).split("\n")[0].split())[:200]
        raise ConfigError(
            f"delta_batch_writer: Spark writes the batch to {mapped} (path {uri!r}), but this "
            f"session has no Hadoop FileSystem for {scheme}:// ({reason}). Add {jar} to the "
            f"session (spark.jars.packages), or name the scheme your cluster maps with "
            f"spark.conf.set('{SPARK_SCHEME_CONF}.{uri.split('://', 1)[0].lower()}', "
            "'<scheme>'); see docs/object-stores.md"
        ) from None
