"""The registry of named snapshots, read from a sink's record table: list the names
and pending requests, show one entry."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from ...errors import ConfigError
from ...state.core import (
    ExportRequest,
    NamedSnapshot,
)
from ...storage import fs as _fs
from ...storage.options import StorageOptions, takes_storage_options
from ..handle import CHUNK_BYTES, SinkHandle, open_sink

#: Written first into an export's folder: whose export it is and which process
#: writes it. A folder with this file and no registry entry is an unfinished
#: export: the next export there removes it once its writer is provably dead.
EXPORT_MARKER = ".pyspark-txn-export.json"
CHUNK_BYTES = CHUNK_BYTES

Progress = Callable[[int, int], None]


def backup_part_name(backup_id: int, catalog_id: str) -> str:
    """The name of a backup's part in each member's snapshot registry. It carries the
    catalog's id (a backup location's own id): a take of the same id into another location
    (or into a location wiped and created again) must never find another catalog's part."""
    return f"backup-{backup_id}-{catalog_id}"


_BACKUP_PART = re.compile(r"backup-([0-9]+)-([0-9a-f]{16})")


def backup_of_part(name: str, location: str) -> tuple[int, str] | None:
    """(backup id, backup location) when ``name`` at ``location`` is a backup's part: its
    name says so and it lies at ``<to>/<id>-<catalog id>/part-<i>`` beside ``<to>/_catalog``."""
    found = _BACKUP_PART.fullmatch(name)
    if found is None:
        return None
    backup_id, catalog_id = int(found.group(1)), found.group(2)
    parts = location.rstrip("/").rsplit("/", 2)
    if len(parts) != 3 or parts[1] != f"{backup_id}-{catalog_id}":
        return None
    fs, root = _fs.filesystem(parts[0])
    if not fs.exists(_fs.join(root, "_catalog", "_delta_log", f"{0:020d}.json")):
        return None
    return backup_id, parts[0]


def _open(location: str, sink: str | None, command: str) -> SinkHandle:
    """The sink, refused by name unless it writes to a Delta table: a named snapshot is
    a copy of a Delta table's files."""
    handle = open_sink(location, sink)
    handle.require_delta(command)
    return handle


def _registry(handle: SinkHandle) -> Mapping[str, NamedSnapshot]:
    return handle.load().named


@takes_storage_options
def list_snapshots(
    location: str,
    sink: str | None = None,
    *,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> list[NamedSnapshot]:
    """Every named snapshot of the sink, oldest first."""
    handle = _open(location, sink, "snapshots list")
    return sorted(_registry(handle).values(), key=lambda n: n.snapshot_id)


@takes_storage_options
def list_requests(
    location: str,
    sink: str | None = None,
    *,
    command: str = "snapshots list",
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> list[ExportRequest]:
    """Every export requested for the sink's next commit and not served yet, oldest first."""
    handle = _open(location, sink, command)
    return sorted(handle.load().export_requests.values(), key=lambda r: r.requested_seq)


@takes_storage_options
def show(
    location: str,
    name: str,
    sink: str | None = None,
    *,
    command: str = "snapshots show",
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> NamedSnapshot:
    handle = _open(location, sink, command)
    state = handle.load()
    named = state.named
    if name not in named:
        if name in state.export_requests:
            request = state.export_requests[name]
            raise ConfigError(
                f"sink {handle.sink_id!r}: {name!r} is not exported yet: it is requested for "
                f"the next commit (to {request.location}); wait for it, or cancel it with "
                "cancel_request / `pyspark-txn snapshots cancel`"
            )
        raise ConfigError(
            f"sink {handle.sink_id!r} has no snapshot named {name!r}; it has: "
            f"{', '.join(sorted(named)) or 'none'}"
            + (
                f" (requested, not exported yet: {', '.join(sorted(state.export_requests))})"
                if state.export_requests
                else ""
            )
        )
    return named[name]
