"""Restoring a backup: copy each part into a new table and write a checkpoint whose
offsets point each downstream source at its restored upstream table, so the chain resumes
exactly there. Reads the backup location only: it is what is left after a disaster."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...errors import ConfigError, CorruptSnapshotError
from ...spark.options import check_location
from ...storage import StorageOptions, current, takes_storage_options
from ...storage import fs as _fs
from ...storage.checkpoint import RESTORE_FILE, read_restore_mark
from .. import snapshots
from ..handle import open_sink
from ..snapshots.location import _relation
from ..snapshots.prepare import check_pair, check_startable, is_stateful, start_from_entry
from .catalog import (
    COMPLETED,
    RESTORE_MARKER,
    _catalog_id,
    _fault,
    _open_catalog,
    _rows,
    _started,
)
from .plan import (
    Member,
    _downstream_first,
    _graph,
    _offset_dict,
)
from .status import BackupStatus, _status_from, verify

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

#: Each restored member's own mark, in its new checkpoint: which restore wrote it and
#: whether it finished (then with the restored table's version and id). A sink refuses
#: to start on a checkpoint whose mark says unfinished (storage.checkpoint).
MEMBER_MARKER = RESTORE_FILE


@dataclass(frozen=True)
class Restored:
    """One member restored: start the same query with this checkpoint and sink path, and
    its ``txn-delta`` sources reading ``reads`` (index -> table)."""

    original: str
    checkpoint: str
    path: str
    batch_id: int
    reads: Mapping[int, str]
    earlier: bool = False  # restored by an earlier run of this restore, not now
    fresh: bool = False  # stateful: a new query that recomputes its state (no offsets)

    def to_json(self) -> dict[str, Any]:
        return {
            "original": self.original,
            "checkpoint": self.checkpoint,
            "path": self.path,
            "batch_id": self.batch_id,
            "reads": {str(k): v for k, v in self.reads.items()},
            "earlier": self.earlier,
            "fresh": self.fresh,
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
    into: str | None = None,
    *,
    in_place: bool = False,
    accept_message_loss: bool = False,
    spark: SparkSession | None = None,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> list[Restored]:
    """Give every member a table and checkpoint at its part: restarted with these, the
    queries continue from the backup.

    ``into``: new locations, ``<into>/part-<i>/checkpoint`` and ``/table``. ``in_place``:
    the members' own checkpoints and targets, which must be gone or empty (lost in the
    disaster, or moved away first); the queries then restart with their own options.
    Each downstream checkpoint's ``txn-delta`` offsets name its restored upstream table
    (its version and Delta table id). Reads only the backup location ``to``. Refused
    while a member runs in this Spark session. Idempotent: a killed restore, run again,
    finishes the same way."""
    if (into is None) == (not in_place):
        raise ConfigError("restore: give either into= (--into DIR) or in_place=True (--in-place)")
    dt = _open_catalog(to)
    rows, catalog_id = _rows(dt), _catalog_id(dt)
    st = _status_from(rows, backup_id, to, catalog_id)
    if st.state != COMPLETED:
        raise ConfigError(f"backup {backup_id} is {st.state}: only a completed backup restores")
    members = [Member.from_json(m) for m in (_started(rows, backup_id) or {})["body"]["members"]]
    running = _running_queries(spark)
    for m in members:
        if _fs.location_key(_fs.normalize_uri(m.checkpoint)) in running:
            raise ConfigError(
                f"query {m.checkpoint} is running in this Spark session: stop it before "
                "restoring its backup"
            )
    _check_sources(members, st, accept_message_loss)
    if in_place:
        places = {i: (m.checkpoint, m.target) for i, m in enumerate(members)}
    else:
        assert into is not None
        _check_into(into, to, members, st)
        into_uri = _fs.normalize_uri(into)
        places = {
            i: (
                _fs.join(into_uri, f"part-{i}", "checkpoint"),
                _fs.join(into_uri, f"part-{i}", "table"),
            )
            for i in range(len(members))
        }
    mine = {
        "backup_id": backup_id,
        "to": _fs.normalize_uri(to),
        "catalog_id": catalog_id,
        "in_place": in_place,
    }
    marks = {i: read_restore_mark(places[i][0]) for i in places}
    for i, m in enumerate(members):
        part = st.members[i].part
        assert part is not None  # a completed backup's members all have their part
        # a stateful query's state is not in the backup: it is restored as a new query
        # over its restored table (prepare.rederives says when that is exact)
        check_startable(part, fresh=is_stateful(part))
        check_pair(*places[i])
        if in_place and not _is_done(marks[i], mine):
            _check_in_place(m, places[i], marks[i], mine)
    check = verify(backup_id, to)
    if not check.ok:
        raise CorruptSnapshotError(
            f"backup {backup_id} does not verify: " + "; ".join(check.problems[:5])
        )
    if into is not None:
        _claim_into(_fs.normalize_uri(into), backup_id, to)
    graph = _graph(members)
    # Each restored table's version and id as the restore left them (kept in its mark): a
    # reader's offsets point past that version. Not the table's version now: after a
    # killed restore the user may have started the upstream query already, and its new
    # commits are exactly what the reader still has to read.
    restored: dict[int, tuple[int, str]] = {}
    out = []
    for i in reversed(_downstream_first(graph) or []):  # upstream first
        m, part = members[i], st.members[i].part
        assert part is not None
        chk, path = places[i]
        reads = {s: places[u][1] for s, u in graph[i]}
        fresh = is_stateful(part)
        mark = marks[i]
        if mark is not None and _is_done(mark, mine):
            restored[i] = (int(mark["table_version"]), str(mark["table_id"]))
            _check_still_there(path, chk, backup_id, restored[i])
            out.append(
                Restored(m.checkpoint, chk, path, part.batch_id, reads, earlier=True, fresh=fresh)
            )
            continue
        _clear_unfinished(chk, path, marks[i], mine, in_place)
        _write_mark(chk, {**mine, "member": m.checkpoint, "done": False})
        _fault(f"restore_after_mark:{i}")
        offsets = list(part.details.get("source_offsets") or [])
        for s, u in graph[i]:
            feed = bool((_offset_dict(offsets[s]) or {}).get("changeFeed"))
            offsets[s] = _next_version(*restored[u], change_feed=feed)
        prepared = start_from_entry(
            part,
            chk,
            path,
            {
                "from": m.checkpoint,
                "backup": mine,
                "reads": {str(s): p for s, p in reads.items()},
            },
            offsets=offsets,
            fresh=fresh,
        )
        _fault(f"restore_after_checkpoint:{i}")
        restored[i] = _table_identity(path)
        version, table_id = restored[i]
        _write_mark(
            chk,
            {
                **mine,
                "member": m.checkpoint,
                "done": True,
                "table_version": version,
                "table_id": table_id,
            },
        )
        out.append(Restored(m.checkpoint, chk, path, prepared.batch_id, reads, fresh=fresh))
        log.info("backup %d: restored %s into %s and %s", backup_id, m.checkpoint, chk, path)
        _fault("exit_after_restore_part")
        _fault(f"restore_after_member:{i}")
    order = {m.checkpoint: k for k, m in enumerate(members)}
    return sorted(out, key=lambda r: order[r.original])


def _check_sources(members: Sequence[Member], st: BackupStatus, accept_message_loss: bool) -> None:
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


def _write_mark(checkpoint: str, mark: Mapping[str, Any]) -> None:
    fs, root = _fs.filesystem(checkpoint)
    path = _fs.join(root, *MEMBER_MARKER)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "w") as f:
        f.write(json.dumps(dict(mark)))


def _is_ours(mark: Mapping[str, Any] | None, mine: Mapping[str, Any]) -> bool:
    return mark is not None and all(mark.get(k) == v for k, v in mine.items())


def _is_done(mark: Mapping[str, Any] | None, mine: Mapping[str, Any]) -> bool:
    return _is_ours(mark, mine) and bool(mark and mark.get("done"))


def _is_empty(uri: str) -> bool:
    fs, root = _fs.filesystem(uri)
    return not fs.exists(root) or (fs.isdir(root) and not fs.ls(root, detail=False))


def _check_in_place(
    m: Member, place: tuple[str, str], mark: Mapping[str, Any] | None, mine: Mapping[str, Any]
) -> None:
    """A member restored in place needs its checkpoint and target gone or empty (or this
    restore's own unfinished work), and a record table of its own kept elsewhere gone
    too: the restored sink has the original's id (same checkpoint location) and would
    read the original's history as its own."""
    chk, path = place
    if _is_ours(mark, mine):
        return  # this restore's own unfinished work: it is redone
    if mark is not None and mark.get("done"):
        raise ConfigError(
            f"restore in place: {chk} is the checkpoint of a query restored from backup "
            f"{mark.get('backup_id')} (in {mark.get('to')}), which may have run since. Stop "
            "the pipeline and move its checkpoints, target tables and record tables away "
            "first (a restore in place never overwrites them), or restore with --into"
        )
    if mark is not None:
        raise ConfigError(
            f"restore in place: {chk} holds the unfinished restore of backup "
            f"{mark.get('backup_id')} (in {mark.get('to')}); finish that restore (run it "
            "again), or move that checkpoint away first"
        )
    places = [("checkpoint", chk), ("target table", path)]
    inside = m.record_table is not None and _relation(m.record_table, chk) == "is inside"
    if m.record_table is not None and not inside:
        places.append(("record table", m.record_table))
    for what, where in places:
        if not _is_empty(where):
            raise ConfigError(
                f"restore in place: the {what} of query {m.checkpoint} ({where}) is not "
                "empty. Stop the pipeline and move its checkpoints, target tables and "
                "record tables away first (a restore in place never overwrites them), or "
                "restore with --into into new locations"
            )


def _clear_unfinished(
    chk: str, path: str, mark: Mapping[str, Any] | None, mine: Mapping[str, Any], in_place: bool
) -> None:
    """Remove what a killed run of this restore left of a member. In place, only behind
    this restore's own mark (the places were checked empty before it wrote anything);
    under ``into``, the whole folder is this restore's (its marker says so)."""
    if in_place and not _is_ours(mark, mine):
        return
    for uri in (chk, path):
        fs, root = _fs.filesystem(uri)
        _fs.remove_tree(fs, root)


def _claim_into(into_uri: str, backup_id: int, to: str) -> None:
    """``into`` must be new, empty or an unfinished restore of this backup; its marker
    says whose restore it is."""
    fs, root = _fs.filesystem(into_uri)
    marker_path = _fs.join(root, RESTORE_MARKER)
    if fs.exists(root) and fs.ls(root, detail=False):
        try:
            marker = json.loads(_fs.read_text(fs, marker_path))
        except FileNotFoundError:
            marker = None
        if (
            not isinstance(marker, dict)
            or marker.get("backup_id") != backup_id
            or marker.get("to") != _fs.normalize_uri(to)
        ):
            raise ConfigError(
                f"into={into_uri!r}: must be a new or empty directory (or an unfinished "
                f"restore of backup {backup_id})"
            )
        return
    fs.makedirs(root, exist_ok=True)
    with fs.open(marker_path, "w") as f:
        f.write(json.dumps({"backup_id": backup_id, "to": _fs.normalize_uri(to)}))
    _fault("restore_after_into_marker")


def _check_into(into: str, to: str, members: list[Member], st: BackupStatus) -> None:
    """``into`` may not be, lie inside or contain the backup location, a member's target,
    checkpoint or record table, or a part: a later ``delete`` of the backup (or of a
    member's snapshots) would remove the restored pipeline with it, and a restore around
    a live table would mix the two. Checked before anything is written."""
    if not isinstance(into, str) or not into.strip():
        raise ConfigError("into: must name a directory")
    check_location("into", into)
    uri = _fs.normalize_uri(into)
    places = [("the backup location", _fs.normalize_uri(to))]
    for m, ms in zip(members, st.members, strict=True):
        places.append((f"the target of query {m.checkpoint}", m.target))
        places.append((f"the checkpoint of query {m.checkpoint}", m.checkpoint))
        record_table = m.record_table or _live_record_table(m.checkpoint)
        if record_table is not None:
            places.append((f"the record table of query {m.checkpoint}", record_table))
        if ms.location:
            places.append((f"the part of query {m.checkpoint}", ms.location))
    for what, where in places:
        how = _relation(uri, _fs.normalize_uri(where))
        if how is not None:
            raise ConfigError(
                f"into={into!r}: {how} {what} ({where}); restore into a location of its own, "
                "outside and not around the backups and the pipeline's tables and checkpoints"
            )


def _live_record_table(checkpoint: str) -> str | None:
    """A member's record table where the backup predates keeping it: from the live sink,
    if it is still there (after a disaster it is not, and nothing is left to protect)."""
    try:
        return open_sink(checkpoint).record_table
    except Exception as e:  # noqa: BLE001 - gone with the pipeline: nothing to keep apart
        log.info("restore: the sink of %s cannot be read (%s)", checkpoint, e)
        return None


def _check_still_there(path: str, chk: str, backup_id: int, restored: tuple[int, str]) -> None:
    """A member an earlier run restored must still have its table (the same one, at the
    restored version or later): a rerun after it was moved or deleted says so instead of
    reporting success."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    version, table_id = restored
    try:
        dt = DeltaTable(path, storage_options=current().for_delta())
        now: str | None = str(dt.metadata().id)
        at = dt.version()
    except TableNotFoundError:
        now, at = None, -1
    if now != table_id or at < version:
        raise ConfigError(
            f"backup {backup_id} was restored into {chk} and {path} by an earlier run, but "
            f"{path} no longer holds that table ({'gone' if now is None else 'replaced'}): "
            "restore into new locations (--into), or move that checkpoint away too and "
            "restore in place again"
        )


def _table_identity(table: str) -> tuple[int, str]:
    from deltalake import DeltaTable

    dt = DeltaTable(table, storage_options=current().for_delta())
    return dt.version(), str(dt.metadata().id)


def _next_version(version: int, table_id: str, *, change_feed: bool = False) -> dict[str, Any]:
    """The txn-delta source offset that reads on after everything of ``version`` of the
    table ``table_id`` (of its change data feed, for a ``readChangeFeed`` source)."""
    offset: dict[str, Any] = {"index": 0, "snapshot": False, "version": version + 1}
    if change_feed:
        offset["changeFeed"] = True
    offset["tableId"] = table_id
    return dict(sorted(offset.items()))
