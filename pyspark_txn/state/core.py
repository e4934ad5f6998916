"""The pure core of the protocol: the transitions (take over, allocate, decide, record,
commit, abandon, dead snapshots), and the one place that names all of the core.

The records are in :mod:`.records`, the fold and its invariants in :mod:`.fold`,
settling and summaries in :mod:`.retention`, named snapshots in :mod:`.named`;
this module re-exports their names, so ``state.core.X`` keeps working.

No IO and no Spark here. Every function takes a state (a fold over one
stream's events) and either returns the next event to append or raises the
error that says why the transition is not allowed. The IO shell appends the
event safely and folds it in; a crash anywhere loses only in-memory state,
which the fold rebuilds from the record table.
"""

from __future__ import annotations

import json
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import (
    CheckpointMismatchError,
    FencedError,
    ProtocolViolation,
    TxnError,
)
from .events import LEASE_FORMAT, Event, EventKind
from .fold import (  # noqa: F401 (re-exported: the names of state.core)
    SUMMARY_OWNERS,
    SinkState,
    allocated_ids,
    bind_leases,
    check_invariants,
    fold,
    fold_sink,
    named_id_problem,
)
from .named import (  # noqa: F401 (re-exported: the names of state.core)
    delete_named,
    fail_export,
    register_named,
    request_export,
)
from .records import (  # noqa: F401 (re-exported: the names of state.core)
    EXPORT_TOKEN_PREFIX,
    MAX_NAME_LENGTH,
    NAME_CHARS,
    NO_SNAPSHOT,
    ExecutionRecord,
    ExportRequest,
    Foldable,
    Invariant,
    NamedSnapshot,
    S,
    SnapshotKind,
    SnapshotRecord,
    TxnHandle,
    _violation,
    check_snapshot_name,
    is_export_token,
    is_lease_token,
    new_lease_token,
    new_token,
)
from .retention import (  # noqa: F401 (re-exported: the names of state.core)
    DEFAULT_RETAIN_SNAPSHOTS,
    SETTLE_IDS,
    bookkeeping_floor,
    pending_phase2,
    settled,
    summarize,
    summary_due,
)


def check_query(state: SinkState, query_id: str | None) -> None:
    """The checkpoint must belong to the query that wrote this sink's history."""
    if state.query_id is not None and query_id is not None and state.query_id != query_id:
        raise CheckpointMismatchError(
            f"sink {state.sink_id!r} was written by streaming query {state.query_id} but the "
            f"checkpoint now belongs to query {query_id}: the checkpoint was deleted or replaced. "
            "Restarting would skip or duplicate data. Restore the original checkpoint, or give "
            "the new query its own sink (option sinkId) and target."
        )


def take_over(
    state: SinkState,
    run_id: str,
    snapshot_id: int | None,
    query_id: str | None,
    query_name: str | None = None,
) -> Event | None:
    """Fence every older run if ``run_id`` is a run this sink has not seen yet.

    A run is one start of a Spark query (Spark's ``runId``). Runs are ordered
    by the snapshot id they take over with: ids are allocated in time order,
    so a run whose attempt was allocated before the current owner took over
    started before it and is a zombie. Returns the ``epoch`` event to append,
    or None when ``run_id`` already holds the epoch.
    """
    check_query(state, query_id)
    if run_id == state.epoch_owner:
        return None
    if run_id in state.owners:
        raise _fenced(state, f"run {run_id}")
    if snapshot_id is not None and snapshot_id < state.epoch_floor:
        raise _fenced(
            state,
            f"run {run_id} (its snapshot {snapshot_id} was allocated before run "
            f"{state.epoch_owner} took over with snapshot {state.epoch_floor})",
        )
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.EPOCH,
        epoch=state.epoch + 1,
        query_id=query_id if query_id is not None else state.query_id,
        payload={"owner": run_id, "query_name": query_name, "from_snapshot": snapshot_id},
    )


def _fenced(state: SinkState, who: str) -> FencedError:
    return FencedError(
        f"sink {state.sink_id!r}: {who} was fenced: epoch {state.epoch} was taken by a newer "
        f"run ({state.epoch_owner}); two runs must never write as the same sink. Stop the "
        "other query, or give each its own checkpoint (and sinkId)."
    )


def check_epoch(state: SinkState, epoch: int) -> None:
    if epoch != state.epoch:
        raise _fenced(state, f"the run holding epoch {epoch}")


def allocate(
    state: SinkState, token: str | None = None, count: int = 1, table: str | None = None
) -> Event:
    """Reserve the next snapshot id (``count`` > 1: the next ``count`` ids, each with
    its own token bound to the record table ``table``, a planner's lease); none is ever
    reused, even if its attempt fails.

    Allocation is not fenced: Spark plans a batch in a pooled Python worker
    that cannot tell which run it plans for. An allocation is only a
    reservation; the run that records it is fenced (:func:`take_over`).
    """
    if count < 1 or (count > 1 and (token is not None or table is None)):
        raise ValueError(f"allocate: count={count} with token={token!r}, table={table!r}")
    first = state.ongoing_snapshot_id + 1
    if count == 1:
        payload: dict[str, Any] = {"token": token if token is not None else new_token()}
    else:
        # the first id is taken at once; the others are reserved ahead
        assert table is not None
        tokens = [new_token()] + [new_lease_token(table, first + i) for i in range(1, count)]
        payload = {"token": tokens[0], "tokens": tokens}
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.ALLOCATED,
        epoch=state.epoch,
        snapshot_id=first,
        query_id=state.query_id,
        payload=payload,
        format_version=LEASE_FORMAT if count > 1 else 0,
    )


@dataclass(frozen=True)
class Replay:
    """The batch was decided before: redo phase 2 of ``record``, discard the new attempt."""

    record: SnapshotRecord


@dataclass(frozen=True)
class Decide:
    """A new decision: make the record safe, then run phase 2."""


def _same_offsets(a: Sequence[Any], b: Sequence[Any]) -> bool:
    canon = lambda v: json.dumps(list(v), sort_keys=True, default=str)  # noqa: E731
    return canon(a) == canon(b)


def decide(
    state: SinkState,
    batch_id: int,
    snapshot_id: int,
    epoch: int,
    query_id: str | None = None,
    source_offsets: Sequence[Any] | None = None,
) -> Replay | Decide:
    """Whether ``batch_id`` is a replay of a decided batch or needs a new decision.

    A replay must carry the offsets the batch was decided with: Spark's offset
    log and the record table disagreeing means the checkpoint was reset or
    replaced, and trusting the record would skip the new offsets' data.
    """
    check_query(state, query_id)
    check_epoch(state, epoch)
    done = state.records.get(batch_id)
    if done is not None:
        if (
            source_offsets is not None
            and done.source_offsets
            and not _same_offsets(done.source_offsets, source_offsets)
        ):
            raise CheckpointMismatchError(
                f"sink {state.sink_id!r}: batch {batch_id} was decided as snapshot "
                f"{done.snapshot_id} with source offsets {list(done.source_offsets)}, but "
                f"Spark's checkpoint now has {list(source_offsets)} for it: the checkpoint's "
                "offsets were reset or replaced. Treating it as a replay would skip data. "
                "Restore the original checkpoint, or start a new query with its own "
                "checkpoint and sink."
            )
        return Replay(done)
    last = state.last_record
    if (
        last is not None
        and batch_id < last.batch_id
        and state.summary_seq
        and (state.records and batch_id < min(state.records))
    ):
        raise CheckpointMismatchError(
            f"sink {state.sink_id!r}: Spark asks to commit batch {batch_id}, but the record "
            f"table keeps records from batch {min(state.records)} on (older ones were "
            f"summarized, retainSnapshots) and batch {last.batch_id} is recorded: either a "
            "stale run of this query still commits an old attempt, or Spark's checkpoint "
            "is older than the record table (restored or replaced). Its offsets cannot be "
            "checked any more, so this is refused; restart the query from its own checkpoint."
        )
    if last is not None and batch_id < last.batch_id:
        raise CheckpointMismatchError(
            f"sink {state.sink_id!r}: Spark asks to commit batch {batch_id}, but batch "
            f"{last.batch_id} is already recorded and batch {batch_id} never was: Spark's "
            "checkpoint is older than the record table (restored or replaced). Refusing to "
            "guess; restore the matching checkpoint."
        )
    if snapshot_id not in state.allocations or snapshot_id in state.abandoned:
        how = (
            "abandoned (by Spark's abort or `pyspark-txn abandon`)"
            if snapshot_id in state.abandoned
            else "never allocated"
        )
        raise _violation(
            Invariant.RECORD_WAS_ALLOCATED,
            f"sink {state.sink_id!r} cannot record snapshot {snapshot_id}: it was {how}",
        )
    if snapshot_id <= state.high_water:
        raise _violation(
            Invariant.LAST_GOOD_NEVER_REVERTS,
            f"sink {state.sink_id!r} cannot record snapshot {snapshot_id}: snapshot "
            f"{state.high_water} was decided after it was allocated (a newer attempt won)",
        )
    return Decide()


def record_snapshot(state: SinkState, record: SnapshotRecord) -> Event:
    decision = decide(state, record.batch_id, record.snapshot_id, record.epoch, record.query_id)
    if isinstance(decision, Replay):
        raise ProtocolViolation(
            f"batch {record.batch_id} of sink {state.sink_id!r} is already decided "
            f"(snapshot {decision.record.snapshot_id})"
        )
    return record.to_event(state.next_seq)


def mark_committed(state: SinkState, snapshot_id: int, target_version: int | None) -> Event:
    rec = state.record_for_snapshot(snapshot_id)
    if rec is None:
        raise _violation(Invariant.COMMIT_AFTER_SAFE_RECORD, f"no record for {snapshot_id}")
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.COMMITTED,
        epoch=state.epoch,
        snapshot_id=snapshot_id,
        batch_id=rec.batch_id,
        query_id=state.query_id,
        payload={"target_version": target_version},
    )


def abandon(state: SinkState, snapshot_id: int, reason: str) -> Event | None:
    """Withdraw an allocation, or a safe record whose phase 2 can never succeed.

    Returns None when there is nothing to withdraw (already abandoned). A
    committed record can never be abandoned, nor any record but the last.
    """
    if snapshot_id in state.abandoned:
        return None
    rec = state.record_for_snapshot(snapshot_id)
    if snapshot_id not in state.allocations:
        raise TxnError(f"sink {state.sink_id!r}: snapshot {snapshot_id} was never allocated")
    if snapshot_id in state.committed:
        raise TxnError(
            f"sink {state.sink_id!r}: snapshot {snapshot_id} is committed (batch "
            f"{rec.batch_id if rec else '?'}); a committed snapshot can never be abandoned"
        )
    if rec is not None and rec is not state.last_record:
        raise TxnError(
            f"sink {state.sink_id!r}: snapshot {snapshot_id} is not the last record; only "
            f"the last one (snapshot {state.snapshot_id}) can be abandoned"
        )
    for entry in state.named.values():
        if entry.snapshot_id == snapshot_id:
            raise TxnError(
                f"sink {state.sink_id!r}: snapshot id {snapshot_id} belongs to the named "
                f"snapshot {entry.name!r}; delete the snapshot instead"
            )
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.ABANDONED,
        epoch=state.epoch,
        snapshot_id=snapshot_id,
        batch_id=rec.batch_id if rec else None,
        query_id=state.query_id,
        payload={"reason": reason, "was_recorded": rec is not None},
    )


def reserved_unused(state: SinkState, snapshot_id: int, staged: Container[tuple[int, str]]) -> bool:
    """Whether ``snapshot_id`` was reserved ahead by a planner's lease and no batch used it
    so far: nothing staged under it (``staged``: the target's attempts), not recorded, not
    withdrawn. There is nothing to roll back or withdraw there."""
    token = state.allocations.get(snapshot_id)
    return (
        token is not None
        and is_lease_token(token)
        and (snapshot_id, token) not in staged
        and snapshot_id not in state.abandoned
        and state.record_for_snapshot(snapshot_id) is None
    )


def dead_snapshots(state: SinkState, staged: Iterable[tuple[int, str]]) -> set[tuple[int, str]]:
    """Staged ``(snapshot id, token)`` attempts that can never be committed: safe to delete.

    Dead means: allocated by this stream with this token, not named by a safe
    record, and either abandoned or below ``high_water`` (ids only get
    recorded above it). Every one of these facts, once true, stays true, so
    the answer is safe on a *stale* state too: a zombie that read the log long
    ago can never delete what a newer run recorded or is still staging.
    Attempts of other streams (unknown token) and ids newer than the state
    are never returned.
    """
    live = {r.snapshot_id for r in state.records.values()}
    return {
        (sid, token)
        for sid, token in staged
        if state.allocations.get(sid) == token
        and sid not in live
        and (sid in state.abandoned or sid < state.high_water)
    }
