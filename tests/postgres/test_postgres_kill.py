"""kill -9 of the whole driver (Python, JVM and workers) at random moments, then a
run to the end: every row once in PostgreSQL, no prepared transaction left.

``PYSPARK_TXN_KILL_RUNS`` kills (default 3); offline, raise it.
"""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pg_pipeline import PgPipeline

pytestmark = [pytest.mark.spark, pytest.mark.chaos, pytest.mark.slow]

DRIVER = str(Path(__file__).with_name("pg_driver.py"))
KILL_RUNS = int(os.environ.get("PYSPARK_TXN_KILL_RUNS", "3"))


def start_driver(base: Path, url: str, table: str, total: int, per_batch: int, n: int):
    log = open(base / f"driver-{n}.log", "w")  # noqa: SIM115 - the child keeps it
    cmd = [sys.executable, DRIVER, str(base), url, table, str(total), str(per_batch)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(60)


def test_kill_9_at_random_moments_is_exactly_once(tmp_path, pg):
    server, schema = pg
    rng = random.Random(int(os.environ.get("PYSPARK_TXN_KILL_SEED", "7")))
    total, per_batch = 40_000, 1000
    table = f"{schema}.target"
    kills = 0
    for n in range(KILL_RUNS):
        proc = start_driver(tmp_path, server.url, table, total, per_batch, n)
        time.sleep(rng.uniform(8.0, 20.0))
        if proc.poll() is None:
            kill_group(proc)
            kills += 1
        else:
            proc.wait()
    final = start_driver(tmp_path, server.url, table, total, per_batch, KILL_RUNS)
    final.wait(timeout=900)
    log = (tmp_path / f"driver-{KILL_RUNS}.log").read_text(errors="replace")
    assert final.returncode == 0, log[-3000:]
    runner = PgPipeline(None, tmp_path, server, schema, total=total, per_batch=per_batch)
    runner.assert_exactly_once()
    runner.assert_nothing_prepared()
    runner.assert_records_consistent()
    assert kills >= 1, "no run was killed: raise the total or lower the delays"
