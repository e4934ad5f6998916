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
