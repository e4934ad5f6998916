"""kill -9 of the whole driver (Python, JVM and workers) in the middle of batches, then
a run to the end: every row once in PostgreSQL, no prepared transaction left.

``PYSPARK_TXN_KILL_RUNS`` kills in the slow test (default 3; offline, raise it); the
bounded set has one kill.
"""

import itertools
import os
import random
import sys
from pathlib import Path

import pytest
from e2e.processes import kill_mid_batch, start_group
from pg_pipeline import PgPipeline

pytestmark = [pytest.mark.spark, pytest.mark.chaos]

DRIVER = str(Path(__file__).with_name("pg_driver.py"))
KILL_RUNS = int(os.environ.get("PYSPARK_TXN_KILL_RUNS", "3"))
_LOGS = itertools.count()


def start_driver(base: Path, url: str, table: str, total: int, per_batch: int):
    cmd = [sys.executable, DRIVER, str(base), url, table, str(total), str(per_batch)]
    return start_group(cmd, base / f"driver-{next(_LOGS)}.log")


def kill_mid_batches_then_finish(tmp_path, pg, runs: int, total: int, seed: str) -> None:
    server, schema = pg
    rng = random.Random(int(os.environ.get("PYSPARK_TXN_KILL_SEED", seed)))
    per_batch = 1000
    table = f"{schema}.target"
    hit = []
    for _ in range(runs):  # each run commits 1-3 more batches, then dies inside one
        proc = start_driver(tmp_path, server.url, table, total, per_batch)
        hit.append(kill_mid_batch(proc, tmp_path / "chk", rng.randint(1, 3), rng))
    assert None not in hit and hit == sorted(set(hit)), f"batches the kills hit: {hit}"
    final = start_driver(tmp_path, server.url, table, total, per_batch)
    final.wait(timeout=900)
    assert final.returncode == 0, final.log_path.read_text(errors="replace")[-3000:]
    runner = PgPipeline(None, tmp_path, server, schema, total=total, per_batch=per_batch)
    runner.assert_exactly_once()
    runner.assert_nothing_prepared()
    runner.assert_records_consistent()


def test_one_kill_9_mid_batch_is_exactly_once(tmp_path, pg):
    """The bounded variant: one kill inside a batch."""
    kill_mid_batches_then_finish(tmp_path, pg, runs=1, total=5000, seed="3")


@pytest.mark.slow
def test_kill_9_mid_batches_is_exactly_once(tmp_path, pg):
    kill_mid_batches_then_finish(tmp_path, pg, runs=KILL_RUNS, total=20_000, seed="7")
