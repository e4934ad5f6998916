"""Named snapshots and requested exports: the registry events, checked on a fold.
Pure, no IO."""

from __future__ import annotations

from ..errors import (
    SnapshotWithdrawnError,
    TxnError,
)
from .events import Event, EventKind
from .fold import (
    SinkState,
    named_id_problem,
)
from .records import (
    NamedSnapshot,
    check_snapshot_name,
)


def register_named(state: SinkState, entry: NamedSnapshot) -> Event:
    """The registry entry of an export, written last: only a complete export has one.

    Checked against ``state``, which the store appends to conditionally: a
    concurrent withdrawal of the export's id makes the append lose its race and
    this check run again on the fresh state, so it refuses instead of landing.
    """
    check_snapshot_name(entry.name)
    if entry.name in state.named:
        raise TxnError(
            f"sink {state.sink_id!r}: a snapshot named {entry.name!r} exists (snapshot "
            f"{state.named[entry.name].snapshot_id}); delete it first or choose another name"
        )
    problem = named_id_problem(state, entry.snapshot_id)
    if problem is not None:
        error = SnapshotWithdrawnError if entry.snapshot_id in state.abandoned else TxnError
        raise error(
            f"sink {state.sink_id!r}: snapshot {entry.name!r} cannot be registered on "
            f"snapshot id {entry.snapshot_id}: {problem}. Nothing was registered; "
            "export it again"
        )
    payload = entry.to_json()
    payload.pop("created_at")
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.NAMED,
        epoch=state.epoch,
        snapshot_id=entry.snapshot_id,
        batch_id=entry.batch_id,
        query_id=state.query_id,
        payload=payload,
    )


def delete_named(state: SinkState, name: str) -> Event:
    if name not in state.named:
        raise TxnError(f"sink {state.sink_id!r} has no snapshot named {name!r}")
    entry = state.named[name]
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.NAME_DELETED,
        epoch=state.epoch,
        snapshot_id=entry.snapshot_id,
        query_id=state.query_id,
        payload={"name": name, "location": entry.location},
    )


def request_export(state: SinkState, name: str, location: str) -> Event:
    """Ask the sink to export its next committed batch under ``name`` to ``location``."""
    check_snapshot_name(name)
    if name in state.named:
        raise TxnError(
            f"sink {state.sink_id!r}: a snapshot named {name!r} exists (snapshot "
            f"{state.named[name].snapshot_id}); delete it first or choose another name"
        )
    if name in state.export_requests:
        raise TxnError(
            f"sink {state.sink_id!r}: an export named {name!r} is already requested (to "
            f"{state.export_requests[name].location}); it runs at the next commit"
        )
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.EXPORT_REQUESTED,
        epoch=state.epoch,
        query_id=state.query_id,
        payload={"name": name, "location": location},
    )


def fail_export(state: SinkState, name: str, error: str) -> Event | None:
    """End a requested export that failed (None if it is no longer pending)."""
    if name not in state.export_requests:
        return None
    return Event(
        stream=state.sink_id,
        seq=state.next_seq,
        kind=EventKind.EXPORT_FAILED,
        epoch=state.epoch,
        query_id=state.query_id,
        payload={"name": name, "error": error[:4000]},
    )
