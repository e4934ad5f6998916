"""Finding a sink from outside Spark: :func:`open_sink` takes a checkpoint location or a
record table and returns a :class:`SinkHandle` (record store, target, which kind). Every
operation starts here; nothing needs a SparkSession."""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from .. import storage
from ..errors import ConfigError
from ..sinks.twophase import (
    TargetTerms,
)
from ..spark.options import check_location
from ..state import DeltaEventLog, EventKind, RecordStore, SinkState
from ..state.events import arrow_schema as record_table_schema
from ..storage import fs as _fs
from ..storage.checkpoint import RECORDS_DIR, latest_batch, read_sink_file

log = logging.getLogger(__name__)

#: First event kinds of offset-log streams (acknowledging sources), not sinks.
OFFSET_LOG_KINDS = frozenset({EventKind.CLAIM, EventKind.ACKED})
CHUNK_BYTES = 1 << 20

Progress = Callable[[int, int], None]


# --- finding a sink -----------------------------------------------------------


def _is_record_table(uri: str, storage_options: Mapping[str, str] | None) -> bool:
    """Whether ``uri`` is a record table; a Delta table of another kind is an error."""
    from deltalake import DeltaTable

    options = dict(storage_options or {}) or storage.current().for_delta()
    if not DeltaTable.is_deltatable(uri, options):
        return False
    names = set(DeltaTable(uri, storage_options=options).schema().to_arrow().names)
    if not set(record_table_schema().names) <= names:
        raise ConfigError(
            f"{uri} is a Delta table but not a pyspark-txn record table (its columns are "
            f"{sorted(names)}); give a checkpoint location or a record table"
        )
    return True


def location_uri(location: str) -> str:
    """The normalized URI of a location a command was given (a checkpoint or a record
    table), refused by name when it is empty, unusable or a local file."""
    if not location.strip():
        raise ConfigError("the location is empty: give a checkpoint location or a record table")
    check_location("location", location)
    uri = _fs.normalize_uri(location)
    if _fs.is_local(uri):
        _refuse_a_file(location, _nearest_existing(uri))
    return uri


def _nearest_existing(path: str) -> str:
    """``path`` or its nearest ancestor that exists (a file there hides the rest)."""
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _refuse_a_file(location: str, file: str) -> None:
    if not os.path.isfile(file):
        return
    where = location if _fs.normalize_uri(location) == file else f"{location}: {file}"
    raise ConfigError(
        f"{where} is a file, not a checkpoint location or record table: give the query's "
        "checkpointLocation (a folder) or its record table"
    )


def locate_record_table(
    location: str, storage_options: Mapping[str, str] | None = None
) -> tuple[str, str | None] | None:
    """``(record table URI, checkpoint URI or None)`` for a checkpoint or record table;
    None where there is no record table (see :func:`find_record_table`)."""
    uri = location_uri(location)
    candidate = _fs.join(uri, *RECORDS_DIR)
    if _is_record_table(candidate, storage_options):
        return candidate, uri
    kept = _kept_record_table(uri)
    if kept is not None and _is_record_table(kept, storage_options):
        return kept, uri  # a checkpoint whose sink keeps its records elsewhere
    if _is_record_table(uri, storage_options):
        suffix = "/" + "/".join(RECORDS_DIR)
        return uri, (uri[: -len(suffix)] if uri.endswith(suffix) else None)
    return None


def find_record_table(
    location: str, storage_options: Mapping[str, str] | None = None
) -> tuple[str, str | None]:
    """``(record table URI, checkpoint URI or None)`` for a checkpoint or record table.

    A checkpoint's record table is ``<checkpoint>/pyspark_txn/records``, or the one
    its ``sink.json`` names (option ``recordTable``). The checkpoint's own comes
    first: a copied checkpoint must never act on the original's history. A
    record table given directly at the default place also yields its checkpoint.
    """
    found = locate_record_table(location, storage_options)
    if found is not None:
        return found
    uri = _fs.normalize_uri(location)
    candidate = _fs.join(uri, *RECORDS_DIR)
    try:
        kept_file = read_sink_file(uri)
    except (OSError, ValueError):
        kept_file = None
    if kept_file is not None and kept_file.get("mode") == "light":
        raise ConfigError(
            f"the sink of checkpoint {location} runs with mode=light: it keeps no record "
            "table, so there is nothing to inspect here; its Delta table's history "
            "(commitInfo pyspark_txn.*) shows what it committed (docs/modes.md)"
        )
    started = read_started_from(uri)
    if started is not None:
        raise ConfigError(
            f"checkpoint {location}: {describe_origin(started)}, "
            f"{describe_not_started(next_batch(uri, started), kept_file is not None)}; its "
            "sink keeps "
            "no record table before its first commit, so there are no records or "
            "snapshots of it yet (pyspark-txn status shows it)"
        )
    if kept_file is not None:
        raise ConfigError(
            f"no record table at {candidate} yet: the sink of checkpoint {location} has not "
            "committed a batch"
        )
    if not _fs.is_local(uri) and _is_a_remote_file(uri):
        raise ConfigError(
            f"{location} is a file, not a checkpoint location or record table: give the "
            "query's checkpointLocation (a folder) or its record table"
        )
    if latest_batch(uri) is not None:  # Spark's offsets: a query ran, no sink of ours did
        raise ConfigError(
            f"checkpoint {location}: no batch was committed through a pyspark-txn sink with "
            "it yet (Spark planned batches, but its pyspark_txn/ folder holds no sink): "
            "nothing to inspect until the query's first commit"
        )
    raise ConfigError(
        f"no record table at {location} (looked for a checkpoint's {candidate} and for a "
        "Delta table at the location itself)"
    )


def _is_a_remote_file(uri: str) -> bool:
    """Whether an object store holds an object at ``uri`` itself (asked only where no
    record table was found: one request that a healthy location never pays)."""
    try:
        fs, root = _fs.filesystem(uri)
        return bool(fs.isfile(root))
    except Exception:  # the clear "no record table" is the answer then
        return False


#: Where ``snapshots prepare-query`` and ``backups restore`` write what a checkpoint was
#: made from (a named snapshot's JSON, ``from``: the original checkpoint, and for a
#: restore ``backup``: ``{"backup_id", "to"}``).
STARTED_FROM = ("pyspark_txn", "started_from.json")


def read_started_from(checkpoint: str) -> dict[str, Any] | None:
    """What ``<checkpoint>/pyspark_txn/started_from.json`` says; None without one (or
    where it cannot be parsed: it only explains, nothing depends on it). A store that
    cannot be read raises, as for every other file."""
    fs, root = _fs.filesystem(checkpoint)
    try:
        started = json.loads(_fs.read_text(fs, _fs.join(root, *STARTED_FROM)))
    except FileNotFoundError:
        return None
    except ValueError as e:
        log.warning("%s: cannot parse %s: %s", checkpoint, "/".join(STARTED_FROM), e)
        return None
    return started if isinstance(started, dict) else None


def describe_origin(started: Mapping[str, Any]) -> str:
    """Where a prepared or restored checkpoint came from, as a phrase: "restored from
    backup 4 (in /backups/orders)" or "started from snapshot 'nightly' of /chk/orders"."""
    backup = started.get("backup")
    if isinstance(backup, Mapping) and backup.get("backup_id") is not None:
        to = backup.get("to")
        return f"restored from backup {backup['backup_id']}" + (f" (in {to})" if to else "")
    name, origin = started.get("name"), started.get("from")
    return (f"started from snapshot {name!r}" if name else "started from a snapshot") + (
        f" of {origin}" if origin else ""
    )


def next_batch(checkpoint: str, started: Mapping[str, Any]) -> int | None:
    """The batch a prepared checkpoint's query runs next: after Spark's last committed
    batch (the snapshot's, as prepared)."""
    committed = latest_batch(checkpoint, "commits")
    if committed is not None:
        return committed + 1
    if started.get("fresh"):  # a stateful query restored as a new one: from batch 0
        return 0
    batch = started.get("batch_id")
    return batch + 1 if isinstance(batch, int) else None


def describe_not_started(next_batch: int | None, ran: bool) -> str:
    """The state of a prepared or restored checkpoint without a commit, as a phrase:
    "not started yet: next batch 32" (``ran``: its query has started, no commit yet)."""
    after = "" if next_batch is None else f": next batch {next_batch}"
    return ("started, no batch committed yet" if ran else "not started yet") + after


def _kept_record_table(location: str) -> str | None:
    try:
        kept = read_sink_file(location)
    except (OSError, ValueError):
        return None
    return None if kept is None else kept.get("record_table")


def sink_streams(store: RecordStore) -> list[str]:
    """The sink streams of a record table (offset-log streams of sources are skipped)."""
    out = []
    for stream in store.log.streams():
        events = store.events(stream)
        if events and events[0].kind not in OFFSET_LOG_KINDS:
            out.append(stream)
    return out


def kept_sink_id(checkpoint: str) -> str | None:
    """The sink id kept in ``<checkpoint>/pyspark_txn/sink.json``; None if there is none.

    Read only: unlike the sink's first use, this never writes the file.
    """
    kept = read_sink_file(checkpoint)
    return None if kept is None else kept["sink_id"]


#: Target kinds (``TargetTerms.kind``) the tools know.
DELTA, POSTGRES = "delta", "postgres"


def target_kind(meta: Mapping[str, Any]) -> str | None:
    """Which target a record's (or ``sink.json``'s) target description names; None if
    it names none."""
    kind = meta.get("kind")
    if kind:
        return str(kind)
    if meta.get("uri"):
        return DELTA
    if meta.get("table"):  # txn-postgres records from before the kind was kept
        return POSTGRES
    return None


def target_terms(kind: str | None) -> TargetTerms:
    """How messages name the things of a target kind (Delta's when it is unknown)."""
    if kind == POSTGRES:
        from ..sinks.postgres_target import PostgresTarget

        return PostgresTarget.terms
    from ..sinks.delta_target import DeltaTarget

    return DeltaTarget.terms


@dataclass(frozen=True)
class SinkHandle:
    """Where one sink's history and data live. Build it with :func:`open_sink`.

    ``kind`` is the target the sink's records name (``delta`` or ``postgres``; None
    before any does). A Delta target is ``target_uri``; a PostgreSQL one is
    ``target_meta`` (schema, table) in the database ``url`` (never with a password:
    libpq takes it from ``PGPASSWORD`` / ``~/.pgpass``, or ``password_file``).
    """

    record_table: str
    sink_id: str
    target_uri: str | None  # Delta; None: not a Delta target, or unknown yet
    storage_options: Mapping[str, str] = field(default_factory=dict, hash=False)
    fs_overrides: tuple[tuple[str, Any], ...] = field(default=(), hash=False)
    partition_by: tuple[str, ...] = ()
    checkpoint: str | None = None
    kind: str | None = None
    target_meta: Mapping[str, Any] = field(default_factory=dict, hash=False)
    url: str | None = field(default=None, repr=False)
    password_file: str | None = None

    @property
    def storage(self) -> storage.StorageOptions:
        """The sink's storage configuration (``storage_options`` and ``fs.*`` overrides)."""
        return storage.StorageOptions(
            items=tuple(sorted(self.storage_options.items())), fs_overrides=self.fs_overrides
        )

    @property
    def has_target(self) -> bool:
        """Whether the handle knows where the sink writes."""
        return self.kind == POSTGRES or self.target_uri is not None

    @property
    def terms(self) -> TargetTerms:
        return target_terms(self.kind)

    @property
    def target_label(self) -> str | None:
        """The target as messages name it (never with a password); None if unknown."""
        if self.kind != POSTGRES:
            return self.target_uri
        from ..sinks.postgres_db import redact

        schema, table = self._pg_table()
        where = redact(self.url) if self.url else "a database its records do not name"
        return f"PostgreSQL table {schema}.{table} at {where}"

    def _pg_table(self) -> tuple[str, str]:
        meta = self.target_meta
        if meta.get("schema") and meta.get("name"):
            return str(meta["schema"]), str(meta["name"])
        schema, _, table = str(meta.get("table", "")).partition(".")  # older records
        return schema, table

    def require_delta(self, command: str) -> None:
        """Refuse ``command`` (which reads a Delta table's files) for another target."""
        if self.kind not in (None, DELTA):
            raise ConfigError(
                f"pyspark-txn {command}: sink {self.sink_id!r} writes to {self.target_label}; "
                f"{command} works on txn-delta sinks only (it copies or reads a Delta "
                "table's files), so it is not available for this sink"
            )

    def record_store(self) -> RecordStore:
        return RecordStore(DeltaEventLog(self.record_table, dict(self.storage_options)))

    def target(self) -> Any:
        """The sink's phase-2 :class:`~pyspark_txn.sinks.twophase.Target` (close it after
        use: a PostgreSQL one holds a connection)."""
        if self.kind == POSTGRES:
            return self._postgres_target()
        from ..sinks.delta_target import DeltaTarget

        if self.target_uri is None:
            raise ConfigError(
                f"sink {self.sink_id!r} has no snapshot record yet, so its target table is "
                "unknown; pass target_uri to open_sink"
            )
        return DeltaTarget(
            self.target_uri,
            self.sink_id,
            partition_by=self.partition_by,
            storage=self.storage,
        )

    def _postgres_target(self) -> Any:
        from ..sinks.postgres_db import Connector
        from ..sinks.postgres_target import PostgresTarget

        schema, table = self._pg_table()
        if not self.url:
            raise ConfigError(
                f"sink {self.sink_id!r} writes to {self.target_label} (its records, written "
                "by an older pyspark-txn, do not name the database): pass --url "
                "postgresql://user@host:5432/db (open_sink(url=...))"
            )
        return PostgresTarget(Connector(self.url, self.password_file), schema, table, self.sink_id)

    def committer(self) -> Any:
        """A :class:`~pyspark_txn.sinks.twophase.TwoPhaseCommitter` for this sink."""
        from ..sinks.twophase import TwoPhaseCommitter

        return TwoPhaseCommitter(self.record_store(), self.target(), self.sink_id)

    def load(self) -> SinkState:
        """The sink's state: a fold over its events (every invariant checked)."""
        return self.record_store().load_sink(self.sink_id)


F = TypeVar("F", bound=Callable[..., Any])


def _in_handle_storage(func: F) -> F:
    """Run ``func(handle, ...)`` with the handle's storage options in effect, so every
    nested read (folder sizes, staged files, checkpoints) reaches the store with them,
    not with whatever configuration the caller had (a trial found ``sink_status``
    reading the record table's folder with the ambient one)."""

    @functools.wraps(func)
    def wrapper(handle: SinkHandle, *args: Any, **kwargs: Any) -> Any:
        with storage.using(handle.storage):
            return func(handle, *args, **kwargs)

    return cast(F, wrapper)


def open_sink(
    location: str,
    sink_id: str | None = None,
    storage_options: storage.StorageOptions | Mapping[str, Any] | str | None = None,
    *,
    target_uri: str | None = None,
    url: str | None = None,
    password_file: str | None = None,
) -> SinkHandle:
    """Find one sink from a checkpoint location or a record table URI.

    The sink id is, in order: ``sink_id``; the one kept in the checkpoint's
    ``pyspark_txn/sink.json``; the record table's only sink stream. Several
    sinks and no id is a :class:`ConfigError` naming them. The target is the one
    the sink's last snapshot record names (before any: the checkpoint's
    ``sink.json``, for targets other than Delta). ``target_uri`` overrides a Delta
    table; ``url`` the database of a PostgreSQL one, whose password comes from
    ``password_file``, the URL, or libpq (``PGPASSWORD``, ``~/.pgpass``).
    ``storage_options``: the object-store keys of ``storageOptions`` (JSON text, a
    mapping or :class:`~pyspark_txn.storage.StorageOptions`; default: the ones in effect,
    e.g. the CLI's ``--storage-options``), for the record table, target and checkpoint.
    """
    parsed = (
        storage.current()
        if storage_options is None
        else storage.StorageOptions.coerce(storage_options)
    )
    with storage.using(parsed):
        return _open_sink(location, sink_id, parsed, target_uri, url, password_file)


def _open_sink(
    location: str,
    sink_id: str | None,
    parsed: storage.StorageOptions,
    target_uri: str | None,
    url: str | None,
    password_file: str | None,
) -> SinkHandle:
    options = dict(parsed.items)
    record_table, checkpoint = find_record_table(location, options)
    store = RecordStore(DeltaEventLog(record_table, options))
    sinks = sink_streams(store)
    chosen = sink_id or (kept_sink_id(checkpoint) if checkpoint else None)
    if chosen is None:
        if not sinks:
            raise ConfigError(f"the record table {record_table} holds no sink yet")
        if len(sinks) > 1:
            raise ConfigError(
                f"the record table {record_table} holds several sinks: {', '.join(sinks)}; "
                "choose one (--sink ID)"
            )
        chosen = sinks[0]
    elif chosen not in sinks:
        raise ConfigError(
            f"the record table {record_table} has no sink {chosen!r}; its sinks: "
            f"{', '.join(sinks) or 'none'}"
        )
    meta = recorded_target(store, chosen)
    if target_kind(meta) is None and checkpoint is not None:
        kept = read_sink_file(checkpoint) or {}
        if kept.get("sink_id") == chosen:
            meta = kept.get("target") or meta
    kind = target_kind(meta) or (DELTA if target_uri else None)
    if kind == POSTGRES and target_uri:
        raise ConfigError(
            f"sink {chosen!r} writes to PostgreSQL, not to a Delta table: target_uri does "
            "not apply (give the database with url / --url)"
        )
    if kind != POSTGRES and (url or password_file):
        raise ConfigError(
            f"--url and --password-file apply to txn-postgres sinks; sink {chosen!r} "
            + ("writes to a Delta table" if kind == DELTA else "has no record naming its target")
        )
    uri = (target_uri or meta.get("uri")) if kind != POSTGRES else None
    return SinkHandle(
        record_table=record_table,
        sink_id=chosen,
        target_uri=_fs.normalize_uri(uri) if uri else None,
        storage_options=options,
        fs_overrides=parsed.fs_overrides,
        partition_by=tuple(meta.get("partition_by") or ()),
        checkpoint=checkpoint,
        kind=kind,
        target_meta=dict(meta) if kind == POSTGRES else {},
        url=(url or meta.get("url")) if kind == POSTGRES else None,
        password_file=password_file,
    )


def recorded_target(
    store: RecordStore, sink_id: str, state: SinkState | None = None
) -> Mapping[str, Any]:
    """What the sink's last snapshot record says about its target (``{}``: none does)."""
    for event in reversed(store.events(sink_id)):  # abandoned records still name the target
        if event.kind is EventKind.SNAPSHOT:
            return event.payload.get("target") or {}
    # the history starts at a summary: its records name the target
    last = (state or store.load_sink(sink_id)).last_record
    return last.target if last is not None else {}


def describe_target(meta: Mapping[str, Any]) -> str:
    """A record's target description as a line (never a password)."""
    kind = target_kind(meta)
    if kind == POSTGRES:
        from ..sinks.postgres_db import redact

        url = meta.get("url")
        return f"PostgreSQL table {meta.get('table')}" + (f" at {redact(url)}" if url else "")
    if kind == DELTA:
        return f"Delta table {meta.get('uri')}"
    return f"{kind}" if kind else "not named by any record yet"


@contextmanager
def opened_target(handle: SinkHandle) -> Iterator[Any]:
    """The handle's target, closed afterwards; None when the target is not known yet."""
    if not handle.has_target:
        yield None
        return
    target = handle.target()
    try:
        yield target
    finally:
        target.close()
