"""Taking a backup: allocate its id in the catalog (conditionally), plan the cut, export
one named snapshot per member."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ...errors import BackupError, ConfigError
from ...storage import StorageOptions, takes_storage_options

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
from ...spark.options import check_location
from ...storage import fs as _fs
from .. import snapshots
from ..snapshots.location import _relation
from .catalog import (
    _LIVE,
    COMPLETED,
    MAX_ID,
    _append,
    _catalog_id,
    _catalog_uri,
    _event,
    _events,
    _fault,
    _find_catalog,
    _now,
    _open_catalog,
    _owner,
    _owner_is_dead,
    _owner_of,
    _part_location,
    _rows,
    _started,
    check_id,
    part_name,
)
from .parts import catalog_parts, completed_event, live_part
from .plan import (
    Member,
    _downstream_first,
    _graph,
    _members,
    _plan,
)
from .status import BackupStatus, _status_from, status

log = logging.getLogger(__name__)


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
    if backup_id is not None:
        check_id(backup_id)
    members = _members(queries, reads)  # reads checked against the sources
    _graph(members)  # a cycle is refused before an id is taken
    _check_to(to, members)
    owner = _owner()
    _LIVE.add(owner["token"])
    try:
        backup_id, members = _allocate(to, backup_id, members, owner)
        return _take(to, backup_id, members, _graph(members), spark)
    finally:
        _LIVE.discard(owner["token"])


#: The export's advice for a version VACUUM removed, and what a backup user does instead.
_EXPORT_ADVICE = (
    "Export a newer snapshot, and keep VACUUM's retention longer than the exports you may "
    "still want"
)
_BACKUP_ADVICE = (
    "Take a new backup (a new id) once the queries reading this table have caught up: "
    "its part is cut at the version they consumed, so a lagging reader pins an old one; "
    "and keep VACUUM's retention longer than the time a take needs"
)


def _backup_advice(message: str) -> str:
    return message.replace(_EXPORT_ADVICE, _BACKUP_ADVICE)


def _check_to(to: str, members: Sequence[Member]) -> None:
    """``to`` may not be, lie inside or contain a member's target, checkpoint or record
    table (a part there would be copied into the pipeline it backs up, and removed with
    it): refused before the catalog is created or an id used."""
    if not isinstance(to, str) or not to.strip():
        raise ConfigError("to: must name a directory")
    check_location("to", to)
    uri = _fs.normalize_uri(to)
    if _fs.is_local(uri) and os.path.exists(uri) and not os.path.isdir(uri):
        raise ConfigError(f"to={to!r}: is a file; backups need a directory")
    for m in members:
        for what, where in (
            ("the target of", m.target),
            ("the checkpoint of", m.checkpoint),
            ("the record table of", m.record_table),
        ):
            if where is None:
                continue
            how = _relation(uri, _fs.normalize_uri(where))
            if how is not None:
                raise ConfigError(
                    f"to={to!r}: {how} {what} query {m.checkpoint} ({where}); backups need a "
                    "location outside and not around the pipeline's tables and checkpoints"
                )


def _refuse_copied_location(to: str, rows: list[dict[str, Any]], catalog_id: str) -> None:
    """A backup location copied whole (``cp -a``, a bucket sync) has its original's
    catalog, id and all: it restores, but a take into it would name its parts as the
    original's do (``backup-<id>-<catalog id>``) and spoil that id there. Refused while
    the original is still there with the same catalog; a location moved (the original
    gone) takes backups on."""
    origin = next(
        (r["body"].get("location") for r in reversed(rows) if r["event"] == "started"), None
    )
    here = _fs.normalize_uri(to)
    if not origin or _fs.location_key(origin) == _fs.location_key(here):
        return
    try:
        other = _find_catalog(origin)
    except Exception as e:  # noqa: BLE001 - another store, other credentials: cannot tell
        log.warning("backups in %s: the location it was copied from cannot be read: %r", to, e)
        return
    if other is not None and _catalog_id(other) == catalog_id:
        raise ConfigError(
            f"to={to!r}: this backup location is a copy of {origin} (the same catalog, id "
            f"{catalog_id}): its backups restore, but new backups go to one of the two only. "
            f"Take them into {origin}, or into a new location"
        )


def _allocate(
    to: str, backup_id: int | None, members: list[Member], owner: Mapping[str, Any]
) -> tuple[int, list[Member]]:
    from deltalake.exceptions import CommitFailedError

    for _ in range(20):
        dt = _open_catalog(to, create=True)
        rows = _rows(dt)
        _refuse_copied_location(to, rows, _catalog_id(dt))
        highest = max((r["backup_id"] for r in rows), default=0)
        if backup_id is None and highest >= MAX_ID:
            raise ConfigError(
                f"backups in {to}: no backup id is left (the highest so far is {highest}, "
                "the largest id there is); take backups in a new location"
            )
        chosen = highest + 1 if backup_id is None else backup_id
        if chosen <= highest:
            events = _events(rows, chosen)
            started = _started(rows, chosen)
            ended = {r["event"] for r in events} & {
                "failed",
                "deleted",
                "delete_started",
                "completed",
            }
            if started is not None and ended == {"completed"}:
                # what status says of it now (its parts may be gone since)
                now = _status_from(rows, chosen, to, _catalog_id(dt)).state
                raise ConfigError(
                    f"backup id {chosen}: ids must grow and are never reused; the highest so "
                    f"far in {to} is {highest} (backup {chosen} is {now})"
                )
            if started is None or ended:
                # the last word on it: deleted over failed over completed
                last = next(
                    (
                        word
                        for e, word in (
                            ("deleted", "deleted"),
                            ("delete_started", "being deleted"),
                            ("failed", "failed"),
                            ("completed", "completed"),
                        )
                        if e in ended
                    ),
                    None,
                )
                raise ConfigError(
                    f"backup id {chosen}: ids must grow and are never reused; the highest so "
                    f"far in {to} is {highest}" + (f" (backup {chosen} is {last})" if last else "")
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
            "body": {
                "owner": dict(owner),
                "members": [m.to_json() for m in members],
                "location": _fs.normalize_uri(to),
            },
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
    dt = _open_catalog(to)
    catalog_id = _catalog_id(dt)
    name = part_name(backup_id, catalog_id)
    recorded = catalog_parts(_events(_rows(dt), backup_id))
    done = {}
    for i, m in enumerate(members):
        entry = recorded.get(m.checkpoint)
        if entry is None:  # registered by a taker that died before the catalog heard of it
            live = live_part(m, name, to)
            if live.unreadable is not None:
                raise BackupError(
                    f"backup {backup_id}: the sink of {m.checkpoint} cannot be read now "
                    f"({live.unreadable}); take the same id again to resume"
                )
            entry = live.entry
            if entry is not None:
                _append(dt, [completed_event(backup_id, m, entry)])
        if entry is not None:
            done[i] = entry
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
            entry = snapshots.export(
                m.checkpoint,
                name,
                _part_location(to, backup_id, i, catalog_id),
                snapshot_id,
                # a stateful query's state is not taken: a restore starts it anew over
                # its restored table (restore: fresh), so a backup needs no SparkSession
                state="skip",
                replace_unfinished=False,
            )
        except Exception as e:
            reason = f"{type(e).__name__}: {_backup_advice(str(e))}"
            _append(
                dt,
                [
                    _event(backup_id, "member_failed", m.checkpoint, {"reason": reason}),
                    _event(backup_id, "failed", None, {"reason": f"{m.checkpoint}: {reason}"}),
                ],
            )
            raise BackupError(
                f"backup {backup_id}: the part of {m.checkpoint} (version {version} of "
                f"{m.target}) could not be taken: {_backup_advice(str(e))}"
            ) from e
        _fault("exit_after_register")
        # the part's whole entry in the backup location: restorable without the sink
        _append(dt, [completed_event(backup_id, m, entry)])
        _fault("exit_after_part")
    result = status(backup_id, to)
    if result.state == COMPLETED:
        _append(dt, [_event(backup_id, "completed", None, {})])
    return result
