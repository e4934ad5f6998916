"""Several txn-sequence -> txn-delta queries in one driver SparkSession.

Each query has its own checkpoint and target and a 1 s processing-time
trigger; Spark plans them on a pool of Python workers, so nothing a worker
caches may stand for "the run" of a query. Every query must keep running
(none fenced by another's run), restarting one in the same driver must work,
and every target must hold rows 0..n-1 exactly once.

CI watches the queries for ``PYSPARK_TXN_MANY_SECONDS`` (default 25) per test,
counted from the first batch of every query, and then until every query
finished three more batches (progress, not a rate: a busy machine only takes
longer); the offline soak sets it to 180 or more.
"""

import itertools
import json
import os
import sys
from pathlib import Path

import pytest
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError
from processes import run_group

SECONDS = int(os.environ.get("PYSPARK_TXN_MANY_SECONDS", "25"))
DRIVER = str(Path(__file__).with_name("many_driver.py"))
# Spark starts in ~15 s here; many_driver allows 120 s for the first batches and 240 s
# for three more; stops take a few s
SLACK_S = 420

pytestmark = [
    pytest.mark.spark,
    pytest.mark.chaos,
    pytest.mark.timeout(SECONDS + SLACK_S + 60),
]

_LOGS = itertools.count()


def run_driver(base: Path, queries: int, *extra: str) -> tuple[int, str]:
    """Run many_driver.py to its end; output goes to a file so no pipe fills up."""
    rc, out = run_group(
        [sys.executable, DRIVER, str(base), str(queries), str(SECONDS), *extra],
        base / f"many-driver-{next(_LOGS)}.log",
        SECONDS + SLACK_S,
    )
    assert rc is not None, f"driver still running after {SECONDS + SLACK_S} s\n{report(out)}"
    return rc, out


def report(out: str) -> str:
    """The log's distinct error lines (Spark buries them in stack traces), then its tail."""
    errors = [line for line in out.splitlines() if "Error:" in line or " failed: " in line]
    return "\n".join(dict.fromkeys(errors)) + "\n--- log tail ---\n" + out[-3000:]


def summary(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith("SUMMARY ")]
    assert lines, f"no summary line\n{report(out)}"
    return json.loads(lines[-1].removeprefix("SUMMARY "))


def assert_progress(out: str, queries: int) -> dict:
    """Every query finished at least three batches while watched (many_driver's
    MIN_NEW_BATCHES), whatever the time it took."""
    got = summary(out)
    assert sorted(got) == [f"q{i}" for i in range(queries)]
    for name, q in got.items():
        assert q["lastBatchId"] >= q["firstBatchId"] + 3, (name, q)
    return got


def assert_exactly_once_prefix(target: Path, batches: int) -> None:
    """Rows 0..n-1 of the sequence, each once: batches are contiguous prefixes; at least
    a row for each of the ``batches`` batches Spark reported finished."""
    try:
        table = DeltaTable(str(target))
    except TableNotFoundError:
        pytest.fail(f"{target}: no Delta table: no batch was committed")
    ids = table.to_pyarrow_table().column("id").to_pylist()
    assert len(ids) == len(set(ids)), f"{target}: {len(ids) - len(set(ids))} duplicate ids"
    assert sorted(ids) == list(range(len(ids))), f"{target}: ids are not 0..{len(ids) - 1}"
    assert len(ids) >= batches, f"{target}: {len(ids)} rows for {batches} batches"


@pytest.mark.parametrize("queries", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_queries_in_one_driver_all_keep_running(tmp_path, queries):
    rc, out = run_driver(tmp_path, queries)
    assert rc == 0, report(out)
    got = assert_progress(out, queries)
    for i in range(queries):
        assert_exactly_once_prefix(tmp_path / f"q{i}" / "target", got[f"q{i}"]["lastBatchId"] + 1)


def test_restarting_one_query_in_the_same_driver(tmp_path):
    rc, out = run_driver(tmp_path, 2, "--restart-first")
    assert rc == 0, report(out)
    got = assert_progress(out, 2)
    assert got["q0"]["runs"] == 2
    for i in range(2):
        assert_exactly_once_prefix(tmp_path / f"q{i}" / "target", got[f"q{i}"]["lastBatchId"] + 1)
