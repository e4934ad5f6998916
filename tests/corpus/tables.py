"""Corpus builders: each writes one small Delta table at ``path`` and says what reading it gives.

Written with delta-rs and its options where delta-rs can write the thing, by hand from the
protocol spec (``handmade``) where it cannot: deletion vectors, column-mapping renames and
drops, id-mode mapping, Spark-style partition values, type widening, unknown reader features.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal

import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.parquet as pq
from deltalake import DeltaTable, TableFeatures, write_deltalake

from . import handmade as hm

UTC = dt.timezone.utc


@dataclass
class Table:
    path: str
    # how deltalake reads the expected content: "pyarrow" (to_pyarrow_table), "query"
    # (QueryBuilder/DataFusion: deletion vectors, column mapping) or None (deltalake cannot)
    oracle: str | None = "pyarrow"
    # the content, known by construction (checked as well as the oracle)
    rows: list[dict] | None = None
    # the default snapshot read must fail with a SourceError matching this
    refuse: str | None = None
    # reading the appends from version 0: None = the same rows as the snapshot read (an
    # append-only history), a string = a SourceError matching it
    from_zero: str | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def add_action(table: str, name: str, rows: int, partition_values: dict | None = None) -> dict:
    """An ``add`` action for a data file already written into ``table``."""
    return {
        "add": {
            "path": name,
            "partitionValues": partition_values or {},
            "size": os.path.getsize(os.path.join(table, name)),
            "modificationTime": 0,
            "dataChange": True,
            "stats": json.dumps({"numRecords": rows}),
        }
    }


def _ids(lo: int, hi: int) -> pa.Array:
    return pa.array(range(lo, hi), pa.int64())


def appends_basic(path: str) -> Table:
    for k in range(3):
        ids = _ids(k * 10, k * 10 + 10)
        write_deltalake(
            path, pa.table({"id": ids, "name": [f"n{i}" for i in range(10)]}), mode="append"
        )
    return Table(path, rows=[{"id": i, "name": f"n{i % 10}"} for i in range(30)])


def _all_types_batch(k: int) -> pa.Table:
    n = 4
    ids = list(range(k * n, k * n + n))
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "i8": pa.array([1, -128, None, 127], pa.int8()),
            "i16": pa.array([1, -32768, None, 32767], pa.int16()),
            "i32": pa.array([1, -(2**31), None, 2**31 - 1], pa.int32()),
            "f32": pa.array([1.5, float("inf"), None, float("nan")], pa.float32()),
            "f64": pa.array([float("nan"), float("-inf"), None, float("inf")], pa.float64()),
            "dec": pa.array(
                [Decimal("1.25"), Decimal("-99999999.99"), None, Decimal("0.01")],
                pa.decimal128(10, 2),
            ),
            "big": pa.array(
                [Decimal("1" * 38), Decimal("-" + "9" * 38), None, Decimal(0)], pa.decimal128(38, 0)
            ),
            "s": pa.array(["ascii", "", None, "ünï 日本 🎉 \u0000"], pa.string()),
            "bin": pa.array([b"\x00\xff", b"", None, b"abc"], pa.binary()),
            "b": pa.array([True, False, None, True]),
            "d": pa.array([dt.date(1970, 1, 1), dt.date(1, 1, 1), None, dt.date(9999, 12, 31)]),
            "ts": pa.array(
                [
                    dt.datetime(2021, 1, 1, 1, 2, 3, 456789, tzinfo=UTC),
                    dt.datetime(1900, 1, 1, tzinfo=UTC),
                    None,
                    dt.datetime(2262, 4, 12, tzinfo=UTC),
                ],
                pa.timestamp("us", tz="UTC"),
            ),
            "st": pa.array(
                [{"a": 1, "b": "x"}, {"a": None, "b": None}, None, {"a": 3, "b": "ü"}],
                pa.struct([("a", pa.int32()), ("b", pa.string())]),
            ),
            "arr": pa.array([[1, 2], [], None, [None, 4]], pa.list_(pa.int64())),
            "m": pa.array(
                [[("k", 1)], [], None, [("a", None), ("b", 2)]], pa.map_(pa.string(), pa.int32())
            ),
            "nested": pa.array(
                [[{"x": [1.0]}], None, [], [{"x": None}]],
                pa.list_(pa.struct([("x", pa.list_(pa.float64()))])),
            ),
        }
    )


def all_types(path: str) -> Table:
    """Every primitive Spark and Delta share, nested types, nulls, NaN/±Infinity, unicode."""
    for k in range(2):
        write_deltalake(path, _all_types_batch(k), mode="append")
    return Table(path)


def timestamp_ntz(path: str) -> Table:
    """timestamp_ntz columns (the timestampNtz reader feature)."""
    t = pa.table(
        {
            "id": _ids(0, 3),
            "ntz": pa.array(
                [dt.datetime(2021, 1, 1, 12), None, dt.datetime(1, 1, 1)], pa.timestamp("us")
            ),
        }
    )
    write_deltalake(path, t)
    write_deltalake(path, t, mode="append")
    return Table(path)


def partitioned_by_types(path: str) -> Table:
    """Partitioned by string (unicode, '/', '=', '%', space, empty, null), date, timestamp,
    decimal and boolean, nulls included; each append adds files in several partitions."""
    strings = ["a", "ü/ x=%", "", None, "日本"]
    dates = [dt.date(2021, 1, 1), dt.date(1970, 1, 1), None, dt.date(2000, 2, 29), dt.date(1, 1, 1)]
    stamps = [
        dt.datetime(2021, 1, 1, 1, 2, 3, 456789, tzinfo=UTC),
        None,
        dt.datetime(1970, 1, 1, tzinfo=UTC),
        dt.datetime(2000, 1, 1, 23, 59, 59, tzinfo=UTC),
        dt.datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    ]
    decimals = [Decimal("1.25"), None, Decimal("3.50"), Decimal("0.00"), Decimal("99999999.99")]
    bools = [True, None, False, True, False]
    for k in range(2):
        t = pa.table(
            {
                "id": _ids(k * 5, k * 5 + 5),
                "v": pa.array([f"v{i}" for i in range(5)]),
                "s": pa.array(strings, pa.string()),
                "d": pa.array(dates, pa.date32()),
                "ts": pa.array(stamps, pa.timestamp("us", tz="UTC")),
                "dec": pa.array(decimals, pa.decimal128(10, 2)),
                "b": pa.array(bools, pa.bool_()),
            }
        )
        write_deltalake(path, t, mode="append", partition_by=["s", "d", "ts", "dec", "b"])
    rows = []
    for k in range(2):
        for i in range(5):
            rows.append(
                {
                    "id": k * 5 + i,
                    "v": f"v{i}",
                    # PROTOCOL.md: an empty partition value is null, for every type
                    "s": strings[i] or None,
                    "d": dates[i],
                    "ts": stamps[i],
                    "dec": decimals[i],
                    "b": bools[i],
                }
            )
    return Table(path, rows=rows)


def partitioned_numbers(path: str) -> Table:
    """Partitioned by integer types and doubles with NaN, ±Infinity, -0.0 and nulls."""
    t = pa.table(
        {
            "id": _ids(0, 6),
            "i8": pa.array([1, -128, None, 127, 0, 5], pa.int8()),
            "i32": pa.array([1, -(2**31), None, 2**31 - 1, 0, 7], pa.int32()),
            "l": pa.array([2**63 - 1, -(2**63), None, 0, 1, 2], pa.int64()),
            "f": pa.array([float("nan"), float("inf"), float("-inf"), None, 1.5, -0.25]),
        }
    )
    write_deltalake(path, t, partition_by=["i8", "i32", "l", "f"])
    return Table(path)


def partitioned_spark_style(path: str) -> Table:
    """Partition values as Spark writes them (by hand: delta-rs writes others): ISO-8601 UTC
    and zone-less timestamps, ``Infinity``/``-Infinity``/``NaN`` doubles, empty strings,
    a timestamp_ntz, a binary and a date partition column."""
    os.makedirs(os.path.join(path, "_delta_log"))
    schema = {
        "type": "struct",
        "fields": [
            {"name": n, "type": t, "nullable": True, "metadata": {}}
            for n, t in [
                ("id", "long"),
                ("ts", "timestamp"),
                ("ntz", "timestamp_ntz"),
                ("f", "double"),
                ("s", "string"),
                ("d", "date"),
                ("bin", "binary"),
            ]
        ],
    }
    parts = [
        (
            "2021-03-04T05:06:07.123456Z",
            "2021-03-04 05:06:07.5",
            "Infinity",
            "a b/c=d%e",
            "2021-3-4",
            "\u0001\u0002",
        ),
        ("2021-03-04 05:06:07", "1970-01-01 00:00:00", "-Infinity", "", "1970-01-01", ""),
        (None, None, "NaN", "日本", None, None),
        (
            "1969-12-31T23:59:59.999999Z",
            "2000-01-01 00:00:00.000001",
            "-0.0",
            None,
            "0001-01-01",
            "x",
        ),
    ]
    adds, rows = [], []
    for k, (ts, ntz, f, s, d, b) in enumerate(parts):
        name = f"part-{k:05d}-{uuid.uuid4()}.parquet"
        pq.write_table(pa.table({"id": _ids(k * 2, k * 2 + 2)}), os.path.join(path, name))
        values = {"ts": ts, "ntz": ntz, "f": f, "s": s, "d": d, "bin": b}
        adds.append(add_action(path, name, 2, values))
        for i in (k * 2, k * 2 + 1):
            rows.append(
                {
                    "id": i,
                    "ts": _spark_ts(ts),
                    "ntz": _spark_ts(ntz, ntz=True),
                    "f": float(f),
                    "s": s or None,
                    "d": dt.date(*map(int, d.split("-"))) if d else None,
                    "bin": b.encode() if b else None,
                }
            )
    with open(os.path.join(path, "_delta_log", f"{0:020d}.json"), "w") as out:
        for action in [
            {
                "protocol": {
                    "minReaderVersion": 3,
                    "minWriterVersion": 7,
                    "readerFeatures": ["timestampNtz"],
                    "writerFeatures": ["timestampNtz"],
                }
            },
            {"metaData": _metadata(schema, ["ts", "ntz", "f", "s", "d", "bin"])},
            *adds,
        ]:
            out.write(json.dumps(action) + "\n")
    return Table(path, rows=rows)


def _spark_ts(raw: str | None, ntz: bool = False):
    if not raw:
        return None
    value = dt.datetime.fromisoformat(raw.replace("Z", "").replace("T", " "))
    return value if ntz else value.replace(tzinfo=UTC)


def _metadata(
    schema: dict, partition_columns: list[str], configuration: dict | None = None
) -> dict:
    return {
        "id": str(uuid.uuid4()),
        "format": {"provider": "parquet", "options": {}},
        "schemaString": json.dumps(schema),
        "partitionColumns": partition_columns,
        "configuration": configuration or {},
        "createdTime": 0,
    }


def int96_timestamps(path: str) -> Table:
    """Timestamps as INT96 (Spark's default parquet timestamp type), beyond the nanosecond
    range too, in a file committed by hand."""
    os.makedirs(os.path.join(path, "_delta_log"))
    stamps = [
        dt.datetime(2021, 1, 1, 1, 2, 3, 456789, tzinfo=UTC),
        None,
        dt.datetime(3000, 1, 1, tzinfo=UTC),
        dt.datetime(1500, 6, 1, 12, tzinfo=UTC),
    ]
    data = pa.table({"id": _ids(0, 4), "ts": pa.array(stamps, pa.timestamp("us", tz="UTC"))})
    name = f"part-{uuid.uuid4()}.parquet"
    pq.write_table(data, os.path.join(path, name), use_deprecated_int96_timestamps=True)
    assert pq.ParquetFile(os.path.join(path, name)).schema.column(1).physical_type == "INT96"
    schema = {
        "type": "struct",
        "fields": [
            {"name": "id", "type": "long", "nullable": True, "metadata": {}},
            {"name": "ts", "type": "timestamp", "nullable": True, "metadata": {}},
        ],
    }
    _write_commit_zero(path, {"minReaderVersion": 1, "minWriterVersion": 2}, schema, [], [name], 4)
    note = "to_pyarrow_table overflows: it reads INT96 as nanoseconds"
    return Table(path, oracle="query", rows=data.to_pylist(), note=note)


def _write_commit_zero(
    path: str, protocol: dict, schema: dict, partitions: list, names: list, rows: int
) -> None:
    adds = [add_action(path, name, rows) for name in names]
    with open(os.path.join(path, "_delta_log", f"{0:020d}.json"), "w") as out:
        for action in [{"protocol": protocol}, {"metaData": _metadata(schema, partitions)}, *adds]:
            out.write(json.dumps(action) + "\n")


def checkpointed(path: str) -> Table:
    for k in range(4):
        write_deltalake(path, pa.table({"id": _ids(k * 10, k * 10 + 10)}), mode="append")
    DeltaTable(path).create_checkpoint()
    for k in range(4, 6):
        write_deltalake(path, pa.table({"id": _ids(k * 10, k * 10 + 10)}), mode="append")
    return Table(path, rows=[{"id": i} for i in range(60)])


def log_cleaned(path: str) -> Table:
    """Checkpointed, then the commits before the checkpoint cleaned (log retention 0)."""
    config = {"delta.logRetentionDuration": "interval 0 seconds"}
    for k in range(4):
        write_deltalake(
            path,
            pa.table({"id": _ids(k * 10, k * 10 + 10)}),
            mode="append",
            configuration=config if k == 0 else None,
        )
    DeltaTable(path).create_checkpoint()
    write_deltalake(path, pa.table({"id": _ids(40, 50)}), mode="append")
    DeltaTable(path).cleanup_metadata()
    assert not os.path.exists(os.path.join(path, "_delta_log", f"{0:020d}.json"))
    return Table(path, rows=[{"id": i} for i in range(50)], from_zero="no longer in the Delta log")


def compacted(path: str) -> Table:
    """Small appends, then ``optimize.compact`` (remove/add with dataChange=false)."""
    for k in range(5):
        write_deltalake(path, pa.table({"id": _ids(k * 10, k * 10 + 10)}), mode="append")
    DeltaTable(path).optimize.compact()
    write_deltalake(path, pa.table({"id": _ids(50, 55)}), mode="append")
    return Table(path, rows=[{"id": i} for i in range(55)])


def deleted(path: str) -> Table:
    """Appends, then a delete that rewrites a file (remove with dataChange=true)."""
    for k in range(3):
        write_deltalake(path, pa.table({"id": _ids(k * 10, k * 10 + 10)}), mode="append")
    DeltaTable(path).delete("id >= 5 AND id < 15")
    return Table(
        path, rows=[{"id": i} for i in range(30) if not 5 <= i < 15], from_zero="ignoreChanges"
    )


def schema_merged(path: str) -> Table:
    """A column added by ``schema_mode="merge"``: files before it have no such column."""
    write_deltalake(path, pa.table({"id": _ids(0, 5)}))
    t = pa.table({"id": _ids(5, 10), "extra": pa.array(["e"] * 5)})
    write_deltalake(path, t, mode="append", schema_mode="merge")
    rows = [{"id": i, "extra": None if i < 5 else "e"} for i in range(10)]
    return Table(path, rows=rows)


def empty(path: str) -> Table:
    DeltaTable.create(path, pa.schema([("id", pa.int64()), ("p", pa.string())]), partition_by=["p"])
    return Table(path, rows=[])


def emptied(path: str) -> Table:
    """Appends then a delete of every row: an empty snapshot with history."""
    write_deltalake(path, pa.table({"id": _ids(0, 5)}))
    DeltaTable(path).delete()
    return Table(path, rows=[], from_zero="ignoreChanges")


# --- deletion vectors (by hand: delta-rs reads them but does not write them) -------------


def _dv_base(path: str, partitioned: bool = True) -> dict[str, dict]:
    kw = {"partition_by": ["p"]} if partitioned else {}
    write_deltalake(path, pa.table({"id": _ids(0, 100), "p": pa.array(["a"] * 100)}), **kw)
    write_deltalake(
        path,
        pa.table({"id": _ids(100, 70000), "p": pa.array(["b"] * 69900)}),
        mode="append",
        **kw,
    )
    DeltaTable(path).alter.add_feature(
        TableFeatures.DeletionVectors, allow_protocol_versions_increase=True
    )
    return {
        a["partitionValues"].get("p", "a" if a["size"] < 5000 else "b"): a
        for a in hm.current_adds(path).values()
    }


_DV_A = [0, 5, 99]
_DV_B = list(range(10, 5000)) + [6000, 69000]  # a run container, then an array one


def deletion_vectors(path: str) -> Table:
    """An inline DV on one file; a ``u``-type DV file (random prefix, run containers, two DVs
    at offsets) on the other: rows of the first file at indexes 0, 5, 99, of the second at
    10..4999, 6000 and 69000 are deleted."""
    adds = _dv_base(path)
    inline = hm.inline_dv(_DV_A)
    _other, on_disk = hm.dv_file(
        path, [[1, 2, 3], _DV_B], prefix="ab", runs=True
    )  # 2nd: offset > 1
    hm.commit(
        path,
        [
            hm.remove_of(adds["a"]),
            hm.with_dv(adds["a"], inline),
            hm.remove_of(adds["b"]),
            hm.with_dv(adds["b"], on_disk),
        ],
        "DELETE",
    )
    gone = set(_DV_A) | {100 + r for r in _DV_B}
    rows = [{"id": i, "p": "a" if i < 100 else "b"} for i in range(70000) if i not in gone]
    return Table(path, oracle="query", rows=rows, from_zero="ignoreChanges")


def deletion_vectors_checkpointed(path: str) -> Table:
    """DVs committed, a second DV replacing the first on one file, a checkpoint holding them,
    then more appends: the snapshot's DVs come from the checkpoint and from later commits."""
    adds = _dv_base(path, partitioned=False)
    first = hm.inline_dv([1, 2])
    hm.commit(path, [hm.remove_of(adds["a"]), hm.with_dv(adds["a"], first)], "DELETE")
    a_with_first = hm.current_adds(path)[adds["a"]["path"]]
    second = hm.inline_dv([1, 2, 50], runs=True)
    hm.commit(path, [hm.remove_of(a_with_first), hm.with_dv(adds["a"], second)], "DELETE")
    DeltaTable(path).create_checkpoint()
    write_deltalake(
        path, pa.table({"id": _ids(70000, 70010), "p": pa.array(["c"] * 10)}), mode="append"
    )
    b = hm.current_adds(path)[adds["b"]["path"]]
    later = hm.dv_file(path, [[0, 69899]])[0]
    hm.commit(path, [hm.remove_of(b), hm.with_dv(b, later)], "DELETE")
    gone = {1, 2, 50, 100, 69999}
    rows = [
        {"id": i, "p": "a" if i < 100 else "b" if i < 70000 else "c"}
        for i in range(70010)
        if i not in gone
    ]
    return Table(path, oracle="query", rows=rows, from_zero="ignoreChanges")


def _rewrite_checkpoint(path: str, style: str) -> None:
    """Turn delta-rs's classic checkpoint into a ``multipart`` one (two parts) or a UUID-named
    ``v2`` JSON checkpoint whose adds live in a sidecar; drop the commits it covers, so that
    nothing but the rewritten checkpoint holds those versions' adds."""
    log = os.path.join(path, "_delta_log")
    (name,) = [n for n in os.listdir(log) if n.endswith(".checkpoint.parquet")]
    version = int(name[:20])
    table = pq.read_table(os.path.join(log, name))
    os.remove(os.path.join(log, name))
    is_add = pa.array([a is not None for a in table.column("add").to_pylist()])
    adds, others = table.filter(is_add), table.filter(pa.compute.invert(is_add))
    if style == "multipart":
        pq.write_table(
            others, os.path.join(log, f"{version:020d}.checkpoint.0000000001.0000000002.parquet")
        )
        pq.write_table(
            adds, os.path.join(log, f"{version:020d}.checkpoint.0000000002.0000000002.parquet")
        )
        last = {"version": version, "size": table.num_rows, "parts": 2}
    else:
        os.makedirs(os.path.join(log, "_sidecars"))
        sidecar = f"{uuid.uuid4()}.parquet"
        pq.write_table(adds.select(["add"]), os.path.join(log, "_sidecars", sidecar))
        lines = [{"checkpointMetadata": {"version": version}}]
        for row in others.to_pylist():
            for key in ("protocol", "metaData"):
                if row.get(key):
                    lines.append({key: _log_json(row[key])})
        lines[1]["protocol"]["readerFeatures"].append("v2Checkpoint")
        lines[1]["protocol"]["writerFeatures"].append("v2Checkpoint")
        size = os.path.getsize(os.path.join(log, "_sidecars", sidecar))
        lines.append({"sidecar": {"path": sidecar, "sizeInBytes": size, "modificationTime": 0}})
        with open(os.path.join(log, f"{version:020d}.checkpoint.{uuid.uuid4()}.json"), "w") as f:
            f.write("\n".join(json.dumps(line) for line in lines) + "\n")
        last = {"version": version, "size": len(lines) + adds.num_rows}
    with open(os.path.join(log, "_last_checkpoint"), "w") as f:
        json.dump(last, f)
    for v in range(version + 1):
        os.remove(os.path.join(log, f"{v:020d}.json"))


_MAPS = {"configuration", "options", "partitionValues", "tags"}


def _log_json(value):
    """A checkpoint row's action as the JSON log writes it (maps as objects, no nulls)."""
    return {
        k: dict(v) if k in _MAPS else _log_json(v) if isinstance(v, dict) else v
        for k, v in value.items()
        if v is not None
    }


def deletion_vectors_multipart_checkpoint(path: str) -> Table:
    """As ``deletion_vectors_checkpointed``, its checkpoint in two parts, older commits gone."""
    table = deletion_vectors_checkpointed(path)
    _rewrite_checkpoint(path, "multipart")
    table.from_zero = "no longer in the Delta log"
    return table


def deletion_vectors_v2_checkpoint(path: str) -> Table:
    """As ``deletion_vectors_checkpointed``, its checkpoint a UUID-named v2 JSON checkpoint
    with the adds (and their DVs) in a sidecar file, older commits gone."""
    table = deletion_vectors_checkpointed(path)
    _rewrite_checkpoint(path, "v2")
    table.from_zero = "no longer in the Delta log"
    return table


# --- column mapping ----------------------------------------------------------------------


def column_mapping_renamed(path: str) -> Table:
    """Mode ``name`` (delta-rs writes physical names), partitioned, with a struct; then a
    rename by hand (a metaData action with new logical names, same physical names): values
    must follow the physical names into the renamed columns."""
    t = pa.table(
        {
            "id": _ids(0, 4),
            "v": pa.array(["w", "x", None, "z"]),
            "st": pa.array([{"a": 1}, None, {"a": None}, {"a": 4}], pa.struct([("a", pa.int32())])),
            "p": pa.array(["p1", "p2", None, "p1"]),
        }
    )
    write_deltalake(path, t, partition_by=["p"], configuration={"delta.columnMapping.mode": "name"})
    write_deltalake(path, t.set_column(0, "id", _ids(4, 8)), mode="append")
    meta = hm.current_metadata(path)
    schema = json.loads(meta["schemaString"])
    renames = {"v": "value", "p": "part", "id": "v"}  # 'v' now names the old 'id' column
    for f in schema["fields"]:
        f["name"] = renames.get(f["name"], f["name"])
        if f["name"] == "st":
            f["type"]["fields"][0]["name"] = "alpha"
    parts = [renames.get(c, c) for c in meta["partitionColumns"]]
    new_meta = {**meta, "schemaString": json.dumps(schema), "partitionColumns": parts}
    hm.commit(path, [{"metaData": new_meta}], "RENAME COLUMN")
    rows = []
    for k in range(2):
        for i, (v, a, p) in enumerate(
            [("w", 1, "p1"), ("x", None, "p2"), (None, None, None), ("z", 4, "p1")]
        ):
            st = None if i == 1 else {"alpha": a}
            rows.append({"v": k * 4 + i, "value": v, "st": st, "part": p})
    return Table(path, oracle="query", rows=rows)


def column_mapping_dropped_readded(path: str) -> Table:
    """Mode ``name``: column ``v`` dropped, then a new ``v`` added (new physical name): the
    old files still hold the old column's data, which must not come back as the new ``v``."""
    t = pa.table({"id": _ids(0, 3), "v": pa.array(["old"] * 3)})
    write_deltalake(path, t, configuration={"delta.columnMapping.mode": "name"})
    meta = hm.current_metadata(path)
    schema = json.loads(meta["schemaString"])
    schema["fields"] = [f for f in schema["fields"] if f["name"] != "v"]
    hm.commit(path, [{"metaData": {**meta, "schemaString": json.dumps(schema)}}], "DROP COLUMNS")
    max_id = int(meta["configuration"]["delta.columnMapping.maxColumnId"]) + 1
    physical = f"col-{uuid.uuid4()}"
    schema["fields"].append(
        {
            "name": "v",
            "type": "string",
            "nullable": True,
            "metadata": {
                "delta.columnMapping.id": max_id,
                "delta.columnMapping.physicalName": physical,
            },
        }
    )
    config = {**meta["configuration"], "delta.columnMapping.maxColumnId": str(max_id)}
    hm.commit(
        path,
        [{"metaData": {**meta, "schemaString": json.dumps(schema), "configuration": config}}],
        "ADD COLUMNS",
    )
    id_physical = schema["fields"][0]["metadata"]["delta.columnMapping.physicalName"]
    name = f"part-{uuid.uuid4()}.parquet"
    data = pa.table(
        {
            id_physical: _ids(3, 5),
            physical: pa.array(["new", "new"]),
        }
    )
    pq.write_table(data, os.path.join(path, name))
    hm.commit(
        path,
        [add_action(path, name, 2)],
        "WRITE",
    )
    rows = [{"id": i, "v": None} for i in range(3)] + [{"id": 3, "v": "new"}, {"id": 4, "v": "new"}]
    return Table(path, oracle="query", rows=rows)


def column_mapping_property_without_feature(path: str) -> Table:
    """``delta.columnMapping.mode=name`` set while the protocol (reader v3) does not list the
    ``columnMapping`` feature: the property must be ignored (delta-rs writes this for tables
    with timestamp_ntz columns, with logical names in the files)."""
    t = pa.table(
        {"id": _ids(0, 3), "ntz": pa.array([dt.datetime(2020, 1, 1)] * 3, pa.timestamp("us"))}
    )
    write_deltalake(path, t, configuration={"delta.columnMapping.mode": "name"})
    assert "columnMapping" not in (DeltaTable(path).protocol().reader_features or [])
    return Table(path, oracle="query", rows=t.to_pylist())


def column_mapping_id(path: str) -> Table:
    """Mode ``id`` by hand: the files' column names are neither the logical nor the physical
    names (as after an Iceberg conversion); only their parquet field ids say which is which."""
    os.makedirs(os.path.join(path, "_delta_log"))

    def meta_field(name, typ, fid):
        return {
            "name": name,
            "type": typ,
            "nullable": True,
            "metadata": {
                "delta.columnMapping.id": fid,
                "delta.columnMapping.physicalName": f"col-{name}",
            },
        }

    st_type = {
        "type": "struct",
        "fields": [meta_field("x", "long", 4), meta_field("y", "string", 5)],
    }
    schema = {
        "type": "struct",
        "fields": [
            meta_field("id", "long", 1),
            meta_field("name", "string", 2),
            meta_field("st", st_type, 3),
        ],
    }

    def fid(name, typ, i):
        return pa.field(name, typ, metadata={b"PARQUET:field_id": str(i).encode()})

    st_arrow = pa.struct([fid("q", pa.string(), 5), fid("r", pa.int64(), 4)])
    file_schema = pa.schema(
        [fid("b", pa.string(), 2), fid("a", pa.int64(), 1), fid("c", st_arrow, 3)]
    )
    name = f"part-{uuid.uuid4()}.parquet"
    data = pa.table(
        {
            "b": ["x", "y", None],
            "a": pa.array([1, 2, 3], pa.int64()),
            "c": pa.array([{"q": "s", "r": 10}, None, {"q": None, "r": 30}], st_arrow),
        },
        schema=file_schema,
    )
    pq.write_table(data, os.path.join(path, name))
    config = {"delta.columnMapping.mode": "id", "delta.columnMapping.maxColumnId": "5"}
    with open(os.path.join(path, "_delta_log", f"{0:020d}.json"), "w") as out:
        for action in [
            {"protocol": {"minReaderVersion": 2, "minWriterVersion": 5}},
            {"metaData": _metadata(schema, [], config)},
            add_action(path, name, 3),
        ]:
            out.write(json.dumps(action) + "\n")
    rows = [
        {"id": 1, "name": "x", "st": {"x": 10, "y": "s"}},
        {"id": 2, "name": "y", "st": None},
        {"id": 3, "name": None, "st": {"x": 30, "y": None}},
    ]
    return Table(path, oracle=None, rows=rows, note="deltalake 1.6 reads every column as null")


# --- protocol features -------------------------------------------------------------------


def type_widened(path: str) -> Table:
    """typeWidening by hand: int files, then the column widened to long (and a float to
    double): old files are read with the new type."""
    write_deltalake(
        path,
        pa.table({"id": pa.array([1, 2], pa.int32()), "f": pa.array([1.5, None], pa.float32())}),
    )
    meta = hm.current_metadata(path)
    schema = json.loads(meta["schemaString"])
    schema["fields"][0]["type"] = "long"
    schema["fields"][1]["type"] = "double"
    for f in schema["fields"]:
        f["metadata"]["delta.typeChanges"] = [
            {"fromType": "integer" if f["name"] == "id" else "float", "toType": f["type"]}
        ]
    hm.commit(
        path,
        [
            {
                "protocol": {
                    "minReaderVersion": 3,
                    "minWriterVersion": 7,
                    "readerFeatures": ["typeWidening"],
                    "writerFeatures": ["typeWidening"],
                }
            },
            {"metaData": {**meta, "schemaString": json.dumps(schema)}},
        ],
        "CHANGE COLUMN",
    )
    name = f"part-{uuid.uuid4()}.parquet"
    pq.write_table(
        pa.table({"id": pa.array([2**40], pa.int64()), "f": pa.array([0.1], pa.float64())}),
        os.path.join(path, name),
    )
    hm.commit(
        path,
        [add_action(path, name, 1)],
        "WRITE",
    )
    rows = [{"id": 1, "f": 1.5}, {"id": 2, "f": None}, {"id": 2**40, "f": 0.1}]
    return Table(path, oracle=None, rows=rows, note="deltalake refuses typeWidening")


def unknown_reader_feature(path: str) -> Table:
    """A reader feature this source does not implement must be refused by name."""
    write_deltalake(path, pa.table({"id": _ids(0, 3)}))
    hm.commit(
        path,
        [
            {
                "protocol": {
                    "minReaderVersion": 3,
                    "minWriterVersion": 7,
                    "readerFeatures": ["madeUpReaderFeature"],
                    "writerFeatures": ["madeUpReaderFeature"],
                }
            }
        ],
        "UPGRADE PROTOCOL",
    )
    return Table(path, oracle=None, refuse="madeUpReaderFeature", from_zero="madeUpReaderFeature")


def unimplemented_reader_feature(path: str) -> Table:
    """A reader feature deltalake knows but this source does not implement (variantType)."""
    write_deltalake(path, pa.table({"id": _ids(0, 3)}))
    DeltaTable(path).alter.add_feature(
        TableFeatures.VariantType, allow_protocol_versions_increase=True
    )
    return Table(path, refuse="variantType", from_zero="variantType")


TABLES: dict[str, Callable[[str], Table]] = {
    f.__name__: f
    for f in [
        appends_basic,
        all_types,
        timestamp_ntz,
        partitioned_by_types,
        partitioned_numbers,
        partitioned_spark_style,
        int96_timestamps,
        checkpointed,
        log_cleaned,
        compacted,
        deleted,
        schema_merged,
        empty,
        emptied,
        deletion_vectors,
        deletion_vectors_checkpointed,
        deletion_vectors_multipart_checkpoint,
        deletion_vectors_v2_checkpoint,
        column_mapping_renamed,
        column_mapping_dropped_readded,
        column_mapping_property_without_feature,
        column_mapping_id,
        type_widened,
        unknown_reader_feature,
        unimplemented_reader_feature,
    ]
}
