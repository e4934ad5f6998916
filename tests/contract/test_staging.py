"""Phase 1 without Spark: staged parquet files on a real local file system."""

import json
import threading
import zlib

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pyspark_txn.sinks.staging import StagingConfig, data_file_prefix, stage_partition
from pyspark_txn.sources.sequence import expected_rows, generate


def _config(tmp_path, **kw) -> StagingConfig:
    return StagingConfig(table_uri=str(tmp_path / "table"), sink_id="s1", **kw)


def _stager_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("txn-stage")]


def test_rows_row_groups_files_checksums_and_stats(tmp_path):
    cfg = _config(tmp_path, row_group_rows=60_000, target_file_rows=130_000)
    schema = expected_rows(0, 1, width=2).schema
    handles = stage_partition(generate(0, 250_000, 2, 10_000), cfg, 7, "tok", 3, schema)

    # 60k-row groups, files closed once they reach 130k rows: 180k + 70k.
    assert [h.rows for h in handles] == [180_000, 70_000]
    row_groups = [[60_000, 60_000, 60_000], [60_000, 10_000]]
    parts = []
    for h, groups in zip(handles, row_groups, strict=True):
        assert h.partition == 3
        assert h.handle.startswith(data_file_prefix("s1", 7, "tok") + "00003-")
        path = tmp_path / "table" / h.handle
        data = path.read_bytes()
        assert h.bytes == len(data)
        assert h.checksum == f"crc32:{zlib.crc32(data):08x}"
        meta = pq.ParquetFile(path).metadata
        assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == groups
        t = pq.read_table(path)
        stats = json.loads(h.meta["stats"])
        assert stats["numRecords"] == t.num_rows
        assert stats["minValues"]["id"] == pc.min(t["id"]).as_py()
        assert stats["maxValues"]["c2"] == pc.max(t["c2"]).as_py()
        assert stats["nullCount"] == {"id": 0, "value": 0, "c1": 0, "c2": 0}
        parts.append(t)
    assert pa.concat_tables(parts).equals(expected_rows(0, 250_000, width=2))


def test_dictionary_encoding_only_for_strings(tmp_path):
    schema = pa.schema([("n", pa.int64()), ("s", pa.string())])
    batch = pa.RecordBatch.from_pydict(
        {"n": list(range(1000)), "s": [f"k{i % 3}" for i in range(1000)]}, schema=schema
    )
    (h,) = stage_partition([batch], _config(tmp_path), 1, "tok", 0, schema)
    rg = pq.ParquetFile(tmp_path / "table" / h.handle).metadata.row_group(0)
    encodings = {rg.column(i).path_in_schema: rg.column(i).encodings for i in range(2)}
    assert not any("DICTIONARY" in e for e in encodings["n"])
    assert any("DICTIONARY" in e for e in encodings["s"])


@pytest.mark.parametrize(
    ("codec", "stored"), [("snappy", "SNAPPY"), ("zstd", "ZSTD"), ("none", "UNCOMPRESSED")]
)
def test_compression_codec(tmp_path, codec, stored):
    schema = expected_rows(0, 1).schema
    (h,) = stage_partition(
        generate(0, 1000), _config(tmp_path, compression=codec), 1, "tok", 0, schema
    )
    meta = pq.ParquetFile(tmp_path / "table" / h.handle).metadata
    assert {meta.row_group(0).column(i).compression for i in range(2)} == {stored}
    assert pq.read_table(tmp_path / "table" / h.handle).equals(expected_rows(0, 1000))


def test_partitioned_output_one_file_per_value(tmp_path):
    schema = pa.schema([("k", pa.string()), ("v", pa.int64())])
    batches = [
        pa.RecordBatch.from_pydict({"k": ["a", "b", None, "a"], "v": [1, 2, 3, 4]}, schema=schema),
        pa.RecordBatch.from_pydict({"k": ["b"], "v": [5]}, schema=schema),
    ]
    handles = stage_partition(batches, _config(tmp_path, partition_by=("k",)), 2, "tok", 0, schema)
    got = {}
    for h in handles:
        t = pq.read_table(tmp_path / "table" / h.handle)
        assert t.column_names == ["v"]
        got[h.meta["partition_values"]["k"]] = sorted(t["v"].to_pylist())
    assert got == {"a": [1, 4], "b": [2, 5], None: [3]}


def test_failing_input_stops_the_encoder_thread(tmp_path):
    schema = expected_rows(0, 1).schema

    def batches():
        yield from generate(0, 100_000, 0, 10_000)
        raise RuntimeError("the JVM went away")

    before = len(_stager_threads())
    with pytest.raises(RuntimeError, match="JVM went away"):
        stage_partition(batches(), _config(tmp_path, row_group_rows=30_000), 1, "tok", 0, schema)
    assert len(_stager_threads()) == before


def test_encoder_error_reaches_the_task(tmp_path):
    # A plain file where the staging folder must go: the encoder thread cannot open files.
    (tmp_path / "table").mkdir()
    (tmp_path / "table" / "txn-staged").write_text("not a folder")
    schema = expected_rows(0, 1).schema
    before = len(_stager_threads())
    with pytest.raises(OSError):
        stage_partition(generate(0, 50_000, 0, 10_000), _config(tmp_path), 1, "tok", 0, schema)
    assert len(_stager_threads()) == before


@pytest.mark.parametrize("partition_by", [(), ("p",)], ids=["flat", "partitioned"])
def test_a_finished_task_attempt_is_known_by_its_committed_files(tmp_path, partition_by):
    """A task attempt whose files are all committed has no other files: discarding
    after the commit need not list the folders it wrote to. Files of a flat table
    sit at the top, where their name starts with the attempt's prefix; read as one
    of the fast path's folders they named no attempt, and every commit listed the
    whole table's folder (issue 26)."""
    from pyspark_txn.sinks.delta_target import finished_task_attempts
    from pyspark_txn.sinks.fast_output import spark_folder

    schema = pa.schema([pa.field("id", pa.int64()), pa.field("p", pa.string())])
    batch = pa.record_batch([pa.array([1, 2]), pa.array(["a", "b"])], schema=schema)
    cfg = _config(tmp_path, partition_by=partition_by)
    handles = stage_partition([batch], cfg, 7, "tok", 3, schema)
    stager_attempts = {"-".join(h.handle.rsplit("/", 1)[-1].rsplit("-", 3)[1:3]) for h in handles}
    assert len(stager_attempts) == 1 and next(iter(stager_attempts)).startswith("00003-")
    prefix = data_file_prefix("s1", 7, "tok")
    assert finished_task_attempts([h.handle for h in handles], prefix) == stager_attempts
    # the fast path's own folder: the attempt is in the folder's name
    folder = spark_folder("s1", 7, "tok", "abcd1234")
    assert finished_task_attempts([f"{folder}/part-00000-x.snappy.parquet"], prefix) == {
        "00000-abcd1234"
    }
