"""Retention and recovery questions on a fold: when an attempt is settled, which
records await phase 2, and the summaries that bound the record table. Pure, no IO."""

from __future__ import annotations

from ..errors import TxnError
from .events import Event, EventKind
from .fold import (
    SUMMARY_OWNERS,
    SinkState,
    _record_to_json,
)
from .records import SnapshotRecord

#: Snapshot ids allocated after an attempt before no task of it can still be writing.
SETTLE_IDS = 32


def settled(state: SinkState, snapshot_id: int) -> bool:
    """Whether ``snapshot_id``'s tasks are certainly over: many batches were decided since
    (Spark runs one batch at a time, and a late or speculative task of a batch ends long
    before dozens of later batches have been planned, run and committed)."""
    return snapshot_id + SETTLE_IDS <= state.high_water


def pending_phase2(state: SinkState) -> list[SnapshotRecord]:
    """Safe records whose phase 2 was never confirmed: recovery redoes them."""
    return sorted(
        (r for r in state.records.values() if r.snapshot_id not in state.committed),
        key=lambda r: r.snapshot_id,
    )


# --- retention -------------------------------------------------------------

#: Snapshot records a sink keeps by default; older history is summarized away.
DEFAULT_RETAIN_SNAPSHOTS = 100


def summary_due(state: SinkState, retain_snapshots: int, window_ids: int = 2 * SETTLE_IDS) -> bool:
    """Whether enough events piled up since the last summary to write a new one."""
    return state.next_seq - state.summary_seq >= 2 * retain_snapshots + window_ids


def summarize(state: SinkState, retain_snapshots: int, window_ids: int = 2 * SETTLE_IDS) -> Event:
    """The fold so far, bounded: after it lands, every older event may be deleted.

    Kept: every record from a floor on, the floor being the oldest of the last
    ``retain_snapshots`` records and of those whose phase 2 is unconfirmed, or
    ``window_ids`` ids below the high-water mark if that is lower (what sweeps
    ask about); allocations, abandons and commits from the floor on; the
    allocation high-water mark, epoch and recent owners, so ids are never
    reused and old runs stay fenced.

    An allocation is never kept without its record: :func:`dead_snapshots`
    would take a committed attempt whose record is gone for a dead one.
    Attempts below the floor are unknown afterwards, and never deleted.
    """
    if retain_snapshots < 1:
        raise TxnError(f"retain_snapshots={retain_snapshots}: keep at least the last record")
    by_id = sorted(state.records.values(), key=lambda r: r.snapshot_id)
    newest = [r.snapshot_id for r in by_id[-retain_snapshots:]]
    floor = min([*newest, *(r.snapshot_id for r in pending_phase2(state))], default=0)
    floor = min(floor, state.high_water - window_ids)
    kept = {r.snapshot_id: r for r in by_id if r.snapshot_id >= floor}
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.SUMMARY,
        epoch=state.epoch,
        query_id=state.query_id,
        payload={
            "epoch_owner": state.epoch_owner,
            "epoch_floor": state.epoch_floor,
            "owners": list(state.owners[-SUMMARY_OWNERS:]),
            "ongoing_snapshot_id": state.ongoing_snapshot_id,
            "high_water": state.high_water,
            "allocations": {str(k): v for k, v in state.allocations.items() if k >= floor},
            "abandoned": sorted(k for k in state.abandoned if k >= floor),
            "committed": {str(k): v for k, v in state.committed.items() if k in kept},
            "records": [_record_to_json(kept[k]) for k in sorted(kept)],
            "named": [n.to_json() for n in state.named.values()],
            "export_requests": [r.to_json() for r in state.export_requests.values()],
            "export_failures": dict(state.export_failures),
            "summarized_events": state.next_seq - state.summary_seq,
        },
    )


def bookkeeping_floor(state: SinkState) -> int | None:
    """The oldest snapshot id the record table still holds a record of; None if none.

    A target's bookkeeping of older ids (PostgreSQL's marker and batch rows) serves
    nobody: :func:`summarize` drops a record only after its phase 2 is confirmed and
    never a pending one, so no older id is committed, verified or listed again. The
    floor never falls, so a stale state (a zombie run) yields a lower one: it prunes
    less, never more.
    """
    return min((r.snapshot_id for r in state.records.values()), default=None)
