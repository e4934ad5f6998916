"""The offset log of an acknowledging source, as a pure fold plus transitions.

A claim binds one offset (a gap-free counter) to the exact message ids a
batch will read, before the offset is handed to Spark; a replayed batch then
reads the same ids. ``acked`` records that claims up to an offset were
acknowledged at the broker. Ids of claims are kept so redeliveries are dropped.
``consumer`` records, before it first reads, each broker consumer name that
reads for the log: the names move with the log (a moved or copied checkpoint
reads under a new name), so recovery finds what any of them was handed.

Folding stays linear in the number of events: the claims of a state are a
view over an append-only backing store that the next state shares (an
append copies only when a state is extended twice, which a fold never does),
with an index from message id to claim, so neither a claim nor a lookup
re-reads earlier claims.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ..errors import ProtocolViolation
from .core import Invariant, _violation, fold
from .events import Event, EventKind

NO_OFFSET = -1


class _Backing:
    """Claims ``first, first+1, ...`` (append-only) and message id -> claim."""

    __slots__ = ("first", "ids", "index")

    def __init__(self, first: int) -> None:
        self.first = first
        self.ids: list[tuple[str, ...]] = []
        self.index: dict[str, int] = {}


class Claims(Mapping[int, tuple[str, ...]]):
    """Claim offset -> message ids, immutable: a bounded view over a shared backing.

    A view sees the backing's first ``n`` claims. ``appended`` extends the backing in
    place when this view is its whole length (the usual case: a fold) and copies it
    otherwise, so no view ever sees a claim it did not have.
    """

    __slots__ = ("_b", "_n")

    def __init__(self, backing: _Backing | None = None, n: int = 0) -> None:
        self._b = backing if backing is not None else _Backing(NO_OFFSET + 1)
        self._n = n

    @property
    def end(self) -> int:
        """One past the last claim."""
        return self._b.first + self._n

    def appended(self, offset: int, ids: Sequence[str]) -> Claims:
        b = self._b
        if self._n == 0 and not b.ids:
            b.first = offset
        if offset != self.end:
            raise ProtocolViolation(f"claim {offset} appended after claim {self.end - 1}")
        if len(b.ids) != self._n:  # someone already extended this backing: branch off
            nb = _Backing(b.first)
            nb.ids = b.ids[: self._n]
            nb.index = {m: o for m, o in b.index.items() if o < self.end}
            b = nb
        b.ids.append(tuple(ids))
        for m in ids:
            b.index.setdefault(m, offset)
        return Claims(b, self._n + 1)

    def claim_of(self, message_id: str) -> int | None:
        """The claim that holds ``message_id``, or None."""
        off = self._b.index.get(message_id)
        return off if off is not None and off < self.end else None

    def between(self, start: int, end: int) -> list[str]:
        lo = max(start + 1, self._b.first) - self._b.first
        hi = min(end + 1, self.end) - self._b.first
        return [m for ids in self._b.ids[lo:hi] for m in ids]

    def __getitem__(self, offset: int) -> tuple[str, ...]:
        i = offset - self._b.first
        if not 0 <= i < self._n:
            raise KeyError(offset)
        return self._b.ids[i]

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._b.first, self.end))

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return f"Claims({self._b.first}..{self.end - 1})"


@dataclass(frozen=True)
class OffsetLogState:
    source_id: str
    next_seq: int = 0
    last_offset: int = NO_OFFSET
    acked_through: int = NO_OFFSET
    claims: Claims = field(default_factory=Claims)
    consumers: tuple[str, ...] = ()  # every consumer name that read for this log

    def ids_between(self, start: int, end: int) -> list[str]:
        """Message ids of claims in ``(start, end]``, in claim order."""
        return self.claims.between(start, end)

    @property
    def unacked(self) -> list[int]:
        return list(range(max(self.acked_through + 1, 0), self.last_offset + 1))

    def claim_of(self, message_id: str) -> int | None:
        return self.claims.claim_of(message_id)

    def is_claimed(self, message_id: str) -> bool:
        return self.claims.claim_of(message_id) is not None

    def apply(self, e: Event) -> OffsetLogState:
        if e.seq != self.next_seq:
            raise _violation(
                Invariant.SEQ_GAP_FREE,
                f"{self.source_id}: expected seq {self.next_seq}, got {e.seq}",
            )
        s = replace(self, next_seq=e.seq + 1)
        if e.kind is EventKind.CLAIM:
            off = e.payload["offset"]
            if off != self.last_offset + 1:
                raise ProtocolViolation(
                    f"offset log {self.source_id!r}: claim {off} after {self.last_offset}"
                )
            return replace(s, last_offset=off, claims=self.claims.appended(off, e.payload["ids"]))
        if e.kind is EventKind.ACKED:
            through = e.payload["through"]
            if not self.acked_through < through <= self.last_offset:
                raise ProtocolViolation(
                    f"offset log {self.source_id!r}: ack through {through} outside "
                    f"({self.acked_through}, {self.last_offset}]"
                )
            return replace(s, acked_through=through)
        if e.kind is EventKind.CONSUMER:
            name = e.payload["name"]
            return s if name in self.consumers else replace(s, consumers=(*self.consumers, name))
        raise ProtocolViolation(f"{self.source_id}: {e.kind.value} is not an offset-log event")


def fold_offsets(source_id: str, events: Iterable[Event]) -> OffsetLogState:
    return fold(OffsetLogState(source_id=source_id), events)


def claim(state: OffsetLogState, message_ids: Sequence[str]) -> Event:
    """Claim the ids not claimed before (redeliveries are dropped) as the next offset."""
    fresh = [m for m in dict.fromkeys(message_ids) if not state.is_claimed(m)]
    return Event(
        stream=state.source_id,
        seq=state.next_seq,
        kind=EventKind.CLAIM,
        payload={"offset": state.last_offset + 1, "ids": fresh},
    )


def ack(state: OffsetLogState, through: int) -> Event:
    return Event(
        stream=state.source_id,
        seq=state.next_seq,
        kind=EventKind.ACKED,
        payload={"through": through},
    )


def add_consumer(state: OffsetLogState, name: str) -> Event | None:
    """Record that consumer ``name`` reads for this log (None: it is recorded)."""
    if name in state.consumers:
        return None
    return Event(
        stream=state.source_id,
        seq=state.next_seq,
        kind=EventKind.CONSUMER,
        payload={"name": name},
    )
