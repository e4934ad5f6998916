"""txn-delta with its target and record table on S3 (moto behind a fault proxy)."""

from __future__ import annotations

import json
import os

import pytest
from deltalake import DeltaTable
from s3_pipeline import S3Pipeline
from support import run_cli_process

import pyspark_txn
from pyspark_txn import snapshots
from pyspark_txn.errors import ConfigError

AWS_ENV = [k for k in os.environ if k.startswith("AWS_")]

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def spark():
    session = pyspark_txn.local_session("pyspark-txn-objectstore")
    yield session
    session.stop()


def test_txn_delta_on_s3_commits_every_batch_exactly_once(spark, tmp_path, s3):
    """Issue 22: batch 1 failed with 'staged files are missing' (a stale s3fs listing)."""
    p = S3Pipeline(spark, tmp_path, s3, total=500, per_batch=100)
    assert p.run() is None
    p.assert_exactly_once()
    p.assert_no_orphans()
    p.assert_records_consistent()


def test_faults_cli_source_and_export_on_s3(spark, tmp_path, s3):
    """5xx answers and responses dropped after the server applied the request, over 5
    batches: exactly once, no orphan objects; then the CLI (verify, status, snapshots
    export to s3://) with --storage-options, and the txn-delta source reading the table."""
    s3.proxy.error_rate = 0.03
    s3.proxy.drop_rate = 0.03
    p = S3Pipeline(spark, tmp_path, s3, total=500, per_batch=100)
    assert p.run() is None
    s3.proxy.calm()
    assert s3.proxy.faults["500"] + s3.proxy.faults["drop"] > 0, s3.proxy.faults
    p.assert_exactly_once()
    p.assert_no_orphans()
    p.assert_records_consistent()

    options = json.dumps(s3.options)
    rc, out, err = run_cli_process("verify", p.records, "--storage-options", options, unset=AWS_ENV)
    assert rc == 0, (out, err)
    rc, out, err = run_cli_process(
        "status", p.records, "--json", "--storage-options", options, unset=AWS_ENV
    )
    assert rc == 0, (out, err)
    assert json.loads(out)["last_batch"] == 4
    opts_file = tmp_path / "storage.json"
    opts_file.write_text(options)
    export_to = s3.uri("exports", "first")
    rc, out, err = run_cli_process(
        "snapshots",
        "export",
        p.records,
        "first",
        "--to",
        export_to,
        "--state",
        "skip",
        "--storage-options",
        f"@{opts_file}",
        unset=AWS_ENV,
    )
    assert rc == 0, (out, err)
    exported = DeltaTable(export_to + "/data", storage_options=s3.options).to_pyarrow_table()
    assert exported.num_rows == 500
    assert snapshots.verify(p.records, "first", storage_options=s3.options).ok

    rows = spark.read.format("txn-delta").option("storageOptions", options).load(p.target).count()
    assert rows == 500


def test_cli_without_credentials_or_endpoint_is_one_line_and_exit_2(s3):
    base = {
        "AWS_ENDPOINT_URL": s3.proxy.endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_REGION": "us-east-1",
    }
    no_key = base
    cases = [
        (no_key, "no usable credentials"),
        ({**s3.options, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, "cannot be reached"),
    ]
    for options, problem in cases:
        rc, out, err = run_cli_process(
            "status", s3.uri("records"), "--storage-options", json.dumps(options), unset=AWS_ENV
        )
        assert rc == 2, (out, err)
        assert problem in err and err.count("\n") == 1 and "Traceback" not in err, err
        rc, out, err = run_cli_process(
            "status",
            s3.uri("records"),
            "--json",
            "--storage-options",
            json.dumps(options),
            unset=AWS_ENV,
        )
        assert rc == 2 and json.loads(out)["type"] == "StorageError", (out, err)


def test_fast_path_hands_spark_the_hadoop_scheme_and_refuses_without_its_filesystem(spark):
    """Issue 22: the fast path handed Spark 'bucket/...' (Wrong FS: file://bucket/...)."""
    from pyspark_txn.sinks.fast import spark_uri
    from pyspark_txn.storage import StorageOptions

    assert spark_uri("/data/t") == "file:///data/t"
    assert spark_uri("s3://b/t/x") == "s3a://b/t/x"
    assert spark_uri("gcs://b/t") == "gs://b/t"
    azure = StorageOptions.parse('{"AZURE_STORAGE_ACCOUNT_NAME": "acct"}')
    assert spark_uri("az://c/t", storage=azure) == "abfss://c@acct.dfs.core.windows.net/t"
    with pytest.raises(ConfigError, match="storage account"):
        spark_uri("az://c/t", storage=StorageOptions())
    # PySpark's bundled Hadoop has no S3AFileSystem: refused before anything is written
    with pytest.raises(ConfigError, match="hadoop-aws"):
        spark_uri("s3://b/t", spark)
    spark.conf.set("spark.pyspark_txn.sparkScheme.s3", "file")
    try:
        assert spark_uri("s3://b/t", spark) == "file://b/t"  # the override is honoured
    finally:
        spark.conf.unset("spark.pyspark_txn.sparkScheme.s3")


def test_fast_path_on_s3_is_refused_before_the_first_batch_writes(spark, tmp_path, s3):
    df = (
        spark.readStream.format("txn-sequence")
        .option("rowsPerBatch", 10)
        .option("totalRows", 10)
        .load()
    )
    chk = str(tmp_path / "chk")
    writer = pyspark_txn.delta_batch_writer(
        path=s3.uri("fast"), checkpoint=chk, storageOptions=json.dumps(s3.options)
    )
    q = df.writeStream.foreachBatch(writer).option("checkpointLocation", chk)
    with pytest.raises(Exception, match="hadoop-aws"):
        pyspark_txn.process_available(q)
    assert s3.keys("fast/") == []
