"""The fast path on Spark Connect (Databricks serverless and shared compute run Connect):
the callback runs in a Python process of the query run, where Spark's job properties
are out of reach, so the run is identified by the writer's own unpickling. Each case
runs a driver with a local Connect server in a child process (as a user's notebook),
then checks every row here with delta-rs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from pipeline_checks import PipelineRunner
from spark_connect import requires_spark_connect, wait_until_free
from test_fast_small import _record_routes

pytestmark = [pytest.mark.spark, requires_spark_connect]

DRIVER = textwrap.dedent(
    """
    import json, sys
    from pyspark.sql import SparkSession
    import pyspark_txn

    target, checkpoint, total, per_batch, runs, given = sys.argv[1:7]
    spark = SparkSession.builder.remote("local[2]").getOrCreate()
    pyspark_txn.register(spark)
    outcomes = []
    for fault in json.loads(runs):
        df = (
            spark.readStream.format("txn-sequence")
            .option("rowsPerBatch", int(per_batch))
            .option("totalRows", int(total))
            .load()
        )
        options = {**json.loads(given), **({"faultInjection": fault} if fault else {})}
        writer = pyspark_txn.delta_batch_writer(path=target, checkpoint=checkpoint, **options)
        try:
            pyspark_txn.process_available(
                df.writeStream.foreachBatch(writer).option("checkpointLocation", checkpoint)
            )
            outcomes.append(None)
        except Exception as e:
            outcomes.append(str(e))
    print("OUTCOMES " + json.dumps(outcomes), flush=True)
    spark.stop()
    """
)


def _run_driver(runner: PipelineRunner, runs: list[str | None], **options: str) -> list[str | None]:
    wait_until_free()
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            DRIVER,
            runner.target,
            runner.checkpoint,
            str(runner.total),
            str(runner.per_batch),
            json.dumps(runs),
            json.dumps(options),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("OUTCOMES ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("OUTCOMES "))


@pytest.mark.parametrize(
    ("fault", "small_rows"),
    [
        ("after_record:raise@batch=1", "10000"),  # the small-batch route (toArrow)
        ("phase1:raise@snapshot=2", "0"),  # Spark's writer
    ],
)
def test_fast_path_on_spark_connect_is_exactly_once_across_a_restart(tmp_path, fault, small_rows):
    runner = PipelineRunner(None, tmp_path, total=3000, per_batch=1000)
    first, second = _run_driver(runner, [fault, None], smallBatchRows=small_rows)
    assert first is not None and "injected fault" in first, first
    assert second is None, second
    runner.assert_exactly_once()
    runner.assert_no_orphans()
    runner.assert_records_consistent()
    state = runner.sink_state()
    # each run took the epoch under its own id: the restart fenced the failed run
    runs = {r.run_id for r in state.records.values()}
    assert len(runs) == 2 and all(r.startswith("connect-") for r in runs), runs
    assert state.epoch == 2
    assert set(_record_routes(runner)) == {"spark" if small_rows == "0" else "driver"}
