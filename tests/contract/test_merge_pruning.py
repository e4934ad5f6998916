"""File pruning of the upsert MERGE on real Delta tables (pyspark_txn.sinks.merge_pruning,
used by DeltaMergeTarget._merge): a batch that touches a key range of a table of many
files reads only the files that can hold its keys, and every result equals the change
log applied once in sequence order, with pruning as without it.

What proves a skip: the MERGE commit's own metrics (``operationMetrics``) and, so that
no metric can stand in for it, a data file the batch cannot touch taken away while the
MERGE runs (a failing read, were the file scanned)."""

from __future__ import annotations

import datetime
import decimal
import os
import random
import shutil

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from test_upserts import CDC, ChangeSink, change_log, oracle, scd2_oracle, scd2_table

FILES = 10
PER_FILE = 1_000


def last_merge(sink: ChangeSink) -> dict:
    """The newest MERGE commit of the sink's table (its commitInfo)."""
    for commit in DeltaTable(sink.target).history(5):
        if commit["operation"] == "MERGE":
            return commit
    raise AssertionError("no MERGE commit")


def filled(tmp_path, **options) -> ChangeSink:
    """A sink whose table holds ids 0..FILES*PER_FILE-1 in FILES files of contiguous ids
    (one batch each), every row at seq 1."""
    sink = ChangeSink(tmp_path, **{**CDC, **options})
    for f in range(FILES):
        sink.batch([(i, f"v{i}", 1, "I") for i in range(f * PER_FILE, (f + 1) * PER_FILE)])
    assert len(DeltaTable(sink.target).file_uris()) == FILES
    return sink


def file_of(sink: ChangeSink, key: int) -> str:
    """The data file that holds ``key`` (by its statistics)."""
    actions = pa.table(DeltaTable(sink.target).get_add_actions(flatten=True)).to_pylist()
    (path,) = [a["path"] for a in actions if a["min.id"] <= key <= a["max.id"]]
    return os.path.join(sink.target, path)


def test_a_batch_on_a_key_range_reads_only_the_files_of_its_keys(tmp_path):
    sink = filled(tmp_path)
    expected = {i: (1, f"v{i}") for i in range(FILES * PER_FILE)}
    # updates of ids 4100..4199 (the fifth file) and three inserts far above the table
    changes = [(i, f"u{i}", 2, "U") for i in range(4_100, 4_200)]
    changes += [(50_000 + i, f"n{i}", 2, "I") for i in range(3)]
    far = file_of(sink, 8_500)  # a file the batch cannot touch: away while it runs
    shutil.move(far, far + ".away")
    try:
        sink.batch(changes, partitions=2)
    finally:
        shutil.move(far + ".away", far)
    for k, v, seq, _ in changes:
        expected[k] = (seq, v)
    assert sink.table() == expected
    merge = last_merge(sink)
    metrics = merge["operationMetrics"]
    assert metrics["num_target_files_scanned"] == 1, metrics
    assert metrics["num_target_files_skipped_during_scan"] == FILES - 1, metrics
    assert metrics["num_target_rows_updated"] == 100 and metrics["num_target_rows_inserted"] == 3
    assert metrics["num_target_rows_copied"] == PER_FILE - 100  # the rest of the fifth file
    assert "id" in merge["operationParameters"]["predicate"]  # the filter MERGE pruned by


def test_keys_far_apart_read_only_their_files(tmp_path):
    """min..max of the batch spans the whole table; its keys sit in two files."""
    sink = filled(tmp_path)
    sink.batch([(150, "a", 2, "U"), (9_150, "b", 2, "U"), (9_151, None, 3, "D")])
    metrics = last_merge(sink)["operationMetrics"]
    assert metrics["num_target_files_scanned"] == 2, metrics
    assert metrics["num_target_rows_updated"] == 2 and metrics["num_target_rows_deleted"] == 1
    table = sink.table()
    assert table[150] == (2, "a") and table[9_150] == (2, "b") and 9_151 not in table
    assert len(table) == FILES * PER_FILE - 1


def clustered_log(seed: int, n: int, keys: int) -> tuple[list, list]:
    """A CDC log whose batches mostly touch a window of keys (a few far away): changes
    of one key out of order across batches, several per batch, deletes."""
    rng = random.Random(seed)
    seqs = rng.sample(range(100_000), n)
    log, batches, i = [], [], 0
    while i < n:
        size = rng.randint(20, 80)
        lo = rng.randrange(keys - 60)
        batch = []
        for seq in seqs[i : i + size]:
            key = lo + rng.randrange(60) if rng.random() < 0.9 else rng.randrange(keys)
            op = rng.choice("IUUUD")
            batch.append((key, None if op == "D" else f"v{key}@{seq}", seq, op))
        log += batch
        batches.append(batch)
        i += size
    return log, batches


@pytest.mark.parametrize("seed", [11, 12])
def test_pruned_merges_equal_the_change_log_applied_in_order(tmp_path, seed):
    sink = ChangeSink(tmp_path, **CDC)
    log, batches = clustered_log(seed, n=1_500, keys=2_000)
    scanned = skipped = 0
    for batch in batches:
        sink.batch(batch, partitions=2)
        metrics = last_merge(sink)["operationMetrics"]
        scanned += metrics["num_target_files_scanned"]
        skipped += metrics["num_target_files_skipped_during_scan"]
    assert sink.table() == oracle(log)
    assert skipped > 0, (scanned, skipped)


def test_pruned_scd2_merges_equal_the_history(tmp_path):
    sink = ChangeSink(tmp_path, **CDC, scdType="2")
    log, batches = clustered_log(5, n=600, keys=800)
    for batch in batches:
        sink.batch(batch)
    assert scd2_table(sink) == scd2_oracle(log)


def test_the_change_log_of_the_upsert_suite_with_pruning(tmp_path):
    sink = ChangeSink(tmp_path, **CDC)
    log, batches = change_log(21, n=300, keys=40)
    for batch in batches:
        sink.batch(batch, partitions=3)
    assert sink.table() == oracle(log)


# --- key types ----------------------------------------------------------------------------


def typed_sink(tmp_path, name, key_type, **options) -> ChangeSink:
    schema = pa.schema(
        [pa.field("k", key_type), pa.field("v", pa.string()), pa.field("seq", pa.int64())]
    )
    return ChangeSink(tmp_path, name=name, schema=schema, keys="k", sequenceBy="seq", **options)


def typed_table(sink: ChangeSink) -> dict:
    return {r["k"]: (r["seq"], r["v"]) for r in sink.rows()}


KEY_VALUES = {
    "string": (
        pa.string(),
        ["a", "it's", "a\\b", "x\\'y", "é", "\\", "zz", "", "'", "a''b", "日本"],
    ),
    "int32": (pa.int32(), [-(2**31), -1, 0, 7, 2**31 - 1]),
    "int64": (pa.int64(), [-(2**63), -5, 0, 2**63 - 1]),
    "date": (
        pa.date32(),
        [datetime.date(1, 1, 1), datetime.date(2024, 2, 29), datetime.date(9999, 12, 31)],
    ),
    "decimal": (
        pa.decimal128(12, 3),
        [decimal.Decimal(s) for s in ("-999999999.999", "-0.001", "0.000", "1.250", "7")],
    ),
}


@pytest.mark.parametrize("kind", sorted(KEY_VALUES))
def test_keys_of_every_literal_kind_match_their_rows(tmp_path, kind):
    """Each key alone (its own range: its bound is the key itself), then all of them:
    every change updates the row of its key, none inserts a second row."""
    key_type, values = KEY_VALUES[kind]
    sink = typed_sink(tmp_path, kind, key_type)
    for i, k in enumerate(values):  # one file per key
        sink.batch([(k, f"first{i}", 1)])
    for i, k in enumerate(values):
        sink.batch([(k, f"alone{i}", 2)])
        metrics = last_merge(sink)["operationMetrics"]
        assert metrics["num_target_rows_updated"] == 1, (k, metrics)
        assert metrics["num_target_files_scanned"] == 1, (k, metrics)
    sink.batch([(k, f"all{i}", 3) for i, k in enumerate(values)], partitions=2)
    assert typed_table(sink) == {k: (3, f"all{i}") for i, k in enumerate(values)}


PARTITION_VALUES = {
    "string": (pa.string(), ["north", "south", "east", "west", "it's"]),
    "date": (pa.date32(), [datetime.date(2024, 1, d) for d in range(1, 6)]),
}


@pytest.mark.parametrize("kind", sorted(PARTITION_VALUES))
def test_a_key_that_partitions_the_table_reads_only_its_partitions(tmp_path, kind):
    """The IN list of partition values as delta-rs's MERGE takes it (through the sink:
    below)."""
    from deltalake import write_deltalake

    from pyspark_txn.sinks.merge_pruning import pruning_predicate

    part_type, parts = PARTITION_VALUES[kind]
    path = str(tmp_path / "t")
    rows = [(p, i, f"{p}{i}") for p in parts for i in range(50)]
    schema = pa.schema([("p", part_type), ("id", pa.int64()), ("v", pa.string())])
    table = pa.Table.from_pylist(
        [dict(zip(schema.names, r, strict=True)) for r in rows], schema=schema
    )
    write_deltalake(path, table, partition_by=["p"])
    changes = [(parts[4], 3, "x"), (parts[0], 3, "y"), (parts[0], 99, "z")]
    source = pa.Table.from_pylist(
        [dict(zip(schema.names, r, strict=True)) for r in changes], schema=schema
    )
    dt = DeltaTable(path)
    files = pa.table(dt.get_add_actions(flatten=True))
    extra = pruning_predicate(source, ["p", "id"], ["p"], files)
    assert extra is not None and " IN (" in extra
    away = [p for p in os.listdir(path) if p.startswith("p=") and str(parts[3]) in p]
    assert len(away) == 1
    shutil.move(os.path.join(path, away[0]), os.path.join(tmp_path, "away"))
    try:
        metrics = (
            dt.merge(source, f"t.p = s.p AND t.id = s.id AND {extra}", "s", "t")
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .execute()
        )
    finally:
        shutil.move(os.path.join(tmp_path, "away"), os.path.join(path, away[0]))
    assert metrics["num_target_files_scanned"] == 2, metrics
    assert metrics["num_target_rows_updated"] == 2 and metrics["num_target_rows_inserted"] == 1
    got = {(r["p"], r["id"]): r["v"] for r in DeltaTable(path).to_pyarrow_table().to_pylist()}
    assert got == {**{(p, i): v for p, i, v in rows}, **{(p, i): v for p, i, v in changes}}


def test_a_partitioned_upsert_sink_reads_only_the_partitions_of_its_keys(tmp_path):
    schema = pa.schema(
        [
            pa.field("region", pa.string()),
            pa.field("id", pa.int64()),
            pa.field("v", pa.string()),
            pa.field("seq", pa.int64()),
        ]
    )
    sink = ChangeSink(
        tmp_path, schema=schema, keys="region,id", sequenceBy="seq", partitionBy="region"
    )
    regions = ["north", "south", "east", "west", "it's"]
    sink.batch([(r, i, f"{r}{i}", 1) for r in regions for i in range(50)], partitions=2)
    far = os.path.join(sink.target, "region=west")
    shutil.move(far, far + ".away")  # a partition the batch cannot touch
    try:
        sink.batch([("it's", 3, "x", 2), ("north", 3, "y", 2), ("north", 99, "z", 2)])
    finally:
        shutil.move(far + ".away", far)
    merge = last_merge(sink)
    metrics = merge["operationMetrics"]
    assert metrics["num_target_files_scanned"] == 2, metrics
    assert metrics["num_target_rows_updated"] == 2 and metrics["num_target_rows_inserted"] == 1
    rows = {(r["region"], r["id"]): (r["seq"], r["v"]) for r in sink.rows()}
    assert rows[("it's", 3)] == (2, "x") and rows[("north", 3)] == (2, "y")
    assert rows[("north", 99)] == (2, "z") and len(rows) == len(regions) * 50 + 1
