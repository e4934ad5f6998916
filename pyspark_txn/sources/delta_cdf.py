"""The change data feed of a Delta table, as the ``txn-delta`` source streams it with
``readChangeFeed=true``: the change set of a version and the three columns Delta adds.

A row of the feed is a row of the table plus ``_change_type`` (``insert``, ``delete``,
``update_preimage``, ``update_postimage``), ``_commit_version`` (long) and
``_commit_timestamp`` (timestamp), as Delta's Spark source gives them. What a version
contributes follows PROTOCOL.md ("Add CDC File"):

- a version with ``cdc`` actions: exactly its ``_change_data`` files (their own
  ``_change_type`` column; partition values from each action);
- a version without: its ``add`` actions are inserts and its ``remove`` actions deletes
  (whole-file deletes and overwrites are written that way, and Delta Spark's DELETE with
  deletion vectors removes a file and adds it back with a larger vector: only the rows
  the new vector deletes and the old one did not are deletes, as ``load_cdf`` and Delta
  read them). ``dataChange=false`` actions (OPTIMIZE) contribute nothing;
- a version that removes data without ``cdc`` actions at a version where the table does
  not record change data (``delta.enableChangeDataFeed`` not true there) is refused:
  which rows it deleted or updated cannot be known. An append-only version is read
  (its adds are its change data) whatever the property says.

``_commit_timestamp`` is the commit's ``commitInfo.inCommitTimestamp``, else its
``commitInfo.timestamp``, else 0 (the epoch): exactly what delta-rs's ``load_cdf`` uses
(``crates/core/src/operations/load_cdf.rs``), read from the commit itself so that a
replay gives the same value forever (a file's modification time, Delta Spark's choice
without in-commit timestamps, changes when the log is copied).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .delta_commits import ChangeSet, DeltaFile

CHANGE_TYPE = "_change_type"
COMMIT_VERSION = "_commit_version"
COMMIT_TIMESTAMP = "_commit_timestamp"
CHANGE_COLUMNS = (CHANGE_TYPE, COMMIT_VERSION, COMMIT_TIMESTAMP)
ENABLE_PROPERTY = "delta.enableChangeDataFeed"

#: The three columns as Delta schema fields (JSON), appended to the table's.
CHANGE_FIELDS: dict[str, dict[str, Any]] = {
    CHANGE_TYPE: {"name": CHANGE_TYPE, "type": "string", "nullable": True, "metadata": {}},
    COMMIT_VERSION: {"name": COMMIT_VERSION, "type": "long", "nullable": True, "metadata": {}},
    COMMIT_TIMESTAMP: {
        "name": COMMIT_TIMESTAMP,
        "type": "timestamp",
        "nullable": True,
        "metadata": {},
    },
}

# a deletion vector descriptor as DeltaFile keeps it: sorted items, hashable
DV = tuple[tuple[str, Any], ...]


def change_feed_schema(schema: Mapping[str, Any], table: str) -> dict[str, Any]:
    """The table's Delta schema (JSON) with the three change columns appended. A table
    column of one of those names (any case) is refused: Delta refuses the feed there too."""
    for f in schema["fields"]:
        if f["name"].lower() in CHANGE_COLUMNS:
            raise ConfigError(
                f"txn-delta source: option readChangeFeed=true: the Delta table {table} has a "
                f"column {f['name']!r}, a name the change data feed adds itself "
                f"({', '.join(CHANGE_COLUMNS)}); rename the column, or read without "
                "readChangeFeed"
            )
    return {**schema, "fields": [*schema["fields"], *CHANGE_FIELDS.values()]}


def records_change_data(configuration: Mapping[str, Any] | None) -> bool:
    """Whether a table with this configuration records change data."""
    return str((configuration or {}).get(ENABLE_PROPERTY, "false")).strip().lower() == "true"


def no_change_data(table: str, version: int) -> ConfigError:
    """``readChangeFeed`` at a start version that records no change data."""
    return ConfigError(
        f"txn-delta source: option readChangeFeed=true: the Delta table {table} does not "
        f"record change data at version {version} (its table property {ENABLE_PROPERTY} is "
        "not true there), so it has no change feed to read. Set the property (ALTER TABLE "
        f"... SET TBLPROPERTIES ({ENABLE_PROPERTY} = true), or the txn-delta sink's option "
        f"{ENABLE_PROPERTY}=true when it creates the table) and start at a version from then "
        "on (startingVersion), or stream the table's appends without readChangeFeed"
    )


def commit_timestamp_ms(actions: Sequence[Mapping[str, Any]]) -> int:
    """The commit's time in ms since the epoch, as ``load_cdf`` takes it (module docstring)."""
    ts = 0
    for action in actions:
        info = action.get("commitInfo")
        if info is not None:
            ts = int(info.get("inCommitTimestamp") or info.get("timestamp") or 0)
    return ts


@dataclass(frozen=True)
class ChangeFile(DeltaFile):
    """A data file of a version's change set, with what its rows say of the change."""

    # insert / delete; None: the file's own _change_type column (a cdc file)
    change_type: str | None = None
    version: int = 0
    timestamp_ms: int = 0
    # a file removed and added back with another deletion vector: only the rows the
    # first vector deletes and the second does not (None: a vector deleting nothing)
    select: tuple[DV | None, DV | None] | None = None

    def constants(self) -> dict[str, Any]:
        values = dict(self.partition_values)
        values[COMMIT_VERSION] = self.version
        values[COMMIT_TIMESTAMP] = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc) + (
            dt.timedelta(milliseconds=self.timestamp_ms)
        )
        if self.change_type is not None:
            values[CHANGE_TYPE] = self.change_type
        return values


def _as_change(f: DeltaFile, change_type: str | None, version: int, ts: int, **kw) -> ChangeFile:
    return ChangeFile(
        f.uri,
        f.partition_values,
        kw.pop("deletion_vector", f.deletion_vector),
        f.size,
        change_type=change_type,
        version=version,
        timestamp_ms=ts,
        **kw,
    )


def snapshot_changes(
    files: Sequence[DeltaFile], version: int, timestamp_ms: int
) -> tuple[ChangeFile, ...]:
    """The table's files at ``version`` as inserts of that version (the default start,
    as Delta's Spark source begins a change feed without startingVersion)."""
    return tuple(_as_change(f, "insert", version, timestamp_ms) for f in files)


def _dv(action: Mapping[str, Any]) -> DV | None:
    dv = action.get("deletionVector")
    return tuple(sorted(dv.items())) if dv else None


def commit_changes(
    version: int,
    actions: Sequence[Mapping[str, Any]],
    file_of: Callable[[Mapping[str, Any]], DeltaFile],
    partitioned: bool,
    records: Callable[[], bool],
) -> ChangeSet:
    """The change set of commit ``version`` (its ``actions``, in log order), or why it
    cannot be streamed (``ChangeSet.error``, without the version: the caller says it).

    ``file_of`` makes the file of an add, remove or cdc action (its partition values
    typed); ``records()`` says whether the table records change data at this version
    (asked only for a version that removes data without cdc files).
    """
    ts = commit_timestamp_ms(actions)
    cdc = [a["cdc"] for a in actions if "cdc" in a]
    if cdc:  # PROTOCOL.md: the changes of such a version are exactly its cdc files
        return ChangeSet(tuple(_as_change(file_of(c), None, version, ts) for c in cdc))
    removes = {
        a["remove"]["path"]: a["remove"]
        for a in actions
        if "remove" in a and a["remove"].get("dataChange", True)
    }
    if removes and not records():
        first = next(iter(removes))
        return ChangeSet(
            (),
            f"it removes data ({first}) but the table does not record change data at that "
            f"version (its property {ENABLE_PROPERTY} is not true there) and the commit has "
            "no cdc files, so which rows it deleted or updated cannot be known. Start a new "
            "query (new checkpoint) at a later version (startingVersion), or stream the "
            "table without readChangeFeed",
        )
    adds = {a["add"]["path"] for a in actions if "add" in a and a["add"].get("dataChange", True)}
    files: list[ChangeFile] = []
    for action in actions:
        add, remove = action.get("add"), action.get("remove")
        if add is not None and add.get("dataChange", True):
            f = file_of(add)
            old = removes.get(add["path"])
            if old is None:
                files.append(_as_change(f, "insert", version, ts))
                continue
            # the same file, another deletion vector: the rows between the two vectors
            new_dv, old_dv = _dv(add), _dv(old)
            if new_dv is not None:
                files.append(
                    _as_change(
                        f, "delete", version, ts, deletion_vector=None, select=(new_dv, old_dv)
                    )
                )
            if old_dv is not None:
                files.append(
                    _as_change(
                        f, "insert", version, ts, deletion_vector=None, select=(old_dv, new_dv)
                    )
                )
        elif remove is not None and remove.get("dataChange", True) and remove["path"] not in adds:
            if partitioned and remove.get("partitionValues") is None:
                return ChangeSet(
                    (),
                    f"its remove action of {remove['path']} has no partitionValues, so the rows "
                    "it deletes cannot be given their partition values",
                )
            files.append(_as_change(file_of(remove), "delete", version, ts))
    return ChangeSet(tuple(files))


def kept_rows(select: tuple[DV | None, DV | None], load: Callable[[dict], Any]):
    """The rows ``select`` keeps (those its first vector deletes and its second does not),
    as a sorted uint64 array; ``load`` decodes a deletion vector descriptor."""
    import numpy as np

    first, second = (np.zeros(0, np.uint64) if d is None else load(dict(d)) for d in select)
    return np.setdiff1d(first, second, assume_unique=True)
