"""Where an export goes: its marker (who writes it, and whether that writer is provably
dead), the checks on ``to=`` (not inside the sink's own folders), and removing an
unfinished copy."""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from ...errors import ConfigError
from ...spark.options import check_location
from ...state import SinkState
from ...state.core import (
    check_snapshot_name,
)
from ...storage import fs as _fs
from ...storage.checkpoint import SINK_FILE
from ..handle import SinkHandle
from .registry import EXPORT_MARKER, _registry

log = logging.getLogger(__name__)


#: ``state=`` of :func:`export`: whether the state of a stateful query is exported.
STATE_CHOICES = ("auto", "include", "skip")


def _read_marker(fs: Any, root: str) -> dict[str, Any] | None:
    try:
        text = _fs.read_text(fs, _fs.join(root, EXPORT_MARKER))
    except FileNotFoundError:
        return None
    try:
        marker = json.loads(text)
    except ValueError:
        return {"unreadable": text[:200]}
    return marker if isinstance(marker, dict) else {"unreadable": text[:200]}


#: Tokens of the exports this process is running now (a marker with our pid and
#: a token not in here is one of ours that failed and could not clean up).
_LIVE_TOKENS: set[str] = set()


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (Linux: clock ticks since boot), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


def _owner() -> dict[str, Any]:
    """Who writes an export marker: enough to tell later whether that process is dead."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_start": _process_start(os.getpid()),
        "token": uuid.uuid4().hex,
        "at": datetime.now(timezone.utc).isoformat(),
    }


def _describe_owner(owner: Mapping[str, Any] | None) -> str:
    if not owner:
        return "an unknown process (the marker does not say who wrote it)"
    return f"pid {owner.get('pid')} on host {owner.get('host')!r}, started {owner.get('at')}"


def _owner_is_dead(owner: Mapping[str, Any] | None) -> bool:
    """True only when the marker's writer provably no longer runs: same host, and its
    pid is gone or now belongs to another process. Anything else might still be alive."""
    if not owner or owner.get("host") != socket.gethostname():
        return False
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():
        same = owner.get("process_start") == _process_start(pid)
        return not same or owner.get("token") not in _LIVE_TOKENS
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it runs, as another user
        pass
    start = owner.get("process_start")
    now = _process_start(pid)
    return start is not None and now is not None and start != now


def _inspect_location(
    fs: Any, root: str, handle: SinkHandle, uri: str, replace_unfinished: bool = False
) -> dict[str, Any] | None:
    """Check that ``root`` may take an export, writing nothing.

    New or empty: None. The partial copy of an export of this sink that never
    registered, whose writer is provably dead (or ``replace_unfinished``): its
    marker (the caller removes it). Anything else is refused.
    """
    if not fs.exists(root):
        return None
    if not fs.isdir(root):
        raise ConfigError(f"--to {uri}: is a file; choose a new or empty directory")
    entries = fs.ls(root, detail=False)
    if not entries:
        return None
    marker = _read_marker(fs, root)
    named = _registry(handle)
    if marker is None or marker.get("sink_id") != handle.sink_id:
        raise ConfigError(
            f"--to {uri}: is not empty and holds no unfinished export of sink "
            f"{handle.sink_id!r}; choose a new or empty directory"
        )
    owner = [n.name for n in named.values() if n.snapshot_id == marker.get("snapshot_id")]
    if owner:
        raise ConfigError(f"--to {uri}: holds the named snapshot {owner[0]!r}; delete it first")
    if replace_unfinished or _owner_is_dead(marker.get("owner")):
        return marker
    raise ConfigError(
        f"--to {uri}: holds an unfinished export {marker.get('name')!r} (snapshot id "
        f"{marker.get('snapshot_id')}) of sink {handle.sink_id!r} by "
        f"{_describe_owner(marker.get('owner'))}, which may still be running; it is left "
        "alone. If you know that export is dead, pass --replace-unfinished "
        "(replace_unfinished=True) to remove its partial copy and export there"
    )


def _prepare_location(
    fs: Any, root: str, handle: SinkHandle, uri: str, replace_unfinished: bool = False
) -> None:
    """``root`` must be new or empty, or a dead export's partial copy (then it is wiped)."""
    marker = _inspect_location(fs, root, handle, uri, replace_unfinished)
    if marker is not None:
        log.warning(
            "export to %s: removing the partial copy of export %r (snapshot id %s) by %s, "
            "which never finished",
            uri,
            marker.get("name"),
            marker.get("snapshot_id"),
            _describe_owner(marker.get("owner")),
        )
        _remove_export(fs, root, uri)
        _withdraw_dead_export(handle, marker)


def _withdraw_dead_export(handle: SinkHandle, marker: Mapping[str, Any]) -> None:
    """Withdraw the snapshot id of the dead export whose partial copy was just removed,
    if it is still open (allocated, never registered nor withdrawn): the export that
    replaces it allocates its own, so status must not keep showing the old one."""
    from ...state import fold_sink
    from ...state.core import abandon

    sid = marker.get("snapshot_id")
    if not isinstance(sid, int):
        return

    def withdraw(s: SinkState) -> Any:
        if (
            sid not in s.allocations
            or sid in s.abandoned
            or sid in s.committed
            or s.record_for_snapshot(sid) is not None
            or any(n.snapshot_id == sid for n in s.named.values())
        ):
            return None
        return abandon(s, sid, f"export {marker.get('name')!r}: its exporter died; replaced")

    try:
        handle.record_store().update(handle.sink_id, fold_sink, withdraw)
    except Exception as e:  # noqa: BLE001 - status still shows it, with its remedy
        log.warning("could not withdraw the dead export's snapshot id %s: %r", sid, e)


def _check_name_free(state: SinkState, name: str, serving: bool = False) -> None:
    check_snapshot_name(name)
    if name in state.named:
        raise ConfigError(
            f"sink {state.sink_id!r} already has a snapshot named {name!r}; delete it "
            "first or choose another name"
        )
    if name in state.export_requests and not serving:
        raise ConfigError(
            f"sink {state.sink_id!r}: an export named {name!r} is requested for the next "
            "commit; wait for it (wait_for_export), cancel it (cancel_request, `pyspark-txn "
            "snapshots cancel`) or choose another name"
        )


def _relation(a: str, b: str) -> str | None:
    """How location ``a`` relates to ``b``: "is", "is inside", "contains" or None."""
    ra, rb = _fs.location_key(a), _fs.location_key(b)
    if ra == rb:
        return "is"
    if ra.startswith(rb.rstrip("/") + "/"):
        return "is inside"
    if rb.startswith(ra.rstrip("/") + "/"):
        return "contains"
    return None


def _check_to(
    handle: SinkHandle,
    to: str,
    state: SinkState | None = None,
    *,
    serving: str | None = None,
) -> str:
    """``to`` as a URI; refused when it is, is inside or contains the sink's target,
    checkpoint or record table, a registered snapshot's location or a requested
    export's (``serving``: the request being served, whose own location is fine)."""
    if handle.target_uri is None:
        raise ConfigError(f"sink {handle.sink_id!r} has no target yet: nothing to export")
    if not isinstance(to, str) or not to.strip():
        raise ConfigError("--to: must name a directory")
    check_location("--to", to)
    uri = _fs.normalize_uri(to)
    state = handle.load() if state is None else state
    places = [
        ("the sink's target", handle.target_uri),
        ("the query's checkpoint", handle.checkpoint),
        ("the sink's record table", handle.record_table),
    ]
    places += [
        (f"the location of snapshot {n.name!r}", n.location)
        for n in sorted(state.named.values(), key=lambda n: n.name)
    ]
    places += [
        (f"the location requested for export {r.name!r}", r.location)
        for r in sorted(state.export_requests.values(), key=lambda r: r.name)
        if r.name != serving
    ]
    for what, where in places:
        if where is None:
            continue
        how = _relation(uri, where)
        if how is not None:
            raise ConfigError(
                f"--to {to}: {how} {what} ({where}); an export needs a location of its own, "
                "outside and not around the sink's tables and other exports"
            )
    enclosing = _enclosing_folder(uri)
    if enclosing is not None:
        what, where = enclosing
        raise ConfigError(
            f"--to {to}: is inside {what} ({where}), whose own removal or maintenance "
            "(delete, a failed export's cleanup, VACUUM) would take this export with it; "
            "choose a location outside it"
        )
    return uri


def _enclosing_folder(uri: str) -> tuple[str, str] | None:
    """The nearest folder above ``uri`` that is an export (of any sink, finished or not),
    a Delta table or a query's checkpoint (Spark's, or one a sink of ours keeps its id
    in), as (what, where); None if there is none."""
    fs, root = _fs.filesystem(_fs.resolved(uri))
    path = root.rstrip("/")
    while True:
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        if not parent or parent == path:
            return None
        path = parent
        if fs.exists(f"{path}/{EXPORT_MARKER}"):
            return "an export folder", path
        if fs.exists(f"{path}/_delta_log"):
            return "a Delta table", path
        if fs.exists("/".join((path, *SINK_FILE))) or (
            fs.exists(f"{path}/metadata") and fs.exists(f"{path}/offsets")
        ):
            return "a query's checkpoint", path


#: Where an export keeps an upserting sink's tombstones (sinks.tombstones).
TOMBSTONES = "tombstones"
#: What an export writes under its location; removing an export removes these alone,
#: in this order: the marker last.
_EXPORT_PARTS = ("data", "manifest", "state", TOMBSTONES, EXPORT_MARKER)


def _remove_export(fs: Any, root: str, uri: str) -> None:
    """Remove what an export wrote at ``root`` (its parts, the marker last, then the
    folder if that left it empty): anything else found there is not the export's and
    stays, with a warning. A removal killed half way keeps the marker, which lets a
    rerun (or an export there, which finds a dead export's copy) finish it."""
    for part in _EXPORT_PARTS:
        _fs.remove_tree(fs, _fs.join(root, part))
    left = fs.ls(root, detail=False) if fs.exists(root) else []
    if left:
        log.warning("%s: left in place what the export did not write: %s", uri, sorted(left)[:10])
    else:
        _fs.remove_tree(fs, root)  # a local disk's empty folder; nothing on object stores
