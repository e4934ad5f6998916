"""Consistent backups of a whole pipeline: one named snapshot per query, as a set.

Members are the checkpoints of queries whose sinks write Delta tables
(``txn-delta``). Queries are linked when one's ``txn-delta`` source reads the
table another's sink writes (``reads=``). A backup is consistent when no
downstream part holds rows derived from upstream data its upstream part lacks
(seed 001): the parts form an exact cut.

How (docs/backups.md has the argument): parts are *planned* downstream first.
A query no other member reads is pinned at its latest committed batch; the
upstream version ``V`` a downstream part consumed is in that batch's source
offset (``{"version": V + 1, "index": 0, ...}``: everything through ``V``); the
upstream part is then pinned at the committed batch whose commit made exactly
version ``V``, and so on up the chain. Restore copies each part into a new
table (version 0 = the pinned version) and rewrites each downstream offset to
the restored upstream table's next version, so the chain resumes exactly there.

The catalog is a small Delta table ``<to>/_catalog``: one row per event
(started, member started/failed, failed, deleted). A backup id is taken with a
conditional commit (no delta-rs retries, an app transaction versioned by the
id), so two takers can never both take an id, and ids only grow: a smaller or
used id is refused, also after a failed or deleted backup.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from ..errors import BackupError, ConfigError, CorruptSnapshotError
from ..storage import StorageOptions, current, takes_storage_options

if TYPE_CHECKING:
    import pyarrow as pa
    from deltalake import DeltaTable
    from pyspark.sql import SparkSession
from ..storage import fs as _fs
from . import handle as admin
from . import snapshots

log = logging.getLogger(__name__)

__all__ = [
    "BackupStatus",
    "MemberStatus",
    "Restored",
    "delete",
    "list_backups",
    "restore",
    "show",
    "status",
    "take",
    "verify",
]

CATALOG = "_catalog"
_APP = "pyspark_txn_backups"
RESTORE_MARKER = ".pyspark-txn-restore.json"
#: Crash tests only: ``exit_after_part`` / ``exit_after_restore_part`` end the process
#: (``os._exit``, no cleanup) after the first part taken or restored.
FAULT_ENV = "PYSPARK_TXN_BACKUP_FAULT"
DONE_FILE = "restored.json"

# member states (seed 001's words)
DOES_NOT_EXIST = "doesNotExist"
IN_PROGRESS = "inProgress"
COMPLETED = "completed"
FAILED = "failed"
INCOMPLETE = "incomplete"
DELETED = "deleted"


def part_name(backup_id: int) -> str:
    """The name of a backup's part in each member's snapshot registry."""
    return f"backup-{backup_id}"


# --- the catalog ------------------------------------------------------------------


def _catalog_uri(to: str) -> str:
    return _fs.join(_fs.normalize_uri(to), CATALOG)


def _schema() -> pa.Schema:
    import pyarrow as pa

    return pa.schema(
        [
            ("backup_id", pa.int64()),
            ("event", pa.string()),
            ("member", pa.string()),
            ("at", pa.string()),
            ("body", pa.string()),
        ]
    )


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _find_catalog(to: str) -> DeltaTable | None:
    """The catalog, or None where none was ever created (any other failure raises: a store
    that cannot be read must not look like one without backups)."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        return DeltaTable(_catalog_uri(to), storage_options=current().for_delta())
    except TableNotFoundError:
        return None


def _open_catalog(to: str, create: bool = False) -> DeltaTable:
    from deltalake import DeltaTable
    from deltalake.transaction import CommitProperties

    found = _find_catalog(to)
    if found is not None:
        return found
    uri = _catalog_uri(to)
    if not create:
        raise ConfigError(f"{to}: no backup catalog there ({uri})")
    try:
        DeltaTable.create(
            uri,
            _schema(),
            mode="ignore",
            name="pyspark_txn_backups",
            description="pyspark-txn backup catalog (append-only events)",
            commit_properties=CommitProperties(max_commit_retries=0),
            storage_options=current().for_delta(),
        )
    except Exception as e:  # a lost race for version 0: the winner's table is ours too
        found = _find_catalog(to)
        if found is None:
            raise ConfigError(f"to={to!r}: the backup catalog {uri} cannot be created: {e}") from e
        return found
    return DeltaTable(uri, storage_options=current().for_delta())


def _rows(dt: DeltaTable) -> list[dict[str, Any]]:
    rows = dt.to_pyarrow_table().to_pylist()
    for r in rows:
        r["body"] = json.loads(r["body"]) if r["body"] else {}
    return sorted(rows, key=lambda r: r["at"])


def _append(dt: DeltaTable, rows: list[dict[str, Any]], *, take_id: int | None = None) -> None:
    """Append catalog rows. With ``take_id`` the commit is conditional: it lands only on
    the version ``dt`` was read at (no delta-rs retries) and versions the id."""
    import pyarrow as pa
    from deltalake import write_deltalake
    from deltalake.transaction import CommitProperties, Transaction

    table = pa.Table.from_pylist(
        [{**r, "body": json.dumps(r.get("body") or {}, default=str)} for r in rows],
        schema=_schema(),
    )
    props = (
        CommitProperties(
            app_transactions=[Transaction(app_id=_APP, version=take_id)], max_commit_retries=0
        )
        if take_id is not None
        else None
    )
    write_deltalake(dt, table, mode="append", commit_properties=props)


def _owner() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_start": _process_start(os.getpid()),
        "token": uuid.uuid4().hex,
        "at": _now(),
    }


_LIVE: set[str] = set()  # tokens of the takes and restores this process runs now


def _process_start(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


def _owner_is_dead(owner: Mapping[str, Any] | None) -> bool:
    """True only when that process provably no longer runs (same host, pid gone or reused)."""
    if not owner or owner.get("host") != socket.gethostname():
        return False
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():
        return owner.get("token") not in _LIVE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    start, now = owner.get("process_start"), _process_start(pid)
    return start is not None and now is not None and start != now


# --- the plan: which committed batch of each member --------------------------------


@dataclass(frozen=True)
class Member:
    checkpoint: str  # as the user gave it
    target: str  # the sink's Delta table
    sink_id: str
    reads: tuple[str | None, ...]  # per source: the table its txn-delta source reads

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "target": self.target,
            "sink_id": self.sink_id,
            "reads": list(self.reads),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Member:
        return cls(d["checkpoint"], d["target"], d["sink_id"], tuple(d.get("reads") or ()))


def _offset_dict(offset: Any) -> dict | None:
    if isinstance(offset, str):
        try:
            offset = json.loads(offset)
        except ValueError:
            return None
    return offset if isinstance(offset, dict) else None


def _is_delta_offset(offset: Any) -> bool:
    d = _offset_dict(offset)
    return d is not None and set(d) == {"version", "index", "snapshot"}


def consumed_version(offset: Any, where: str) -> int:
    """The last upstream version a ``txn-delta`` source has read all of, at a batch whose
    end is ``offset``; refused when the batch ended inside a version (a part cut there
    could not be restored exactly)."""
    d = _offset_dict(offset)
    if d is None or not _is_delta_offset(d):
        raise BackupError(f"{where}: offset {offset!r} is not a txn-delta source offset")
    if d["index"] or d["snapshot"]:
        raise BackupError(
            f"{where}: its batch ended inside version {d['version']} of the upstream table "
            f"(offset {json.dumps(d, sort_keys=True)}: maxFilesPerBatch cut that version); "
            "such a batch cannot be the cut. Take the backup again (the next batch usually "
            "ends on a version boundary) or raise the source's maxFilesPerBatch"
        )
    return int(d["version"]) - 1


def _members(
    queries: Sequence[str], reads: Mapping[str, Sequence[str | None]] | None
) -> list[Member]:
    if isinstance(queries, str) or not queries:
        raise ConfigError("queries: give a non-empty list of checkpoint locations")
    keys = [_fs.location_key(_fs.normalize_uri(q)) for q in queries]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"queries: a checkpoint is listed twice: {list(queries)}")
    reads = dict(reads or {})
    by_key = dict(zip(keys, queries, strict=True))
    for k in reads:
        if _fs.location_key(_fs.normalize_uri(k)) not in by_key:
            raise ConfigError(f"reads: {k!r} is not one of the queries {list(queries)}")
    read_of = {_fs.location_key(_fs.normalize_uri(k)): v for k, v in reads.items()}
    out = []
    for q, k in zip(queries, keys, strict=True):
        handle = admin.open_sink(q)
        handle.require_delta("backups take")
        if handle.target_uri is None:
            raise ConfigError(f"query {q}: its sink has no committed batch yet: nothing to back up")
        got = read_of.get(k)
        if got is not None and (isinstance(got, str) or not isinstance(got, Sequence)):
            raise ConfigError(
                f"reads[{q!r}]: give a list with one entry per source (a table path or None)"
            )
        out.append(
            Member(
                q,
                handle.target_uri,
                handle.sink_id,
                tuple(None if p is None else _fs.normalize_uri(p) for p in (got or ())),
            )
        )
    return out


def _graph(members: list[Member]) -> dict[int, list[tuple[int, int]]]:
    """For each member: (source index, upstream member) of its sources that read a
    member's target. Cycles are refused."""
    targets = {_fs.location_key(m.target): i for i, m in enumerate(members)}
    ups: dict[int, list[tuple[int, int]]] = {}
    for i, m in enumerate(members):
        ups[i] = [
            (s, targets[_fs.location_key(p)])
            for s, p in enumerate(m.reads)
            if p is not None and _fs.location_key(p) in targets
        ]
    order = _downstream_first(ups)
    if order is None:
        raise ConfigError("reads: the queries read each other's tables in a cycle")
    return ups


def _downstream_first(ups: Mapping[int, list[tuple[int, int]]]) -> list[int] | None:
    """Members in reverse topological order (every reader before what it reads)."""
    readers: dict[int, set[int]] = {i: set() for i in ups}
    for i, edges in ups.items():
        for _, u in edges:
            readers[u].add(i)
    order: list[int] = []
    left = set(ups)
    while left:
        ready = sorted(i for i in left if not (readers[i] & left))
        if not ready:
            return None
        order.extend(ready)
        left -= set(ready)
    return order


def _committed(handle: admin.SinkHandle) -> list[tuple[Any, int | None]]:
    """(record, the target version its own commit made, None for none) newest first."""
    state = handle.load()
    target = handle.target()
    out = []
    try:
        for rec in sorted(state.records.values(), key=lambda r: r.snapshot_id, reverse=True):
            version = state.committed.get(rec.snapshot_id)
            if version is None and rec.txns:
                version = target.committed_version(rec)
            out.append((rec, version))
    finally:
        target.close()
    return out


def _check_sources(member: Member, offsets: Sequence[Any]) -> None:
    for s, offset in enumerate(offsets):
        declared = member.reads[s] if s < len(member.reads) else None
        if _is_delta_offset(offset) and declared is None:
            raise ConfigError(
                f"query {member.checkpoint}: source {s} is a txn-delta source; say which table "
                f"it reads with reads={{{member.checkpoint!r}: [...]}} (--reads), so the "
                "backup can cut it consistently with that table's query"
            )


def _boundary_version(offset: Any) -> int | None:
    """The upstream version a txn-delta offset has read all of, None if it ends inside one."""
    d = _offset_dict(offset)
    if d is None or not _is_delta_offset(d) or d["index"] or d["snapshot"]:
        return None
    return int(d["version"]) - 1


def _align_readers(
    members: Any, ups: Any, readers: Any, done: Any, u: Any, cut: Any, pins: Any, offsets_of: Any
) -> None:
    """A fan-out whose readers consumed different versions of member ``u``'s table: pin
    the readers that are ahead at their committed batch that ended exactly at ``cut``
    (the version the slowest reader consumed). Only readers that nothing else constrains
    (no reader of their own, no other upstream, not taken yet) can move."""
    table = members[u].target
    for r, s in readers[u]:
        if _boundary_version(offsets_of[r][s]) == cut:
            continue
        who = members[r].checkpoint
        if readers[r] or len(ups[r]) > 1 or r in done:
            raise BackupError(
                f"query {members[u].checkpoint}: the queries reading its table {table} stand "
                f"at different versions of it; {who} is ahead (it has readers or other "
                "upstream tables of its own, or its part is taken), so it cannot be cut back "
                f"to version {cut}: take the backup again"
            )
        for rec, version in _committed(admin.open_sink(who)):
            offset = rec.source_offsets[s] if s < len(rec.source_offsets) else None
            if version is not None and _boundary_version(offset) == cut:
                pins[r] = (rec.snapshot_id, version)
                offsets_of[r] = rec.source_offsets
                break
        else:
            raise BackupError(
                f"query {who}: it reads {table} ahead of the other readers, and none of its "
                f"kept committed batches ended exactly at version {cut} of it: no exact cut "
                "of this fan-out exists now; take the backup again"
            )


def _plan(
    members: list[Member], ups: Mapping[int, list[tuple[int, int]]], done: Mapping[int, Any]
) -> dict[int, tuple[int, int]]:
    """(snapshot id, table version) to export for each member, downstream first.
    ``done``: parts already registered (a retried take) are kept as they are."""
    readers: dict[int, list[tuple[int, int]]] = {i: [] for i in ups}
    for i, edges in ups.items():
        for s, u in edges:
            readers[u].append((i, s))
    pins: dict[int, tuple[int, int]] = {}
    offsets_of: dict[int, Sequence[Any]] = {}
    order = _downstream_first(ups) or []
    for i in order:
        m = members[i]
        if i in done:
            entry = done[i]
            pins[i] = (entry.of_snapshot_id, entry.target_version)
            offsets_of[i] = entry.details.get("source_offsets") or []
            continue
        records = _committed(admin.open_sink(m.checkpoint))
        needs = {
            consumed_version(
                offsets_of[r][s], f"query {members[r].checkpoint}, source {s} (reads {m.target})"
            )
            for r, s in readers[i]
        }
        if not needs:  # nothing in the backup reads it: its latest committed batch (whose
            # txn-delta offsets end on version boundaries: only such a batch is a cut)
            for rec, version in records:
                if version is not None and all(
                    _boundary_version(
                        rec.source_offsets[s] if s < len(rec.source_offsets) else None
                    )
                    is not None
                    for s, _ in ups[i]
                ):
                    pins[i] = (rec.snapshot_id, version)
                    offsets_of[i] = rec.source_offsets
                    break
            else:
                raise BackupError(
                    f"query {m.checkpoint}: no committed batch to back up yet"
                    + (
                        " whose txn-delta offsets end on a version boundary (maxFilesPerBatch "
                        "splits versions: raise it, or take the backup after the next batch)"
                        if ups[i] and records
                        else ""
                    )
                )
        else:
            if len(needs) > 1:
                _align_readers(members, ups, readers, done, i, min(needs), pins, offsets_of)
            need = min(needs)
            for rec, version in records:
                if version == need:
                    pins[i] = (rec.snapshot_id, version)
                    offsets_of[i] = rec.source_offsets
                    break
            else:
                raise BackupError(
                    f"query {m.checkpoint}: its readers consumed version {need} of {m.target}, "
                    "but no kept committed batch of this query made that version (retention "
                    "summarized it away, or another writer made it): this part cannot be cut "
                    "consistently"
                )
        _check_sources(m, offsets_of[i])
    return pins


# --- take ----------------------------------------------------------------------------


def _events(rows: list[dict[str, Any]], backup_id: int) -> list[dict[str, Any]]:
    return [r for r in rows if r["backup_id"] == backup_id]


def _started(rows: list[dict[str, Any]], backup_id: int) -> dict[str, Any] | None:
    for r in rows:
        if r["backup_id"] == backup_id and r["event"] == "started":
            return r
    return None


def _owner_of(events: list[dict[str, Any]]) -> Mapping[str, Any] | None:
    owners = [r["body"].get("owner") for r in events if r["event"] in ("started", "resumed")]
    return owners[-1] if owners else None


def _part_location(to: str, backup_id: int, index: int) -> str:
    return _fs.join(_fs.normalize_uri(to), str(backup_id), f"part-{index}")


@takes_storage_options
def take(
    backup_id: int | None,
    queries: Sequence[str],
    to: str,
    *,
    reads: Mapping[str, Sequence[str | None]] | None = None,
    spark: SparkSession | None = None,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> BackupStatus:
    """Back up the queries at ``queries`` (checkpoint locations) as one consistent set
    into ``to``, while they run. ``backup_id``: a positive integer above every id taken
    so far in ``to`` (None: the next one). ``reads``: for each query whose sources
    include ``txn-delta``, the table each source reads (one entry per source, None for
    other sources). Returns the backup's status; raises :class:`BackupError` (the
    backup is then failed, its id used) when a part cannot be taken.

    Retrying the id of a backup whose taker died (kill -9) resumes it: parts already
    registered are kept, the others are taken consistently with them.
    """
    if backup_id is not None and (
        isinstance(backup_id, bool) or not isinstance(backup_id, int) or backup_id < 1
    ):
        raise ConfigError(f"backup id {backup_id!r}: must be a positive integer")
    members = _members(queries, reads)
    _graph(members)  # a cycle is refused before an id is taken
    owner = _owner()
    _LIVE.add(owner["token"])
    try:
        backup_id, members = _allocate(to, backup_id, members, owner)
        return _take(to, backup_id, members, _graph(members), spark)
    finally:
        _LIVE.discard(owner["token"])


def _allocate(
    to: str, backup_id: int | None, members: list[Member], owner: Mapping[str, Any]
) -> tuple[int, list[Member]]:
    from deltalake.exceptions import CommitFailedError

    for _ in range(20):
        dt = _open_catalog(to, create=True)
        rows = _rows(dt)
        highest = max((r["backup_id"] for r in rows), default=0)
        chosen = highest + 1 if backup_id is None else backup_id
        if chosen <= highest:
            events = _events(rows, chosen)
            started = _started(rows, chosen)
            ended = {r["event"] for r in events} & {"failed", "deleted", "completed"}
            if started is None or ended:
                raise ConfigError(
                    f"backup id {chosen}: ids must grow and are never reused; the highest so "
                    f"far in {to} is {highest}"
                    + (f" (backup {chosen} is {sorted(ended)[0]})" if ended else "")
                )
            if not _owner_is_dead(_owner_of(events)):
                raise ConfigError(
                    f"backup {chosen} is being taken by another process "
                    f"({_owner_of(events)}); retry it once that process has ended"
                )
            recorded = [Member.from_json(m) for m in started["body"]["members"]]
            if [_fs.location_key(_fs.normalize_uri(m.checkpoint)) for m in recorded] != [
                _fs.location_key(_fs.normalize_uri(m.checkpoint)) for m in members
            ]:
                raise ConfigError(
                    f"backup {chosen} was started with the queries "
                    f"{[m.checkpoint for m in recorded]}; retry it with the same queries"
                )
            event = {"backup_id": chosen, "event": "resumed", "member": None, "at": _now()}
            try:
                _append(dt, [{**event, "body": {"owner": dict(owner)}}], take_id=chosen)
            except CommitFailedError:
                continue
            log.info("backup %d: resumed (its taker had died)", chosen)
            return chosen, recorded
        started_row = {
            "backup_id": chosen,
            "event": "started",
            "member": None,
            "at": _now(),
            "body": {"owner": dict(owner), "members": [m.to_json() for m in members]},
        }
        try:
            _append(dt, [started_row], take_id=chosen)
        except CommitFailedError:
            continue  # another taker committed meanwhile: read again
        return chosen, members
    raise BackupError(f"backup catalog {_catalog_uri(to)}: too many concurrent takers, try again")


def _take(
    to: str, backup_id: int, members: list[Member], ups: Any, spark: SparkSession | None
) -> BackupStatus:
    name = part_name(backup_id)
    done = {}
    for i, m in enumerate(members):
        registry = {n.name: n for n in snapshots.list_snapshots(m.checkpoint)}
        if name in registry:
            done[i] = registry[name]
    dt = _open_catalog(to)
    try:
        pins = _plan(members, ups, done)
    except (BackupError, ConfigError) as e:
        _append(dt, [_event(backup_id, "failed", None, {"reason": str(e)})])
        raise BackupError(f"backup {backup_id} failed: {e}") from e
    for i in _downstream_first(ups) or []:
        if i in done:
            continue
        m = members[i]
        snapshot_id, version = pins[i]
        _append(dt, [_event(backup_id, "member_started", m.checkpoint, {"snapshot": snapshot_id})])
        try:
            snapshots.export(
                m.checkpoint,
                name,
                _part_location(to, backup_id, i),
                snapshot_id,
                spark=spark,
                replace_unfinished=False,
            )
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
            _append(
                dt,
                [
                    _event(backup_id, "member_failed", m.checkpoint, {"reason": reason}),
                    _event(backup_id, "failed", None, {"reason": f"{m.checkpoint}: {reason}"}),
                ],
            )
            raise BackupError(
                f"backup {backup_id}: the part of {m.checkpoint} (version {version} of "
                f"{m.target}) could not be taken: {e}"
            ) from e
        _fault("exit_after_part")
    result = status(backup_id, to)
    if result.state == COMPLETED:
        _append(dt, [_event(backup_id, "completed", None, {})])
    return result


def _fault(point: str) -> None:
    if os.environ.get(FAULT_ENV) == point:
        log.warning("fault injection: %s: exit", point)
        os._exit(86)


def _event(
    backup_id: int, event: str, member: str | None, body: Mapping[str, Any]
) -> dict[str, Any]:
    return {"backup_id": backup_id, "event": event, "member": member, "at": _now(), "body": body}


# --- status, list, show --------------------------------------------------------------


@dataclass(frozen=True)
class MemberStatus:
    checkpoint: str
    state: str
    reason: str | None = None
    location: str | None = None
    batch_id: int | None = None
    target_version: int | None = None
    source_offsets: tuple[Any, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "state": self.state,
            "reason": self.reason,
            "location": self.location,
            "batch_id": self.batch_id,
            "target_version": self.target_version,
            "source_offsets": list(self.source_offsets),
        }


@dataclass(frozen=True)
class BackupStatus:
    backup_id: int
    state: str
    members: tuple[MemberStatus, ...] = field(default_factory=tuple)
    created_at: str | None = None
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "backup_id": self.backup_id,
            "state": self.state,
            "created_at": self.created_at,
            "reason": self.reason,
            "members": [m.to_json() for m in self.members],
        }


def aggregate(states: Sequence[str]) -> str:
    """Seed 001: all completed -> completed; any failed -> failed; some missing ->
    incomplete; otherwise inProgress."""
    if states and all(s == COMPLETED for s in states):
        return COMPLETED
    if any(s == FAILED for s in states):
        return FAILED
    if any(s == DOES_NOT_EXIST for s in states):
        return INCOMPLETE
    return IN_PROGRESS


def _status_from(rows: list[dict[str, Any]], backup_id: int, to: str) -> BackupStatus:
    started = _started(rows, backup_id)
    if started is None:
        known = sorted({r["backup_id"] for r in rows if r["event"] == "started"})
        raise ConfigError(
            f"no backup {backup_id} in {to}; it has: {', '.join(map(str, known)) or 'none'}"
        )
    events = _events(rows, backup_id)
    kinds = {r["event"] for r in events}
    members = [Member.from_json(m) for m in started["body"]["members"]]
    if "deleted" in kinds:
        return BackupStatus(
            backup_id,
            DELETED,
            tuple(MemberStatus(m.checkpoint, DELETED) for m in members),
            started["at"],
        )
    owner_dead = _owner_is_dead(_owner_of(events))
    reasons = {
        r["member"]: r["body"].get("reason") for r in events if r["event"] == "member_failed"
    }
    begun = {r["member"] for r in events if r["event"] == "member_started"}
    name = part_name(backup_id)
    out = []
    for m in members:
        try:
            registry = {n.name: n for n in snapshots.list_snapshots(m.checkpoint)}
        except Exception as e:
            out.append(MemberStatus(m.checkpoint, FAILED, f"its sink cannot be read: {e}"))
            continue
        entry = registry.get(name)
        if entry is not None:
            out.append(
                MemberStatus(
                    m.checkpoint,
                    COMPLETED,
                    location=entry.location,
                    batch_id=entry.batch_id,
                    target_version=entry.target_version,
                    source_offsets=tuple(entry.details.get("source_offsets") or ()),
                )
            )
        elif m.checkpoint in reasons:
            out.append(MemberStatus(m.checkpoint, FAILED, reasons[m.checkpoint]))
        elif m.checkpoint in begun:
            if owner_dead:
                out.append(
                    MemberStatus(
                        m.checkpoint,
                        FAILED,
                        "its taker died before the part was registered (retry the same id "
                        "to finish the backup)",
                    )
                )
            else:
                out.append(MemberStatus(m.checkpoint, IN_PROGRESS))
        else:
            out.append(MemberStatus(m.checkpoint, DOES_NOT_EXIST))
    failed = [r["body"].get("reason") for r in events if r["event"] == "failed"]
    state = aggregate([m.state for m in out])
    if failed and state != COMPLETED:
        state = FAILED
    elif state == IN_PROGRESS and owner_dead:
        state = FAILED
    return BackupStatus(backup_id, state, tuple(out), started["at"], failed[-1] if failed else None)


@takes_storage_options
def status(
    backup_id: int,
    to: str,
    *,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> BackupStatus:
    """Each member's part (doesNotExist | inProgress | completed | failed) and the whole."""
    dt = _open_catalog(to)
    return _status_from(_rows(dt), backup_id, to)


show = status


@takes_storage_options
def list_backups(
    to: str,
    *,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> list[BackupStatus]:
    """Every backup in ``to``, oldest first (deleted ones too: their ids stay used)."""
    dt = _find_catalog(to)
    if dt is None:
        return []
    rows = _rows(dt)
    ids = sorted({r["backup_id"] for r in rows if r["event"] == "started"})
    return [_status_from(rows, i, to) for i in ids]


# --- verify and delete ------------------------------------------------------------------


@dataclass(frozen=True)
class BackupCheck:
    backup_id: int
    checks: tuple[Any, ...]  # snapshots.ExportCheck per member
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "backup_id": self.backup_id,
            "ok": self.ok,
            "members": [c.to_json() for c in self.checks],
            "problems": list(self.problems),
        }


@takes_storage_options
def verify(
    backup_id: int,
    to: str,
    *,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> BackupCheck:
    """Every part's files and checksums (snapshots.verify), and the cut: each downstream
    part consumed exactly the version its upstream part holds."""
    st = status(backup_id, to)
    dt = _open_catalog(to)
    members = [
        Member.from_json(m) for m in (_started(_rows(dt), backup_id) or {})["body"]["members"]
    ]
    problems: list[str] = []
    checks = []
    for m, ms in zip(members, st.members, strict=True):
        if ms.state != COMPLETED:
            problems.append(
                f"{m.checkpoint}: part {ms.state}" + (f" ({ms.reason})" if ms.reason else "")
            )
            continue
        check = snapshots.verify(m.checkpoint, part_name(backup_id))
        checks.append(check)
        problems.extend(f"{m.checkpoint}: {p}" for p in check.problems)
    if not problems:
        for i, edges in _graph(members).items():
            for s, u in edges:
                need = consumed_version(st.members[i].source_offsets[s], members[i].checkpoint)
                if need != st.members[u].target_version:
                    problems.append(
                        f"{members[i].checkpoint}: source {s} consumed version {need} of "
                        f"{members[u].target}, its part holds version "
                        f"{st.members[u].target_version}"
                    )
    return BackupCheck(backup_id, tuple(checks), tuple(problems))


@takes_storage_options
def delete(
    backup_id: int,
    to: str,
    *,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> BackupStatus:
    """Remove every member's part (its registry entry and copy); the id stays used."""
    st = status(backup_id, to)
    if st.state == DELETED:
        return st
    dt = _open_catalog(to)
    rows = _rows(dt)
    events = _events(rows, backup_id)
    ended = {r["event"] for r in events} & {"failed", "completed"}
    if st.state != COMPLETED and not ended and not _owner_is_dead(_owner_of(events)):
        raise ConfigError(f"backup {backup_id} is being taken now; delete it once it has ended")
    for ms in st.members:
        if ms.state == COMPLETED:
            snapshots.delete(ms.checkpoint, part_name(backup_id))
    fs, root = _fs.filesystem(_fs.join(_fs.normalize_uri(to), str(backup_id)))
    if fs.exists(root):  # what dead takers left unregistered
        fs.rm(root, recursive=True)
    _append(dt, [_event(backup_id, "deleted", None, {})])
    return status(backup_id, to)


# --- restore -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Restored:
    """One member restored: start the same query with this checkpoint and sink path, and
    its ``txn-delta`` sources reading ``reads`` (index -> table)."""

    original: str
    checkpoint: str
    path: str
    batch_id: int
    reads: Mapping[int, str]

    def to_json(self) -> dict[str, Any]:
        return {
            "original": self.original,
            "checkpoint": self.checkpoint,
            "path": self.path,
            "batch_id": self.batch_id,
            "reads": {str(k): v for k, v in self.reads.items()},
        }


def _running_queries(spark: SparkSession | None) -> set[str]:
    if spark is None:
        try:
            from pyspark.sql import SparkSession

            spark = SparkSession.getActiveSession()
        except Exception:
            return set()
    if spark is None:
        return set()
    out = set()
    for q in spark.streams.active:
        try:
            out.add(_fs.location_key(_fs.normalize_uri(snapshots.query_checkpoint(q))))
        except Exception:
            continue
    return out


@takes_storage_options
def restore(
    backup_id: int,
    to: str,
    into: str,
    *,
    accept_message_loss: bool = False,
    spark: SparkSession | None = None,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> list[Restored]:
    """Give every member a new table and checkpoint at its part, under ``into``
    (``<into>/part-<i>/checkpoint`` and ``/table``): restarted with these, the queries
    continue from the backup. A downstream checkpoint's offsets are rewritten to the
    restored upstream table's versions. Refused while a member runs in this Spark
    session. Idempotent: a killed restore, run again, finishes the same way."""
    st = status(backup_id, to)
    if st.state != COMPLETED:
        raise ConfigError(f"backup {backup_id} is {st.state}: only a completed backup restores")
    dt = _open_catalog(to)
    members = [
        Member.from_json(m) for m in (_started(_rows(dt), backup_id) or {})["body"]["members"]
    ]
    running = _running_queries(spark)
    for m in members:
        if _fs.location_key(_fs.normalize_uri(m.checkpoint)) in running:
            raise ConfigError(
                f"query {m.checkpoint} is running in this Spark session: stop it before "
                "restoring its backup"
            )
    for m, ms in zip(members, st.members, strict=True):
        for s, offset in enumerate(ms.source_offsets):
            d = _offset_dict(offset)
            if d is not None and set(d) == {"claim", "source"}:
                if not accept_message_loss:
                    raise ConfigError(
                        f"query {m.checkpoint}: source {s} is an acknowledging source "
                        f"({d['source']}, e.g. txn-redis): messages acknowledged after the "
                        "backup are gone from the broker and cannot be read again; pass "
                        "accept_message_loss=True (--accept-message-loss) to restore anyway"
                    )
                raise ConfigError(
                    f"query {m.checkpoint}: restoring a query with an acknowledging source "
                    "(txn-redis) is not supported yet: restart the original query from its "
                    "checkpoint"
                )
    check = verify(backup_id, to)
    if not check.ok:
        raise CorruptSnapshotError(
            f"backup {backup_id} does not verify: " + "; ".join(check.problems[:5])
        )
    into_uri = _fs.normalize_uri(into)
    fs, root = _fs.filesystem(into_uri)
    marker_path = _fs.join(root, RESTORE_MARKER)
    if fs.exists(root) and fs.ls(root, detail=False):
        marker = json.loads(fs.cat(marker_path)) if fs.exists(marker_path) else None
        if (
            not marker
            or marker.get("backup_id") != backup_id
            or marker.get("to") != _fs.normalize_uri(to)
        ):
            raise ConfigError(
                f"into={into!r}: must be a new or empty directory (or an unfinished restore "
                f"of backup {backup_id})"
            )
    else:
        fs.makedirs(root, exist_ok=True)
        with fs.open(marker_path, "w") as f:
            f.write(json.dumps({"backup_id": backup_id, "to": _fs.normalize_uri(to)}))
    graph = _graph(members)
    paths = {i: _fs.join(into_uri, f"part-{i}", "table") for i in range(len(members))}
    out = []
    for i in reversed(_downstream_first(graph) or []):  # upstream first
        m, ms = members[i], st.members[i]
        base = _fs.join(into_uri, f"part-{i}")
        chk, path = _fs.join(base, "checkpoint"), paths[i]
        reads = {s: paths[u] for s, u in graph[i]}
        done_path = _fs.join(root, f"part-{i}", DONE_FILE)
        if fs.exists(done_path):
            out.append(Restored(m.checkpoint, chk, path, int(ms.batch_id or 0), reads))
            continue
        for sub in ("checkpoint", "table"):
            p = _fs.join(root, f"part-{i}", sub)
            if fs.exists(p):
                fs.rm(p, recursive=True)  # an unfinished earlier run of this restore
        prepared = snapshots.prepare_query(m.checkpoint, part_name(backup_id), chk, path)
        if reads:
            _rewrite_offsets(
                chk, prepared.batch_id, {s: _next_version(paths[u]) for s, u in graph[i]}
            )
        with fs.open(done_path, "w") as f:
            f.write(
                json.dumps(Restored(m.checkpoint, chk, path, prepared.batch_id, reads).to_json())
            )
        out.append(Restored(m.checkpoint, chk, path, prepared.batch_id, reads))
        _fault("exit_after_restore_part")
    order = {m.checkpoint: k for k, m in enumerate(members)}
    return sorted(out, key=lambda r: order[r.original])


def _next_version(table: str) -> dict[str, Any]:
    from deltalake import DeltaTable

    version = DeltaTable(table, storage_options=current().for_delta()).version()
    return {"index": 0, "snapshot": False, "version": version + 1}


def _rewrite_offsets(checkpoint: str, batch: int, new: Mapping[int, Mapping[str, Any]]) -> None:
    """Point the restored checkpoint's ``txn-delta`` offsets at the restored upstream
    tables: everything of the part's version is read, the next version comes next."""
    fs, root = _fs.filesystem(_fs.normalize_uri(checkpoint))
    for b in (batch - 1, batch):
        path = _fs.join(root, "offsets", str(b))
        if b < 0 or not fs.exists(path):
            continue
        lines = fs.cat(path).decode().split("\n")
        for s, offset in new.items():
            lines[2 + s] = json.dumps(dict(offset), sort_keys=True)
        with fs.open(path, "w") as f:
            f.write("\n".join(lines))
