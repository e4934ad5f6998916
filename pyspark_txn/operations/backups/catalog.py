"""The backup catalog (a small Delta table ``<to>/_catalog``, one row per event), who
takes or restores a backup (owners, liveness) and the crash-test fault hook."""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from ...errors import ConfigError
from ...storage import current
from ...storage.delta_tables import read_rows
from ..snapshots.registry import backup_part_name

if TYPE_CHECKING:
    import pyarrow as pa
    from deltalake import DeltaTable
from ...storage import fs as _fs

log = logging.getLogger(__name__)


CATALOG = "_catalog"
_APP = "pyspark_txn_backups"
RESTORE_MARKER = ".pyspark-txn-restore.json"
#: Crash tests only: the process ends (``os._exit``, no cleanup, as kill -9) at the point
#: named: ``exit_after_register`` / ``exit_after_part`` (the first part taken: registered,
#: then in the catalog), ``exit_after_restore_part`` (the first member restored),
#: ``restore_after_into_marker``, ``restore_after_mark:<i>``,
#: ``restore_after_checkpoint:<i>``, ``restore_after_member:<i>`` (member ``i``).
FAULT_ENV = "PYSPARK_TXN_BACKUP_FAULT"

# member states (seed 001's words)
DOES_NOT_EXIST = "doesNotExist"
IN_PROGRESS = "inProgress"
COMPLETED = "completed"
FAILED = "failed"
INCOMPLETE = "incomplete"
DELETED = "deleted"
DELETING = "deleting"  # a delete began and has not finished (run it again)
UNKNOWN = "unknown"  # a live sink could not be read now: never taken for failed


#: The largest backup id: the catalog stores ids as int64.
MAX_ID = 2**63 - 1


def check_id(backup_id: object) -> int:
    """A backup id as given: a positive integer the catalog can store."""
    if isinstance(backup_id, bool) or not isinstance(backup_id, int) or backup_id < 1:
        raise ConfigError(f"backup id {backup_id!r}: must be a positive integer")
    if backup_id > MAX_ID:
        raise ConfigError(f"backup id {backup_id}: at most {MAX_ID} (2**63 - 1)")
    return backup_id


part_name = backup_part_name  # the registry's convention (snapshots.registry)


def _catalog_id(dt: DeltaTable) -> str:
    """The catalog's own id: its Delta table id (a uuid written when it was created)."""
    return str(dt.metadata().id).replace("-", "")[:16]


def _is_ours(location: str | None, to: str) -> bool:
    """Whether a registered part's location lies inside this backup location ``to``."""
    if not location:
        return False
    here = _fs.location_key(_fs.normalize_uri(to)).rstrip("/") + "/"
    return _fs.location_key(_fs.normalize_uri(location)).startswith(here)


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
    rows = read_rows(dt)
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


def _backup_dir(to: str, backup_id: int, catalog_id: str) -> str:
    """``<to>/<id>-<catalog id>``: a catalog created again in a wiped ``to`` never writes
    where a part of the old one is still registered."""
    return _fs.join(_fs.normalize_uri(to), f"{backup_id}-{catalog_id}")


def _part_location(to: str, backup_id: int, index: int, catalog_id: str) -> str:
    return _fs.join(_backup_dir(to, backup_id, catalog_id), f"part-{index}")


def _fault(point: str) -> None:
    if os.environ.get(FAULT_ENV) == point:
        log.warning("fault injection: %s: exit", point)
        os._exit(86)


def _event(
    backup_id: int, event: str, member: str | None, body: Mapping[str, Any]
) -> dict[str, Any]:
    return {"backup_id": backup_id, "event": event, "member": member, "at": _now(), "body": body}


# --- status, list, show --------------------------------------------------------------
