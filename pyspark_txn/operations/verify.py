""":func:`verify`: re-read every file a live record names and check it (size, checksum,
presence in the target), without Spark."""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import unquote

from ..state import SinkState, SnapshotRecord, TxnHandle, pending_phase2
from ..storage import fs as _fs
from .handle import CHUNK_BYTES, POSTGRES, Progress, SinkHandle, _in_handle_storage, opened_target

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Problem:
    """One finding about one file of one snapshot record."""

    severity: str  # "error" or "warning"
    # missing | size | checksum | unreadable | not-in-table | checksum-format (Delta);
    # missing | prepared | rows | not-in-table (PostgreSQL)
    kind: str
    handle: str  # the file, relative to the target table root; a PostgreSQL gid
    message: str

    def to_json(self) -> dict[str, Any]:
        return {
            "severity": self.severity,
            "kind": self.kind,
            "handle": self.handle,
            "message": self.message,
        }


@dataclass(frozen=True)
class SnapshotCheck:
    snapshot_id: int
    batch_id: int
    committed: bool
    files: int
    bytes: int
    problems: tuple[Problem, ...] = ()

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    def to_json(self) -> dict[str, Any]:
        return {
            "snapshot_id": self.snapshot_id,
            "batch_id": self.batch_id,
            "committed": self.committed,
            "files": self.files,
            "bytes": self.bytes,
            "ok": self.ok,
            "problems": [p.to_json() for p in self.problems],
        }


@dataclass(frozen=True)
class VerifyReport:
    sink_id: str
    target_uri: str | None  # the target as messages name it (Delta: its URI)
    snapshots: tuple[SnapshotCheck, ...] = ()

    @property
    def problems(self) -> list[tuple[int, Problem]]:
        """Every ``(snapshot id, problem)``, errors and warnings."""
        return [(s.snapshot_id, p) for s in self.snapshots for p in s.problems]

    @property
    def errors(self) -> list[tuple[int, Problem]]:
        return [(sid, p) for sid, p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[tuple[int, Problem]]:
        return [(sid, p) for sid, p in self.problems if p.severity == "warning"]

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.snapshots)

    def to_json(self) -> dict[str, Any]:
        return {
            "sink_id": self.sink_id,
            "target_uri": self.target_uri,
            "ok": self.ok,
            "snapshots": [s.to_json() for s in self.snapshots],
        }


def _table_files(handle: SinkHandle) -> tuple[int, set[str]] | None:
    """(version, relative paths) of the target now; None if there is no table."""
    import pyarrow as pa

    from ..storage.delta_tables import open_table

    if handle.target_uri is None:
        return None
    dt = open_table(handle.target_uri, dict(handle.storage_options))
    if dt is None:
        return None
    paths = pa.table(dt.get_add_actions(flatten=False)).column("path").to_pylist()
    return dt.version(), {unquote(p) for p in paths} | set(paths)


def _not_in_table(
    table: tuple[int, set[str]] | None,
    committed_version: int | None,
    stamp_matches: bool = True,
) -> Problem:
    """Why a committed file is not in the table now: a later removal is a warning; a table
    that is gone, older than the commit, or whose commit at that version is not this
    record's (re-created, restored) lost committed data."""
    if table is None:
        return Problem("error", "not-in-table", "", "committed, but there is no table any more")
    version = table[0]
    if committed_version is not None and (version < committed_version or not stamp_matches):
        return Problem(
            "error",
            "not-in-table",
            "",
            f"committed at table version {committed_version}, but the table is at version "
            f"{version}: it was re-created or restored and lost committed data",
        )
    return Problem("warning", "not-in-table", "", "not in the current table version")


def byte_progress(total: int, progress: Progress | None) -> Callable[[int], None]:
    """A callback that adds bytes done and reports ``(done, total)`` to ``progress``
    (reported once with 0 at once)."""
    done = 0
    if progress is not None:
        progress(0, total)

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(min(done, total), total)

    return advance


def crc32_of(fs: Any, path: str, on_bytes: Callable[[int], None]) -> str:
    crc = 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
            on_bytes(len(chunk))
    return f"crc32:{crc:08x}"


@_in_handle_storage
def verify(handle: SinkHandle, progress: Progress | None = None) -> VerifyReport:
    """Re-read every file every live (non-abandoned) snapshot record names.

    Each file must exist with the recorded size and CRC32. A committed record's
    files must also be in the target's current version; a file that is not (a
    later delete, overwrite or vacuum removed it) is a warning, and is not read (in
    complete mode, where every batch replaces the last one's files, not even that). A
    committed record of an upsert (merged by key) has no files left to read: its
    commit must be the one stamped with it.
    ``progress(done_bytes, total_bytes)`` is called as files are read.
    """
    state = handle.load()
    records = sorted(state.records.values(), key=lambda r: r.snapshot_id)
    if not records or not handle.has_target:
        return VerifyReport(handle.sink_id, handle.target_label)
    if handle.kind == POSTGRES:
        with opened_target(handle) as target:
            return _verify_postgres(handle, state, records, target)
    assert handle.target_uri is not None
    fs, root = _fs.filesystem(handle.target_uri, handle.storage)
    target = handle.target()
    committed = dict(state.committed)
    for rec in pending_phase2(state):  # the last record: the next one would confirm it
        version = target.committed_version(rec)
        if version is not None:
            committed[rec.snapshot_id] = version
    table = _table_files(handle) if committed else None
    stamps = target.commit_stamps(v for v in committed.values() if v is not None)
    plan: list[tuple[SnapshotRecord, list[Problem], list]] = []
    for rec in records:
        problems: list[Problem] = []
        to_read: list[TxnHandle] = []
        if rec.snapshot_id in committed and rec.target.get("upsert"):
            # merged by key: its staged files were the MERGE's input, removed once it
            # landed; what is left to check is that the table's commit is this record's
            version = committed.get(rec.snapshot_id)
            if version is not None and table is not None and stamps.get(version) != rec.record_id:
                problems.append(replace(_not_in_table(table, version, False), handle=""))
            plan.append((rec, problems, to_read))
            continue
        # complete mode: each batch's result replaces the last, so an older record's
        # files are out of the table by design; only a lost table or commit is wrong
        replaced = rec.target.get("output_mode") == "complete"
        for t in rec.txns:
            if rec.snapshot_id in committed and (table is None or t.handle not in table[1]):
                version = committed.get(rec.snapshot_id)
                why = _not_in_table(
                    table, version, version is None or stamps.get(version) == rec.record_id
                )
                if not (replaced and why.severity == "warning"):
                    problems.append(replace(why, handle=t.handle))
            else:
                to_read.append(t)
        plan.append((rec, problems, to_read))
    advance = byte_progress(sum(t.bytes for _, _, to_read in plan for t in to_read), progress)
    checks = []
    for rec, problems, to_read in plan:
        for t in to_read:
            problems.extend(_check_file(fs, _fs.join(root, t.handle), t, advance))
        checks.append(
            SnapshotCheck(
                snapshot_id=rec.snapshot_id,
                batch_id=rec.batch_id,
                committed=rec.snapshot_id in committed,
                files=len(rec.txns),
                bytes=sum(t.bytes for t in rec.txns),
                problems=tuple(problems),
            )
        )
        for p in problems:  # the report carries them; the log is for --verbose
            log.debug(
                "sink %s, snapshot %d: %s: %s", handle.sink_id, rec.snapshot_id, p.handle, p.message
            )
    return VerifyReport(handle.sink_id, handle.target_uri, tuple(checks))


def _verify_postgres(
    handle: SinkHandle, state: SinkState, records: list[SnapshotRecord], target: Any
) -> VerifyReport:
    """Every prepared transaction of every live record must be committed with the rows
    the record counts (or, while its phase 2 is pending, still prepared), and every
    committed record's batch row must be its own. Nothing is re-read row by row."""
    from ..sinks.postgres_db import BATCHES_TABLE

    checks = []
    for rec in records:
        own = target.batch_record(rec.batch_id)
        committed = rec.snapshot_id in state.committed or own == rec.record_id
        problems: list[Problem] = []
        if committed and own != rec.record_id:
            problems.append(
                Problem(
                    "error",
                    "not-in-table",
                    "",
                    (
                        f"batch {rec.batch_id} has no row in {BATCHES_TABLE}"
                        if own is None
                        else f"the row of batch {rec.batch_id} in {BATCHES_TABLE} names "
                        f"record {own}, not this one"
                    )
                    + ": the bookkeeping was changed or the database restored",
                )
            )
        states = target.txn_states(rec)
        for t in rec.txns:
            st, rows = states[t.handle]
            if st == "missing":
                problems.append(
                    Problem(
                        "error",
                        "missing",
                        t.handle,
                        "neither prepared nor committed: rolled back outside the sink, or "
                        "the database was restored",
                    )
                )
            elif st == "prepared" and committed:
                problems.append(
                    Problem(
                        "error",
                        "prepared",
                        t.handle,
                        "still prepared although its batch is committed: it holds its locks "
                        "until someone commits it (COMMIT PREPARED)",
                    )
                )
            elif st == "committed" and rows != t.rows:
                problems.append(
                    Problem(
                        "error",
                        "rows",
                        t.handle,
                        f"committed {rows} rows, the record says {t.rows}",
                    )
                )
        checks.append(
            SnapshotCheck(
                snapshot_id=rec.snapshot_id,
                batch_id=rec.batch_id,
                committed=committed,
                files=len(rec.txns),
                bytes=sum(t.bytes for t in rec.txns),
                problems=tuple(problems),
            )
        )
    return VerifyReport(handle.sink_id, handle.target_label, tuple(checks))


def _check_file(fs: Any, path: str, t: Any, advance: Callable[[int], None]) -> Iterable[Problem]:
    try:
        info = fs.info(path)
    except FileNotFoundError:
        advance(t.bytes)
        return [Problem("error", "missing", t.handle, "file is missing")]
    size = info.get("size")
    if size != t.bytes:
        advance(t.bytes)
        return [Problem("error", "size", t.handle, f"expected {t.bytes} bytes, found {size} bytes")]
    if not str(t.checksum).startswith("crc32:"):
        advance(t.bytes)
        return [
            Problem(
                "warning", "checksum-format", t.handle, f"unknown checksum {t.checksum!r}: not read"
            )
        ]
    read = 0

    def count(n: int) -> None:
        nonlocal read
        read += n
        advance(n)

    try:
        actual = crc32_of(fs, path, count)
    except OSError as e:
        advance(t.bytes - read)
        return [Problem("error", "unreadable", t.handle, f"cannot be read: {e}")]
    if actual != t.checksum:
        return [
            Problem(
                "error",
                "checksum",
                t.handle,
                f"checksum mismatch: recorded {t.checksum}, file has {actual}",
            )
        ]
    return []
