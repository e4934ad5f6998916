"""The offset log of an acknowledging source, as a pure fold plus transitions.

A claim binds one offset (a gap-free counter) to the exact message ids a
batch will read, before the offset is handed to Spark; a replayed batch then
reads the same ids. ``acked`` records that claims up to an offset were
acknowledged at the broker. Ids of claims are kept so redeliveries are dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from ..errors import ProtocolViolation
from .core import Invariant, _violation, fold
from .events import Event, EventKind

NO_OFFSET = -1


@dataclass(frozen=True)
class OffsetLogState:
    source_id: str
    next_seq: int = 0
    last_offset: int = NO_OFFSET
    acked_through: int = NO_OFFSET
    claims: Mapping[int, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))

    def ids_between(self, start: int, end: int) -> list[str]:
        """Message ids of claims in ``(start, end]``, in claim order."""
        return [i for off in range(start + 1, end + 1) for i in self.claims.get(off, ())]

    @property
    def unacked(self) -> list[int]:
        return [o for o in sorted(self.claims) if o > self.acked_through]

    def is_claimed(self, message_id: str) -> bool:
        return any(message_id in ids for ids in self.claims.values())

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
            claims = dict(self.claims)
            claims[off] = tuple(e.payload["ids"])
            return replace(s, last_offset=off, claims=MappingProxyType(claims))
        if e.kind is EventKind.ACKED:
            through = e.payload["through"]
            if not self.acked_through < through <= self.last_offset:
                raise ProtocolViolation(
                    f"offset log {self.source_id!r}: ack through {through} outside "
                    f"({self.acked_through}, {self.last_offset}]"
                )
            return replace(s, acked_through=through)
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
