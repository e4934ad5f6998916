"""Restoring a backup: copy each part into a new table and rewrite each downstream
checkpoint's offset to its restored upstream table, so the chain resumes exactly there."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...errors import BackupError, ConfigError, CorruptSnapshotError
from ...storage import StorageOptions, current, takes_storage_options

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
from ...storage import fs as _fs
from .. import snapshots
from ..handle import open_sink
from ..snapshots.location import _relation
from .catalog import (
    COMPLETED,
    DONE_FILE,
    RESTORE_MARKER,
    _catalog_id,
    _fault,
    _open_catalog,
    _rows,
    _started,
    part_name,
)
from .plan import (
    Member,
    _downstream_first,
    _graph,
    _offset_dict,
)
from .status import (
    status,
    verify,
)


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
    _check_into(into, to, members, st)
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
    # Each restored table's version as the restore left it (kept in its done file): a
    # reader's offsets point past it. Not the table's version now: after a killed restore
    # the user may have started the upstream query already, and its new commits are
    # exactly what the reader still has to read.
    restored_version: dict[int, int] = {}
    out = []
    for i in reversed(_downstream_first(graph) or []):  # upstream first
        m, ms = members[i], st.members[i]
        base = _fs.join(into_uri, f"part-{i}")
        chk, path = _fs.join(base, "checkpoint"), paths[i]
        reads = {s: paths[u] for s, u in graph[i]}
        done_path = _fs.join(root, f"part-{i}", DONE_FILE)
        if fs.exists(done_path):
            done = json.loads(fs.cat(done_path))
            if "table_version" not in done:
                raise BackupError(
                    f"restore of backup {backup_id} into {into!r}: part {i} was restored "
                    "by an older pyspark-txn that did not record its table's version; "
                    "restore into a new location"
                )
            restored_version[i] = int(done["table_version"])
            out.append(Restored(m.checkpoint, chk, path, int(ms.batch_id or 0), reads))
            continue
        for sub in ("checkpoint", "table"):
            p = _fs.join(root, f"part-{i}", sub)
            if fs.exists(p):
                fs.rm(p, recursive=True)  # an unfinished earlier run of this restore
        prepared = snapshots.prepare_query(
            m.checkpoint, part_name(backup_id, _catalog_id(dt)), chk, path
        )
        if reads:
            _rewrite_offsets(
                chk,
                prepared.batch_id,
                {s: _next_version(restored_version[u]) for s, u in graph[i]},
            )
        restored_version[i] = _table_version(path)
        done = Restored(m.checkpoint, chk, path, prepared.batch_id, reads).to_json()
        with fs.open(done_path, "w") as f:
            f.write(json.dumps({**done, "table_version": restored_version[i]}))
        out.append(Restored(m.checkpoint, chk, path, prepared.batch_id, reads))
        _fault("exit_after_restore_part")
    order = {m.checkpoint: k for k, m in enumerate(members)}
    return sorted(out, key=lambda r: order[r.original])


def _check_into(into: str, to: str, members: list[Member], st: Any) -> None:
    """``into`` may not be, lie inside or contain the backup location, a member's target,
    checkpoint or record table, or a part: a later ``delete`` of the backup (or of a
    member's snapshots) would remove the restored pipeline with it, and a restore around
    a live table would mix the two. Checked before anything is written."""
    if not isinstance(into, str) or not into.strip():
        raise ConfigError("into: must name a directory")
    uri = _fs.normalize_uri(into)
    places = [("the backup location", _fs.normalize_uri(to))]
    for m, ms in zip(members, st.members, strict=True):
        places.append((f"the target of query {m.checkpoint}", m.target))
        places.append((f"the checkpoint of query {m.checkpoint}", m.checkpoint))
        # an unreadable sink fails here, before anything is written (the restore needs
        # its registry anyway)
        record_table = open_sink(m.checkpoint).record_table
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


def _table_version(table: str) -> int:
    from deltalake import DeltaTable

    return DeltaTable(table, storage_options=current().for_delta()).version()


def _next_version(version: int) -> dict[str, Any]:
    """The txn-delta source offset that reads on after everything of ``version``."""
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
