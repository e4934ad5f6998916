"""The offset log of an acknowledging source, as a pure fold plus transitions.

A claim binds one offset (a gap-free counter) to the exact message ids a
batch will read, before the offset is handed to Spark; a replayed batch then
reads the same ids. ``acked`` records that claims up to an offset were
acknowledged at the broker. Ids of claims are kept so redeliveries are dropped.
``consumer`` records, before it first reads, each broker consumer name that
reads for the log: the names move with the log (a moved or copied checkpoint
reads under a new name), so recovery finds what any of them was handed.

Bounded history: a ``summary`` restates the log (offsets, consumers, the claims
still kept) and the events before it are deleted. Claims acknowledged long ago
are dropped from it; what remains of them is one high-water id per broker
partition (``marks``: for Redis, per stream, the newest entry id ever claimed),
which the source uses to recognise a redelivery by the group's position
(``>``) of an entry claimed long ago. Start time and memory then depend on the
claims kept, not on the history.

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


#: Acknowledged claims a summary keeps (besides every unacknowledged one).
RETAIN_ACKED_CLAIMS = 16
#: Events between two summaries of an offset log.
SUMMARY_EVERY_EVENTS = 64
#: The format offset-log summaries are written with (readers that predate them
#: refuse the log instead of misreading it).
SUMMARY_FORMAT = 4


@dataclass(frozen=True)
class OffsetLogState:
    source_id: str
    next_seq: int = 0
    last_offset: int = NO_OFFSET
    acked_through: int = NO_OFFSET
    claims: Claims = field(default_factory=Claims)
    consumers: tuple[str, ...] = ()  # every consumer name that read for this log
    # per broker partition: the newest message id of the claims summarized away
    marks: Mapping[str, str] = field(default_factory=dict)
    summary_seq: int = 0  # seq of the last summary: the history before it may be gone

    @property
    def first_kept(self) -> int:
        """The oldest claim whose ids the log still holds (older ones were summarized)."""
        return min(self.claims.end - len(self.claims), self.last_offset + 1)

    def newest_ids(self) -> list[str]:
        """Ids that bound every claim ever made from above, per partition: the claims
        kept and the marks of those summarized (what a lost consumer group is made again
        after)."""
        return [*self.marks.values(), *self.claims.between(NO_OFFSET, self.last_offset)]

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
        if e.kind is EventKind.SUMMARY and (e.seq == self.next_seq or self.next_seq == 0):
            return _from_summary(self, e)  # (a read may start at one: older events are gone)
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


def _from_summary(s: OffsetLogState, e: Event) -> OffsetLogState:
    p = e.payload
    if s.next_seq:  # continuing a fold: it must agree with the events before it
        restated = (p["last_offset"], p["acked_through"])
        if restated != (s.last_offset, s.acked_through):
            raise _violation(
                Invariant.SUMMARY_RESTATES,
                f"offset log summary #{e.seq} says (last claim, acked through) = {restated}, "
                f"the events before it say {(s.last_offset, s.acked_through)}",
            )
    kept = p["claims"]  # [[offset, [ids]], ...], consecutive, ending at last_offset
    claims = Claims(_Backing(kept[0][0] if kept else p["last_offset"] + 1))
    for offset, ids in kept:
        claims = claims.appended(offset, ids)
    if claims.end != p["last_offset"] + 1:
        raise ProtocolViolation(
            f"offset log {s.source_id!r}: summary #{e.seq} keeps claims up to "
            f"{claims.end - 1}, not up to its last claim {p['last_offset']}"
        )
    return OffsetLogState(
        source_id=s.source_id,
        next_seq=e.seq + 1,
        last_offset=p["last_offset"],
        acked_through=p["acked_through"],
        claims=claims,
        consumers=tuple(p.get("consumers") or ()),
        marks=dict(p.get("marks") or {}),
        summary_seq=e.seq,
    )


def summary_due(state: OffsetLogState, every: int = SUMMARY_EVERY_EVENTS) -> bool:
    return state.next_seq - state.summary_seq >= every


def summarize(
    state: OffsetLogState, marks: Mapping[str, str], retain_acked: int = RETAIN_ACKED_CLAIMS
) -> Event:
    """The log so far, bounded: every unacknowledged claim and the last ``retain_acked``
    acknowledged ones keep their ids; older ones leave only ``marks`` (computed by the
    source from their ids and the previous marks). After it lands, every older event may
    be deleted."""
    floor = summary_floor(state, retain_acked)
    return Event(
        stream=state.source_id,
        seq=state.next_seq,
        kind=EventKind.SUMMARY,
        payload={
            "last_offset": state.last_offset,
            "acked_through": state.acked_through,
            "consumers": list(state.consumers),
            "marks": dict(marks),
            "claims": [[o, list(state.claims[o])] for o in range(floor, state.last_offset + 1)],
            "summarized_events": state.next_seq - state.summary_seq,
        },
        format_version=SUMMARY_FORMAT,
    )


def summary_floor(state: OffsetLogState, retain_acked: int = RETAIN_ACKED_CLAIMS) -> int:
    """The oldest claim :func:`summarize` keeps."""
    return max(state.first_kept, state.acked_through + 1 - max(retain_acked, 0))


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
