"""The plan (the cut): which committed batch of each member a backup pins, downstream
first, so that no part holds rows derived from upstream data another part lacks."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...errors import BackupError, ConfigError

if TYPE_CHECKING:
    pass
from ...storage import fs as _fs
from ...storage.checkpoint import read_sink_file
from .. import handle as admin


@dataclass(frozen=True)
class Member:
    checkpoint: str  # an absolute URI (normalized before anything is stored)
    target: str  # the sink's Delta table
    sink_id: str
    reads: tuple[str | None, ...]  # per source: the table its txn-delta source reads
    record_table: str | None = None  # None: a backup taken before it was kept

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "target": self.target,
            "sink_id": self.sink_id,
            "reads": list(self.reads),
            "record_table": self.record_table,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Member:
        return cls(
            d["checkpoint"],
            d["target"],
            d["sink_id"],
            tuple(d.get("reads") or ()),
            d.get("record_table"),
        )


def _offset_dict(offset: Any) -> dict | None:
    if isinstance(offset, str):
        try:
            offset = json.loads(offset)
        except ValueError:
            return None
    return offset if isinstance(offset, dict) else None


#: A txn-delta source offset's keys; ``tableId`` since offsets name their table,
#: ``changeFeed`` in a change-data-feed source's (readChangeFeed).
_DELTA_OFFSET_KEYS = frozenset({"version", "index", "snapshot"})
_DELTA_OFFSET_OPTIONAL = frozenset({"tableId", "changeFeed"})


def _is_delta_offset(offset: Any) -> bool:
    d = _offset_dict(offset)
    return (
        d is not None
        and _DELTA_OFFSET_KEYS <= set(d) <= _DELTA_OFFSET_KEYS | _DELTA_OFFSET_OPTIONAL
    )


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
    """The members, checkpoints as absolute URIs, with ``reads`` checked against each
    query's sources (refused here, before an id is used or a catalog created)."""
    if isinstance(queries, str) or not queries:
        raise ConfigError("queries: give a non-empty list of checkpoint locations")
    for q in queries:
        if not isinstance(q, str) or not q.strip():
            raise ConfigError(f"queries: {q!r} is not a checkpoint location")
    uris = [_fs.normalize_uri(q) for q in queries]
    keys = [_fs.location_key(u) for u in uris]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"queries: a checkpoint is listed twice: {list(queries)}")
    reads = dict(reads or {})
    by_key = dict(zip(keys, queries, strict=True))
    for k in reads:
        if _fs.location_key(_fs.normalize_uri(k)) not in by_key:
            raise ConfigError(f"reads: {k!r} is not one of the queries {list(queries)}")
    read_of = {_fs.location_key(_fs.normalize_uri(k)): v for k, v in reads.items()}
    out = []
    for q, uri, k in zip(queries, uris, keys, strict=True):
        if _runs_light(uri):
            raise ConfigError(
                f"query {q}: its sink runs with mode=light, which keeps no record table; a "
                "backup's part is a named snapshot cut from the record table, so back up "
                "only queries whose txn-delta sink runs in snapshots mode (the default)"
            )
        handle = admin.open_sink(uri)
        handle.require_delta("backups take")
        if handle.target_uri is None:
            raise ConfigError(f"query {q}: its sink has no committed batch yet: nothing to back up")
        got = read_of.get(k)
        if got is not None and (isinstance(got, str) or not isinstance(got, Sequence)):
            raise ConfigError(
                f"reads[{q!r}]: give a list with one entry per source (a table path or None)"
            )
        member = Member(
            uri,
            handle.target_uri,
            handle.sink_id,
            tuple(None if p is None else _fs.normalize_uri(p) for p in (got or ())),
            handle.record_table,
        )
        _check_reads(member, handle)
        out.append(member)
    _refuse_copies(out)
    return out


def _table_id(uri: str) -> str | None:
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    from ...storage import current

    try:
        return str(DeltaTable(uri, storage_options=current().for_delta()).metadata().id)
    except TableNotFoundError:
        return None


def _refuse_copies(members: Sequence[Member]) -> None:
    """A declared table with the Delta id of a member's target at another path is a copy
    of it (``cp -r``, a replica): its offsets' ``tableId`` cannot tell them apart, and the
    reader would be cut as if it read a table outside the backup. Declare the member's
    target itself."""
    targets = {_table_id(m.target): m for m in members}
    targets.pop(None, None)
    for m in members:
        for s, table in enumerate(m.reads):
            if table is None:
                continue
            owner = targets.get(_table_id(table))
            if owner is not None and _fs.location_key(owner.target) != _fs.location_key(table):
                raise ConfigError(
                    f"reads of {m.checkpoint}: source {s} is declared to read {table}, which "
                    f"has the Delta table id of {owner.target}, the target of query "
                    f"{owner.checkpoint}: a copy of it, or the same table under another name. "
                    f"Declare {owner.target} itself"
                )


def _latest_offsets(handle: admin.SinkHandle) -> Sequence[Any]:
    state = handle.load()
    if not state.records:
        return ()
    latest = max(state.records.values(), key=lambda r: r.snapshot_id)
    return latest.source_offsets or ()


def _check_reads(member: Member, handle: admin.SinkHandle) -> None:
    """``reads`` against the query's sources, as its latest batch recorded them: one entry
    per source at most; a table only for a ``txn-delta`` source, and then the Delta table
    its offsets name (``tableId``) and that has the version the source has read up to;
    every ``txn-delta`` source named.

    Offsets written before they named their table (no ``tableId``) are checked by version
    only: a wrong table that exists and is far enough along cannot be told from the right
    one there (docs/backups.md)."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    from ...storage import current

    offsets = _latest_offsets(handle)
    q = member.checkpoint
    if len(member.reads) > len(offsets):
        raise ConfigError(
            f"reads of {q}: {len(member.reads)} tables given, but the query has "
            f"{len(offsets)} source(s) (its latest batch's offsets): give one entry per "
            "source, in order ('-' / None for a source that is not txn-delta)"
        )
    for s, offset in enumerate(offsets):
        table = member.reads[s] if s < len(member.reads) else None
        if table is None:
            if _is_delta_offset(offset):
                raise ConfigError(_reads_missing(q, s))
            continue
        if not _is_delta_offset(offset):
            raise ConfigError(
                f"reads of {q}: source {s} is not a txn-delta source (its offset is "
                f"{json.dumps(offset, default=str)[:120]}), yet the table {table} is given "
                "for it: give '-' (None) for it"
            )
        try:
            dt = DeltaTable(table, storage_options=current().for_delta())
        except TableNotFoundError:
            raise ConfigError(
                f"reads of {q}: source {s} reads {table!r}, which is not a Delta table "
                "(no _delta_log there)"
            ) from None
        version = dt.version()
        read_id = (_offset_dict(offset) or {}).get("tableId")
        if read_id is not None and read_id != str(dt.metadata().id):
            raise ConfigError(
                f"reads of {q}: source {s} reads the Delta table with id {read_id} (its "
                f"offsets say so), but {table} is the table with id {dt.metadata().id}: it is "
                "not the table this source reads"
            )
        consumed = int(_offset_dict(offset)["version"]) - 1  # type: ignore[index]
        if consumed > version:
            raise ConfigError(
                f"reads of {q}: source {s} has read version {consumed} of its table, but "
                f"{table} is only at version {version}: it is not the table this source reads"
            )


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
            raise ConfigError(_reads_missing(member.checkpoint, s))


def _reads_missing(query: str, source: int) -> str:
    """The refusal of a txn-delta source nobody said the table of (API and CLI words)."""
    return (
        f"query {query}: source {source} is a txn-delta source; say which table it reads "
        f"(--reads {query}=TABLE, or reads= in Python: one table per source, in order), so "
        "the backup can cut it consistently with that table's query"
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


def _runs_light(checkpoint: str) -> bool:
    try:
        kept = read_sink_file(checkpoint)
    except (OSError, ValueError):
        return False  # open_sink says what is wrong with it
    return kept is not None and kept.get("mode") == "light"
