"""txn-postgres end to end: Spark, the two-phase protocol and a real PostgreSQL."""

import pytest

pytestmark = pytest.mark.spark


def test_a_stream_lands_exactly_once_and_nothing_stays_prepared(pipeline):
    assert pipeline.run(width=2) is None
    pipeline.assert_exactly_once(width=2)
    pipeline.assert_nothing_prepared()
    pipeline.assert_records_consistent()
    # a second run of the same query finds nothing new and writes nothing twice
    assert pipeline.run(width=2) is None
    pipeline.assert_exactly_once(width=2)


def test_upsert_keeps_the_last_value_of_every_key_across_batches(pipeline):
    """Every batch carries each key once; later batches overwrite earlier ones."""
    df = (
        pipeline.spark.readStream.format("txn-sequence")
        .option("rowsPerBatch", 500)
        .option("totalRows", 2500)
        .load()
        .selectExpr("id % 500 AS k", "id AS v", "CAST(id AS STRING) AS s")
    )
    from pipeline_checks import run_to_end

    run_to_end(
        df.writeStream.format("txn-postgres")
        .option("url", pipeline.server.url)
        .option("table", pipeline.table)
        .option("createTable", "true")
        .option("mode", "upsert")
        .option("keyColumns", "k")
        .option("checkpointLocation", pipeline.checkpoint)
    )
    rows = pipeline.query(f"SELECT k, v, s FROM {pipeline.table} ORDER BY k")
    assert rows == [(k, 2000 + k, str(2000 + k)) for k in range(500)]
    pipeline.assert_nothing_prepared()


def test_a_bad_option_fails_the_query_before_anything_is_written(pipeline):
    failure = pipeline.run(mode="upsert")  # no keyColumns
    assert failure is not None and "keyColumns is required" in str(failure)
    assert pipeline.query(
        "SELECT count(*) FROM pg_tables WHERE schemaname = %s", (pipeline.schema,)
    ) == [(0,)]


def test_spark_types_arrive_as_postgresql_types(pipeline):
    """What Spark hands a Python writer for each common type, end to end."""
    import datetime as dt
    import math
    from decimal import Decimal

    from pipeline_checks import run_to_end

    df = (
        pipeline.spark.readStream.format("txn-sequence")
        .option("totalRows", 3)
        .load()
        .selectExpr(
            "id",
            "CAST(id AS TINYINT) AS b",
            "CAST(id AS SMALLINT) AS s",
            "CAST(id AS INT) AS i",
            "CAST(id AS FLOAT) / 2 AS f",
            "CASE id WHEN 0 THEN double('NaN') WHEN 1 THEN double('Infinity') "
            "ELSE double('-Infinity') END AS d",
            "CAST(id AS DECIMAL(10, 2)) + 0.25 AS dec",
            "CONCAT('é', CAST(id AS STRING)) AS txt",
            "CAST(CONCAT('x', CAST(id AS STRING)) AS BINARY) AS bin",
            "id % 2 = 0 AS ok",
            "DATE_ADD(DATE'2026-01-01', CAST(id AS INT)) AS day",
            "TIMESTAMP'2026-01-01 00:00:00 UTC' + MAKE_INTERVAL(0, 0, 0, 0, 0, 0, id) AS ts",
            "CAST(TIMESTAMP_NTZ'2026-01-01 12:00:00' AS TIMESTAMP_NTZ) AS ntz",
            "ARRAY(id, id + 1) AS arr",
            "NAMED_STRUCT('a', id, 'b', CAST(id AS STRING)) AS st",
            "MAP('k', id) AS m",
        )
    )
    run_to_end(
        df.writeStream.format("txn-postgres")
        .option("url", pipeline.server.url)
        .option("table", pipeline.table)
        .option("createTable", "true")
        .option("checkpointLocation", pipeline.checkpoint)
    )
    rows = pipeline.query(f"SELECT * FROM {pipeline.table} ORDER BY id")
    assert len(rows) == 3
    r = rows[1]
    utc = dt.timezone.utc
    assert r[:3] == (1, 1, 1) and r[3] == 1 and r[4] == 0.5 and r[5] == math.inf
    assert r[6] == Decimal("1.25") and r[7] == "é1" and r[8] == b"x1" and r[9] is False
    assert r[10] == dt.date(2026, 1, 2)
    assert r[11] == dt.datetime(2026, 1, 1, 0, 0, 1, tzinfo=utc)
    assert r[12] == dt.datetime(2026, 1, 1, 12, 0)
    assert r[13] == [1, 2] and r[14] == {"a": 1, "b": "1"} and r[15] == {"k": 1}
    assert math.isnan(rows[0][5]) and rows[2][5] == -math.inf
