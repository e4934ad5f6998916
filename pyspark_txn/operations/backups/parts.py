"""What a backup knows of each member's part, from the backup location alone.

A backup exists for the day its pipeline is lost: its checkpoints, record tables and
targets gone, moved, or replaced by restored ones. So a part is known from what lies
under ``to``, in this order:

1. the catalog's ``member_completed`` event, written by the taker right after it
   registered the part: the whole registry entry (files, sizes, CRC32s, offsets);
2. for a backup taken before that event existed and completed: the part's own
   ``manifest`` table (batch, table version, offsets, counts, the data checksum), the
   files listed from its ``data`` table (verify re-derives their CRC32s and checks them
   against the manifest's checksum);
3. only for a backup still being taken (or whose taker died): the member's live
   registry, where a part is registered before the catalog hears of it.

The live sinks are never asked about a completed backup: nothing that happens to the
pipeline after a backup can change what the backup holds."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError
from ...state.core import NamedSnapshot
from ...storage import fs as _fs
from ...storage.delta_tables import read_rows
from .. import snapshots
from .catalog import _is_ours
from .plan import Member

log = logging.getLogger(__name__)

#: The catalog event that carries a registered part's registry entry.
MEMBER_COMPLETED = "member_completed"


def catalog_parts(events: list[dict[str, Any]]) -> dict[str, NamedSnapshot]:
    """Member checkpoint -> its part's entry, from the catalog's ``member_completed``."""
    return {
        r["member"]: NamedSnapshot.from_json(r["body"]["part"])
        for r in events
        if r["event"] == MEMBER_COMPLETED
    }


def completed_event(backup_id: int, member: Member, entry: NamedSnapshot) -> dict[str, Any]:
    from .catalog import _event

    return _event(backup_id, MEMBER_COMPLETED, member.checkpoint, {"part": entry.to_json()})


def part_is_present(location: str) -> bool:
    """Whether the part's data table is still there (its first commit: one request)."""
    fs, root = _fs.filesystem(location)
    return bool(fs.exists(_fs.join(root, "data", "_delta_log", f"{0:020d}.json")))


def part_from_manifest(location: str, name: str, member: Member) -> NamedSnapshot | None:
    """A completed legacy backup's part, read back from its manifest table (None if there
    is none): what the registry entry said, but for the per-file sizes and CRC32s, which
    verify re-derives from the data table and checks against the manifest's checksum."""
    from deltalake.exceptions import TableNotFoundError

    try:
        rows = read_rows(_fs.join(location, "manifest"))
    except TableNotFoundError:
        return None
    if not rows:
        return None
    rows.sort(key=lambda r: r["source_index"])
    first = rows[0]
    offsets = [json.loads(r["source_offset"]) for r in rows]
    if offsets == [None]:
        offsets = []  # the export writes one row for a query without sources
    state_tables = json.loads(first.get("state_tables") or "[]")
    created = first.get("created_at")
    return NamedSnapshot(
        name=name,
        snapshot_id=first["snapshot_id"],
        of_snapshot_id=first["of_snapshot_id"],
        batch_id=first["batch_id"],
        location=location,
        target_version=first["table_version"],
        details={
            "rows": first["rows"],
            "bytes": first["bytes"],
            "file_count": first["files"],
            "data_checksum": first["data_checksum"],
            "source_offsets": offsets,
            "query_id": first["query_id"],
            "target_uri": member.target,
            "checkpoint": member.checkpoint,
            "stateful": bool(state_tables),
            "state_tables": state_tables,
        },
        created_at=created,
    )


@dataclass(frozen=True)
class LivePart:
    """What a member's live registry says of a part: its entry (None: not registered), or
    why the registry could not be read (``unreadable``: retry, never a verdict)."""

    entry: NamedSnapshot | None = None
    unreadable: str | None = None


def live_part(member: Member, name: str, to: str) -> LivePart:
    """The part ``name`` in the member's registry, if it is this location's.

    A sink that is not there (no record table: lost, moved, or never this kind) holds no
    part: a determinate answer. Any other failure (a store error, a timeout) is
    ``unreadable``: the caller must not take it for "not registered"."""
    try:
        registry = snapshots.list_snapshots(member.checkpoint)
    except ConfigError as e:
        log.info("backup member %s: no registry to read (%s)", member.checkpoint, e)
        return LivePart()
    except Exception as e:  # noqa: BLE001 - reported as unknown, never as an answer
        return LivePart(unreadable=f"{type(e).__name__}: {e}")
    for entry in registry:
        if entry.name == name and _is_ours(entry.location, to):
            return LivePart(entry)
    return LivePart()
