"""Test doubles shared by the unit and contract suites.

``FaultyLog`` wraps a *real* backend and injects failures; ``MemoryTarget`` is
an in-memory phase-2 target used only by pure unit tests of the protocol core.
"""

from pyspark_txn.errors import CorruptSnapshotError
from pyspark_txn.sinks.twophase import Target
from pyspark_txn.state import Event, EventKind, EventLog


def allocated_event(seq, stream="s", **kw):
    """An ``allocated`` event whose snapshot id equals its seq: filler for log tests."""
    return Event(stream=stream, seq=seq, kind=EventKind.ALLOCATED, epoch=1, snapshot_id=seq, **kw)


class FaultyLog(EventLog):
    """Wraps a real backend and injects storage failures around its calls.

    ``plan`` holds one action per coming append: ``fail_before`` (the write
    never happens, the caller sees an error), ``lose_response`` (the write
    lands, the caller sees an error), ``indeterminate`` (lands, the caller sees
    an error, and every later read fails), or None (pass through).
    """

    def __init__(self, inner: EventLog):
        self.inner = inner
        self.plan: list[str | None] = []
        self.read_failures = 0
        self.appends = 0

    def append(self, event):
        self.appends += 1
        action = self.plan.pop(0) if self.plan else None
        if action == "fail_before":
            raise OSError("injected: connection reset before the write")
        self.inner.append(event)
        if action == "indeterminate":  # landed, and from now on nothing can be read back
            self.read_failures = 10**6
        if action in ("lose_response", "indeterminate"):
            raise TimeoutError("injected: response lost after the write landed")

    def read(self, stream):
        if self.read_failures:
            self.read_failures -= 1
            raise OSError("injected: read failed")
        return self.inner.read(stream)

    def streams(self):
        return self.inner.streams()


class MemoryTarget(Target):
    """A target whose staged and committed txns are dicts; it records every rollback."""

    def __init__(self):
        self.staged: dict[int, dict[str, list[int]]] = {}  # snapshot -> handle -> rows
        self.batches: dict[int, list[int]] = {}  # committed batch -> rows
        self.version: int | None = None
        self.rolled_back: set[str] = set()
        self.committed_handles: set[str] = set()

    def stage(self, snapshot_id, handle, rows):
        self.staged.setdefault(snapshot_id, {})[handle] = list(rows)

    def committed_batch(self, sink_id):
        return self.version

    def commit(self, record):
        if self.version is not None and self.version >= record.batch_id:
            return self.version
        self.verify_staged(record.snapshot_id, record.txns)
        staged = self.staged[record.snapshot_id] if record.txns else {}
        self.batches[record.batch_id] = [r for t in record.txns for r in staged[t.handle]]
        self.committed_handles |= {t.handle for t in record.txns}
        self.version = record.batch_id
        return self.version

    def verify_staged(self, snapshot_id, txns):
        present = self.staged.get(snapshot_id, {})
        missing = [t.handle for t in txns if t.handle not in present]
        if missing:
            raise CorruptSnapshotError(f"missing {missing}")

    def discard(self, snapshot_id, keep=()):
        files = self.staged.get(snapshot_id, {})
        for handle in [h for h in files if h not in set(keep)]:
            self.rolled_back.add(handle)
            del files[handle]
        if not files:
            self.staged.pop(snapshot_id, None)

    def staged_snapshot_ids(self):
        return set(self.staged)

    @property
    def rows(self):
        return [r for b in sorted(self.batches) for r in self.batches[b]]
