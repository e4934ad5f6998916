"""Acknowledging sources: a broker's deliveries made replayable through a claim log.

A broker (Redis Streams, NATS JetStream, ...) hands out messages once and
forgets them only when they are acknowledged. Spark needs offsets that name
the same rows forever. The bridge is the **claim log**, an offset log in the
state module (``claim`` and ``acked`` events, :mod:`pyspark_txn.state.offset_log`):

- **Offsets are claim sequence numbers** (``{"claim": n, "source": id}``).
  Batch ``(start, end]`` reads the messages of claims ``start+1 .. end``.
- ``latestOffset`` takes at most ``maxMessagesPerBatch`` new deliveries from
  the broker and appends them as the next claim *safely* (a conditional append
  that is re-read after an unknown outcome) **before** it returns the new
  offset. A claim that was written but never reached Spark's offset log (a
  crash in between) lies beyond Spark's start at the next call and is served
  as the next batch instead of claiming anew.
- ``partitions``/``read`` read exactly the claimed ids (by id, or from what the
  claim received when the same process plans the batch), so a replayed
  batch reads the same messages (as long as the broker keeps them: an entry
  deleted before its batch was read is a :class:`SourceError`, never a skip).
- **Acks** (at the broker, then an ``acked`` event) cover only claims of
  batches in Spark's commit log: claims ``<= end`` in ``commit(end)``, and
  claims ``<= start`` whenever Spark asks ``latestOffset(start)`` (Spark plans
  a batch only after the previous one committed). Spark calls ``commit`` for
  batch N only while planning N+1 and ``stop()`` is not reliable (DESIGN.md
  §8), so the last batch before a stop is acked at the next start, before any
  new claim. A sink that knows a batch is durably committed earlier may call
  :func:`ack_committed` with its source offset.
- **Dedup**: the ids of unacknowledged and recently acknowledged claims are in
  the log, older ones as one high-water mark per broker partition (a
  ``summary`` every so many events, the events before it deleted, so a start
  folds a bounded log); a redelivery (the broker's pending list read back at
  start, a reclaim of idle messages, another consumer handing messages back, a
  reset position handing out old ones as new) is never claimed twice, so it
  never reaches the output twice. Deliveries the broker made to this log's
  consumers (every name the log recorded) that no claim holds (a crash
  between the broker call and the claim) are claimed first at start.

Where the claim log lives: sources are not told the query's checkpoint, so
an acknowledging source needs either ``claimLog`` (the URI of a Delta table)
or ``checkpointLocation`` (the query's checkpoint, repeated on the reader); the
log is then ``<checkpointLocation>/pyspark_txn/claims``, a table of its own,
apart from the sink's record table, so neither's history or maintenance slows
the other. Without either, the source refuses to start.

A second broker implements :class:`Broker` (claim, fetch by id, ack; the rest
is optional) and a picklable :class:`BrokerConfig` that opens it; the reader
here does everything else.
"""

from __future__ import annotations

import logging
import marshal
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition

from ..errors import ConfigError, SourceError, TxnError
from ..faults import NO_FAULTS, FaultPlan
from ..state import DeltaEventLog, Event, EventKind, OffsetLogState, RecordStore
from ..state import offset_log as offset_log_events
from ..storage import fs as _fs
from ._common import SupportsTriggerAvailableNow, canonical, check_batch_order, limit_rows

log = logging.getLogger(__name__)

NO_CLAIM = offset_log_events.NO_OFFSET  # the offset before the first claim
CLAIM_LOG_FOLDER = "pyspark_txn/claims"  # under the query's checkpoint
IDS_PER_PARTITION = 50000
# A read task carries what the claim received up to this size (marshalled); a larger one
# fetches by id, so a task stays far below Spark's RPC message limit.
RECEIVED_BYTES_PER_PARTITION = 16 << 20
MAX_ROUNDS = 1000  # broker calls per planning while they return only redeliveries


# --- the broker calls -----------------------------------------------------------------


class Broker(ABC):
    """One open connection to a broker, used in one process (driver or executor).

    Message ids are strings that name one message for good (e.g.
    ``"<stream>/<entry id>"``): they are what the claim log stores.
    """

    @abstractmethod
    def claim(self, max_messages: int, block_ms: int) -> list[str]:
        """Take up to ``max_messages`` *new* deliveries for this consumer; ``block_ms``
        > 0 may wait that long when none is there. They stay pending until acked."""

    @abstractmethod
    def fetch(self, ids: Sequence[str], arrow_schema) -> Iterator[Any]:
        """Arrow record batches of exactly these messages, in this order (executors).
        A message the broker no longer has is a :class:`SourceError`."""

    @abstractmethod
    def ack(self, ids: Sequence[str]) -> None:
        """Acknowledge these messages (idempotent: acking twice is harmless)."""

    def received(self, ids: Sequence[str]) -> Any | None:
        """What the deliveries of ``ids`` carried, if this connection received every one
        of them (``claim``/``reclaim``) and still holds it: plain lists, dicts and bytes
        (it travels marshalled), handed to the read task instead of a fetch. They leave
        the connection. None (the default): fetch."""
        return None

    def fetch_received(self, ids: Sequence[str], received: Any, arrow_schema) -> Iterator[Any]:
        """Like :meth:`fetch`, from what :meth:`received` returned (no broker call)."""
        raise NotImplementedError

    def open(self, claimed: Sequence[str] = ()) -> None:  # noqa: B027 - optional
        """Connect and create what the source needs (a consumer group); errors name it.

        ``claimed``: every id the claim log holds. Where what the source needs is gone
        although messages were claimed (a group destroyed, a broker that lost it), it
        must be made again *after* them, never from the configured start: messages
        that arrived meanwhile would be skipped otherwise.
        """

    def consumer(self) -> str | None:
        """The name this broker connection reads under, where the broker has one."""
        return None

    def pending(self, consumers: Sequence[str] = ()) -> list[str]:
        """Messages delivered and not acked (the pending list) of this consumer and of
        ``consumers``, earlier names of this claim log's reader (a moved checkpoint)."""
        return []

    def reclaim(self, max_messages: int) -> list[str]:
        """Messages the broker hands to this consumer again (idle ones of others)."""
        return []

    def missing(self, ids: Sequence[str]) -> set[str]:
        """Which of ``ids`` the broker no longer holds (they cannot be read)."""
        return set()

    def high_water(self, ids: Iterable[str], marks: Mapping[str, str]) -> dict[str, str] | None:
        """``marks`` (partition -> newest message id) raised by ``ids``, for a broker whose
        new deliveries come in increasing id order per partition; None (the default): the
        claim log keeps every id it ever claimed."""
        return None

    def covered(self, marks: Mapping[str, str], message_id: str) -> bool:
        """Whether ``message_id`` is at or below its partition's mark: a *new* delivery
        (``claim``) of it is a redelivery of a claim summarized away."""
        return False

    def bound_to_now(self) -> None:  # noqa: B027 - optional
        """Trigger.AvailableNow: from now on ``claim`` stops at what exists now.
        Without it the stream ends when ``claim`` returns nothing."""

    def close(self) -> None:  # noqa: B027 - optional
        pass


class BrokerConfig(ABC):
    """Plain, picklable settings of a broker: they travel to executors, connections do not."""

    @abstractmethod
    def connect(self) -> Broker: ...

    @abstractmethod
    def describe(self) -> str:
        """What the broker is, for messages (no secrets)."""

    def split(self, ids: Sequence[str]) -> list[list[str]]:
        """Ids of one batch into read partitions (in claim order within each)."""
        return [list(ids[i : i + IDS_PER_PARTITION]) for i in range(0, len(ids), IDS_PER_PARTITION)]


# --- the claim log --------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimLogConfig:
    """Where one source's claims live: a Delta event table and the stream in it."""

    uri: str
    source_id: str
    storage_options: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # secrets

    @classmethod
    def locate(
        cls,
        fmt: str,
        options: Mapping[str, str],
        source_id: str,
        storage_options: tuple[tuple[str, str], ...] = (),
    ) -> ClaimLogConfig:
        """From ``claimLog`` or ``<checkpointLocation>/pyspark_txn/claims`` (lowercased keys)."""
        uri = options.get("claimlog") or ""
        if not uri.strip():
            chk = options.get("checkpointlocation") or ""
            if not chk.strip():
                raise ConfigError(
                    f"{fmt}: option claimLog (URI of the claim log, a Delta table) or "
                    "checkpointLocation (the query's checkpoint, repeated on the reader; the "
                    f"log is then <checkpointLocation>/{CLAIM_LOG_FOLDER}) is required: a "
                    "source is not told the query's checkpoint, and without a durable claim "
                    "log a replayed batch could not read the same messages"
                )
            uri = _fs.join(_fs.normalize_uri(chk), CLAIM_LOG_FOLDER)
        return cls(uri=_fs.normalize_uri(uri), source_id=source_id, storage_options=storage_options)

    def store(self) -> RecordStore:
        return RecordStore(DeltaEventLog(self.uri, dict(self.storage_options) or None))


def _by_claim(state: OffsetLogState, start: int, end: int) -> list[str]:
    return state.ids_between(start, end)


def _ack_through(
    store: RecordStore,
    source_id: str,
    broker: Broker,
    state: OffsetLogState,
    through: int,
    faults: FaultPlan = NO_FAULTS,
) -> OffsetLogState:
    """XACK-then-record every claim in ``(acked_through, through]``; idempotent.

    The broker is acked first: a crash before the ``acked`` event only repeats
    an idempotent ack at the next call. (Fault points ``before_ack``, ``mid_ack``
    and ``after_ack`` match ``@batch=N`` against ``through``, the claim acked through.)
    """
    through = min(through, state.last_offset)
    if through <= state.acked_through:
        return state
    ids = _by_claim(state, state.acked_through, through)
    faults.hit("before_ack", through)
    if ids and any(r.point == "mid_ack" for r in faults.rules):
        half = max(1, len(ids) // 2)
        broker.ack(ids[:half])
        faults.hit("mid_ack", through)
        ids_left = ids[half:]
    else:
        ids_left = ids
    if ids_left:
        broker.ack(ids_left)
    faults.hit("after_ack", through)

    def transition(s: OffsetLogState) -> Event | None:
        if s.acked_through >= through:
            return None  # someone (a sink's ack_committed) recorded it first
        return offset_log_events.ack(s, through)

    first = state.acked_through + 1
    _, state = store.update(source_id, offset_log_events.fold_offsets, transition, state)
    log.info("%s: acked claims %d..%d (%d messages)", source_id, first, through, len(ids))
    return state


def ack_committed(broker: BrokerConfig, claim_log: ClaimLogConfig, end: Mapping | str) -> int:
    """Acknowledge every claim up to the source offset ``end`` of a committed batch.

    For sinks: call it only once the batch ending at ``end`` is durably
    committed (after phase 2). It acks at the broker, then records ``acked``;
    repeating it is harmless. Returns the claim acked through.
    """
    import json

    offset = json.loads(end) if isinstance(end, str) else dict(end)
    if offset.get("source") not in (None, claim_log.source_id):
        raise SourceError(
            f"offset {offset} belongs to source {offset.get('source')!r}, not "
            f"{claim_log.source_id!r} of claim log {claim_log.uri}"
        )
    through = int(offset["claim"])
    store = claim_log.store()
    state = store.load_offsets(claim_log.source_id)
    if through > state.last_offset:
        raise SourceError(
            f"{claim_log.source_id}: cannot ack through claim {through}: the claim log "
            f"{claim_log.uri} ends at claim {state.last_offset}"
        )
    b = broker.connect()
    try:
        b.open(state.newest_ids())
        state = _ack_through(store, claim_log.source_id, b, state, through)
    finally:
        b.close()
    return state.acked_through


# --- the driver side: claims, reuse, acks, recovery ----------------------------------------


class ClaimCoordinator:
    """The driver-side logic of an acknowledging source, free of Spark.

    Lives in the reader's long-lived driver process; everything it knows
    beyond the claim log (the index, the recovered backlog) is rebuilt from the
    log and the broker after a restart.
    """

    def __init__(
        self,
        store: RecordStore,
        source_id: str,
        broker: Broker,
        where: str,
        faults: FaultPlan = NO_FAULTS,
    ) -> None:
        self.store = store
        self.source_id = source_id
        self.broker = broker
        self.where = where  # the claim log's location, for messages
        self.faults = faults  # tests only
        self.recovered = False
        self.backlog: list[str] = []  # our pending deliveries that no claim holds
        self.bounded = False  # Trigger.AvailableNow
        self.asked_initial = False
        self.acked_known = NO_CLAIM  # claims this process saw acknowledged in the log

    def state(self) -> OffsetLogState:
        return self.store.load_offsets(self.source_id)

    def initial(self) -> int:
        """Where a query without offsets starts: after the last acknowledged claim.

        Claims beyond it were never acknowledged, so no checkpoint committed them
        as far as this log knows (the first planning crashed before Spark wrote
        its offsets): they are served again, first.
        """
        s = self.state()
        first, self.asked_initial = not self.asked_initial, True
        if first and s.last_offset > s.acked_through:  # (Spark asks again while planning)
            log.warning(
                "%s: Spark starts without offsets, but claim log %s holds claims %d..%d "
                "that were never acknowledged: serving them first (if another checkpoint "
                "already committed them, they come again)",
                self.source_id,
                self.where,
                s.acked_through + 1,
                s.last_offset,
            )
        return s.acked_through

    def check_range(self, s: OffsetLogState, start: int, end: int | None = None) -> None:
        if end is not None and end > start and start + 1 < s.first_kept:
            raise SourceError(
                f"{self.source_id}: Spark asks for claims {start + 1}..{end}, but claims "
                f"before {s.first_kept} were acknowledged long ago and summarized away in "
                f"the claim log {self.where} (their batches committed): Spark's checkpoint "
                "is older than the claim log (restored or replaced). Restore the matching "
                "checkpoint, or start a new query with a new claim log"
            )
        for off in (start, end):
            if off is not None and off > s.last_offset:
                raise SourceError(
                    f"{self.source_id}: Spark's checkpoint names claim {off}, but the claim "
                    f"log {self.where} ends at claim {s.last_offset}: the log was replaced, "
                    "deleted or belongs to another query; restore it, or start a new "
                    "checkpoint with a new claim log"
                )

    def latest(self, start: int, cap: int, block_ms: int = 0) -> int:
        """The end of the next batch after ``start`` (claims ``<= start`` are committed)."""
        s = self.state()
        self.check_range(s, start)
        s = _ack_through(self.store, self.source_id, self.broker, s, start, self.faults)
        self.acked_known = max(self.acked_known, s.acked_through)
        s = self._bound(s)
        if not self.recovered:
            s = self._recover(s)
            self.recovered = True
        if s.last_offset > start:
            return self._reuse(s, start, cap)
        ids = self._collect(s, cap, block_ms)
        if not ids:
            return start
        return self._claim(s, ids)

    def ids(self, start: int, end: int) -> list[str]:
        """The exact message ids of batch ``(start, end]``."""
        s = self.state()
        self.check_range(s, start, end)
        return _by_claim(s, start, end)

    def commit(self, end: int) -> None:
        if end <= self.acked_known:
            # Spark commits batch N after planning N+1, whose latest() acked through N
            # already: nothing to do, and no claim-log read (acks only ever grow)
            return
        s = self.state()
        self.check_range(s, end)
        s = _ack_through(self.store, self.source_id, self.broker, s, end, self.faults)
        self.acked_known = max(self.acked_known, s.acked_through)
        self._bound(s)

    def _bound(self, s: OffsetLogState) -> OffsetLogState:
        """Summarize the claim log every so many events and delete what the summary
        restates, so a start reads and folds a bounded log whatever the history."""
        if not offset_log_events.summary_due(s):
            return s
        if self.broker.high_water((), {}) is None:
            return s  # this broker cannot tell a redelivery by id order: keep every id

        def transition(cur: OffsetLogState) -> Event | None:
            if not offset_log_events.summary_due(cur):
                return None  # someone summarized meanwhile
            dropped = cur.ids_between(cur.first_kept - 1, offset_log_events.summary_floor(cur) - 1)
            marks = self.broker.high_water(dropped, cur.marks)
            assert marks is not None  # checked above
            return offset_log_events.summarize(cur, marks)

        try:
            event, s = self.store.update(
                self.source_id, offset_log_events.fold_offsets, transition, s
            )
        except TxnError as e:  # housekeeping: the next call tries again
            log.warning("%s: summarizing the claim log failed: %s", self.source_id, e)
            return s
        if event is None:
            return s
        log.info(
            "%s: claim log summarized at #%d: claims %d..%d kept, %d events restated",
            self.source_id,
            event.seq,
            s.first_kept,
            s.last_offset,
            event.payload["summarized_events"],
        )
        try:
            self.store.log.truncate(self.source_id, event.seq)
        except Exception as e:  # noqa: BLE001 - the summary is safe; deleting is housekeeping
            log.warning("%s: deleting summarized claim-log events failed: %r", self.source_id, e)
        return s

    # --- helpers ---------------------------------------------------------------

    def _reuse(self, s: OffsetLogState, start: int, cap: int) -> int:
        """Serve claims already in the log beyond ``start`` (written, never planned)."""
        end = start + 1
        total = len(s.claims.get(end, ()))
        while end < s.last_offset and total + len(s.claims.get(end + 1, ())) <= cap:
            end += 1
            total += len(s.claims.get(end, ()))
        log.info(
            "%s: claims %d..%d (%d messages) were written before Spark planned them: "
            "serving them as the next batch",
            self.source_id,
            start + 1,
            end,
            total,
        )
        return end

    def _recover(self, s: OffsetLogState) -> OffsetLogState:
        """Once per process: settle what the broker holds for us that the log disagrees on.

        This reader's consumer name is recorded first, before it ever reads: the pending
        lists of every name the log ever read under are this log's, so a crash between a
        read and its claim loses nothing even if the checkpoint then moves (and with it
        the default name) or the ``consumer`` option changes.
        """
        me = self.broker.consumer()
        if me is not None and me not in s.consumers:
            _, s = self.store.update(
                self.source_id,
                offset_log_events.fold_offsets,
                lambda cur: offset_log_events.add_consumer(cur, me),
                s,
            )
        earlier = [c for c in s.consumers if c != me]
        lost, stale = [], []
        for m in dict.fromkeys(self.broker.pending(earlier)):
            claim = s.claim_of(m)
            if claim is None:
                lost.append(m)  # delivered, never claimed: a crash between the two
            elif claim <= s.acked_through:
                stale.append(m)  # acked in the log, the broker's ack did not land
        if stale:
            self.broker.ack(stale)
        gone = self.broker.missing(lost) if lost else set()
        if gone:  # deleted before anyone read them: nothing can be served
            log.warning(
                "%s: %d pending messages no longer exist at the broker; acknowledging them: %s",
                self.source_id,
                len(gone),
                sorted(gone)[:10],
            )
            self.broker.ack(sorted(gone))
        self.backlog = [m for m in lost if m not in gone]
        if self.backlog:
            log.warning(
                "%s: %d messages were delivered but never claimed (a crash between the two); "
                "claiming them first",
                self.source_id,
                len(self.backlog),
            )
        return s

    def _collect(self, s: OffsetLogState, cap: int, block_ms: int) -> list[str]:
        """Up to ``cap`` deliveries no claim holds: our lost ones, reclaimed, then new ones.

        A redelivery (the group's position reset, a reclaim) is dropped and, as its
        claim was acknowledged, acknowledged again; the broker is asked again while
        it hands out only redeliveries, so they cannot hide the messages behind them.
        """
        fresh: dict[str, None] = {}
        dropped = 0

        def take(ids: list[str], new: bool = False) -> int:
            """``new``: deliveries by the group's position (``claim``); an id at or below
            its partition's mark is then one of a claim summarized away (acked)."""
            nonlocal dropped
            held = [(m, s.claim_of(m)) for m in ids]
            if new and s.marks:
                held = [
                    (m, s.acked_through if c is None and self.broker.covered(s.marks, m) else c)
                    for m, c in held
                ]
            again = [(m, c) for m, c in held if c is not None]
            for m, c in held:
                if c is None:
                    fresh[m] = None
            if again:
                dropped += len(again)
                done = [m for m, c in again if c <= s.acked_through]
                if done:
                    self.broker.ack(done)
            return len(ids)

        take(self.backlog[:cap])
        self.backlog = self.backlog[cap:]
        for fetch_more in (self.broker.reclaim, None):
            for _ in range(MAX_ROUNDS):
                if len(fresh) >= cap:
                    break
                if fetch_more is None:
                    wait = 0 if (fresh or self.bounded) else block_ms
                    got = take(self.broker.claim(cap - len(fresh), wait), new=True)
                else:
                    before = len(fresh)
                    got = take(fetch_more(cap - len(fresh)))
                    if len(fresh) == before:
                        break  # one pass over the pending entries is enough
                if not got:
                    break
        if dropped:
            log.info(
                "%s: dropped %d redelivered messages that earlier claims hold",
                self.source_id,
                dropped,
            )
        return list(fresh)

    def _claim(self, s: OffsetLogState, ids: list[str]) -> int:
        expected = s.last_offset

        def transition(cur: OffsetLogState) -> Event:
            if cur.last_offset != expected:
                raise SourceError(
                    f"{self.source_id}: claim log {self.where} got claim {cur.last_offset} "
                    f"while this reader was about to write claim {expected + 1}: another "
                    "reader with the same claim log and source is running"
                )
            # Built here, not with offset_log.claim: _collect already dropped
            # every id an earlier claim holds.
            return Event(
                stream=cur.source_id,
                seq=cur.next_seq,
                kind=EventKind.CLAIM,
                payload={"offset": expected + 1, "ids": ids},
            )

        self.faults.hit("before_claim", expected + 1)
        _, s = self.store.update(self.source_id, offset_log_events.fold_offsets, transition, s)
        self.faults.hit("after_claim", s.last_offset)
        log.info("%s: claim %d: %d messages", self.source_id, s.last_offset, len(ids))
        return s.last_offset


# --- the Spark reader ---------------------------------------------------------------------


class ClaimedIds(InputPartition):
    """One read task: message ids of a claim range, and (marshalled) what their deliveries
    carried when the driver still holds it: the task then reads nothing from the broker.
    Messages never change once delivered, so both give the same rows; a replay in a new
    process has only the ids and fetches by id."""

    def __init__(self, ids: list[str], received: bytes | None = None) -> None:
        self.ids = ids
        self.received = received


class AcknowledgingStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """The Spark side of an acknowledging source; brokers only provide :class:`Broker`."""

    def __init__(
        self,
        fmt: str,
        broker: BrokerConfig,
        claim_log: ClaimLogConfig,
        arrow_schema,
        max_per_batch: int,
        block_ms: int = 0,
        faults: FaultPlan = NO_FAULTS,
    ) -> None:
        self.fmt = fmt
        self.faults = faults  # tests only
        self.broker_config = broker
        self.claim_log = claim_log
        self.arrow_schema = arrow_schema
        self.max_per_batch = max_per_batch
        self.block_ms = block_ms
        self._coordinator: ClaimCoordinator | None = None
        self._last: int | None = None  # for PySpark versions that call latestOffset()

    def __getstate__(self) -> dict[str, Any]:
        # read() runs on executors from a pickled copy: no connections travel
        state = dict(self.__dict__)
        state["_coordinator"] = None
        return state

    def _offset(self, claim: int) -> dict[str, Any]:
        return canonical({"claim": claim, "source": self.claim_log.source_id})

    def _claim_of(self, offset: Mapping[str, Any]) -> int:
        if offset.get("source") != self.claim_log.source_id:
            raise SourceError(
                f"{self.fmt}: Spark's checkpoint holds offsets of source "
                f"{offset.get('source')!r}, but this reader is {self.claim_log.source_id!r} "
                "(another group or source id than the checkpoint was made with); use the "
                "original options or a new checkpoint"
            )
        return int(offset["claim"])

    def coordinator(self) -> ClaimCoordinator:
        if self._coordinator is None:
            log_ = DeltaEventLog(self.claim_log.uri, dict(self.claim_log.storage_options) or None)
            try:
                log_.create_if_missing()
            except Exception as e:
                raise SourceError(
                    f"{self.fmt}: cannot open or create the claim log {self.claim_log.uri}: {e}"
                ) from e
            store = RecordStore(log_)
            claimed = store.load_offsets(self.claim_log.source_id)
            broker = self.broker_config.connect()
            broker.open(claimed.newest_ids())
            self._coordinator = ClaimCoordinator(
                store, self.claim_log.source_id, broker, self.claim_log.uri, self.faults
            )
        return self._coordinator

    def initialOffset(self) -> dict[str, Any]:
        return self._offset(self.coordinator().initial())

    def getDefaultReadLimit(self):
        from ._common import HAS_ADMISSION_CONTROL, ReadMaxRows

        return ReadMaxRows(self.max_per_batch) if HAS_ADMISSION_CONTROL else None

    def latestOffset(self, start: dict | None = None, limit: Any = None) -> dict[str, Any]:
        c = self.coordinator()
        cap = self.max_per_batch
        by_limit = limit_rows(limit)
        if by_limit is not None:
            cap = max(1, min(cap, by_limit))
        if start is not None:
            begin = self._claim_of(start)
        elif self._last is not None:
            # PySpark < 4.2 passes no start: where this process planned last (a
            # restarted query re-plans its last batch first, see partitions)
            begin = self._last
        else:
            begin = c.initial()
        end = c.latest(begin, cap, self.block_ms)
        self._last = end
        return self._offset(end)

    def prepareForTriggerAvailableNow(self) -> None:
        c = self.coordinator()
        c.bounded = True
        c.broker.bound_to_now()

    def partitions(self, start: dict, end: dict) -> list[ClaimedIds]:
        lo, hi = self._claim_of(start), self._claim_of(end)
        check_batch_order(self.fmt, lo, hi)
        self._last = hi
        c = self.coordinator()
        ids = c.ids(lo, hi)
        parts = []
        for chunk in self.broker_config.split(ids):
            if chunk:
                got = c.broker.received(chunk)
                # marshal: plain lists/dicts of bytes, ~10x faster than pickle here (the
                # driver's Python and the workers' are the same version, as PySpark requires)
                packed = None if got is None else marshal.dumps(got)
                if packed is not None and len(packed) > RECEIVED_BYTES_PER_PARTITION:
                    packed = None  # too big to ship in a task: the task fetches by id
                parts.append(ClaimedIds(chunk, packed))
        return parts

    def read(self, partition: ClaimedIds):  # type: ignore[override]  # our partitions
        broker = self.broker_config.connect()
        try:
            received = getattr(partition, "received", None)
            if received is None:
                yield from broker.fetch(partition.ids, self.arrow_schema)
            else:
                got = marshal.loads(received)  # made by partitions(), this query
                yield from broker.fetch_received(partition.ids, got, self.arrow_schema)
        finally:
            broker.close()

    def commit(self, end: dict) -> None:
        self.coordinator().commit(self._claim_of(end))

    def stop(self) -> None:
        if self._coordinator is not None:
            self._coordinator.broker.close()
            self._coordinator = None
