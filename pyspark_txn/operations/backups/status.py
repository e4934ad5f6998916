"""A backup's status, the list of backups, verify (each part and the cut between them) and
delete."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import ConfigError
from ...storage import StorageOptions, takes_storage_options

if TYPE_CHECKING:
    pass
from ...storage import fs as _fs
from .. import snapshots
from .catalog import (
    COMPLETED,
    DELETED,
    DOES_NOT_EXIST,
    FAILED,
    IN_PROGRESS,
    INCOMPLETE,
    _append,
    _backup_dir,
    _catalog_id,
    _event,
    _events,
    _find_catalog,
    _is_ours,
    _open_catalog,
    _owner_is_dead,
    _owner_of,
    _rows,
    _started,
    check_id,
    part_name,
)
from .plan import (
    Member,
    _graph,
    consumed_version,
)


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


def _status_from(
    rows: list[dict[str, Any]], backup_id: int, to: str, catalog_id: str
) -> BackupStatus:
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
    name = part_name(backup_id, catalog_id)
    out = []
    for m in members:
        try:
            registry = {n.name: n for n in snapshots.list_snapshots(m.checkpoint)}
        except Exception as e:
            out.append(MemberStatus(m.checkpoint, FAILED, f"its sink cannot be read: {e}"))
            continue
        entry = registry.get(name)
        if entry is not None and _is_ours(entry.location, to):
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
    check_id(backup_id)
    dt = _open_catalog(to)
    return _status_from(_rows(dt), backup_id, to, _catalog_id(dt))


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
    return [_status_from(rows, i, to, _catalog_id(dt)) for i in ids]


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
        check = snapshots.verify(m.checkpoint, part_name(backup_id, _catalog_id(dt)))
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
            snapshots.delete(ms.checkpoint, part_name(backup_id, _catalog_id(dt)))
    fs, root = _fs.filesystem(_backup_dir(to, backup_id, _catalog_id(dt)))
    if fs.exists(root):  # what dead takers left unregistered
        fs.rm(root, recursive=True)
    _append(dt, [_event(backup_id, "deleted", None, {})])
    return status(backup_id, to)
