"""Spark <-> Arrow: the Arrow schema of a Spark schema (sources and sinks both need it)
and Arrow batches from what PySpark hands a writer."""

from __future__ import annotations

from ..errors import ConfigError
from .features import utc_arrow_schema_kwargs


def spark_to_arrow_schema(spark_schema, target: str = "a Delta table"):
    """The Arrow schema of the stream. Timestamps are UTC instants, as on Spark's Arrow path.

    A column Arrow (or the target) cannot carry is named in a ``ConfigError``
    before anything is staged, not left to a conversion traceback.
    """
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructType

    fields = []
    for f in spark_schema.fields:
        if "variant" in f.dataType.simpleString():
            raise ConfigError(
                f"column {f.name!r} has type {f.dataType.simpleString()}: pyspark-txn cannot "
                "write VARIANT yet; convert it first, e.g. to_json(col)"
            )
        try:
            fields.append(to_arrow_schema(StructType([f]), **utc_arrow_schema_kwargs()).field(0))
        except Exception as e:
            raise ConfigError(
                f"column {f.name!r} has type {f.dataType.simpleString()}, which cannot be "
                f"written to {target} ({e}); cast it or give it a type with .cast(...)"
            ) from None
    return pa.schema(fields)


def as_arrow(iterator, arrow_schema, chunk_rows: int = 65536):
    """Arrow batches from whatever the installed PySpark hands the writer."""
    import pyarrow as pa

    rows: list = []
    for item in iterator:
        if isinstance(item, pa.RecordBatch):
            yield item
            continue
        rows.append(item.asDict(recursive=True))
        if len(rows) >= chunk_rows:
            yield pa.RecordBatch.from_pylist(rows, schema=arrow_schema)
            rows = []
    if rows:
        yield pa.RecordBatch.from_pylist(rows, schema=arrow_schema)
