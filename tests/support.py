"""Test doubles and helpers shared by the suites.

``FaultyLog`` wraps a *real* backend and injects failures; ``MemoryTarget`` is
an in-memory phase-2 target used only by pure unit tests of the protocol core.
"""

import os
import socket
import subprocess
import sys
import time

from pyspark_txn.errors import CheckpointMismatchError, CorruptSnapshotError
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
    """A target whose staged and committed txns are dicts; it records every rollback.

    Staged attempts are keyed ``(snapshot id, token)`` like the real targets;
    every committed batch keeps the record id that committed it, so a record
    can tell its own commit from another sink's.
    """

    def __init__(self):
        self.staged: dict[tuple[int, str], dict[str, list[int]]] = {}
        self.batches: dict[int, list[int]] = {}  # committed batch -> rows
        self.commits: dict[int, str] = {}  # committed batch -> record id
        self.version: int | None = None
        self.rolled_back: set[str] = set()
        self.committed_handles: set[str] = set()
        self.pruned: list[int] = []  # every floor prune() was called with

    def stage(self, snapshot_id, token, handle, rows):
        self.staged.setdefault((snapshot_id, token), {})[handle] = list(rows)

    def committed_batch(self, sink_id):
        return self.version

    def commit(self, record):
        if self.version is not None and self.version >= record.batch_id:
            if self.commits.get(record.batch_id) != record.record_id:
                raise CheckpointMismatchError(f"batch {record.batch_id} committed by another")
            return self.version
        self.verify_staged(record.snapshot_id, record.token, record.txns)
        staged = self.staged[(record.snapshot_id, record.token)] if record.txns else {}
        self.batches[record.batch_id] = [r for t in record.txns for r in staged[t.handle]]
        self.commits[record.batch_id] = record.record_id
        self.committed_handles |= {t.handle for t in record.txns}
        self.version = record.batch_id
        return self.version

    def verify_staged(self, snapshot_id, token, txns):
        present = self.staged.get((snapshot_id, token), {})
        missing = [t.handle for t in txns if t.handle not in present]
        if missing:
            raise CorruptSnapshotError(f"missing {missing}")

    def discard(self, snapshot_id, token, keep=()):
        files = self.staged.get((snapshot_id, token), {})
        for handle in [h for h in files if h not in set(keep)]:
            self.rolled_back.add(handle)
            del files[handle]
        if not files:
            self.staged.pop((snapshot_id, token), None)

    def staged_attempts(self):
        return set(self.staged)

    def prune(self, floor):
        self.pruned.append(floor)

    @property
    def rows(self):
        return [r for b in sorted(self.batches) for r in self.batches[b]]


def run_cli_process(*argv, env=None, unset=(), timeout=120):
    """``pyspark-txn ARGV`` as a user runs it: a new process, this interpreter, this
    environment (minus ``unset``, plus ``env``). Returns (exit status, stdout, stderr)."""
    environ = {k: v for k, v in os.environ.items() if k not in unset}
    proc = subprocess.run(
        [sys.executable, "-m", "pyspark_txn", *(str(a) for a in argv)],
        capture_output=True,
        text=True,
        env={**environ, **(env or {})},
        timeout=timeout,
    )
    return proc.returncode, proc.stdout, proc.stderr


def stop_process(proc: subprocess.Popen) -> None:
    """Stop a test server: SIGTERM, then SIGKILL if it is still there after 10 s."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for_port(proc: subprocess.Popen, port: int, what: str, timeout_s: float = 30.0) -> None:
    """Wait until a test server started as ``proc`` accepts connections on loopback
    ``port``; stop it and raise if it exits or does not listen within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                stop_process(proc)
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.1)


def at_fault_point(monkeypatch, point: str, batch: int, action) -> None:
    """Run ``action()`` once, when the protocol reaches fault point ``point`` of ``batch``
    (something another process does at that moment), then go on."""
    from pyspark_txn import faults

    hit = faults.FaultPlan.hit
    pending = [action]

    def at_point(self, where, batch_id=None, **kw):
        if where == point and batch_id == batch and pending:
            pending.pop()()
        return hit(self, where, batch_id, **kw)

    monkeypatch.setattr(faults.FaultPlan, "hit", at_point)
