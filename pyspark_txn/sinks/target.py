"""What a two-phase sink writes to: the :class:`Target` interface (phase 2 and its
bookkeeping), its words for messages, and the questions about a target that lost
what the record table says was committed to it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from ..errors import TargetGoneError
from ..state import (
    SinkState,
    SnapshotRecord,
    TxnHandle,
    pending_phase2,
)


@dataclass(frozen=True)
class TargetTerms:
    """How messages name a target's things, so that code shared by every target speaks
    of files and table versions only for Delta."""

    kind: str  # kept in records (``target.kind``): how tools tell targets apart
    txn: str  # one staged txn, e.g. "file"
    txns: str  # several
    version: str  # what ``commit`` returns, "{}" standing for the number
    no_version: str  # what a commit that returned None did

    def count(self, n: int) -> str:
        return f"{n} {self.txn if n == 1 else self.txns}"

    def committed_as(self, version: int | None) -> str:
        return self.no_version if version is None else self.version.format(version)


class Target(ABC):
    """Where phase 2 makes staged data visible. Every method must be idempotent.

    Staged artifacts are named by ``(snapshot id, token)``: the token of the
    allocation they were staged for, so two sinks that share an id never
    mistake each other's artifacts for their own.
    """

    terms: ClassVar[TargetTerms] = TargetTerms(
        "target", "staged txn", "staged txns", "target version {}", "no target version"
    )

    @abstractmethod
    def committed_batch(self, sink_id: str) -> int | None:
        """Highest batch id this sink has committed into the target, or None."""

    @abstractmethod
    def commit(self, record: SnapshotRecord) -> int | None:
        """Make ``record``'s staged txns visible at most once; return the target version.

        If the target shows the batch as committed, the commit carrying it must
        be ``record``'s own (its ``record_id``); otherwise raise.
        """

    @abstractmethod
    def verify_staged(self, snapshot_id: int, token: str, txns: Sequence[TxnHandle]) -> None:
        """Raise ``CorruptSnapshotError`` naming every staged txn that is missing or wrong."""

    def preflight(self, record: SnapshotRecord) -> None:  # noqa: B027 - optional hook
        """Raise if phase 2 of ``record`` would fail for a reason retries cannot fix.

        Runs before the record is written: nothing that can fail permanently
        may come after it.
        """

    def check_new_sink(self, sink_id: str, query_id: str | None) -> None:  # noqa: B027
        """Raise if the target holds commits of ``query_id`` made by another sink."""

    @abstractmethod
    def discard(self, snapshot_id: int, token: str, keep: Iterable[str] = ()) -> None:
        """Roll back the staged txns of one attempt, except handles in ``keep``."""

    @abstractmethod
    def staged_attempts(self) -> set[tuple[int, str]]:
        """``(snapshot id, token)`` of every attempt that has staged artifacts right now."""

    def forget(self, snapshot_id: int, token: str) -> None:  # noqa: B027 - optional hook
        """Drop what finds an attempt's artifacts (markers) once no task of it can write:
        committed data stays; ``staged_attempts`` no longer lists the attempt."""

    def committed_batch_recent(self, sink_id: str) -> int | None:
        """``committed_batch`` as this process read it moments ago where the target can
        tell that it is still the same table: for checks the commit makes again."""
        return self.committed_batch(sink_id)

    def location(self) -> str:
        """The target in a message, e.g. "the table at s3://b/t"."""
        return "the target"

    def gone(self) -> str | None:
        """Where the target no longer exists (a Delta table deleted or moved, a
        PostgreSQL table dropped): a sentence naming it, else None. Read only when
        ``committed_batch`` says None, so it costs nothing in a steady run."""
        return None

    def commits_nothing(self, record: SnapshotRecord) -> bool:
        """Whether phase 2 of ``record`` leaves no trace in an existing target (an append
        of an empty batch makes no commit), so the target cannot show that it landed,
        and nothing is left to land: tools take such a last record for committed."""
        return False

    def abandon_refusal(self, record: SnapshotRecord) -> str | None:
        """Why withdrawing the safe ``record`` now would lose or duplicate data although
        ``committed_batch`` does not hold its batch (phase 2 has begun, or can still
        finish), else None. Targets whose phase 2 is one atomic step have no such case."""
        return None

    def prune(self, floor: int) -> None:  # noqa: B027 - optional hook
        """Drop bookkeeping of snapshot ids below ``floor``: the record table keeps no
        record of them any more, and none was pending (retention keeps those)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the target may be used again afterwards."""


def last_committed_batch(state: SinkState) -> int | None:
    """The highest batch of a record the record table marks committed, or None."""
    done = [r.batch_id for r in state.records.values() if r.snapshot_id in state.committed]
    return max(done) if done else None


def proven_batch(state: SinkState) -> int | None:
    """The highest batch the target must hold for this sink: that of a record the record
    table marks committed whose phase 2 wrote something (an empty batch makes no commit
    of its own, so it proves nothing about the target's app transaction)."""
    done = [
        r.batch_id for r in state.records.values() if r.snapshot_id in state.committed and r.txns
    ]
    return max(done) if done else None


def target_lost(state: SinkState, target: Target, committed: int | None) -> str | None:
    """Why the target no longer holds what the record table proves was committed to it
    (deleted, moved, re-created or restored to an older version), else None.
    ``committed``: what ``target.committed_batch`` says now. Reads the target only
    where it holds no batch of this sink, so it costs nothing in a steady run."""
    if last_committed_batch(state) is None:
        return None
    if committed is None:
        gone = target.gone()
        if gone is not None:
            return f"{gone}: the table is gone"
    proven = proven_batch(state)
    if proven is None or (committed is not None and committed >= proven):
        return None
    return (
        f"{target.location()} no longer holds this sink's batches up to {proven} (it holds "
        f"{held_batches(committed)}): it was deleted or replaced (re-created, or restored to "
        "an older version)"
    )


def held_batches(committed: int | None) -> str:
    """What a target holds of this sink, for messages about a lost target."""
    return "no batch of this sink" if committed is None else f"batches only up to {committed}"


#: What to do about a target that lost batches the record table says it had.
RESTORE_THE_TABLE = (
    "Restore the table where it was (with its history: the _delta_log), or start over "
    "with a new checkpoint (a new query reads its source from the start)"
)


def lost_batches(state: SinkState) -> str:
    """What the record table says was committed, for messages about a lost target: the
    committed batches, and a pending record whose phase 2 may have landed too."""
    last = last_committed_batch(state)
    pending = [r.batch_id for r in pending_phase2(state) if last is None or r.batch_id > last]
    maybe = (
        f", and batch {max(pending)} may have been too (its phase 2 had begun or was "
        "about to; only the table could tell, and Spark's commit log may count it)"
        if pending
        else ""
    )
    return f"batches up to {last} were committed to it{maybe}"


def abandon_lost_refusal(lost: str, batch_id: int) -> str:
    """Why a pending record cannot be abandoned while its target is lost."""
    return (
        f"{lost}; whether phase 2 of batch {batch_id} landed can only be read from the "
        "table. Restore the table where it was (with its _delta_log) first: then "
        "restarting the query finishes or replays it (or start over with a new checkpoint)"
    )


def target_gone_error(
    sink_id: str, state: SinkState, target: Target, committed: int | None
) -> TargetGoneError | None:
    """The error for a target that lost what the record table says was committed to it
    (None: it holds all of that, or nothing was committed)."""
    lost = target_lost(state, target, committed)
    if lost is None:
        return None
    return TargetGoneError(
        f"sink {sink_id!r}: {lost}. This sink's record table says {lost_batches(state)}; "
        "writing on would leave those batches out of the table, and Spark would not serve "
        f"them again. Nothing was written. {RESTORE_THE_TABLE}"
    )


def lost_pending_error(
    sink_id: str, target: Target, pending: Sequence[SnapshotRecord], committed: int | None
) -> TargetGoneError | None:
    """The error for a target that holds less than the pending records a commit has just
    confirmed (None: it holds them). Their phase 2 landed (this process saw it, or
    wrote it just now), and nothing proves it yet but the table: one deleted,
    re-created or put back to an older copy since then holds less, and confirming
    would leave those batches out for good."""
    wrote = [rec.batch_id for rec in pending if rec.txns]
    if not wrote or (committed is not None and committed >= max(wrote)):
        return None
    return TargetGoneError(
        f"sink {sink_id!r}: batch {max(wrote)} was committed to {target.location()}, which "
        f"now holds {held_batches(committed)}: it was deleted or replaced (re-created, or "
        f"restored to an older copy) since. Nothing was written. {RESTORE_THE_TABLE}"
    )
