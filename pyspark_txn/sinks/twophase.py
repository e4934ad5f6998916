"""The two-phase commit protocol of one sink, independent of Spark and of the target.

``allocate`` runs where Spark plans a batch, before any task stages data;
``commit`` and ``abort`` run where Spark calls the writer's commit/abort (the
first commit of a new Spark run takes the sink's epoch and recovers). All
IO goes through a :class:`RecordStore` and a :class:`Target`, so the same code
is driven by Spark in production and by plain tests with in-memory parts.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import (
    CheckpointMismatchError,
    ConfigError,
    IndeterminateCommitError,
    TargetGoneError,
    TxnError,
)
from ..faults import NO_FAULTS, FaultPlan
from ..state import (
    Event,
    Replay,
    SinkState,
    SnapshotKind,
    SnapshotRecord,
    TxnHandle,
    abandon,
    allocate,
    allocated_ids,
    bookkeeping_floor,
    dead_snapshots,
    decide,
    fold_sink,
    mark_committed,
    pending_phase2,
    record_snapshot,
    settled,
    summarize,
    summary_due,
    take_over,
)
from ..state.core import DEFAULT_RETAIN_SNAPSHOTS, SETTLE_IDS, reserved_unused
from ..state.store import RecordStore
from .target import (  # noqa: F401 (re-exported: callers import them from here)
    Target,
    TargetTerms,
    abandon_lost_refusal,
    last_committed_batch,
    lost_batches,
    lost_pending_error,
    proven_batch,
    target_gone_error,
    target_lost,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# Per process: record id -> target version of every phase 2 this process
# finished lately. "Phase 2 of this record returned" never stops being true, so
# the next batch's commit (usually in the same reused Python worker) confirms
# the previous record without asking the target again.
_PHASE2_DONE: OrderedDict[str, int | None] = OrderedDict()
_PHASE2_DONE_MAX = 256
_PHASE2_LOCK = threading.Lock()

#: The reason of the ``abandoned`` event of an attempt Spark aborted: status tells a
#: failed batch (restart the query) from a deliberate withdrawal (``settle``, ``abandon``).
SPARK_ABORT_REASON = "aborted by Spark"


def _phase2_done(record_id: str) -> tuple[bool, int | None]:
    with _PHASE2_LOCK:
        if record_id in _PHASE2_DONE:
            return True, _PHASE2_DONE[record_id]
    return False, None


def _remember_phase2(record_id: str, version: int | None) -> None:
    with _PHASE2_LOCK:
        _PHASE2_DONE[record_id] = version
        while len(_PHASE2_DONE) > _PHASE2_DONE_MAX:
            _PHASE2_DONE.popitem(last=False)


def _check_same_target(
    sink_id: str, state: SinkState, target_meta: Mapping[str, Any] | None
) -> None:
    """A sink writes one target: its records name it. Another location for the same
    sink (a restart with another path, or a second writer on the same checkpoint) would
    take the records of one table for the other's, and skip batches as replays."""
    last = state.last_record
    recorded = (last.target or {}).get("uri") if last is not None else None
    given = (target_meta or {}).get("uri")
    if last is not None and recorded and given and recorded != given:
        raise ConfigError(
            f"sink {sink_id!r} writes to {recorded} (its record of batch {last.batch_id} "
            f"says so), but this writer writes to {given}: one checkpoint's sink writes one "
            "table. Give the other table its own query and checkpoint (a foreachBatch that "
            "writes two tables: use mode=light, or write the two tables from two queries)"
        )
    if last is None or given is None:
        return
    for key, what in WRITE_KEYS.items():
        before, now = (last.target or {}).get(key), (target_meta or {}).get(key)
        if isinstance(before, Mapping) and isinstance(now, Mapping):
            before, now = _changed(before, now)
        if before != now:
            raise ConfigError(
                f"sink {sink_id!r} wrote its batches with {what} {_describe(before)} (its "
                f"record of batch {last.batch_id} says so), and this writer with "
                f"{_describe(now)}: a checkpoint's sink keeps how it writes its table (the "
                "rows already there were written the first way). Start a new query (a new "
                "checkpoint) for the new way"
            )


#: What a record's target says of *how* phase 2 writes (besides where): a sink keeps it
#: across restarts (``upsert``: the keys, sequence, deletes of a merge; ``output_mode``).
WRITE_KEYS = {"upsert": "upsert options", "output_mode": "output mode"}


def _changed(before: Mapping[str, Any], now: Mapping[str, Any]) -> tuple[dict, dict]:
    """The settings that differ between two ways of writing (what a message names);
    a setting that may change across restarts (``tombstone_retention_s``) is left out."""
    keys = {k for k in set(before) | set(now) if k not in MAY_CHANGE}
    differ = sorted(k for k in keys if before.get(k) != now.get(k))
    return {k: before.get(k) for k in differ}, {k: now.get(k) for k in differ}


#: Settings of ``upsert`` a restart may change: how long deletes are remembered.
MAY_CHANGE = frozenset({"tombstone_retention_s"})


def _describe(value: Any) -> str:
    if value is None:
        return "none (appends)"
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={v!r}" for k, v in sorted(value.items()))
    return str(value)


#: The most snapshot ids one ``allocated`` event reserves for a planner: the query's
#: next batches take theirs from this process's lease without writing to the record
#: table (docs/protocol.md, "Leases"). Measured: one record-table read and one append
#: less per batch, ~15-20 ms of Spark's addBatch on local disk.
LEASE_IDS = 16


@dataclass
class _Lease:
    """This process's ids reserved ahead for one sink, not handed out yet (in order), and
    how many the next allocation reserves. Leases start at 2 ids and double while they
    are used up (up to ``LEASE_IDS``); after one was cut short by someone else's
    allocation, ``LEASE_IDS`` allocations take one id each. Ids of leases that keep
    being cut short would run ahead of the batches, and windows counted in ids
    (``SETTLE_IDS``, the summary window) would shrink."""

    ids: list[tuple[int, str]] = field(default_factory=list)
    size: int = 2
    single: int = 0

    def next_count(self) -> int:
        return 1 if self.single > 0 else self.size


# Per process: (record table location, sink) -> its lease.
_LEASES: dict[tuple, _Lease] = {}
_LEASES_MAX = 256
_LEASES_LOCK = threading.Lock()


def _take_leased(key: tuple, state: SinkState) -> tuple[int, str] | None:
    """The next id of this process's lease, if ``state`` (read just now) still allows it.

    Allowed: the lease is the newest allocation (so ids stay in the order they are
    handed out, which fencing relies on), the id is above every record and not
    withdrawn, and the table holds it with our token (not a re-created table)."""
    with _LEASES_LOCK:
        lease = _LEASES.setdefault(key, _Lease())
        if not lease.ids:
            return None
        sid, token = lease.ids[0]
        if state.ongoing_snapshot_id != lease.ids[-1][0]:
            # another allocation came after ours: a pool of planner workers, an export,
            # a batch without tasks. One id at a time for a while.
            _LEASES[key] = _Lease(single=LEASE_IDS)
            return None
        if (
            state.allocations.get(sid) != token
            or sid <= state.high_water
            or sid in state.abandoned
            or state.record_for_snapshot(sid) is not None
        ):
            _LEASES[key] = _Lease()
            return None
        lease.ids.pop(0)
        return sid, token


def _leased(key: tuple, ids: list[tuple[int, str]]) -> None:
    """Keep what a new allocation of ``ids`` reserved ahead (``ids[0]`` is taken now)."""
    with _LEASES_LOCK:
        lease = _LEASES.pop(key, None) or _Lease()
        if lease.single > 0:
            lease.single -= 1
        elif len(ids) > 1:
            lease.size = min(2 * len(ids), LEASE_IDS)
        lease.ids = ids[1:]
        _LEASES[key] = lease
        while len(_LEASES) > _LEASES_MAX:
            _LEASES.pop(next(iter(_LEASES)))


def _lease_count(key: tuple) -> int:
    with _LEASES_LOCK:
        lease = _LEASES.get(key)
        return lease.next_count() if lease is not None else _Lease().next_count()


_UNREAD: Any = object()  # "not read yet", where None is an answer

# (sink, snapshot id, token) of dead attempts this process rolled back and said so
_ROLLED_BACK: set[tuple[str, int, str]] = set()


def _retry(what: str, fn: Callable[[], T], attempts: int, backoff_s: float) -> T:
    """Retry an idempotent step; the last error propagates (recovery redoes it).

    Decided errors (a ``TxnError`` that is not ``retryable``) are not retried. An
    outcome one attempt left unknown stays unknown unless a later attempt decides it:
    a retry that cannot even reach the target ends in ``IndeterminateCommitError``.
    """
    unknown: IndeterminateCommitError | None = None
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as e:
            if isinstance(e, TxnError) and not e.retryable:
                raise
            if isinstance(e, IndeterminateCommitError):
                unknown = e
            if attempt == attempts - 1:
                if unknown is not None and e is not unknown:
                    raise IndeterminateCommitError(
                        f"{what}: {unknown} The {attempts - 1} retries could not decide it "
                        f"({type(e).__name__}: {e})"
                    ) from unknown
                raise
            log.warning("%s failed (attempt %d/%d): %r", what, attempt + 1, attempts, e)
            time.sleep(backoff_s * 2**attempt)
    raise AssertionError("unreachable")


class TwoPhaseCommitter:
    def __init__(
        self,
        store: RecordStore,
        target: Target,
        sink_id: str,
        *,
        faults: FaultPlan = NO_FAULTS,
        phase2_attempts: int = 5,
        backoff_s: float = 0.1,
        sweep_every: int = 32,
        retain_snapshots: int = DEFAULT_RETAIN_SNAPSHOTS,
        summary_window_ids: int = 2 * SETTLE_IDS,
        serve_exports: Callable[[SinkState, SnapshotRecord, int | None], None] | None = None,
    ) -> None:
        self.store = store
        self.target = target
        self.sink_id = sink_id
        self.faults = faults
        self.phase2_attempts = phase2_attempts
        self.backoff_s = backoff_s
        self.sweep_every = sweep_every
        self.retain_snapshots = retain_snapshots
        self.summary_window_ids = summary_window_ids
        # Exports requested for "the next commit" (named snapshots): the target
        # decides how to export; failures are the exporter's to record.
        self.serve_exports = serve_exports

    def load(self) -> SinkState:
        return self.store.load_sink(self.sink_id)

    def _update(self, transition: Callable[[SinkState], Any], state: SinkState | None = None):
        return self.store.update(self.sink_id, fold_sink, transition, state)

    # --- planner, before each batch's phase 1 ---------------------------------

    def allocate(
        self, target_meta: Mapping[str, Any] | None = None, *, lease: bool = True
    ) -> tuple[int, str]:
        """Reserve a snapshot id and token safely; only then may phase 1 stage anything.

        ``target_meta`` (the ``uri`` a record would name): a sink whose records name
        another target is refused here, before phase 1 leaves markers and files in the
        wrong place (the commit checks again). ``lease``: the planner's allocation,
        which may take an id reserved ahead or reserve the next ones (not for the one
        id a commit allocates for a batch without tasks)."""
        self.faults.hit("allocate")
        state = self.load()
        if target_meta is not None:
            _check_same_target(self.sink_id, state, target_meta)
            if last_committed_batch(state) is not None:
                # before phase 1 leaves staged files at the place of a lost table; a
                # recent read that looks lost may predate a phase 2: a fresh one decides
                recent = self.target.committed_batch_recent(self.sink_id)
                if target_lost(state, self.target, recent) is not None:
                    self._refuse_lost_target(state)
        location = self.store.log.location()
        if location is None or not lease:
            event, _ = self._update(allocate, state)
            return event.snapshot_id, event.payload["token"]
        key = (location, self.sink_id)
        leased = _take_leased(key, state)
        if leased is not None:
            return leased
        count = _lease_count(key)
        event, _ = self._update(lambda s: allocate(s, count=count, table=location), state)
        ids = allocated_ids(event)
        _leased(key, ids)
        return ids[0]

    # --- driver, Spark's commit -----------------------------------------------

    def commit(
        self,
        batch_id: int,
        snapshot_id: int,
        token: str,
        txns: Sequence[TxnHandle],
        *,
        run_id: str | None,
        source_offsets: Sequence[Any] | None = None,
        query_id: str | None = None,
        query_name: str | None = None,
        target_meta: dict[str, Any] | None = None,
        kind: SnapshotKind = SnapshotKind.AUTOMATIC,
    ) -> SnapshotRecord:
        """Decide ``batch_id`` (or recognise a replay), make the record safe, run phase 2.

        ``run_id`` identifies the Spark query run whose tasks staged ``txns``
        (None when no task ran: then the current epoch holder's run is assumed).
        """
        started = time.perf_counter()
        state = self.load()
        _check_same_target(self.sink_id, state, target_meta)
        recovered = False
        if run_id is not None:
            event, state = self._update(
                lambda s: take_over(s, run_id, snapshot_id, query_id, query_name), state
            )
            if event is not None:
                log.info("sink %s: run %s took epoch %d", self.sink_id, run_id, event.epoch)
                state = self._recover(state, query_id)
                recovered = True
        decision = decide(state, batch_id, snapshot_id, state.epoch, query_id, source_offsets)
        if isinstance(decision, Replay):
            # A replayed batch: decided before. Phase 2 again "just in case"
            # (a no-op if it landed) and this attempt's staged data goes: only
            # this call could ever record it.
            rec = decision.record
            log.info(
                "sink %s: batch %d was decided as snapshot %d; replay is a no-op",
                self.sink_id,
                batch_id,
                rec.snapshot_id,
            )
            if rec.snapshot_id != snapshot_id:
                self.target.discard(snapshot_id, token)
            if rec.snapshot_id not in state.committed:
                if not _phase2_done(rec.record_id)[0]:
                    self._refuse_lost_target(state)
                state, _ = self._phase2(state, rec, confirm=True)
            if not recovered:  # recovery has just swept
                self._sweep(state)
            return rec
        # An older decision lands before a newer one. In a steady run that is the
        # previous batch, whose phase 2 is done: the new record confirms it.
        confirms = {}
        pending = pending_phase2(state)
        if any(not _phase2_done(p.record_id)[0] for p in pending):
            self._refuse_lost_target(state)  # phase 2 never goes into a lost table
        for rec in pending:
            state, confirms[rec.snapshot_id] = self._phase2(state, rec, confirm=False)
        committed = self.target.committed_batch(self.sink_id)
        self._refuse_lost_target(state, committed)
        lost_pending = lost_pending_error(self.sink_id, self.target, pending, committed)
        if lost_pending is not None:
            raise lost_pending
        if committed is not None and committed >= batch_id:
            raise CheckpointMismatchError(
                f"sink {self.sink_id!r}: the target already holds batch {committed} but the "
                f"record table has no record of batch {batch_id}: refusing to decide it again"
            )
        record = SnapshotRecord(
            sink_id=self.sink_id,
            snapshot_id=snapshot_id,
            batch_id=batch_id,
            epoch=state.epoch,
            kind=kind,
            txns=tuple(sorted(txns, key=lambda t: (t.partition, t.handle))),
            source_offsets=tuple(source_offsets or ()),
            query_id=query_id,
            target=target_meta or {},
            token=token,
            run_id=run_id if run_id is not None else state.epoch_owner,
            confirms=confirms,
        )
        self.target.verify_staged(snapshot_id, token, record.txns)
        self.target.preflight(record)
        previous = state.last_record
        self.faults.hit("before_record", batch_id)
        decided = time.perf_counter()
        _, state = self._update(lambda s: record_snapshot(s, record), state)
        self.faults.hit("after_record", batch_id)
        recorded = time.perf_counter()
        state, version = self._phase2(state, record, confirm=False)
        terms = self.target.terms
        log.info(
            "sink %s: batch %d committed as snapshot %d: %d rows, %s, %d bytes, "
            "%s; decide %.0f ms, record %.0f ms, phase 2 %.0f ms",
            self.sink_id,
            batch_id,
            snapshot_id,
            record.rows,
            terms.count(len(record.txns)),
            sum(t.bytes for t in record.txns),
            terms.committed_as(version),
            (decided - started) * 1000,
            (recorded - decided) * 1000,
            (time.perf_counter() - recorded) * 1000,
        )
        if state.export_requests and self.serve_exports is not None:
            try:
                self.serve_exports(state, record, version)
            except Exception as e:  # the batch is committed; the request records its failure
                log.warning("sink %s: serving export requests failed: %r", self.sink_id, e)
        if _skipped_ids(previous, snapshot_id) or snapshot_id % self.sweep_every == 0:
            # Attempts allocated since the last record died with this one (or
            # it is time for the periodic sweep that catches files written late
            # into dead attempts). Only provably dead attempts go.
            self._sweep(state)
        if previous is not None:
            # Tasks of the previous batch have all ended by now: files a
            # speculative or late attempt wrote into its folder since its own
            # phase 2 are named by no record and go.
            self.target.discard(previous.snapshot_id, previous.token, _handles(previous))
        if summary_due(state, self.retain_snapshots, self.summary_window_ids):
            try:
                self._summarize(state)
            except TxnError as e:  # housekeeping: the batch is committed; the next one retries
                log.warning("sink %s: summarizing the history failed: %s", self.sink_id, e)
        return record

    def _summarize(self, state: SinkState) -> None:
        """Bound the history: write a summary, then delete the events it restates, then
        the target's bookkeeping of the records the summary dropped."""
        event, state = self._update(
            lambda s: summarize(s, self.retain_snapshots, self.summary_window_ids), state
        )
        log.info(
            "sink %s: history summarized at event %d (%d events)",
            self.sink_id,
            event.seq,
            event.payload["summarized_events"],
        )
        try:
            self.store.log.truncate(self.sink_id, event.seq)
        except Exception as e:  # the summary is safe; deleting is housekeeping
            log.warning("sink %s: deleting summarized events failed: %r", self.sink_id, e)
        floor = bookkeeping_floor(state)
        if floor is not None:
            try:
                self.target.prune(floor)
            except Exception as e:  # housekeeping too: the next summary prunes again
                log.warning("sink %s: pruning the target's bookkeeping failed: %r", self.sink_id, e)

    def _recover(self, state: SinkState, query_id: str | None) -> SinkState:
        """A new run took over: check the target, finish safe records, sweep the dead."""
        self._check_target_matches(state)
        if not state.records:
            self.target.check_new_sink(self.sink_id, query_id)
        for rec in pending_phase2(state):
            state, _ = self._phase2(state, rec, confirm=True)
        self._sweep(state)
        return state

    def _sweep(self, state: SinkState, attempts: set[tuple[int, str]] | None = None) -> None:
        """Delete every staged attempt the state proves dead (safe on a stale state), and
        forget settled attempts, so the staging area lists only recent ones.
        ``attempts``: the staged attempts, if just listed."""
        if attempts is None:
            attempts = self.target.staged_attempts()
        for sid, token in sorted(dead_snapshots(state, attempts)):
            # Its markers stay until it is settled (a zombie task may still write), so
            # later sweeps find it again: said once per process, then at DEBUG.
            key = (self.sink_id, sid, token)
            log.log(
                logging.DEBUG if key in _ROLLED_BACK else logging.WARNING,
                "sink %s: rolling back dead staged snapshot %d (%s)",
                self.sink_id,
                sid,
                token,
            )
            if len(_ROLLED_BACK) > 10_000:
                _ROLLED_BACK.clear()
            _ROLLED_BACK.add(key)
            self.target.discard(sid, token)
            if settled(state, sid):
                self.target.forget(sid, token)
        live = {r.snapshot_id: r for r in state.records.values()}
        for sid, token in sorted(attempts):
            rec = live.get(sid)
            if rec is not None and rec.token == token and settled(state, sid):
                self.target.discard(sid, token, _handles(rec))
                self.target.forget(sid, token)

    def _refuse_lost_target(self, state: SinkState, committed: Any = _UNREAD) -> None:
        """Raise ``TargetGoneError`` where the target lost batches the record table says
        were committed to it (deleted, re-created, restored to an older version): a
        commit or phase 2 there would silently leave them out. ``committed``: the
        target's committed batch, if just read."""
        if last_committed_batch(state) is None:
            return
        if committed is _UNREAD:
            committed = self.target.committed_batch(self.sink_id)
        error = target_gone_error(self.sink_id, state, self.target, committed)
        if error is not None:
            raise error

    def _check_target_matches(self, state: SinkState) -> None:
        committed = self.target.committed_batch(self.sink_id)
        # before phase 2 of a pending record writes into a new or replaced table
        self._refuse_lost_target(state, committed)
        last = state.last_record.batch_id if state.last_record else None
        if committed is not None and (last is None or committed > last):
            recorded = "has no record of any batch" if last is None else f"ends at batch {last}"
            raise CheckpointMismatchError(
                f"the target already holds batch {committed} of sink {self.sink_id!r}, but this "
                f"sink's record table {recorded}: another query writes to the same table with "
                "the same sinkId, or the record table was deleted or replaced. Continuing could "
                "skip or duplicate data. Give every query its own sinkId, or restore the record "
                "table (or, if this checkpoint ran with mode=light, keep that mode)."
            )

    def _phase2(
        self, state: SinkState, record: SnapshotRecord, *, confirm: bool
    ) -> tuple[SinkState, int | None]:
        """Commit a safe record's txns. Idempotent; re-runnable from the record alone.

        ``confirm`` writes a ``committed`` event now; otherwise the next record
        confirms it (and until then recovery redoes this no-op phase 2).
        Returns the state and the target version.
        """
        done, version = _phase2_done(record.record_id)
        if not done:
            version = _retry(
                f"phase 2 of snapshot {record.snapshot_id}",
                lambda: self.target.commit(record),
                self.phase2_attempts,
                self.backoff_s,
            )
            self.target.discard(record.snapshot_id, record.token, _handles(record))
            _remember_phase2(record.record_id, version)
        self.faults.hit("after_phase2", record.batch_id)
        if confirm and record.snapshot_id not in state.committed:
            _, state = self._update(lambda s: mark_committed(s, record.snapshot_id, version), state)
        self.faults.hit("after_commit", record.batch_id)
        return state, version

    # --- planner, for targets whose staged txns hold locks ----------------------

    def release_staged(self) -> None:
        """Before phase 1, where staged txns hold locks (PostgreSQL's prepared
        transactions): finish phase 2 of every safe record, withdraw open attempts that
        staged something, and roll back every dead attempt, so a new attempt never waits
        on a lock an earlier one still holds.

        An open attempt with staged txns belongs to a crashed or stopped run: Spark
        plans a batch only after the previous batch's commit returned. Withdrawing it
        is Spark's abort (a conditional ``abandoned`` event), so a zombie that records
        it first keeps it, and one that comes later can never record it.
        """
        state = self.load()
        for rec in pending_phase2(state):
            _retry(
                f"phase 2 of snapshot {rec.snapshot_id}",
                functools.partial(self.target.commit, rec),
                self.phase2_attempts,
                self.backoff_s,
            )
            self.target.discard(rec.snapshot_id, rec.token, _handles(rec))
        opened = [
            (sid, token)
            for sid, token in sorted(self.target.staged_attempts())
            if state.allocations.get(sid) == token
            and sid > state.high_water
            and state.record_for_snapshot(sid) is None
        ]
        for sid, token in opened:
            log.warning(
                "sink %s: withdrawing open staged snapshot %d (%s)", self.sink_id, sid, token
            )
            self.abort(sid, token)
        self._sweep(self.load() if opened else state)

    # --- driver, Spark's abort -------------------------------------------------

    def abort(self, snapshot_id: int, token: str) -> None:
        """Roll back one attempt's staged data, unless a safe record claims it.

        The attempt is first abandoned in the record table (a conditional
        append), so a record write of the same attempt still in flight either
        landed before (and the abort leaves everything alone) or can never
        land. Tasks may still be writing when Spark aborts: whatever lands
        later is dead and goes at a later sweep.
        """
        state = self.load()
        if state.allocations.get(snapshot_id) != token:
            log.warning(
                "sink %s: abort of unknown attempt %d (%s) ignored",
                self.sink_id,
                snapshot_id,
                token,
            )
            return
        if state.record_for_snapshot(snapshot_id) is None:
            _, state = self._update(
                lambda s: (
                    None
                    if s.record_for_snapshot(snapshot_id) is not None
                    else abandon(s, snapshot_id, SPARK_ABORT_REASON)
                ),
                state,
            )
        if state.record_for_snapshot(snapshot_id) is not None:
            log.warning(
                "sink %s: abort of snapshot %d ignored: its record is safe, phase 2 will finish it",
                self.sink_id,
                snapshot_id,
            )
            return
        self.target.discard(snapshot_id, token)

    def settle(self, reason: str) -> SinkState:
        """Take the sink from the run holding it (a stopped query), finish every safe
        record and roll back every unrecorded attempt, so nothing staged outlives it.

        The sink's epoch goes to a run of its own, with an id allocated after
        every attempt of the stopped run: none of them can be recorded any more.
        A restarted query takes the epoch back as any new run does.
        """
        event, state = self._update(allocate)
        mine = event.snapshot_id
        run_id = f"settle-{event.payload['token']}"
        _, state = self._update(lambda s: take_over(s, run_id, mine, s.query_id), state)
        log.info("sink %s: settling (%s) as run %s", self.sink_id, reason, run_id)
        state = self._recover(state, state.query_id)
        # (an export's id is withdrawn too unless it already registered: a running
        # export then fails to register, cleanly, and nothing can still write there)
        named = {n.snapshot_id for n in state.named.values()}
        staged = self.target.staged_attempts()
        withdrawn = [
            sid
            for sid in sorted(state.allocations)
            if sid > state.high_water
            and sid not in state.abandoned
            and sid not in named
            # an id reserved ahead that nothing was staged under needs no withdrawal: it
            # is below settle's own allocation, so no lease hands it out any more
            and not reserved_unused(state, sid, staged)
        ]
        for sid in withdrawn:

            def withdraw(s: SinkState, sid: int = sid) -> Event | None:
                return abandon(s, sid, reason)

            _, state = self._update(withdraw, state)
        self._sweep(state, staged)  # the query is stopped: nothing staged since the listing
        for sid in withdrawn:  # the query is stopped (documented): no task can still write
            self.target.discard(sid, state.allocations[sid])
            self.target.forget(sid, state.allocations[sid])
        return state

    def abandon(self, snapshot_id: int, reason: str) -> SinkState:
        """Operator's way out of a record whose phase 2 can never succeed.

        Refused if the target shows the batch as committed. The staged data
        goes; Spark replays the batch, which is then decided anew.
        """
        state = self.load()
        rec = state.record_for_snapshot(snapshot_id)
        if rec is not None:
            committed = self.target.committed_batch(self.sink_id)
            if committed is not None and committed >= rec.batch_id:
                raise TxnError(
                    f"sink {self.sink_id!r}: the target already holds batch {committed} "
                    f">= {rec.batch_id}; snapshot {snapshot_id} cannot be abandoned"
                )
            if snapshot_id not in state.abandoned and snapshot_id not in state.committed:
                lost = target_lost(state, self.target, committed)
                if lost is not None:
                    raise TargetGoneError(
                        f"sink {self.sink_id!r}: snapshot {snapshot_id} cannot be abandoned: "
                        + abandon_lost_refusal(lost, rec.batch_id)
                    )
                refusal = self.target.abandon_refusal(rec)
                if refusal is not None:
                    raise TxnError(
                        f"sink {self.sink_id!r}: snapshot {snapshot_id} cannot be abandoned: "
                        f"{refusal}"
                    )
        _, state = self._update(lambda s: abandon(s, snapshot_id, reason), state)
        token = state.allocations.get(snapshot_id)
        if token is not None:  # the query is stopped (documented): no task can still write
            self.target.discard(snapshot_id, token)
            self.target.forget(snapshot_id, token)
        return state


def _skipped_ids(previous: SnapshotRecord | None, snapshot_id: int) -> bool:
    """Whether ids were allocated between the previous record and ``snapshot_id``."""
    return (previous.snapshot_id if previous else -1) + 1 < snapshot_id


def _handles(record: SnapshotRecord) -> list[str]:
    return [t.handle for t in record.txns]
