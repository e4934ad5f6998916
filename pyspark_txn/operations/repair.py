"""Stuck snapshots and their repair: :func:`stuck_snapshots` lists safe records whose
phase 2 never completed, :func:`abandon_snapshot` withdraws one (then **restart the
query**: Spark replays the batch under a new snapshot id), :func:`settle` finishes what
the records already decided."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import storage
from ..errors import TxnError
from ..sinks.twophase import (
    TargetTerms,
    abandon_lost_refusal,
    last_committed_batch,
    lost_batches,
    target_lost,
)
from ..state import SinkState, SnapshotRecord, pending_phase2
from .handle import POSTGRES, SinkHandle, _in_handle_storage, open_sink, opened_target

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SnapshotStatus:
    """One snapshot id of a sink, as the record table and the target see it.

    ``state`` is ``pending`` (safe record, phase 2 not confirmed), ``committed``,
    ``allocated`` (reserved, never recorded), ``abandoned`` or ``unknown``.
    ``refusal`` says why :func:`abandon_snapshot` would refuse it (None: it
    would not). ``txn_states`` (PostgreSQL): each prepared transaction of a pending
    record (prepared, committed or missing), or of an allocation (prepared).
    """

    sink_id: str
    snapshot_id: int
    state: str
    record: SnapshotRecord | None = None
    target_batch: int | None = None  # highest batch of this sink the target holds
    target_error: str | None = None  # the target could not be read
    refusal: str | None = None
    terms: TargetTerms | None = None
    txn_states: Mapping[str, str] = field(default_factory=dict, hash=False)
    # the target lost (deleted, replaced) batches up to last_committed committed to it
    target_gone: str | None = None
    last_committed: int | None = None
    lost_batches: str | None = None  # what the record table says went to the lost target

    @property
    def target_holds_batch(self) -> bool:
        return (
            self.record is not None
            and self.target_batch is not None
            and self.target_batch >= self.record.batch_id
        )

    def to_json(self) -> dict[str, Any]:
        rec = self.record
        out = {
            "sink_id": self.sink_id,
            "snapshot_id": self.snapshot_id,
            "state": self.state,
            "batch_id": rec.batch_id if rec else None,
            "rows": rec.rows if rec else None,
            "files": len(rec.txns) if rec else None,
            "bytes": sum(t.bytes for t in rec.txns) if rec else None,
            "created_at": rec.created_at.isoformat() if rec and rec.created_at else None,
            "run_id": rec.run_id if rec else None,
            "target_batch": self.target_batch,
            "target_holds_batch": self.target_holds_batch,
            "target_error": self.target_error,
            "abandonable": self.refusal is None,
            "refusal": self.refusal,
            "target_gone": self.target_gone,
        }
        if self.txn_states:
            out["txn_states"] = dict(self.txn_states)
        return out


def _target_batch(handle: SinkHandle, target: Any) -> tuple[int | None, str | None]:
    try:
        return target.committed_batch(handle.sink_id), None
    except TxnError:
        raise
    except Exception as e:  # a diagnosis must still show what the record table knows
        log.warning("sink %s: cannot read target %s: %r", handle.sink_id, handle.target_label, e)
        return None, f"{type(e).__name__}: {e}"


def _status(
    handle: SinkHandle,
    state: SinkState,
    snapshot_id: int,
    target: Any,
    batch_read: tuple[int | None, str | None] | None = None,
) -> SnapshotStatus:
    """``target``: the opened target (None: unknown); ``batch_read``: its committed batch
    of this sink (and why it could not be read), when the caller read it already."""
    rec = state.record_for_snapshot(snapshot_id)
    if snapshot_id in state.abandoned:
        kind, refusal = "abandoned", "it is already abandoned"
    elif snapshot_id in state.committed:
        kind, refusal = "committed", "it is committed; a committed snapshot is never abandoned"
    elif rec is not None:
        kind, refusal = "pending", None
        if rec is not state.last_record:
            refusal = f"it is not the last record (snapshot {state.snapshot_id} is)"
    elif snapshot_id in state.allocations:
        kind, refusal = "allocated", None
    else:
        kind, refusal = "unknown", "this sink never allocated it"
    batch, error = (None, None)
    if rec is not None and target is not None:
        batch, error = batch_read if batch_read is not None else _target_batch(handle, target)
    if kind == "pending" and rec is not None and batch is not None and batch >= rec.batch_id:
        # The usual state of the last record: its phase 2 landed and the next
        # record (or a restart's recovery) confirms it in the record table.
        kind = "committed"
        refusal = (
            f"it is committed (the target holds batch {batch} >= {rec.batch_id}); a "
            "committed snapshot is never abandoned"
        )
    if refusal is None and rec is not None and batch is not None and batch >= rec.batch_id:
        refusal = (
            f"the target already holds batch {batch} >= {rec.batch_id}: phase 2 landed; "
            "restart the query and recovery records it as committed"
        )
    states: Mapping[str, str] = {}
    token = state.allocations.get(snapshot_id)
    if handle.kind == POSTGRES and target is not None and rec is None and token is not None:
        # an allocation (open or abandoned): what its tasks prepared, which abandoning
        # rolls back (a task may prepare after Spark's abort abandoned the attempt)
        states = dict.fromkeys(target.attempt_txns(snapshot_id, token), "prepared")
    if kind == "pending" and rec is not None and target is not None and error is None:
        # where phase 2 is several steps, how far it got decides (Target.abandon_refusal)
        try:
            if handle.kind == POSTGRES:
                states = {g: st for g, (st, _) in target.txn_states(rec).items()}
            if refusal is None:
                refusal = target.abandon_refusal(rec)
        except TxnError:
            raise
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    if refusal is None and error is not None:
        refusal = f"the target cannot be read ({error})"
    gone, last = None, last_committed_batch(state)
    if rec is not None and target is not None and error is None and last is not None:
        try:
            gone = target_lost(state, target, batch)
        except TxnError:
            raise
        except Exception as e:
            log.warning("sink %s: cannot tell whether the target is there: %r", handle.sink_id, e)
    if (
        kind == "pending"
        and rec is not None
        and rec is state.last_record
        and gone is None
        and batch is not None
        and target is not None
        and target.commits_nothing(rec)
    ):
        # an empty batch: its phase 2 made no commit, so the table cannot show it and
        # has nothing to receive (the next record, or a restart, confirms it)
        kind = "committed"
        refusal = (
            f"batch {rec.batch_id} wrote no rows: its phase 2 makes no commit, nothing is "
            "left to land"
        )
    if gone is not None and rec is not None and kind == "pending":
        # its phase 2 may have landed in the lost table: only a restored one can say
        refusal = abandon_lost_refusal(gone, rec.batch_id)
    restart = lost_batches(state) if gone is not None else None
    return SnapshotStatus(
        handle.sink_id,
        snapshot_id,
        kind,
        rec,
        batch,
        error,
        refusal,
        handle.terms,
        states,
        gone,
        last,
        restart,
    )


@_in_handle_storage
def snapshot_status(handle: SinkHandle, snapshot_id: int) -> SnapshotStatus:
    """What the record table and the target say about one snapshot id."""
    with opened_target(handle) as target:
        return _status(handle, handle.load(), snapshot_id, target)


@_in_handle_storage
def stuck_snapshots(handle: SinkHandle) -> list[SnapshotStatus]:
    """Safe records whose phase 2 was never confirmed, oldest first, each with the
    target's committed batch of this sink.

    A running query shows its current batch here for a moment. A record whose
    batch the target holds is committed (the next record confirms it), so it is
    not listed. One whose batch the target lacks is finished by a restart too, unless
    phase 2 can no longer succeed (files lost, prepared transactions rolled back,
    target dropped or altered): then :func:`abandon_snapshot` withdraws it.
    """
    state = handle.load()
    if not pending_phase2(state):
        return []
    with opened_target(handle) as target:
        batch_read = _target_batch(handle, target) if target is not None else None
        return _stuck(handle, state, target, batch_read)


def _stuck(
    handle: SinkHandle,
    state: SinkState,
    target: Any,
    batch_read: tuple[int | None, str | None] | None,
) -> list[SnapshotStatus]:
    statuses = [
        _status(handle, state, r.snapshot_id, target, batch_read) for r in pending_phase2(state)
    ]
    return [s for s in statuses if s.state == "pending"]


@_in_handle_storage
def abandon_snapshot(handle: SinkHandle, snapshot_id: int, reason: str) -> SinkState:
    """Withdraw a stuck snapshot record (or an open allocation) with an ``abandoned`` event
    and roll back what it staged (Delta: its files; PostgreSQL: its prepared
    transactions, as recovery would). Returns the sink's state afterwards.

    Refused (:class:`TxnError`) for a committed snapshot, a record that is not
    the last one, one whose batch the target already holds, and one the target
    says could still commit or has begun to (:meth:`Target.abandon_refusal`).
    Abandoning an id that is already abandoned changes nothing.

    Stop the query first: the target check and the ``abandoned`` event are two
    steps, so a running query's recovery could land phase 2 between them (the
    sink would then refuse to restart with ``CheckpointMismatchError``).

    After abandoning, **restart the query**: Spark replays the batch and it is
    decided anew, under a new snapshot id (ids are never reused).
    """
    log.info("sink %s: abandoning snapshot %d: %s", handle.sink_id, snapshot_id, reason)
    committer = handle.committer()
    try:
        state = committer.abandon(snapshot_id, reason)
    finally:
        committer.target.close()
    log.info("sink %s: snapshot %d is abandoned", handle.sink_id, snapshot_id)
    return state


def settle(
    location: str, sink: str | None = None, *, reason: str = "settled", **target: Any
) -> SinkState:
    """Finish or roll back whatever a stopped query left of its sink's last batch.

    Stop the query first: settling takes the sink's epoch, so a run still
    going would be fenced (it fails with ``FencedError`` at its next commit).
    ``target``: ``url`` / ``password_file`` of a PostgreSQL sink, as for :func:`open_sink`.
    """
    handle = open_sink(location, sink, **target)
    with storage.using(handle.storage):
        committer = handle.committer()
        try:
            return committer.settle(reason)
        finally:
            committer.target.close()
