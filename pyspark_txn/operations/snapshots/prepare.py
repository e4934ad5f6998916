"""Starting a new query from a snapshot: :func:`source_offsets`,
:func:`kafka_starting_offsets` and :func:`prepare_query` (a checkpoint whose next batch
resumes exactly after the snapshot)."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError, CorruptSnapshotError
from ...state.core import NamedSnapshot
from ...storage import fs as _fs
from ...storage.options import StorageOptions, takes_storage_options
from ..handle import STARTED_FROM
from .copy import copy_table
from .registry import Progress, show
from .verification import verify

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedQuery:
    """What :func:`prepare_query` made: start a query with these and it resumes there."""

    checkpoint: str
    path: str
    batch_id: int  # the snapshot's batch: the new query runs batch_id + 1 next
    source_offsets: tuple[Any, ...]
    rows: int


@takes_storage_options
def source_offsets(
    location: str,
    name: str,
    sink: str | None = None,
    *,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> list[str | None]:
    """Spark's offset of every source of the snapshot's batch, as JSON (None: no offset).

    For Kafka the string is the source's ``startingOffsets`` JSON; for ``rate`` or
    file sources it is what their offset log holds (not enough to resume them:
    they keep more under the checkpoint's ``sources/``).
    """
    entry = show(location, name, sink, command="snapshots offsets")
    return [
        None if o is None else (o if isinstance(o, str) else json.dumps(o, sort_keys=True))
        for o in entry.details.get("source_offsets") or []
    ]


@takes_storage_options
def kafka_starting_offsets(
    location: str,
    name: str,
    source: int = 0,
    sink: str | None = None,
    *,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> Any:
    """The ``startingOffsets`` option that makes a Kafka source begin right after the
    snapshot's batch: ``{"topic": {"partition": offset}}``, as Spark logged it."""
    offsets = source_offsets(location, name, sink)
    if not 0 <= source < len(offsets):
        raise ConfigError(
            f"source={source}: snapshot {name!r} has {len(offsets)} source(s), numbered from 0"
        )
    raw = offsets[source]
    parsed = json.loads(raw) if raw else None
    if not (
        isinstance(parsed, dict)
        and parsed
        and all(
            isinstance(parts, dict) and all(isinstance(v, int) for v in parts.values())
            for parts in parsed.values()
        )
    ):
        raise ConfigError(
            f"source {source} of snapshot {name!r} is not a Kafka source: its offset is {raw}"
        )
    return raw


def _write_text(fs: Any, path: str, text: str) -> None:
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "w") as f:
        f.write(text)


def _new_location(fs: Any, root: str, option: str, uri: str) -> None:
    if _fs.is_local(uri) and os.path.islink(uri) and not os.path.exists(uri):
        raise ConfigError(
            f"{option} {uri}: is a symbolic link to {os.readlink(uri)!r}, which does not "
            "exist; give a new or empty directory"
        )
    if fs.exists(root) and (not fs.isdir(root) or fs.ls(root, detail=False)):
        raise ConfigError(f"{option} {uri}: must be a new or empty directory")


def _offset_dict(offset: Any) -> dict | None:
    if isinstance(offset, str):
        try:
            offset = json.loads(offset)
        except ValueError:
            return None
    return offset if isinstance(offset, dict) else None


def _is_file_source_offset(offset: Any) -> bool:
    """Spark's file source writes ``{"logOffset": n}``: an index into its own log."""
    d = _offset_dict(offset)
    return d is not None and set(d) == {"logOffset"}


def _is_plain_number_offset(offset: Any) -> bool:
    """Spark's ``rate`` source (also socket and memory) writes a bare number: seconds
    from a start time it keeps under the checkpoint's ``sources/``."""
    if isinstance(offset, str):
        try:
            offset = json.loads(offset)
        except ValueError:
            return False
    return isinstance(offset, int) and not isinstance(offset, bool)


def _claim_log_source(offset: Any) -> str | None:
    """The claim log source id of an acknowledging source's offset (``txn-redis``:
    ``{"claim": n, "source": "redis:<group>:<streams>"}``), else None."""
    d = _offset_dict(offset)
    if d is None or set(d) != {"claim", "source"}:
        return None
    return str(d["source"])


@takes_storage_options
def prepare_query(
    location: str,
    name: str,
    checkpoint: str,
    path: str,
    *,
    sink: str | None = None,
    progress: Progress | None = None,
    storage_options: StorageOptions | Mapping[str, Any] | str | None = None,
) -> PreparedQuery:
    """Make a new query start exactly at a named snapshot.

    Copies the exported data into a new table at ``path`` and writes a Spark
    checkpoint at ``checkpoint`` whose last committed batch is the snapshot's,
    with its offsets: a query with the same sources, started with this
    checkpoint and a ``txn-delta`` sink on ``path``, reads on from there and
    continues the table. Only for sources whose offset alone is their position
    (this package's sources, Kafka), not ``rate`` or the file source, which
    keep more under the checkpoint's ``sources/`` (not exported), nor acknowledging
    sources (``txn-redis``), whose offset is a position in a claim log that is not
    exported: both are refused before anything is written. Stateful queries are
    refused: Spark cannot load state from the exported tables.
    """
    entry = show(location, name, sink, command="snapshots prepare-query")
    check_startable(entry)
    chk_uri, path_uri = check_new_locations(checkpoint, path)
    check = verify(location, name, sink)
    if not check.ok:
        raise CorruptSnapshotError(
            f"snapshot {name!r} does not verify: " + "; ".join(check.problems[:5])
        )
    return start_from_entry(entry, chk_uri, path_uri, {"from": location}, progress=progress)


def is_stateful(entry: NamedSnapshot) -> bool:
    """Whether the snapshot is of a stateful query (its Spark state, exported or not,
    is not in a Spark checkpoint a new query could start from)."""
    return bool(entry.details.get("stateful") or entry.details.get("state_tables"))


def rederives(entry: NamedSnapshot) -> bool:
    """Whether the snapshot's query, stateful, may start anew and recompute its state
    from its sources over its restored table: its sink rewrites its results (merged by
    key, or each batch the whole result), so what it writes again replaces what the
    table holds. An append of stateful results would write them a second time."""
    writes = entry.details.get("writes") or {}
    return bool(writes.get("upsert")) or writes.get("output_mode") == "complete"


def check_startable(entry: NamedSnapshot, *, fresh: bool = False) -> None:
    """Refuse, before anything is written, a snapshot a new query cannot start from
    (``fresh``: a stateful query that starts anew, see :func:`rederives`)."""
    name = entry.name
    if fresh and not rederives(entry):
        raise ConfigError(
            f"snapshot {name!r} is of a stateful query that appends its results: its state "
            "is not restored, and started anew it would recompute and append them a second "
            "time. Restore it on its own: start its query with a new checkpoint and table "
            "(from its sources' beginning), or keep its part's data/ as a table to read"
        )
    if fresh:
        return
    if is_stateful(entry):
        raise ConfigError(
            f"snapshot {name!r} is of a stateful query: its exported state tables can be read "
            "but Spark cannot start a query from them"
        )
    for i, offset in enumerate(entry.details.get("source_offsets") or []):
        if _is_file_source_offset(offset):
            raise ConfigError(
                f"source {i} of snapshot {name!r} is Spark's file source (offset {offset}): its "
                f"position is the file log under the checkpoint's sources/{i}/, which is not "
                "exported, so a new query cannot start from this snapshot (read the exported "
                "table instead, or use a source whose offset is its position: Kafka, "
                "txn-delta, txn-sequence)"
            )
        if _is_plain_number_offset(offset):
            raise ConfigError(
                f"source {i} of snapshot {name!r} has a plain number for its offset ({offset}):"
                " Spark's rate source (also socket and memory), whose offsets count seconds "
                f"from a start time kept under the checkpoint's sources/{i}/, which is not "
                "exported: a new query started from this snapshot would fail in Spark "
                "(startSeconds > endSeconds). Restart the original query from its "
                "checkpoint, or use a source whose offset is its position: Kafka, "
                "txn-delta, txn-sequence"
            )
        claims = _claim_log_source(offset)
        if claims is not None:
            raise ConfigError(
                f"source {i} of snapshot {name!r} is an acknowledging source ({claims}, e.g. "
                f"txn-redis; offset {offset}): its offset is a claim number in the claim log "
                "under the original query's checkpoint (or its claimLog), which is not "
                "exported, and the broker acknowledges messages once their batch commits, so "
                "a new query cannot start from this snapshot. Restart the original query "
                "from its checkpoint, or start a new one with its own group and startId"
            )


def check_pair(checkpoint: str, path: str) -> tuple[str, str]:
    """The sink's own check of a (checkpoint, path) pair (same folder, checkpoint inside
    the table, ...): a prepared query it would refuse is refused before anything is
    written. Returns both as URIs."""
    from ...sinks.delta import DeltaSinkOptions

    try:
        DeltaSinkOptions.parse({"path": path, "checkpointLocation": checkpoint})
    except ConfigError as e:
        raise ConfigError(
            f"checkpoint {checkpoint} and path {path}: the txn-delta sink refuses this pair, "
            f"so the prepared query could not start: {e}"
        ) from e
    return _fs.normalize_uri(checkpoint), _fs.normalize_uri(path)


def check_new_locations(checkpoint: str, path: str) -> tuple[str, str]:
    """:func:`check_pair`, and both locations new or empty."""
    chk_uri, path_uri = check_pair(checkpoint, path)
    for option, uri in (("checkpoint", chk_uri), ("path", path_uri)):
        fs, root = _fs.filesystem(uri)
        _new_location(fs, root, option, uri)
    return chk_uri, path_uri


def start_from_entry(
    entry: NamedSnapshot,
    chk_uri: str,
    path_uri: str,
    lineage: Mapping[str, Any],
    *,
    offsets: Sequence[Any] | None = None,
    progress: Progress | None = None,
    fresh: bool = False,
) -> PreparedQuery:
    """Copy the snapshot's data to ``path_uri`` and write a Spark checkpoint at
    ``chk_uri`` whose last committed batch is the snapshot's. The caller checked both
    places (new, empty, or its own unfinished work) and the snapshot (it verifies, a query
    can start from it). ``lineage`` goes into ``started_from.json`` beside the entry;
    ``offsets``: the sources' offsets to start from (default: the snapshot's).
    ``fresh``: no Spark logs at all (a stateful query whose state is not exported: it
    starts as a new query and recomputes its state from its sources; only for one whose
    sink rewrites its results, see :func:`rederives`)."""
    copied = copy_table(
        _fs.join(entry.location, "data"),
        None,
        path_uri,
        name=None,
        description=f"started from pyspark-txn snapshot {entry.name!r} (batch {entry.batch_id})",
        progress=progress,
    )
    tombstones = entry.details.get("tombstones")
    if tombstones:  # an upserting sink's deletes: the new query's table inherits them
        from ...sinks.tombstones import INHERITED, tombstones_uri

        copy_table(
            _fs.join(entry.location, tombstones["path"]),
            None,
            tombstones_uri(path_uri, INHERITED),
            name=None,
            description=f"tombstones inherited from pyspark-txn snapshot {entry.name!r}",
        )
    batch = entry.batch_id
    if offsets is None:
        offsets = entry.details.get("source_offsets") or []
    chk_fs, chk_root = _fs.filesystem(chk_uri)
    lines = [
        "v1",
        json.dumps({"batchWatermarkMs": 0, "batchTimestampMs": int(time.time() * 1000)}),
        *("-" if o is None else (o if isinstance(o, str) else json.dumps(o)) for o in offsets),
    ]
    # The lineage first, Spark's logs last: a half-written checkpoint has no commit.
    _write_text(
        chk_fs,
        _fs.join(chk_root, *STARTED_FROM),
        json.dumps(
            {**entry.to_json(), "details": None, **lineage, **({"fresh": True} if fresh else {})},
            default=str,
        ),
    )
    if fresh:
        log.info(
            "prepared a new query from snapshot %r of a stateful query: checkpoint %s (it "
            "recomputes its state from its sources), table %s (%d rows)",
            entry.name,
            chk_uri,
            path_uri,
            copied.rows,
        )
        return PreparedQuery(chk_uri, path_uri, -1, (), copied.rows)
    _write_text(chk_fs, _fs.join(chk_root, "metadata"), json.dumps({"id": str(uuid.uuid4())}))
    if batch > 0:  # Spark reads the batch before the last too (it takes the last's over)
        _write_text(chk_fs, _fs.join(chk_root, "offsets", str(batch - 1)), "\n".join(lines))
    _write_text(chk_fs, _fs.join(chk_root, "offsets", str(batch)), "\n".join(lines))
    _write_text(
        chk_fs,
        _fs.join(chk_root, "commits", str(batch)),
        "v1\n" + json.dumps({"nextBatchWatermarkMs": 0}),
    )
    log.info(
        "prepared a query from snapshot %r: checkpoint %s (next batch %d), table %s (%d rows)",
        entry.name,
        chk_uri,
        batch + 1,
        path_uri,
        copied.rows,
    )
    return PreparedQuery(chk_uri, path_uri, batch, tuple(offsets), copied.rows)
