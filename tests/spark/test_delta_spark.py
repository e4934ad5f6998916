"""OPTIONAL CHECK: our target and record tables read by Delta's own Spark connector
(delta-spark). It is skipped on this project's machines and in CI (no jars); the
readers that always run are delta-rs (every test) and DuckDB (test_duckdb_read.py).

Delta's JVM jars come from Maven Central, which this project's machines cannot
reach, so the test runs where the jars are on disk: ``DELTA_SPARK_JARS`` (a
comma-separated list of jar paths: delta-spark and delta-storage) or Ivy's
cache (``~/.ivy2.5.2/jars``, ``~/.ivy2/jars``) holding them. Elsewhere it is
skipped, saying so. The pipeline runs in a subprocess: jars must be on the
classpath when the JVM starts, and the suite's session is already running.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from deltalake import DeltaTable

from pyspark_txn.storage.checkpoint import RECORDS_DIR

pytestmark = pytest.mark.spark


def _delta_jars() -> list[str]:
    if os.environ.get("DELTA_SPARK_JARS"):
        return [p for p in os.environ["DELTA_SPARK_JARS"].split(",") if p]
    for cache in ("~/.ivy2.5.2/jars", "~/.ivy2/jars"):
        root = os.path.expanduser(cache)
        spark = sorted(glob.glob(os.path.join(root, "io.delta_delta-spark_*.jar")))
        storage = sorted(glob.glob(os.path.join(root, "io.delta_delta-storage-*.jar")))
        if spark and storage:
            return [spark[-1], storage[-1]]
    return []


JARS = _delta_jars()


@pytest.mark.skipif(
    not JARS,
    reason="optional check: delta-spark's jars are not on this machine (Maven Central is unreachable "
    "here); set DELTA_SPARK_JARS=/path/delta-spark_2.13-X.jar,/path/delta-storage-X.jar",
)
def test_optional_delta_spark_reads_our_target_and_record_tables(tmp_path: Path):
    target, chk = tmp_path / "target", tmp_path / "chk"
    script = textwrap.dedent(
        f"""
        import json
        import pyspark_txn
        spark = pyspark_txn.local_session(
            "delta-spark-read",
            **{{
                "spark.jars": {",".join(JARS)!r},
                "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
                "spark.sql.catalog.spark_catalog":
                    "org.apache.spark.sql.delta.catalog.DeltaCatalog",
            }},
        )
        (spark.readStream.format("txn-sequence").option("rowsPerBatch", 500)
            .option("totalRows", 2000).load()
            .writeStream.format("txn-delta").option("path", {str(target)!r})
            .option("checkpointLocation", {str(chk)!r})
            .trigger(availableNow=True).start().awaitTermination())
        rows = spark.read.format("delta").load({str(target)!r})
        records = spark.read.format("delta").load({str(chk.joinpath(*RECORDS_DIR))!r})
        print(json.dumps({{
            "rows": rows.count(),
            "distinct": rows.select("id").distinct().count(),
            "record_events": records.count(),
        }}))
        """
    )
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=400, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["rows"] == got["distinct"] == 2000
    assert got["record_events"] == len(
        DeltaTable(str(chk.joinpath(*RECORDS_DIR))).to_pyarrow_table()
    )
    assert got["record_events"] > 0
