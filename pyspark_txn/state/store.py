"""The thin IO shell: an append-only event log behind one small interface.

Backends implement :class:`EventLog` (conditional append + read). Everything
about *safe* writes — re-reading to decide unknown outcomes, bounded retries,
conflicts, indeterminate results — lives once, in :class:`RecordStore`.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from typing import Any

from ..errors import CommitConflict, IndeterminateCommitError
from . import offset_log as offsets
from .core import S, SinkState, fold_sink
from .core import fold as fold_more
from .events import Event, EventKind
from .fold import bind_leases
from .offset_log import OffsetLogState, fold_offsets

log = logging.getLogger(__name__)


#: What an unknown outcome means for the writer of each kind of event (the rest:
#: the operations modules read the registry again and say so themselves).
_UNKNOWN_OUTCOME = {
    kind: "the batch stops here without phase 2 and recovery decides on restart"
    for kind in (EventKind.EPOCH, EventKind.SNAPSHOT, EventKind.COMMITTED)
}


class AppendRejected(Exception):
    """Backend answer: the append determinately did not land (seq taken or a lost race)."""


class EventLog(ABC):
    """A store of per-stream, gap-free event sequences.

    ``append`` must be atomic and conditional: it lands only if ``event.seq``
    is the stream's next free sequence number. It returns on success,
    raises :class:`AppendRejected` when it determinately did not land, and
    raises anything else when the outcome is unknown.
    """

    @abstractmethod
    def append(self, event: Event) -> None: ...

    @abstractmethod
    def read(self, stream: str) -> list[Event]:
        """All events of ``stream`` ordered by seq."""

    @abstractmethod
    def streams(self) -> list[str]: ...

    def truncate(self, stream: str, below_seq: int) -> None:  # noqa: B027 - optional
        """Delete the events of ``stream`` below ``below_seq`` (a summary restates them).

        Best effort and idempotent: a backend may keep them. Readers must accept a
        history that starts at a summary.
        """

    def memo_key(self) -> Hashable | None:
        """Identifies the log across instances in this process, so folds can be
        continued instead of redone (None: never memoize)."""
        return None

    def create_if_missing(self) -> None:  # noqa: B027 - optional
        """Create the backing table (idempotent); a log that needs no setup does nothing."""

    def location(self) -> str | None:
        """Where this log lives, one spelling per place: the ids a planner reserves
        ahead are bound to it (a copy elsewhere does not take them for its own). None:
        no reservations ahead (every allocation is one id)."""
        return None


class MemoryEventLog(EventLog):
    """In-process backend for pure unit tests of the state core. Not durable."""

    def __init__(self) -> None:
        self._events: dict[str, list[Event | None]] = {}  # None: truncated
        self._lock = threading.Lock()

    def append(self, event: Event) -> None:
        with self._lock:
            events = self._events.setdefault(event.stream, [])
            if event.seq != len(events):
                raise AppendRejected(
                    f"{event.stream}#{event.seq} cannot land: the next free seq is {len(events)}"
                )
            events.append(event)

    def read(self, stream: str) -> list[Event]:
        with self._lock:
            return [e for e in self._events.get(stream, ()) if e is not None]

    def truncate(self, stream: str, below_seq: int) -> None:
        with self._lock:  # keep the positions: the next free seq stays the list's length
            events = self._events.get(stream, [])
            for i in range(min(below_seq, len(events))):
                events[i] = None

    def streams(self) -> list[str]:
        with self._lock:
            return sorted(s for s, events in self._events.items() if events)

    def memo_key(self) -> Hashable:
        return ("memory", id(self))

    def location(self) -> str:
        return f"memory:{id(self)}"


# Per process: the last fold of each (log, stream, fold function). Logs are
# append-only (older events may only be summarized away) and every event has a
# unique id, so when the event at the memoized seq still has the memoized id,
# the memoized state is the fold up to it and only the newer events need
# applying (through the same invariant checks). Without this, every read
# re-folds the whole history.
_FOLDS: dict[tuple, tuple[int, str, Any]] = {}
_FOLDS_LOCK = threading.Lock()


def _newer_than(events: list[Event], seq: int, event_id: str) -> list[Event] | None:
    """The events after ``seq`` if ``events`` still holds that event; else None."""
    if not events:
        return None
    i = seq - events[0].seq
    if 0 <= i < len(events) and events[i].event_id == event_id:
        return events[i + 1 :]
    return None


class RecordStore:
    """Safe writes and folds over an :class:`EventLog`."""

    def __init__(
        self,
        log: EventLog,
        *,
        max_attempts: int = 5,
        backoff_s: float = 0.05,
        conflict_retries: int = 3,
    ) -> None:
        self.log = log
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.conflict_retries = conflict_retries

    def events(self, stream: str) -> list[Event]:
        return self.log.read(stream)

    def fold(self, stream: str, fold: Callable[[str, list[Event]], S]) -> S:
        """``fold(stream, events)``, continuing this process's last fold when it can; a
        sink's state as this log's location sees it (:func:`fold.bind_leases`)."""
        state = self._fold(stream, fold)
        location = self.log.location()
        if location is not None and isinstance(state, SinkState):
            return bind_leases(state, location)  # type: ignore[return-value]
        return state

    def _fold(self, stream: str, fold: Callable[[str, list[Event]], S]) -> S:
        events = self.events(stream)
        key = self.log.memo_key()
        if key is None:
            return fold(stream, events)
        memo_key = (key, stream, fold)
        with _FOLDS_LOCK:
            memo = _FOLDS.get(memo_key)
        newer = None if memo is None else _newer_than(events, memo[0], memo[1])
        state = fold(stream, events) if memo is None or newer is None else fold_more(memo[2], newer)
        if events:
            with _FOLDS_LOCK:
                _FOLDS[memo_key] = (events[-1].seq, events[-1].event_id, state)
        return state

    def load_sink(self, sink_id: str) -> SinkState:
        return self.fold(sink_id, fold_sink)

    def load_offsets(self, source_id: str) -> OffsetLogState:
        return self.fold(source_id, fold_offsets)

    def claim(self, source_id: str, message_ids: list[str]) -> tuple[int, list[str]]:
        """Durably bind the not-yet-claimed ids to the next offset: (offset, ids)."""
        event, _ = self.update(source_id, fold_offsets, lambda s: offsets.claim(s, message_ids))
        assert event is not None  # a claim always appends (possibly of no fresh ids)
        return event.payload["offset"], event.payload["ids"]

    def ack(self, source_id: str, through: int) -> None:
        """Record that claims up to ``through`` were acknowledged (idempotent)."""
        if self.load_offsets(source_id).acked_through < through:
            self.update(source_id, fold_offsets, lambda s: offsets.ack(s, through))

    def safe_append(self, event: Event) -> Event:
        """Return only once ``event`` is known to have landed.

        Raises ``CommitConflict`` when another writer holds ``event.seq`` and
        ``IndeterminateCommitError`` when the outcome stays unknown after
        ``max_attempts`` tries. Never guesses.
        """
        last_error: BaseException | None = None
        for attempt in range(self.max_attempts):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                self.log.append(event)
                return event
            except AppendRejected as e:
                last_error = e
            except Exception as e:  # unknown outcome: re-read to decide
                log.warning("record write %s#%d: outcome unknown (%r)", event.stream, event.seq, e)
                last_error = e
            try:
                found = self._find(event)
            except Exception as e:
                log.warning("re-reading %s after a failed write failed too: %r", event.stream, e)
                last_error = e
                continue
            if found is None:
                continue  # it did not land: try again
            if found.event_id == event.event_id:
                return event  # it landed; the response was lost
            raise CommitConflict(
                f"record {event.stream}#{event.seq} ({event.kind.value}) was written by another "
                f"writer first ({found.kind.value}, epoch {found.epoch})"
            )
        raise IndeterminateCommitError(
            f"could not determine whether record {event.stream}#{event.seq} "
            f"({event.kind.value}) was written after {self.max_attempts} attempts; "
            + _UNKNOWN_OUTCOME.get(event.kind, "the record table decides when read again")
        ) from last_error

    def _find(self, event: Event) -> Event | None:
        for e in self.log.read(event.stream):
            if e.seq == event.seq:
                return e
        return None

    def update(
        self,
        stream: str,
        fold: Callable[[str, list[Event]], S],
        transition: Callable[[S], Event | None],
        state: S | None = None,
    ) -> tuple[Event | None, S]:
        """Fold, run ``transition``, append its event safely; re-fold on a lost race.

        A transition that returns None has nothing to append (the state
        already says what it wanted): ``(None, state)`` is returned.

        ``state``, when the caller just folded it, saves the first read: if it
        is stale the conditional append loses and the loop re-folds. The
        transition sees the fresh state after a conflict, so it raises the
        error that explains the race (``FencedError``) or succeeds when the
        concurrent event was harmless.
        """
        for _ in range(self.conflict_retries):
            if state is None:
                state = self.fold(stream, fold)
            event = transition(state)
            if event is None:
                return None, state
            try:
                self.safe_append(event)
            except CommitConflict:
                state = None
                continue
            return event, state.apply(event)
        raise CommitConflict(
            f"record stream {stream!r}: lost {self.conflict_retries} races in a row "
            "to concurrent writers"
        )
