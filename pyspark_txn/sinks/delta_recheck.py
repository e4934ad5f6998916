"""Phase 2's second look at a Delta target: may a record's files still go into the
table as it is now?

Preflight checks the table before the record is written; nothing stops another engine
from changing it afterwards: DDL while the driver is down (recovery commits later), or
a change that makes phase 2's commit conflict (delta-rs then refuses the commit, and
phase 2 retries on the fresh table). delta-rs commits whatever files it is given, so
the check is made here, on the very table object the commit is built on. Any Delta
target that commits staged files calls :func:`refuse_changed_table` before committing.

Cost: phase 2 on the table version the record was made against checks nothing (that
version is the one preflight checked). Otherwise the checks read the table's metadata
and the files' statistics (in memory, no request); the staged files themselves are read
only when the table has CHECK constraints now, which preflight refuses: only when a
constraint was added since the record.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import TargetChangedError
from ..state import SnapshotRecord, TxnHandle
from .delta_target_schema import (
    batch_nulls,
    cdf_reserved,
    check_constraints,
    column_mapping_mode,
    rule_columns,
    rule_name,
    schema_drift,
    schema_from_b64,
    table_arrow_schema,
    unknown_writer_features,
)

log = logging.getLogger(__name__)

#: Phase 2 evaluates CHECK constraints on the batch's rows itself.
_EVALUATED_FEATURES = frozenset({"checkConstraints"})

RowReader = Callable[[TxnHandle], Any]  # a staged file's rows, as a pyarrow Table


def refuse_changed_table(
    dt, record: SnapshotRecord, *, uri: str, sink_id: str, read_rows: RowReader
) -> None:
    """Raise :class:`TargetChangedError` where ``dt``, the table phase 2 is about to
    commit ``record``'s files to, is no longer a table they may go into. ``read_rows``
    reads one staged file (only called to evaluate CHECK constraints)."""
    if dt is None:
        return  # phase 2 creates the table, from the stream's schema
    base = record.target.get("base_version")
    if base is not None and dt.version() == int(base):
        return  # the version preflight checked, before the record
    problems = table_problems(dt, record.target, record.txns, read_rows)
    if not problems:
        return
    sid = record.snapshot_id
    raise TargetChangedError(
        f"sink {sink_id!r}: batch {record.batch_id} (snapshot {sid}) cannot be committed "
        f"to the Delta table at {uri}, which changed after the batch's record was written: "
        + "; ".join(problems)
        + ". Nothing was committed and the record stays pending: `pyspark-txn stuck "
        f"CHECKPOINT` shows it and `pyspark-txn abandon CHECKPOINT --snapshot {sid}` "
        "withdraws it (Spark then replays the batch, checked anew); or undo the change "
        "and restart the query"
    )


def table_problems(
    dt,
    target_meta: Mapping[str, Any],
    txns: Sequence[TxnHandle],
    read_rows: RowReader,
) -> list[str]:
    """What of the table (as ``dt`` has it) the batch's files break, one phrase each:
    what preflight refuses, except that CHECK constraints are evaluated on the rows."""
    stream_schema = schema_from_b64(target_meta["arrow_schema"])
    merge_schema = bool(target_meta.get("merge_schema"))
    problems: list[str] = []
    parts = list(dt.metadata().partition_columns)
    staged_parts = target_meta.get("partition_by")  # None: a record that did not keep it
    if staged_parts is not None and parts != list(staged_parts):
        problems.append(f"it is partitioned by {parts}, the batch's files by {list(staged_parts)}")
    mode = column_mapping_mode(dt)
    if mode != "none":
        problems.append(f"it uses column mapping (mode {mode!r}), which txn-delta cannot write")
    problems += [
        f"its column {path!r} is {rule_name(key)} ({key}), which txn-delta cannot honour"
        for path, key in rule_columns(dt)
    ]
    unknown = unknown_writer_features(dt, _EVALUATED_FEATURES)
    if unknown:
        problems.append(f"it needs writer features {unknown} that txn-delta does not support")
    reserved = cdf_reserved(dt.metadata().configuration or {}, stream_schema.names)
    if reserved:
        problems.append(f"its change data feed reserves the batch's columns {reserved}")
    table_schema = table_arrow_schema(dt)
    added, drift = schema_drift(table_schema, stream_schema)
    problems += drift
    if not merge_schema:
        problems += [
            f"the batch's column {c!r} is not in the table (dropped or renamed)" for c in added
        ]
    nulls = batch_nulls([f.name for f in table_schema if not f.nullable], txns)
    problems += [
        f"column {c!r} is NOT NULL and the batch has {n} nulls there"
        for c, n in sorted(nulls.items())
    ]
    constraints = check_constraints(dt)
    if constraints and not problems:  # rows of files that fit the table: worth reading
        problems += _broken_constraints(table_schema, constraints, txns, read_rows)
    return problems


def _broken_constraints(
    table_schema,
    constraints: Mapping[str, str],
    txns: Sequence[TxnHandle],
    read_rows: RowReader,
) -> list[str]:
    """The constraints the batch's rows break, by Delta's rule (a row whose expression
    is false or null breaks it), or that could not be evaluated here (delta-rs's SQL
    engine, DataFusion, evaluates the Spark SQL text: what it cannot parse is reported,
    never taken as met). One staged file is read at a time."""
    total = sum(t.rows for t in txns)
    log.info(
        "CHECK constraints %s were added after the record: evaluating them on the "
        "batch's %d rows in %d staged files",
        sorted(constraints),
        total,
        len(txns),
    )
    broken = dict.fromkeys(constraints, 0)
    failed: dict[str, str] = {}
    folder = tempfile.mkdtemp(prefix="pyspark-txn-check-")
    try:
        for i, t in enumerate(txns):
            if not t.rows:
                continue
            try:
                rows = _rows_as_table_has_them(read_rows(t), t, table_schema)
                staged = _Staged(os.path.join(folder, str(i)), rows)
            except Exception as e:
                return [
                    f"its CHECK constraints {sorted(constraints)} could not be evaluated on "
                    f"the batch's rows ({_one_line(e)})"
                ]
            for name, expression in constraints.items():
                if name in failed:
                    continue
                try:
                    broken[name] += staged.count_broken(expression)
                except Exception as e:
                    failed[name] = _one_line(e)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    out = [
        f"CHECK constraint {name!r} ({constraints[name]}) is broken by {n} of the "
        f"batch's {total} rows"
        for name, n in sorted(broken.items())
        if n and name not in failed
    ]
    out += [
        f"CHECK constraint {name!r} ({constraints[name]}) could not be evaluated on the "
        f"batch's rows ({why}), so nothing shows they meet it"
        for name, why in sorted(failed.items())
    ]
    return out


class _Staged:
    """One staged file's rows as a scratch Delta table, for delta-rs's SQL engine."""

    def __init__(self, path: str, rows) -> None:
        self.path, self.rows = path, rows
        self._tables: dict[bool, Any] = {}

    def _table(self, lower: bool):
        from deltalake import DeltaTable, write_deltalake

        if lower not in self._tables:
            path = self.path + ("-lower" if lower else "")
            rows = self.rows
            if lower:
                rows = rows.rename_columns([n.lower() for n in rows.column_names])
            write_deltalake(path, rows)
            self._tables[lower] = DeltaTable(path)
        return self._tables[lower]

    def count_broken(self, expression: str) -> int:
        """Rows for which ``expression`` is not true. DataFusion lower-cases unquoted
        names, where Spark matches names in any case: the rows with lower-case names
        (Delta's names are unique regardless of case) are tried before giving up."""
        import pyarrow as pa
        from deltalake import QueryBuilder

        sql = f"SELECT count(*) FROM batch WHERE ({expression}) IS NOT TRUE"
        try:
            result = QueryBuilder().register("batch", self._table(False)).execute(sql).read_all()
        except Exception:
            if all(n == n.lower() for n in self.rows.column_names):
                raise
            result = QueryBuilder().register("batch", self._table(True)).execute(sql).read_all()
        return int(pa.table(result).column(0)[0].as_py())


def _rows_as_table_has_them(rows, t: TxnHandle, table_schema):
    """A staged file's rows with every column of the table: partition columns from the
    file's partition values (the files do not hold them), and columns the stream lacks
    as nulls (what every reader sees there)."""
    import pyarrow as pa

    values = t.meta.get("partition_values") or {}
    columns, names = [], []
    for field in table_schema:
        if field.name in rows.column_names:
            columns.append(rows.column(field.name))
        elif field.name in values:
            value = values[field.name]
            if value is None:
                columns.append(pa.nulls(rows.num_rows, field.type))
            else:
                columns.append(pa.array([value] * rows.num_rows, pa.string()).cast(field.type))
        else:
            columns.append(pa.nulls(rows.num_rows, field.type))
        names.append(field.name)
    return pa.table(columns, names=names)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."
