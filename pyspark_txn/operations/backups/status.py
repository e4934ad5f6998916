"""A backup's status, the list of backups, verify (each part and the cut between them) and
delete."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ...errors import BackupError, ConfigError
from ...state.core import NamedSnapshot
from ...storage import StorageOptions, takes_storage_options
from ...storage import fs as _fs
from .. import snapshots
from .catalog import (
    COMPLETED,
    DELETED,
    DELETING,
    DOES_NOT_EXIST,
    FAILED,
    IN_PROGRESS,
    INCOMPLETE,
    UNKNOWN,
    _append,
    _backup_dir,
    _catalog_id,
    _event,
    _events,
    _open_catalog,
    _owner_is_dead,
    _owner_of,
    _part_location,
    _rows,
    _started,
    check_id,
    part_name,
)
from .parts import catalog_parts, live_part, part_from_manifest, part_is_present
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
    part: NamedSnapshot | None = field(default=None, repr=False, compare=False)

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
    incomplete; otherwise inProgress. A part whose sink could not be read now is
    ``unknown`` (never failed: asking again may find it), and so is the whole then."""
    if states and all(s == COMPLETED for s in states):
        return COMPLETED
    if any(s == FAILED for s in states):
        return FAILED
    if any(s == UNKNOWN for s in states):
        return UNKNOWN
    if any(s == DOES_NOT_EXIST for s in states):
        return INCOMPLETE
    return IN_PROGRESS


def _status_from(
    rows: list[dict[str, Any]], backup_id: int, to: str, catalog_id: str
) -> BackupStatus:
    """The backup's status from its catalog rows (module parts: where each part is known
    from; the live sinks only for a backup not completed)."""
    started = _started(rows, backup_id)
    if started is None:
        known = sorted({r["backup_id"] for r in rows if r["event"] == "started"})
        raise ConfigError(
            f"no backup {backup_id} in {to}; it has: {', '.join(map(str, known)) or 'none'}"
        )
    events = _events(rows, backup_id)
    kinds = {r["event"] for r in events}
    members = [Member.from_json(m) for m in started["body"]["members"]]
    if "deleted" in kinds or "delete_started" in kinds:
        state = DELETED if "deleted" in kinds else DELETING
        return BackupStatus(
            backup_id,
            state,
            tuple(MemberStatus(m.checkpoint, state) for m in members),
            started["at"],
            None if state == DELETED else "a delete began and has not finished: run it again",
        )
    owner_dead = _owner_is_dead(_owner_of(events))
    reasons = {
        r["member"]: r["body"].get("reason") for r in events if r["event"] == "member_failed"
    }
    begun = {r["member"] for r in events if r["event"] == "member_started"}
    recorded = catalog_parts(events)
    completed = "completed" in kinds
    name = part_name(backup_id, catalog_id)
    out = []
    for i, m in enumerate(members):
        # a part lies at part-<i> of this backup in ``to``, wherever ``to`` was when it was
        # taken: a backup location moved or copied whole still finds its parts
        here = _part_location(to, backup_id, i, catalog_id)
        entry = recorded.get(m.checkpoint)
        if entry is not None:
            entry = replace(entry, location=here)
        elif completed:  # taken before parts were kept in the catalog
            entry = part_from_manifest(here, name, m)
            if entry is None:
                out.append(MemberStatus(m.checkpoint, FAILED, _GONE))
                continue
        if entry is None:  # still being taken, or its taker died: the live registry
            live = live_part(m, name, to)
            if live.unreadable is not None:
                out.append(
                    MemberStatus(
                        m.checkpoint,
                        UNKNOWN,
                        f"its sink cannot be read now ({live.unreadable}); ask again",
                    )
                )
                continue
            entry = live.entry
        if entry is not None:
            present = part_is_present(entry.location)
            out.append(
                MemberStatus(
                    m.checkpoint,
                    COMPLETED if present else FAILED,
                    None if present else _GONE,
                    location=entry.location,
                    batch_id=entry.batch_id,
                    target_version=entry.target_version,
                    source_offsets=tuple(entry.details.get("source_offsets") or ()),
                    part=entry,
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
    if failed and state not in (COMPLETED, UNKNOWN):
        state = FAILED
    elif state == IN_PROGRESS and owner_dead:
        state = FAILED
    return BackupStatus(backup_id, state, tuple(out), started["at"], failed[-1] if failed else None)


#: A completed part whose files are gone from the backup location.
_GONE = (
    "its part's files are gone from the backup location (deleted with `snapshots delete "
    "--force`, or removed by hand): this backup cannot be restored"
)


def _catalog(to: str) -> tuple[Any, list[dict[str, Any]], str]:
    """The catalog, its rows, its id."""
    dt = _open_catalog(to)
    return dt, _rows(dt), _catalog_id(dt)


@takes_storage_options
def status(
    backup_id: int,
    to: str,
    *,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> BackupStatus:
    """Each member's part (doesNotExist | inProgress | completed | failed | unknown) and
    the whole. A completed backup is read from ``to`` alone (module :mod:`.parts`)."""
    check_id(backup_id)
    _, rows, catalog_id = _catalog(to)
    return _status_from(rows, backup_id, to, catalog_id)


show = status


@takes_storage_options
def list_backups(
    to: str,
    *,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> list[BackupStatus]:
    """Every backup in ``to``, oldest first (deleted ones too: their ids stay used).
    A location without a catalog is refused as ``status`` refuses it: a typo in ``to``
    must not read as "no backups"."""
    _, rows, catalog_id = _catalog(to)
    ids = sorted({r["backup_id"] for r in rows if r["event"] == "started"})
    return [_status_from(rows, i, to, catalog_id) for i in ids]


# --- verify and delete ------------------------------------------------------------------


@dataclass(frozen=True)
class BackupCheck:
    backup_id: int
    checks: tuple[Any, ...]  # snapshots.ExportCheck per member with a part
    problems: tuple[str, ...]
    members: tuple[str, ...] = ()  # the checkpoint of each check, in order

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "backup_id": self.backup_id,
            "ok": self.ok,
            "members": [
                {"checkpoint": m, **c.to_json()}
                for m, c in zip(self.members, self.checks, strict=True)
            ],
            "problems": list(self.problems),
        }


@takes_storage_options
def verify(
    backup_id: int,
    to: str,
    *,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> BackupCheck:
    """Every part's files and checksums (as ``snapshots verify`` checks an export), and
    the cut: each downstream part consumed exactly the version its upstream part holds.
    Reads the backup location only (the parts' entries are in the catalog)."""
    check_id(backup_id)
    _, rows, catalog_id = _catalog(to)
    st = _status_from(rows, backup_id, to, catalog_id)
    members = [Member.from_json(m) for m in (_started(rows, backup_id) or {})["body"]["members"]]
    problems: list[str] = []
    checks = []
    checked = []
    for m, ms in zip(members, st.members, strict=True):
        if ms.state != COMPLETED or ms.part is None:
            problems.append(
                f"{m.checkpoint}: part {ms.state}" + (f" ({ms.reason})" if ms.reason else "")
            )
            continue
        check = snapshots.verify_entry(ms.part, m.sink_id)
        checks.append(check)
        checked.append(m.checkpoint)
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
    return BackupCheck(backup_id, tuple(checks), tuple(problems), tuple(checked))


@takes_storage_options
def delete(
    backup_id: int,
    to: str,
    *,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> BackupStatus:
    """Remove every member's part (its files, then its registry entry where the member's
    sink still holds it); the id stays used.

    The delete is announced first (``delete_started``, a conditional commit on the catalog
    version whose status allowed it: a taker resuming meanwhile makes it read again), so
    a delete that fails half way shows as ``deleting`` and running it again finishes it.
    A member whose sink cannot be read now stops the delete before any of its files go:
    a part still registered is never left without its files."""
    from deltalake.exceptions import CommitFailedError

    check_id(backup_id)
    for _ in range(20):
        dt, rows, catalog_id = _catalog(to)
        st = _status_from(rows, backup_id, to, catalog_id)
        if st.state == DELETED:
            return st
        if st.state != DELETING:
            events = _events(rows, backup_id)
            ended = {r["event"] for r in events} & {"failed", "completed"}
            if st.state != COMPLETED and not ended and not _owner_is_dead(_owner_of(events)):
                raise ConfigError(
                    f"backup {backup_id} is being taken now; delete it once it has ended"
                )
            try:
                _append(dt, [_event(backup_id, "delete_started", None, {})], take_id=backup_id)
            except CommitFailedError:
                continue  # the catalog moved (a resumed take?): decide again
        break
    else:
        raise BackupError(f"backup {backup_id} in {to}: the catalog kept changing; try again")
    members = [Member.from_json(m) for m in (_started(rows, backup_id) or {})["body"]["members"]]
    name = part_name(backup_id, catalog_id)
    for i, m in enumerate(members):
        live = live_part(m, name, to)
        if live.unreadable is not None:
            raise BackupError(
                f"backup {backup_id}: the sink of {m.checkpoint} cannot be read now "
                f"({live.unreadable}), so whether it still registers its part is unknown: "
                "nothing of that part was deleted. Run the delete again"
            )
        if live.entry is not None:  # files first, then the name (a rerun finishes both)
            snapshots.delete(m.checkpoint, name, force=True)
        fs, root = _fs.filesystem(_part_location(to, backup_id, i, catalog_id))
        _fs.remove_tree(fs, root)
    fs, root = _fs.filesystem(_backup_dir(to, backup_id, catalog_id))
    _fs.remove_tree(fs, root)  # what dead takers left unregistered
    _append(_open_catalog(to), [_event(backup_id, "deleted", None, {})])
    return status(backup_id, to)
