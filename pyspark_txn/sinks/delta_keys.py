"""The rows of a Delta table that hold some keys, read for phase 2 of an upsert (SCD type
2's versions of the keys a batch touches; the tombstones of its keys).

Through delta-rs's DataFusion (``QueryBuilder``) with the batch's key bounds as the
condition, so files that cannot hold a key are not read, then matched exactly in memory.
Not pyarrow's dataset filters: files that delta-rs's MERGE wrote store strings as
``string_view``, and pyarrow 26 cannot compare them with the table's ``string`` when it
prunes by statistics (a trial wedged every string-keyed upsert with deletes there)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .merge_pruning import pruning_predicate
from .upsert import quote


def rows_of_keys(dt: Any, rows: Any, keys: Sequence[str], schema: Any) -> Any:
    """The rows of table ``dt`` whose ``keys`` match a row of ``rows``, with the columns
    and types of ``schema`` (the table's as phase 2 writes it: ``string``, not views)."""
    import pyarrow as pa
    from deltalake import QueryBuilder

    if rows.num_rows == 0:
        return schema.empty_table()
    condition = pruning_predicate(
        rows,
        keys,
        dt.metadata().partition_columns,
        pa.table(dt.get_add_actions(flatten=True)),
    )
    columns = ", ".join(f"t.{quote(c)}" for c in schema.names)
    sql = f"SELECT {columns} FROM t" + (f" WHERE {condition}" if condition else "")
    found = pa.table(QueryBuilder().register("t", dt).execute(sql).read_all())
    found = found.select(schema.names).cast(schema)
    return found.take(matching(found, rows, keys))


def matching(table: Any, rows: Any, keys: Sequence[str]) -> Any:
    """Indices of ``table``'s rows whose ``keys`` match a row of ``rows``. The join runs
    on the keys and a row number only: pyarrow joins refuse list, struct and map columns
    beside the keys (a trial wedged an upsert with an array column there)."""
    import pyarrow as pa

    numbered = table.select(list(keys)).append_column(
        "__row", pa.array(range(table.num_rows), pa.int64())
    )
    wanted = rows.select(list(keys)).group_by(list(keys)).aggregate([])
    hit = numbered.join(wanted, keys=list(keys), join_type="left semi")
    return hit.column("__row").combine_chunks().sort()
