"""The Delta log as the txn-delta source reads it: the reader features it supports, the
files a commit adds or changes, column mapping, and a snapshot's deletion vectors."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import SourceError
from ..storage import fs as _fs
from ..storage.delta_tables import read_commit

# Reader features whose semantics this source implements (anything else is refused by name).
SUPPORTED_READER_FEATURES = frozenset(
    {
        "columnMapping",
        "deletionVectors",
        "timestampNtz",
        "typeWidening",
        "typeWidening-preview",
        "v2Checkpoint",
        "vacuumProtocolCheck",
    }
)


@dataclass(frozen=True)
class DeltaFile:
    uri: str
    # (logical column, value already converted to the column's Python type), partition columns only
    partition_values: tuple[tuple[str, Any], ...] = ()
    # the add action's deletionVector descriptor, as sorted items; None without one
    deletion_vector: tuple[tuple[str, Any], ...] | None = None
    # bytes of the data file as its action says (maxBytesPerBatch); 0 where it says none
    size: int = 0

    def constants(self) -> dict[str, Any]:
        """Column name -> the value every row of the file has (its partition values)."""
        return dict(self.partition_values)


@dataclass(frozen=True)
class ChangeSet:
    files: tuple[DeltaFile, ...]
    # why this version cannot be streamed (the stream stops before it); None if it can
    error: str | None = None


@dataclass(frozen=True)
class _Protocol:
    min_reader_version: int
    reader_features: list[str] | None

    @classmethod
    def of(cls, protocol: Any) -> _Protocol:
        """From a log ``protocol`` action or deltalake's ``ProtocolVersions``."""
        if isinstance(protocol, Mapping):
            return cls(int(protocol.get("minReaderVersion", 1)), protocol.get("readerFeatures"))
        return cls(int(protocol.min_reader_version), list(protocol.reader_features or []) or None)


def _protocol_problem(protocol) -> str | None:
    version = int(protocol.min_reader_version)
    if version > 3:
        return f"needs Delta reader version {version}; this source reads versions 1 to 3"
    if version == 3:
        unknown = sorted(set(protocol.reader_features or []) - SUPPORTED_READER_FEATURES)
        if unknown:
            return (
                f"uses Delta reader feature(s) {unknown}, which this source does not implement "
                f"(it implements {sorted(SUPPORTED_READER_FEATURES)})"
            )
    return None


def _mapping_mode(configuration: Mapping[str, Any], protocol: _Protocol) -> str:
    """The column mapping mode in effect: the table property counts only when the protocol
    supports the feature (reader version 2, or 3 listing ``columnMapping``), PROTOCOL.md says."""
    supported = protocol.min_reader_version == 2 or (
        protocol.min_reader_version == 3 and "columnMapping" in (protocol.reader_features or [])
    )
    if not supported:
        return "none"
    mode = str(configuration.get("delta.columnMapping.mode") or "none").lower()
    if mode not in ("none", "name", "id"):
        raise SourceError(f"txn-delta source: unknown column mapping mode {mode!r}")
    return mode


def _read_commit(fs, root: str, version: int, uri: str) -> list[dict]:
    try:
        return read_commit(fs, root, version)
    except FileNotFoundError:
        raise SourceError(
            f"txn-delta source: commit {version} of {uri} is no longer in the Delta "
            "log (log retention cleaned it up): those offsets cannot be replayed. Restart from "
            "a snapshot (startingVersion=snapshot with a new checkpoint)."
        ) from None


_CHECKPOINT = re.compile(
    r"(\d{20})\.checkpoint(?:\.(\d{10})\.(\d{10})|\.([0-9a-fA-F-]{36}))?\.(parquet|json)"
)


def _snapshot_deletion_vectors(fs, root: str, version: int, paths: list[str]) -> dict[str, Any]:
    """path -> deletionVector of the live ``paths`` at ``version`` (deltalake 1.6's add-action
    listing has none): the newest add of each path, from the commits back to a checkpoint."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    log = _fs.join(root, "_delta_log")
    names = [n.rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(log, detail=False)]
    parts: dict[int, dict[Any, set]] = {}
    for n in names:
        m = _CHECKPOINT.fullmatch(n)
        if m and int(m[1]) <= version:
            kind = ("multi", int(m[3])) if m[2] else ("single", n)
            parts.setdefault(int(m[1]), {}).setdefault(kind, set()).add(n)
    base, base_files = -1, []
    for v in sorted(parts, reverse=True):
        for (kind, arg), files in parts[v].items():
            if kind == "single" or len(files) == arg:
                base, base_files = v, sorted(files)
                break
        if base >= 0:
            break
    need, found = set(paths), {}
    for v in range(version, base, -1):
        if not need:
            break
        for action in _read_commit(fs, root, v, root):
            add = action.get("add")
            if add and add["path"] in need:
                found[add["path"]] = add.get("deletionVector")
                need.discard(add["path"])
    if not need:
        return found
    wanted = pa.array(sorted(need), pa.string())

    def take(adds) -> None:
        for a in adds:
            if a and a["path"] in need:
                found[a["path"]] = a.get("deletionVector")
                need.discard(a["path"])

    def from_parquet(path: str) -> list[str]:
        sidecars: list[str] = []
        with fs.open(path, "rb") as fh:
            pf = pq.ParquetFile(fh)
            cols = [c for c in ("add", "sidecar") if c in pf.schema_arrow.names]
            for batch in pf.iter_batches(columns=cols):
                if "add" in cols:
                    add = batch.column("add")
                    hit = pc.fill_null(pc.is_in(pc.struct_field(add, "path"), wanted), False)
                    take(add.filter(hit).to_pylist())
                if "sidecar" in cols:
                    sidecars += [s["path"] for s in batch.column("sidecar").to_pylist() if s]
        return sidecars

    sidecars: list[str] = []
    for name in base_files:
        path = _fs.join(log, name)
        if name.endswith(".json"):
            text = _fs.read_text(fs, path)
            lines = [json.loads(line) for line in text.splitlines() if line.strip()]
            take(a.get("add") for a in lines)
            sidecars += [a["sidecar"]["path"] for a in lines if "sidecar" in a]
        else:
            sidecars += from_parquet(path)
    for sidecar in sidecars:
        if "://" not in sidecar and not sidecar.startswith("/"):
            sidecar = _fs.join(log, "_sidecars", sidecar)
        from_parquet(sidecar.removeprefix("file://"))
    if need:
        raise SourceError(
            f"txn-delta source: the Delta log of {root} has no add action for "
            f"{sorted(need)[:3]} at or before version {version}: cannot find their deletion "
            "vectors"
        )
    return found
