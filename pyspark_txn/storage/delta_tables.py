"""Open Delta tables once per thread and catch up, instead of replaying the log each time.

Opening a ``DeltaTable`` lists and replays the log since the last checkpoint
(measured: 8 ms for the record table, 20 ms for a target with 60 commits);
``update_incremental`` reads only the new commits (~2 ms). A protocol step
opens tables 5-7 times per micro-batch, so this is most of the per-batch cost.

Safety rules:
- Objects are cached **per thread**: the record table checks an app
  transaction on the same snapshot it commits on, which another thread's
  ``update_incremental`` must never move underneath it.
- A cached table is reused only if the commit file of the version it last saw
  is still the same file (size and mtime). A table that was deleted and
  created again has a different or missing file there, so it is reopened
  from scratch: catching up across a re-creation would mix two tables.
- A cached table is opened afresh once it has caught up over
  :data:`REBASE_AFTER` commits: delta-rs's ``update_incremental`` keeps the
  log segment it opened with (it never moves to a newer checkpoint), and every
  commit built on it replays that whole segment (measured, deltalake 1.6.6,
  local disk: an append 3 ms on a fresh table, 44 ms 600 commits later on one
  object with a checkpoint every 100; 4-11 ms when reopened at each
  checkpoint). Writers that checkpoint call :func:`forget_table` right after.
- Within one protocol step (:func:`one_check_per_step`: a Spark writer's life in
  the planner, building it and allocating; or in the commit worker), a
  table checked once is not checked again for ``refresh=False`` reads (never for
  a write, ``for_write``: a table re-created since would take the commit): the step
  might as well have held on to the object, and the opens that must see the
  latest commit (``refresh=True``) still check. A commit step opened the target
  six times and the record table twice, each check a request on an object store.
- A cached object made from commit files reads them again for some answers
  (``transaction_version`` replays its log segment), and another writer may
  have checkpointed the table and cleaned those files up since (its log
  retention elapsed): :func:`read_table` then forgets the object and opens the
  table afresh from its latest checkpoint, once.
- On S3 and GCS that check is one LIST of ``_delta_log`` from that commit file
  on (``start-after``; through obstore, configured from the same delta-rs
  options), which also says whether anything is newer: a table with nothing
  new costs that one request, where a HEAD of the file and delta-rs's own
  catch-up (a LIST of the log since its checkpoint) cost two. Stores that cannot
  list from an offset (Azure lists a whole prefix) HEAD the file instead. The
  marker is the file's size and ETag. Opening from scratch costs a
  ``_last_checkpoint`` GET, a LIST and a GET of every commit since the
  checkpoint (and of the checkpoint itself); catching up costs the check, a
  LIST and the new commits only (measured against moto:
  benchmarks/s3_requests.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from . import fs as _fs

log = logging.getLogger(__name__)

T = TypeVar("T")

_LOCAL = threading.local()

#: How old a cached table may be for ``open_table(refresh=False)``: far below the
#: record table's log retention, so no log entry after it can have been cleaned up.
STALE_OK_S = 5.0

#: Commits a cached table may catch up over before it is opened afresh from the
#: latest checkpoint (Delta's default checkpoint interval is 100).
REBASE_AFTER = 100


#: Stores whose LIST starts after a given key on the server (object_store's
#: ``offset``); elsewhere it lists the whole prefix and filters.
_LISTS_FROM_OFFSET = frozenset({"s3", "s3a", "gs", "gcs"})

Marker = tuple[int, int, int]


def _listed_commits(
    uri: str, version: int, options: Mapping[str, str] | None
) -> dict[int, Marker] | None:
    """Markers of the commit files from ``version`` on, from one LIST; None where the
    store cannot list from an offset or the LIST failed (callers then HEAD)."""
    if uri.split("://", 1)[0].lower() not in _LISTS_FROM_OFFSET:
        return None
    from .options import object_store_fs

    found = object_store_fs(uri, options)
    if found is None:
        return None
    fs, root = found
    bucket, _, key = root.partition("/")
    prefix = f"{key}/_delta_log/" if key else "_delta_log/"
    try:
        import obstore

        store = fs._construct_store(bucket)
        offset = f"{prefix}{version - 1:020d}.json" if version > 0 else None
        listed = obstore.list(store, prefix, offset=offset).collect()
    except Exception:  # unreachable, denied...: do not trust the cache; reopening says why
        log.debug("LIST of %s/_delta_log from %d failed", uri, version, exc_info=True)
        return None
    markers: dict[int, Marker] = {}
    for meta in listed:
        name = str(meta["path"]).rsplit("/", 1)[-1]
        stem, _, ext = name.partition(".")
        if ext == "json" and len(stem) == 20 and stem.isdigit():
            v = int(stem)
            markers[v] = (v, int(meta["size"]), _tag(meta.get("e_tag"), meta["last_modified"]))
    return markers


def _tag(e_tag: Any, last_modified: Any) -> int:
    return hash(str(e_tag or last_modified))


def commit_file_marker(
    uri: str, version: int, options: Mapping[str, str] | None = None
) -> Marker | None:
    """(version, size, mtime) of the commit file of ``version``; None if there is none."""
    name = f"{version:020d}.json"
    listed = _listed_commits(uri, version, options)
    if listed is not None:  # the same request the catch-up check makes: same markers
        return listed.get(version)
    if _fs.is_local(uri):
        try:
            st = os.stat(os.path.join(uri, "_delta_log", name))
        except OSError:
            return None
        return (version, st.st_size, st.st_mtime_ns)
    from .options import object_store_fs

    found = object_store_fs(uri, options)
    if found is not None:  # one HEAD (delta-rs' file info costs a LIST and a HEAD)
        fs, root = found
        try:
            head = fs.info(f"{root}/_delta_log/{name}")
        except FileNotFoundError:
            return None
        except Exception:  # unreachable, denied...: do not trust the cache; reopening says why
            log.debug("HEAD of %s/_delta_log/%s failed", uri, name, exc_info=True)
            return None
        if head.get("type") != "file":
            return None
        return (version, int(head["size"]), _tag(head.get("e_tag"), head.get("last_modified")))
    import pyarrow.fs as pa_fs

    try:
        info = _store(uri, options).get_file_info([f"_delta_log/{name}"])[0]
    except Exception:  # unreachable, denied...: do not trust the cache; reopening says why
        log.debug("HEAD of %s/_delta_log/%s failed", uri, name, exc_info=True)
        return None
    if info.type != pa_fs.FileType.File or info.size is None:
        return None
    return (version, int(info.size), int(info.mtime_ns or 0))


def commit_markers_from(
    uri: str, version: int, options: Mapping[str, str] | None = None
) -> dict[int, Marker]:
    """Markers of the commit files from ``version`` on: one LIST on S3 and GCS; else
    ``version``, ``version + 1``, ... until one is missing (a ``stat`` each on local
    disk, a HEAD each on other stores). Commits are numbered without gaps and cleaned
    up oldest first, so the first missing file ends the log."""
    listed = _listed_commits(uri, version, options)
    if listed is not None:
        return listed
    markers: dict[int, Marker] = {}
    v = version
    while (found := commit_file_marker(uri, v, options)) is not None:
        markers[v] = found
        v += 1
    return markers


def put_marker(uri: str, version: int, size: int, e_tag: str | None) -> Marker | None:
    """The marker a LIST will show for the commit file just PUT with this ETag, where
    it can be known without asking (S3: the PUT's ETag is the one its LIST gives);
    None elsewhere (ask with :func:`commit_file_marker`)."""
    if not e_tag or uri.split("://", 1)[0].lower() not in ("s3", "s3a"):
        return None
    return (version, size, _tag(e_tag, None))


def _has_commit(uri: str, version: int) -> bool:
    return os.path.exists(os.path.join(uri, "_delta_log", f"{version:020d}.json"))


def _key(uri: str, options: Mapping[str, str] | None) -> tuple:
    """This thread's cache key of a table: its URI and storage options."""
    return (uri, tuple(sorted((options or {}).items())))


def _tables() -> dict:
    """This thread's cached tables: key -> (table, marker, read at, base version)."""
    return _LOCAL.__dict__.setdefault("tables", {})


def _store(uri: str, options: Mapping[str, str] | None):
    """delta-rs's object store for the table root, kept per thread (it holds a client)."""
    from deltalake.fs import DeltaStorageHandler

    stores: dict = _LOCAL.__dict__.setdefault("stores", {})
    key = _key(uri, options)
    store = stores.get(key)
    if store is None:
        store = stores[key] = DeltaStorageHandler(uri, dict(options or {}) or None)
    return store


@contextmanager
def one_check_per_step(checked: set | None = None) -> Iterator[None]:
    """Within the block, this thread checks each cached table once for reads that
    accept a slightly stale copy (``refresh=False``); see the module's rules.
    ``checked``: the tables checked so far in this step, to carry a step over several
    blocks (a Spark writer's life in one process: built, then pickled or committed)."""
    outer = getattr(_LOCAL, "checked", None)
    _LOCAL.checked = checked if checked is not None else (set() if outer is None else outer)
    try:
        yield
    finally:
        _LOCAL.checked = outer


def open_table(
    uri: str,
    storage_options: Mapping[str, str] | None = None,
    *,
    refresh: bool = True,
    for_write: bool = False,
) -> Any | None:
    """The table at ``uri`` at its latest version, or None if there is none.

    ``refresh=False`` returns this thread's cached table as last read, if that
    was less than :data:`STALE_OK_S` ago: for a commit whose conflict check makes
    a slightly stale snapshot safe. ``for_write``: a commit will be built on it, so
    it is checked even where this step checked it already (a table re-created since
    would take the commit: its conflict check cannot tell two tables apart).
    """
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    options = dict(storage_options or {}) or None
    cache = _tables()
    key = _key(uri, options)
    checked: set | None = getattr(_LOCAL, "checked", None)
    entry = cache.get(key)
    if entry is not None and not (refresh or for_write) and checked is not None and key in checked:
        return entry[0]
    cache.pop(key, None)
    if checked is not None:
        checked.add(key)
    dt = None
    listed: dict[int, Marker] | None = None
    if entry is not None:
        cached, marker, read_at, base = entry
        if marker is not None:
            listed = _listed_commits(uri, marker[0], options)
        if cached.version() - base >= REBASE_AFTER:
            pass  # a long log segment: open afresh from the latest checkpoint
        elif cached.version() > marker[0] if marker is not None else False:
            # Moved by a commit made through it that nobody noted (note_own_commit):
            # the file at its version may not be ours any more (the table put back to
            # an older copy, then someone else's commit there), so it is not trusted.
            pass
        elif (
            marker is not None
            and (
                listed.get(marker[0])
                if listed is not None
                else commit_file_marker(uri, marker[0], options)
            )
            == marker
        ):
            if not refresh and time.monotonic() - read_at < STALE_OK_S:
                cache[key] = entry
                return cached
            if listed is not None and max(listed) <= marker[0]:
                cache[key] = (cached, marker, time.monotonic(), base)  # nothing newer
                return cached
            if _fs.is_local(uri) and not _has_commit(uri, marker[0] + 1):
                # Nothing new: on a local disk delta-rs' catch-up lists the whole
                # _delta_log folder (every commit the log retention keeps: the cost
                # grew with the number of batches). Commits are numbered without
                # gaps and cleaned up oldest first: no next file, no newer commit.
                cache[key] = (cached, marker, time.monotonic(), base)
                return cached
            try:
                cached.update_incremental()
                dt = cached
            except Exception:  # the log changed under us in a way it cannot follow: reopen
                dt = None
            if dt is not None and dt.version() == marker[0]:
                cache[key] = (dt, marker, time.monotonic(), base)  # no new commit: same marker
                return dt
    if dt is None:
        try:
            dt = DeltaTable(uri, storage_options=options)
        except TableNotFoundError:
            return None
        base = dt.version()
    # The LIST made before the catch-up or reopen shows every commit file up to then:
    # a version it holds needs no second request for its marker.
    marker_now = listed.get(dt.version()) if listed else None
    if marker_now is None:
        marker_now = commit_file_marker(uri, dt.version(), options)
    cache[key] = (dt, marker_now, time.monotonic(), base)
    return dt


def log_file_gone(error: BaseException) -> bool:
    """Whether ``error`` (delta-rs's, or a store's) says a file of a ``_delta_log`` is
    missing: "Kernel error: File not found: .../_delta_log/...json" on a local disk,
    "Object at location .../_delta_log/... not found" on an object store."""
    text = str(error)
    return "_delta_log" in text and (_fs.is_not_found(error) or "not found" in text.lower())


def read_table(
    uri: str,
    storage_options: Mapping[str, str] | None,
    read: Callable[[Any], T],
    *,
    refresh: bool = True,
) -> tuple[Any, T]:
    """``(table, read(table))`` for :func:`open_table`'s table (None if there is none).

    A cached object made from commit files reads them again for some answers
    (delta-rs's ``transaction_version`` replays its log segment). Another writer may
    have checkpointed the table and cleaned those files up since; the object is then
    forgotten and the table opened afresh from its latest checkpoint, once: a second
    failure is raised as it is.
    """
    dt = open_table(uri, storage_options, refresh=refresh)
    try:
        return dt, read(dt)
    except Exception as e:
        if dt is None or not log_file_gone(e):
            raise
        log.info("Delta table %s: reopened, a log file this copy read is gone (%s)", uri, e)
    forget_table(uri, storage_options)
    dt = open_table(uri, storage_options, refresh=True)
    return dt, read(dt)


def read_commit(fs: Any, root: str, version: int) -> list[dict[str, Any]]:
    """The actions of commit ``version`` of the table at ``root`` in ``fs``: one GET.
    ``FileNotFoundError`` if the log does not hold it (cleaned up, or never written)."""
    import json

    path = _fs.join(root, "_delta_log", f"{version:020d}.json")
    try:
        raw = fs.cat_file(path)
    except Exception as e:
        if _fs.is_not_found(e):
            raise FileNotFoundError(path) from None
        raise
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def read_commit_actions(
    uri: str, version: int, options: Mapping[str, str] | None = None
) -> list[dict[str, Any]] | None:
    """The actions of one commit file, one GET; None if it cannot be read (gone,
    unreachable, a store obstore lacks): callers then ask delta-rs."""
    try:
        if _fs.is_local(uri):
            import fsspec

            return read_commit(fsspec.filesystem("file"), uri, version)
        from .options import object_store_fs

        found = object_store_fs(uri, options)
        if found is None:
            return None
        return read_commit(*found, version)
    except Exception:  # missing, unreachable, not JSON: delta-rs decides and says why
        log.debug("reading commit %d of %s failed", version, uri, exc_info=True)
        return None


def note_own_commit(uri: str, storage_options: Mapping[str, str] | None, dt: Any) -> None:
    """After a commit made through ``dt`` (this thread's cached table, caught up to
    it): the cache's marker becomes that commit's file, as read now (a LIST or a
    ``stat``), so that later checks compare against our own file."""
    options = dict(storage_options or {}) or None
    cache = _tables()
    key = _key(uri, options)
    entry = cache.get(key)
    if entry is None or entry[0] is not dt:
        return
    marker = commit_file_marker(uri, dt.version(), options)
    cache[key] = (dt, marker, entry[2], entry[3])


def forget_table(uri: str, storage_options: Mapping[str, str] | None = None) -> None:
    """Drop this thread's cached table: the next open reads the log from scratch (from
    the latest checkpoint: call it after writing one)."""
    _tables().pop(_key(uri, storage_options), None)


def read_rows(table: Any, storage: Any = None) -> list[dict[str, Any]]:
    """Every row of a small table this package wrote (a backup catalog, a manifest),
    read file by file with pyarrow's reader on one thread, each row with every column
    of the table's schema (None where its file predates the column).

    Neither ``DeltaTable.to_pyarrow_table()`` nor ``pq.read_table(file)``: pyarrow's
    threaded reads of a file object (the dataset reader both use) can leave threads
    that abort the interpreter as it exits ("terminate called without an active
    exception", rc 134: 7-13 of 20 one-row reads in a short script, pyarrow 26), and a
    user's script that calls our Python API and ends would die after its work was done.
    ``table``: a URI, or a ``DeltaTable`` to read at its version; ``storage``: the
    StorageOptions (None: the one in effect). A file that holds another number of rows
    than the log says is :class:`CorruptSnapshotError`. Raises delta-rs'
    ``TableNotFoundError`` where there is no table, as ``DeltaTable`` does."""
    import pyarrow.parquet as pq

    dt, files = _data_files(table, storage)
    if files is None:  # delta-rs' dataset, still on one thread (0 of 20 aborted)
        return dt.to_pyarrow_dataset().to_table(use_threads=False).to_pylist()
    names = [f.name for f in dt.schema().fields]
    rows: list[dict[str, Any]] = []
    for file in files:
        with file.open() as f:
            got = pq.ParquetFile(f).read(use_threads=False)
        file.check_rows(got.num_rows)
        rows.extend({n: r.get(n) for n in names} for r in got.to_pylist())
    return rows


def count_rows(table: Any, storage: Any = None) -> int:
    """The table's row count from every data file's footer (so a missing or truncated
    file fails here, as does a footer that disagrees with the log), read as
    :func:`read_rows` reads."""
    import pyarrow.parquet as pq

    dt, files = _data_files(table, storage)
    if files is None:
        return int(dt.to_pyarrow_dataset().count_rows())
    total = 0
    for file in files:
        with file.open() as f:
            n = pq.ParquetFile(f).metadata.num_rows
        file.check_rows(n)
        total += n
    return total


class _DataFile:
    """One data file of a table's version: where it is and how many rows its add says."""

    def __init__(self, fs: Any, path: str, rows: int | None) -> None:
        self.fs, self.path, self.rows = fs, path, rows

    def open(self) -> Any:
        return self.fs.open(self.path, "rb")

    def check_rows(self, found: int) -> None:
        if self.rows is not None and found != self.rows:
            from ..errors import CorruptSnapshotError

            raise CorruptSnapshotError(
                f"{self.path}: {found} rows in the file, {self.rows} in the table's log "
                "(the file was replaced or rewritten)"
            )


def _data_files(table: Any, storage: Any) -> tuple[Any, list[_DataFile] | None]:
    """The table and its version's data files; None for a table whose files do not hold
    its rows as they are (partition values kept in the log, deletion vectors, renamed
    columns: this package writes none of those), which delta-rs must read."""
    from urllib.parse import unquote

    import pyarrow as pa
    from deltalake import DeltaTable

    from .options import current

    options = current() if storage is None else storage
    if isinstance(table, str):
        table = _fs.normalize_uri(table)  # file://localhost/... is this machine's path
        dt = DeltaTable(table, storage_options=options.for_delta())
    else:  # delta-rs gives its URI percent-encoded (a space as %20), as it reads paths
        dt, table = table, unquote(table.table_uri)
    if dt.metadata().partition_columns or dt.protocol().min_reader_version > 1:
        return dt, None
    adds = pa.table(dt.get_add_actions(flatten=False))
    paths = adds.column("path").to_pylist()
    if any("://" in p for p in paths):  # files outside the table (a shallow clone)
        return dt, None
    fs, root = _fs.filesystem(table, options)
    counts = adds.column("num_records").to_pylist()
    return dt, [
        _DataFile(fs, _fs.join(root, unquote(p)), None if n is None else int(n))
        for p, n in zip(paths, counts, strict=True)
    ]
