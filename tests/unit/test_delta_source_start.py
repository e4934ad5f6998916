"""The txn-delta source's initial offset is one answer per run (Spark asks twice)."""

import pyarrow as pa
from deltalake import write_deltalake

from pyspark_txn.formats import TxnDeltaDataSource


def _append(path, start):
    write_deltalake(
        path, pa.table({"id": pa.array(range(start, start + 10), pa.int64())}), mode="append"
    )


def test_initial_offset_stays_put_while_the_table_moves_on(tmp_path):
    # Spark asks for the initial offset when it plans the first batch and again when
    # it runs it: a second, later answer would start that batch past its end, and the
    # batch would read nothing (the rows of the snapshot were lost)
    path = str(tmp_path / "t")
    _append(path, 0)
    for starting in ("snapshot", "latest", "0"):
        source = TxnDeltaDataSource({"path": path, "startingVersion": starting})
        reader = source.streamReader(source.schema())
        first = reader.initialOffset()
        end = reader.latestOffset(first, None)
        _append(path, 100)
        assert reader.initialOffset() == first
        rows = sum(b.num_rows for p in reader.partitions(first, end) for b in reader.read(p))
        if starting != "latest":
            assert rows >= 10
