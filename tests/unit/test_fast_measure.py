"""The fast path measures a staged file (size, CRC32, footer) without holding it in the
driver's memory (issue 23 item 12): Spark's files reach 8M rows, 8 are measured at once."""

from __future__ import annotations

import os
import tracemalloc
import zlib

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from pyspark_txn.sinks import fast


def test_a_staged_file_is_measured_a_chunk_at_a_time(tmp_path):
    schema = pa.schema([pa.field("id", pa.int64()), pa.field("b", pa.binary())])
    rows = 48
    blobs = [os.urandom(1 << 20) for _ in range(rows)]  # incompressible: ~48 MiB file
    pq.write_table(pa.table({"id": list(range(rows)), "b": blobs}, schema=schema), tmp_path / "f")
    data = (tmp_path / "f").read_bytes()
    size, crc = len(data), zlib.crc32(data)
    del data, blobs
    move = fast._Move(rel="f", values={}, partition=3)
    tracemalloc.start()
    try:
        handle = fast._measure(fsspec.filesystem("file"), str(tmp_path), move, True, schema)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (handle.rows, handle.bytes, handle.checksum) == (rows, size, f"crc32:{crc:08x}")
    assert handle.partition == 3 and '"numRecords":48' in handle.meta["stats"].replace(" ", "")
    assert peak < 16 << 20, f"{peak >> 20} MiB held at once for a {size >> 20} MiB file"
