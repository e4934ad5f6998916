"""Spark glue shared by every two-phase sink (txn-delta, txn-postgres).

Everything here is about Spark's Python data source API, not about a target:
the writer base class, the commit message that carries phase 1's handles back
to the driver, the run id of a task, worker logging, the option parsers the sinks share, and allocation before phase 1.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import WriterCommitMessage

from ..errors import ConfigError, ProtocolViolation
from ..spark.arrow import as_arrow as as_arrow  # re-exported: the sinks import them from here
from ..spark.arrow import spark_to_arrow_schema as spark_to_arrow_schema
from ..state import TxnHandle
from ..state.core import MAX_NAME_LENGTH, NAME_CHARS
from ..storage.checkpoint import read_batch_offsets, read_query_id
from .twophase import TwoPhaseCommitter

try:  # PySpark >= 4.1
    from pyspark.sql.datasource import DataSourceStreamArrowWriter as WriterBase
except ImportError:  # 4.0: an Arrow writer mixed into the stream writer works there
    from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamWriter

    class WriterBase(DataSourceArrowWriter, DataSourceStreamWriter):  # type: ignore[no-redef,misc]
        pass


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "OFF")


def parse_bool(name: str, value: str) -> bool:
    """``true`` or ``false`` (any case), as Spark's own boolean options: the message says
    so, and a ``yes`` another tool reads differently is refused rather than guessed."""
    v = value.strip().lower()
    if v in ("true", "false"):
        return v == "true"
    raise ConfigError(f"option {name}={value!r}: expected true or false")


def parse_positive_int(name: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n <= 0:
        raise ConfigError(f"option {name}={value!r}: expected a positive integer")
    return n


def parse_log_level(value: str) -> str:
    level = value.strip().upper()
    level = {"WARN": "WARNING"}.get(level, level)  # Spark's spelling
    if level not in LOG_LEVELS:
        raise ConfigError(f"option logLevel={value!r}: expected one of {', '.join(LOG_LEVELS)}")
    return level


def check_sink_id(sink_id: str, option: str) -> str:
    if not sink_id or not set(sink_id) <= NAME_CHARS or sink_id.startswith("."):
        raise ConfigError(
            f"option {option}={sink_id!r}: use letters, digits, '-', '_' and '.' only "
            "(it names folders and Delta app transactions)"
        )
    if len(sink_id) > MAX_NAME_LENGTH:  # file names hold it (255 bytes at most)
        raise ConfigError(
            f"option {option}={sink_id[:20]!r}...: {len(sink_id)} characters, at most "
            f"{MAX_NAME_LENGTH} (it is part of every staged file's name)"
        )
    return sink_id


@dataclass
class TxnCommitMessage(WriterCommitMessage):
    """What one write task sends the driver: its attempt, Spark's run id and its handles."""

    sink_id: str
    snapshot_id: int
    token: str
    run_id: str | None
    partition: int
    txns: list[dict[str, Any]]
    replay: bool = False  # the task staged nothing: the planner knew the batch was decided


def task_slot() -> tuple[int, int]:
    """(partition id, task attempt id) of the running write task; (0, 0) outside Spark."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return (ctx.partitionId(), ctx.taskAttemptId()) if ctx is not None else (0, 0)


def commit_message(
    sink_id: str,
    snapshot_id: int,
    token: str,
    partition: int,
    handles: Sequence[TxnHandle],
    replay: bool = False,
) -> TxnCommitMessage:
    """The task's message to the driver, with the run it belongs to."""
    return TxnCommitMessage(
        sink_id=sink_id,
        snapshot_id=snapshot_id,
        token=token,
        run_id=spark_run_id(),
        partition=partition,
        txns=[h.to_json() for h in handles],
        replay=replay,
    )


def batch_attempt(
    committer: TwoPhaseCommitter, messages: Sequence[TxnCommitMessage], batch_id: int
) -> tuple[int, str, str | None]:
    """(snapshot id, token, run id) of the one attempt whose tasks staged ``batch_id``;
    allocated here when no task ran (nothing was staged, so that is safe)."""
    if not messages:
        snapshot_id, token = committer.allocate(lease=False)
        return snapshot_id, token, None
    attempts = {(m.snapshot_id, m.token) for m in messages}
    runs = {m.run_id for m in messages}
    if len(attempts) != 1 or len(runs) != 1:
        raise ProtocolViolation(
            f"batch {batch_id}: commit messages of several attempts {attempts} / runs {runs}"
        )
    (snapshot_id, token), run_id = attempts.pop(), runs.pop()
    return snapshot_id, token, run_id


def commit_batch(
    committer: TwoPhaseCommitter,
    messages: Sequence[TxnCommitMessage],
    batch_id: int,
    attempt: tuple[int, str, str | None],
    checkpoint: str,
    query_name: str | None,
    target_meta: Callable[[], dict[str, Any]],
    fs_options: Any = None,
) -> None:
    """Phase 2 of a micro-batch as a stream writer's ``commit`` hands it over: the tasks'
    handles, with the batch's source offsets and query id read from Spark's checkpoint."""
    snapshot_id, token, run_id = attempt
    offsets = read_batch_offsets(checkpoint, batch_id, fs_options)
    committer.commit(
        batch_id,
        snapshot_id,
        token,
        [TxnHandle.from_json(t) for m in messages for t in m.txns],
        run_id=run_id,
        source_offsets=offsets,
        query_id=read_query_id(checkpoint, fs_options),
        query_name=query_name,
        target_meta=target_meta(),
    )


def abort_attempts(committer: TwoPhaseCommitter, messages: Sequence[TxnCommitMessage]) -> None:
    """Spark's abort of a batch: abort every attempt the tasks' messages name."""
    for snapshot_id, token in sorted({(m.snapshot_id, m.token) for m in messages if m}):
        committer.abort(snapshot_id, token)


def spark_run_id() -> str | None:
    """Spark's ``runId`` of the query run this task belongs to, from the task's local
    properties (StreamExecution sets the job group to it; measured on 4.0-4.3). It is
    the same for every task of one run and new at every (re)start of the query."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        return None
    description = ctx.getLocalProperty("spark.job.description") or ""
    for line in description.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "runId" and value.strip():
            return value.strip()
    return ctx.getLocalProperty("spark.jobGroup.id") or None


def worker_logging(level: str) -> None:
    """Send this package's log lines to stderr in a Spark Python worker, at ``level``.

    Workers are separate processes that never see the application's logging
    setup, so without this the per-batch line and every recovery warning would
    be dropped. Nothing is changed where the application configured logging
    itself (a handler on ``pyspark_txn`` or the root logger). Spark reuses
    workers across queries, so the level is set at every call: queries with
    different levels running at the same moment share the last one set.
    """
    package = logging.getLogger("pyspark_txn")
    ours = [h for h in package.handlers if getattr(h, "_pyspark_txn_worker", False)]
    if not ours and (package.handlers or logging.getLogger().handlers):
        return
    if not ours:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler._pyspark_txn_worker = True  # type: ignore[attr-defined]
        package.addHandler(handler)
        package.propagate = False
    package.setLevel(logging.CRITICAL + 1 if level == "OFF" else getattr(logging, level))


_CREATED: set[str] = set()
_CREATED_LOCK = threading.Lock()


def prepare_attempt(
    committer: TwoPhaseCommitter,
    record_table: str,
    *,
    release_staged: bool = False,
    target_meta: Mapping[str, Any] | None = None,
) -> tuple[int, str]:
    """Planner side, before phase 1 (the writer checked the stream's schema when it was
    made): allocate the batch's snapshot id. Returns (snapshot id, token).
    ``release_staged``: first free what earlier attempts hold (targets with locks).

    Nothing here knows which query run it plans for (Spark plans on a pool of
    Python workers): fencing happens at commit, by Spark's run id.
    """
    with _CREATED_LOCK:
        if record_table not in _CREATED:
            committer.store.log.create_if_missing()
            _CREATED.add(record_table)
    if release_staged:
        committer.release_staged()
    return committer.allocate(target_meta)
