"""``pyspark-txn status`` of a ``mode=light`` query that Spark ran (issue 34 item 12): a
healthy one exits 0 (it exited 2, "error", so monitoring saw a light query as broken),
a batch Spark planned and the query never wrote needs attention once it is stale.
tests/contract/test_status_locations.py covers the other cases without Spark."""

import json
import re

import pytest

from pyspark_txn import cli

pytestmark = pytest.mark.spark


def status(capsys, *argv):
    code = cli.main(["status", *(str(a) for a in argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_status_of_a_light_query(pipeline, capsys):
    pipeline.total = 3000
    assert pipeline.run(mode="light") is None
    code, out, err = status(capsys, pipeline.checkpoint, "--target", pipeline.target)
    assert code == 0, (out, err)
    assert re.match(r"sink txn-\w+ \(mode=light\): healthy\n", out), out
    assert re.search(r"last batch 2 committed \S+, \d+ s ago \(table version 2, query ", out)
    assert re.search(r"Spark's checkpoint: batch 2 planned \d+ s ago, batch 2 committed", out)
    assert "holds this sink's batches up to 2" in out and "None" not in out

    code, out, _ = status(capsys, pipeline.checkpoint, "--target", pipeline.target, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["healthy"] and doc["mode"] == "light"
    assert doc["last_batch"] == doc["target_batch"] == doc["spark_committed_batch"] == 2
    assert doc["last_query_id"] == doc["query_id"] is not None

    # the table is not named: a light checkpoint names its own (sink.json)
    code, out, _ = status(capsys, pipeline.checkpoint)
    assert code == 0 and "holds this sink's batches up to 2" in out, out
    assert "pass --target URI" not in out, out

    # the next run fails in batch 3's tasks: Spark planned it, the table lacks it
    pipeline.total = 4000
    failure = pipeline.run("phase1:raise@snapshot=0", mode="light")
    assert failure is not None and "injected fault" in str(failure)
    code, out, _ = status(capsys, pipeline.checkpoint, "--target", pipeline.target)
    assert code == 0 and "batch 3 in flight" in out, out  # as far as status can tell
    code, out, _ = status(
        capsys, pipeline.checkpoint, "--target", pipeline.target, "--stale-after", "0"
    )
    assert code == 1 and "(mode=light): NEEDS ATTENTION" in out.splitlines()[0], out
    assert "problem: Spark planned batch 3" in out and "the table does not hold it" in out

    assert pipeline.run(mode="light") is None  # restarted: batch 3 replayed and written
    pipeline.assert_exactly_once(4000)
    code, out, _ = status(
        capsys, pipeline.checkpoint, "--target", pipeline.target, "--stale-after", "0"
    )
    assert code == 0 and "holds this sink's batches up to 3" in out, out
