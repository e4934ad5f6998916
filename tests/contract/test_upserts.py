"""Upserts by key, SCD type 2 and complete mode on real Delta tables, driven without Spark
as Spark would (allocate, stage, commit), counted against an oracle that applies the
whole change log once in sequence order; every protocol step of a merge batch crashed
(raised at the fault point, then recovered by the next commit) and counted again.
Spark's own runs are in tests/spark/test_upserts_spark.py."""

from __future__ import annotations

import json
import random
import time

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from pyspark_txn import admin
from pyspark_txn.errors import ConfigError
from pyspark_txn.faults import FaultPlan, InjectedFault
from pyspark_txn.sinks.delta import DeltaSinkOptions
from pyspark_txn.sinks.staging import stage_partition
from pyspark_txn.sinks.tombstones import tombstones_uri
from pyspark_txn.sinks.upsert import END_AT, START_AT

CHANGES = pa.schema(
    [
        pa.field("id", pa.int64()),
        pa.field("v", pa.string()),
        pa.field("seq", pa.int64()),
        pa.field("op", pa.string()),
    ]
)
CDC = {"keys": "id", "sequenceBy": "seq", "deleteWhen": "op = 'D'", "exceptColumns": "op"}


class ChangeSink:
    """A txn-delta sink with upsert options, driven like Spark would drive it."""

    def __init__(self, tmp_path, name="s", schema=CHANGES, complete=False, **options):
        self.target = str(tmp_path / f"table-{name}")
        self.chk = str(tmp_path / f"chk-{name}")
        self.schema = schema
        opts = DeltaSinkOptions.parse(
            {"path": self.target, "checkpointLocation": self.chk, **options}
        )
        if complete:
            opts = opts.for_complete_mode()
        self.opts = opts.with_checkpoint_sink_id()
        self.opts.record_store().log.create_if_missing()
        self.opts.check_schema(schema)
        self.next = 0

    def batch(self, changes, *, faults=None, batch_id=None, partitions=1):
        """Stage ``changes`` (tuples in the schema's order) in ``partitions`` tasks and
        commit them as the next batch (or ``batch_id``)."""
        batch_id = self.next if batch_id is None else batch_id
        committer = self._committer(faults)
        snapshot_id, token = committer.allocate(self.opts.write_meta())
        handles = []
        parts = [changes[i::partitions] for i in range(partitions)]
        for p, part in enumerate(parts):
            rows = pa.Table.from_pylist(
                [dict(zip(self.schema.names, c, strict=True)) for c in part], schema=self.schema
            )
            handles += stage_partition(
                rows.to_batches() or [], self.opts.staging(), snapshot_id, token, p, self.schema
            )
        result = committer.commit(
            batch_id,
            snapshot_id,
            token,
            handles,
            run_id="run-1",
            query_id="q",
            target_meta=self.opts.target_meta(self.schema, committer.target.base()),
        )
        self.next = max(self.next, batch_id + 1)
        return result

    def _committer(self, faults):
        from dataclasses import replace

        return replace(self.opts, faults=FaultPlan.parse(faults)).committer()

    def stray_files(self):
        """Staged data files still in the table's staging folder."""
        import os

        from pyspark_txn.sinks.staging import STAGING_ROOT

        found = []
        for folder, _, files in os.walk(os.path.join(self.target, STAGING_ROOT)):
            found += [os.path.join(folder, f) for f in files if f.endswith(".parquet")]
        return sorted(found)

    def rows(self):
        t = DeltaTable(self.target).to_pyarrow_table()
        return sorted(t.to_pylist(), key=lambda r: tuple(str(r[c]) for c in sorted(r)))

    def table(self):
        return {r["id"]: (r["seq"], r["v"]) for r in self.rows()}


def oracle(log):
    """The change log applied once in sequence order (per key: the last change wins; a
    delete removes the key)."""
    out = {}
    for key in {c[0] for c in log}:
        last = max((c for c in log if c[0] == key), key=lambda c: c[2])
        if last[3] != "D":
            out[key] = (last[2], last[1])
    return out


def change_log(seed, n=120, keys=12):
    """Inserts, updates and deletes of ``keys`` keys, each (key, seq) once, shuffled into
    batches of 5-25: out of order across batches, several changes per key in one."""
    rng = random.Random(seed)
    seqs = rng.sample(range(10_000), n)
    log = []
    for seq in seqs:
        key = rng.randrange(keys)
        op = rng.choice("IUUUD")
        log.append((key, None if op == "D" else f"v{key}@{seq}", seq, op))
    batches, i = [], 0
    while i < len(log):
        size = rng.randint(5, 25)
        batches.append(log[i : i + size])
        i += size
    return log, batches


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_cdc_stream_equals_the_change_log_applied_in_order(tmp_path, seed):
    sink = ChangeSink(tmp_path, **CDC)
    log, batches = change_log(seed)
    for batch in batches:
        sink.batch(batch, partitions=2)
    assert sink.table() == oracle(log)
    assert "op" not in DeltaTable(sink.target).schema().to_arrow().names  # exceptColumns
    # a replay of every batch id changes nothing
    for batch_id, batch in enumerate(batches):
        sink.batch(batch, batch_id=batch_id)
    assert sink.table() == oracle(log)
    assert DeltaTable(sink.target).transaction_version(sink.opts.sink_id) == len(batches) - 1


POINTS = ["before_record", "after_record", "mid_phase2", "after_phase2", "after_commit"]


@pytest.mark.parametrize("scd", ["1", "2"])
@pytest.mark.parametrize("point", POINTS)
def test_a_merge_batch_crashed_at_each_step_lands_exactly_once(tmp_path, point, scd):
    """Raised at the fault point of every other batch, then the same batch again (a
    restarted query replays it): the table equals the oracle, every batch once."""
    sink = ChangeSink(tmp_path, **CDC, scdType=scd)
    log, batches = change_log(7)
    fired = 0
    for batch_id, batch in enumerate(batches):
        if batch_id % 2 == 1:
            try:
                sink.batch(batch, batch_id=batch_id, faults=f"{point}:raise@batch={batch_id}")
            except InjectedFault:
                fired += 1
        sink.batch(batch, batch_id=batch_id)
    assert fired >= len(batches) // 2 - (1 if point == "mid_phase2" else 0)
    assert (sink.table() if scd == "1" else scd2_table(sink)) == (
        oracle(log) if scd == "1" else scd2_oracle(log)
    )
    handle = admin.open_sink(sink.chk)
    assert not admin.stuck_snapshots(handle)
    report = admin.verify(handle)
    assert report.ok and not report.problems, report.problems  # no warning about spent files
    # staged change records are spent: no data file but the table's is left
    assert sink.stray_files() == []


def test_without_sequence_two_changes_of_a_key_in_a_batch_are_refused(tmp_path):
    sink = ChangeSink(tmp_path, keys="id")
    sink.batch([(1, "a", 1, "I"), (2, "b", 1, "I")])
    with pytest.raises(ConfigError, match=r"share the same key .*\{'id': 3\}"):
        sink.batch([(3, "c", 1, "I"), (3, "d", 2, "U")], partitions=2)
    assert sink.table() == {1: (1, "a"), 2: (1, "b")}
    state = sink.opts.record_store().load_sink(sink.opts.sink_id)
    assert [r.batch_id for r in state.records.values()] == [0]  # refused before the record
    sink.batch([(3, "c", 1, "I"), (2, "B", 5, "U")])  # the next batch goes on
    assert sink.table() == {1: (1, "a"), 2: (5, "B"), 3: (1, "c")}


def test_null_keys_and_sequences_are_refused_before_the_record(tmp_path):
    sink = ChangeSink(tmp_path, **CDC)
    with pytest.raises(ConfigError, match="column 'id' is null in 1 change record"):
        sink.batch([(None, "a", 1, "I")])
    with pytest.raises(ConfigError, match="column 'seq' is null"):
        sink.batch([(1, "a", None, "I")])
    assert not DeltaTable.is_deltatable(sink.target) or sink.table() == {}


def test_keys_changed_across_a_restart_are_refused(tmp_path):
    sink = ChangeSink(tmp_path, **CDC)
    sink.batch([(1, "a", 1, "I")])
    other = ChangeSink(tmp_path, **{**CDC, "keys": "v", "sequenceBy": "seq"})
    with pytest.raises(ConfigError, match=r"upsert options .*keys=\['id'\].*keys=\['v'\]"):
        other.batch([(2, "b", 2, "I")])
    plain = ChangeSink(tmp_path)
    with pytest.raises(ConfigError, match=r"and this writer with none \(appends\)"):
        plain.batch([(2, "b", 2, "I")])
    # only what changed is named
    changed = ChangeSink(tmp_path, **{**CDC, "deleteWhen": "op = 'X'"})
    with pytest.raises(ConfigError) as e:
        changed.batch([(2, "b", 2, "I")])
    assert "delete_when=\"op = 'D'\"" in str(e.value) and "keys=" not in str(e.value)
    assert sink.table() == {1: (1, "a")}
    # how long deletes are remembered may change (a too short retention is fixable)
    longer = ChangeSink(tmp_path, **CDC, tombstoneRetention="30 days")
    longer.next = sink.next
    longer.batch([(2, "b", 2, "I")])
    assert longer.table() == {1: (1, "a"), 2: (2, "b")}


def test_a_late_change_older_than_a_delete_does_not_bring_the_row_back(tmp_path):
    sink = ChangeSink(tmp_path, **CDC)
    sink.batch([(1, "a", 10, "I")])
    sink.batch([(1, None, 20, "D")])
    sink.batch([(1, "late", 15, "U"), (2, "b", 1, "I")])  # older than the delete
    assert sink.table() == {2: (1, "b")}
    sink.batch([(1, "new", 30, "U")])  # newer than the delete: back
    assert sink.table() == {1: (30, "new"), 2: (1, "b")}
    tomb = DeltaTable(tombstones_uri(sink.target, sink.opts.sink_id)).to_pyarrow_table()
    assert tomb.column("id").to_pylist() == [1] and tomb.column("seq").to_pylist() == [20]


def test_tombstones_are_forgotten_after_their_retention(tmp_path):
    sink = ChangeSink(tmp_path, **CDC, tombstoneRetention="1 second")
    sink.batch([(1, "a", 10, "I"), (2, "b", 10, "I")])
    sink.batch([(1, None, 20, "D")])
    time.sleep(1.2)
    sink.batch([(2, None, 30, "D")])  # its commit drops the expired tombstone of key 1
    sink.batch([(1, "late", 15, "U")])  # documented: after the retention it comes back
    assert sink.table() == {1: (15, "late")}


def test_the_change_data_feed_of_upserts(tmp_path):
    sink = ChangeSink(tmp_path, **CDC, **{"delta.enableChangeDataFeed": "true"})
    sink.batch([(1, "a", 1, "I"), (2, "b", 1, "I")])
    sink.batch([(1, "A", 2, "U"), (2, None, 2, "D")])
    dt = DeltaTable(sink.target)
    assert dt.metadata().configuration["delta.enableChangeDataFeed"] == "true"
    cdf = pa.table(dt.load_cdf(starting_version=0).read_all()).to_pylist()
    got = sorted((r["_change_type"], r["id"], r["v"]) for r in cdf)
    assert got == [
        ("delete", 2, "b"),
        ("insert", 1, "a"),
        ("insert", 2, "b"),
        ("update_postimage", 1, "A"),
        ("update_preimage", 1, "a"),
    ]


def test_scd2_keeps_every_version_and_late_changes_land_in_place(tmp_path):
    sink = ChangeSink(tmp_path, **CDC, scdType="2")
    sink.batch([(1, "a", 10, "I"), (1, "b", 20, "U"), (2, "x", 5, "I")])
    sink.batch([(1, "c", 30, "U"), (2, None, 8, "D")])
    sink.batch([(1, "late", 25, "U"), (3, "y", 1, "I"), (3, None, 0, "D")])
    history = {(r["id"], r[START_AT]): (r["v"], r[END_AT]) for r in sink.rows()}
    assert history == {
        (1, 10): ("a", 20),
        (1, 20): ("b", 25),
        (1, 25): ("late", 30),
        (1, 30): ("c", None),
        (2, 5): ("x", 8),
        (3, 1): ("y", None),
    }


def scd2_oracle(log):
    """Every version of the change log's keys: each upsert opens one, the key's next
    change (in sequence order) ends it."""
    expected = {}
    for key in {c[0] for c in log}:
        events = sorted((c for c in log if c[0] == key), key=lambda c: c[2])
        for i, (k, v, seq, op) in enumerate(events):
            if op != "D":
                expected[(k, seq)] = (v, events[i + 1][2] if i + 1 < len(events) else None)
    return expected


def scd2_table(sink):
    return {(r["id"], r[START_AT]): (r["v"], r[END_AT]) for r in sink.rows()}


@pytest.mark.parametrize("seed", [4, 5])
def test_scd2_equals_the_history_of_the_change_log(tmp_path, seed):
    sink = ChangeSink(tmp_path, **CDC, scdType="2")
    log, batches = change_log(seed, n=80, keys=6)
    for batch in batches:
        sink.batch(batch)
    assert scd2_table(sink) == scd2_oracle(log)


@pytest.mark.parametrize("point", ["after_record", "after_phase2"])
def test_complete_mode_replaces_the_table_and_a_crash_leaves_one_whole_result(tmp_path, point):
    schema = pa.schema([pa.field("k", pa.int64()), pa.field("n", pa.int64())])
    sink = ChangeSink(tmp_path, schema=schema, complete=True)
    results = [[(0, 1), (1, 1)], [(0, 2), (1, 1), (2, 5)], [(2, 6)], []]
    for batch_id, result in enumerate(results):
        with pytest.raises(InjectedFault):
            sink.batch(result, batch_id=batch_id, faults=f"{point}:raise@batch={batch_id}")
        # the table holds one whole result: the previous one, or this one
        before = results[batch_id - 1] if batch_id else None
        got = (
            sorted((r["k"], r["n"]) for r in sink.rows())
            if DeltaTable.is_deltatable(sink.target)
            else None
        )
        assert got in (sorted(before) if before is not None else None, sorted(result)), got
        sink.batch(result, batch_id=batch_id)
        assert sorted((r["k"], r["n"]) for r in sink.rows()) == sorted(result)
    assert sink.rows() == []  # the last result is empty: so is the table


def test_bad_upsert_and_complete_options_are_refused(tmp_path):
    base = {"path": str(tmp_path / "t"), "checkpointLocation": str(tmp_path / "c")}
    with pytest.raises(ConfigError, match="needs mode=snapshots"):
        DeltaSinkOptions.parse({**base, "keys": "id", "mode": "light"})
    with pytest.raises(ConfigError, match="keys with outputMode complete"):
        DeltaSinkOptions.parse({**base, "keys": "id"}).for_complete_mode()
    with pytest.raises(ConfigError, match=r"keys: columns \['nope'\]"):
        ChangeSink(tmp_path, name="x", keys="nope")
    with pytest.raises(ConfigError, match="sequenceBy: column 'v'|has no order") as e:
        ChangeSink(
            tmp_path,
            name="y",
            keys="id",
            sequenceBy="flag",
            schema=CHANGES.append(pa.field("flag", pa.list_(pa.int64()))),
        )
    assert "flag" in str(e.value)
    with pytest.raises(ConfigError, match="deleteWhen='op ==' ?.*position"):
        DeltaSinkOptions.parse({**base, "keys": "id", "deleteWhen": "op =="})
    assert json.dumps(DeltaSinkOptions.parse({**base, **CDC}).write_meta())  # plain data


def test_a_query_started_from_a_snapshot_inherits_the_tombstones(tmp_path):
    """A named snapshot of an upserting sink carries its tombstones as of its batch; a
    query prepared from it (or a restored backup) reads them: a late change older than a
    delete made before the snapshot stays dropped."""
    from pyspark_txn import snapshots

    sink = ChangeSink(tmp_path, **CDC)
    sink.batch([(1, "a", 10, "I"), (2, "b", 10, "I")])
    sink.batch([(1, None, 20, "D")])
    exported = snapshots.export(sink.chk, "after-delete", str(tmp_path / "exp"))
    sink.batch([(2, None, 30, "D")])  # after the snapshot: not in it
    assert exported.details["tombstones"]["rows"] == 1
    assert snapshots.verify(sink.chk, "after-delete").ok
    prepared = snapshots.prepare_query(
        sink.chk, "after-delete", str(tmp_path / "chk-new"), str(tmp_path / "table-new")
    )
    again = ChangeSink(tmp_path, name="new", **CDC)
    assert again.target == prepared.path and again.chk == prepared.checkpoint
    again.next = prepared.batch_id + 1
    again.batch([(1, "late", 15, "U"), (2, "late", 25, "U")])
    # key 1's delete (20) is inherited: its older change stays dropped; key 2's (30) came
    # after the snapshot: its change at 25 is newer than the row's 10
    assert again.table() == {2: (25, "late")}
    # a flipped byte in the exported tombstones fails verify
    tomb_dir = tmp_path / "exp" / "tombstones"
    part = next(p for p in tomb_dir.iterdir() if p.suffix == ".parquet")
    data = bytearray(part.read_bytes())
    data[8] ^= 0xFF
    part.write_bytes(bytes(data))
    assert not snapshots.verify(sink.chk, "after-delete").ok


def test_complete_mode_verifies_clean_and_an_empty_light_result_empties_the_table(tmp_path):
    """verify: a complete-mode record's files are out of the table once the next result
    replaced them, by design (no warning); light mode: an empty result empties the table
    as in snapshots mode."""
    from pyspark_txn.sinks.light import LIGHT_SNAPSHOT_ID
    from pyspark_txn.state import new_token

    schema = pa.schema([pa.field("k", pa.int64()), pa.field("n", pa.int64())])
    sink = ChangeSink(tmp_path, schema=schema, complete=True)
    for result in ([(0, 1)], [(0, 2), (1, 1)], [(1, 5)]):
        sink.batch(result)
    report = admin.verify(admin.open_sink(sink.chk))
    assert report.ok and not report.problems, report.problems

    light = DeltaSinkOptions.parse(
        {
            "path": str(tmp_path / "light"),
            "checkpointLocation": str(tmp_path / "lc"),
            "mode": "light",
        }
    ).for_complete_mode()
    light = light.with_checkpoint_sink_id()
    for batch_id, result in enumerate(([(0, 1), (1, 2)], [])):
        token = new_token()
        rows = pa.Table.from_pylist(
            [dict(zip(schema.names, r, strict=True)) for r in result], schema=schema
        )
        txns = stage_partition(
            rows.to_batches(), light.staging(), LIGHT_SNAPSHOT_ID, token, 0, schema
        )
        light.light_committer().commit(
            batch_id, token, txns, query_id="q", target_meta=light.target_meta(schema, None)
        )
        got = DeltaTable(light.path).to_pyarrow_table().num_rows
        assert got == len(result), (batch_id, got)


WIDE = pa.schema(
    [
        pa.field("id", pa.string()),
        pa.field("v", pa.string()),
        pa.field("seq", pa.int64()),
        pa.field("op", pa.string()),
        pa.field("tags", pa.list_(pa.int64())),
        pa.field("info", pa.struct([pa.field("a", pa.int64()), pa.field("b", pa.string())])),
        pa.field("attrs", pa.map_(pa.string(), pa.int64())),
    ]
)


@pytest.mark.parametrize("scd", ["1", "2"])
def test_string_keys_and_nested_columns_with_deletes(tmp_path, scd):
    """Trial of issue 35, findings 1 and 2: the files delta-rs's MERGE writes store strings
    as string_view, which pyarrow's dataset filters could not compare with the table's
    strings (every string-keyed upsert with deletes wedged at its second batch); and
    pyarrow's joins refuse list, struct and map columns beside the keys."""
    sink = ChangeSink(tmp_path, schema=WIDE, **CDC, scdType=scd)
    log, batches = change_log(11, n=90, keys=8)

    def row(c):
        key, v, seq, op = c
        return (f"key-{key}", v, seq, op, [seq, key], {"a": seq, "b": v}, [("n", seq)])

    for batch in batches:
        sink.batch([row(c) for c in batch], partitions=2)
    rows = sink.rows()
    if scd == "1":
        got = {r["id"]: (r["seq"], r["v"]) for r in rows}
        assert got == {f"key-{k}": v for k, v in oracle(log).items()}
        for r in rows:
            assert r["tags"][0] == r["seq"] and r["info"] == {"a": r["seq"], "b": r["v"]}
    else:
        got = {(r["id"], r[START_AT]): (r["v"], r[END_AT]) for r in rows}
        assert got == {(f"key-{k}", s): v for (k, s), v in scd2_oracle(log).items()}


def test_an_expired_tombstone_no_longer_blocks_a_late_change(tmp_path):
    """Trial of issue 35, finding 6: an expired delete kept blocking late older changes
    until a later batch with a delete rewrote the tombstones."""
    sink = ChangeSink(tmp_path, **CDC, tombstoneRetention="1 second")
    sink.batch([(1, "a", 10, "I"), (2, "b", 10, "I")])
    sink.batch([(1, None, 20, "D")])
    sink.batch([(1, "late", 15, "U")])  # within the retention: dropped
    assert sink.table() == {2: (10, "b")}
    time.sleep(1.2)
    sink.batch([(1, "later", 16, "U")])  # expired: applied, no delete in between needed
    assert sink.table() == {1: (16, "later"), 2: (10, "b")}


def test_a_restored_or_prepared_table_keeps_its_properties(tmp_path):
    """Trial of issue 35, finding 5: export, prepare-query and backup restore dropped the
    table's properties: a restored silver lost its change data feed and its own sink
    (delta.enableChangeDataFeed=true in its options) refused the table."""
    from pyspark_txn import snapshots

    props = {"delta.enableChangeDataFeed": "true", "delta.logRetentionDuration": "interval 9 days"}
    sink = ChangeSink(tmp_path, **CDC, **props)
    sink.batch([(1, "a", 10, "I"), (2, "b", 10, "I")])
    snapshots.export(sink.chk, "s1", str(tmp_path / "exp"))
    prepared = snapshots.prepare_query(
        sink.chk, "s1", str(tmp_path / "chk-new"), str(tmp_path / "table-new")
    )
    for table in (str(tmp_path / "exp" / "data"), prepared.path):
        config = DeltaTable(table).metadata().configuration
        assert {k: config.get(k) for k in props} == props, (table, config)
    again = ChangeSink(tmp_path, name="new", **CDC, **props)  # its own options agree
    again.next = prepared.batch_id + 1
    again.batch([(1, None, 20, "D")])
    feed = pa.table(DeltaTable(prepared.path).load_cdf(starting_version=1).read_all())
    assert feed.column("_change_type").to_pylist() == ["delete"]
