"""kill -9 of the whole driver (Python, JVM and workers) at random moments.

CI runs a bounded number of kills (``PYSPARK_TXN_KILL_RUNS``, default 3);
offline, set it to 1000. Every run: start the driver, kill its whole process
group after a random delay, repeat, then run to the end and check every row.
"""

import itertools
import os
import random
import sys
import time
from pathlib import Path

import pytest
from deltalake import DeltaTable
from pipeline_checks import PipelineRunner
from processes import kill_group, start_group

pytestmark = [pytest.mark.spark, pytest.mark.chaos]

DRIVER = str(Path(__file__).with_name("driver.py"))
KILL_RUNS = int(os.environ.get("PYSPARK_TXN_KILL_RUNS", "3"))


_LOGS = itertools.count()


def start_driver(base, total, per_batch, *extra):
    log_path = Path(base) / f"driver-{next(_LOGS)}.log"
    return start_group(
        [sys.executable, DRIVER, str(base), str(total), str(per_batch), *extra], log_path
    )


def output(proc) -> str:
    return proc.log_path.read_text(errors="replace")


def committed_batches(target):
    try:
        return DeltaTable(str(target)).version() + 1
    except Exception:
        return 0


def kill_at_random_moments(tmp_path, seed: str, *flags: str) -> tuple[int, int]:
    """Start the driver ``KILL_RUNS`` times, kill -9 each at a random moment, then run it
    to the end; return (total, per_batch) for the checks."""
    rng = random.Random(int(os.environ.get("PYSPARK_TXN_KILL_SEED", seed)))
    total, per_batch = 40_000, 1000
    kills = 0
    for _ in range(KILL_RUNS):
        proc = start_driver(tmp_path, total, per_batch, *flags)
        time.sleep(rng.uniform(6.0, 16.0))  # Spark starts in ~5-8 s, then ~2-5 batches/s
        if proc.poll() is None:
            kill_group(proc)
            kills += 1
        else:
            proc.wait()
    final = start_driver(tmp_path, total, per_batch, *flags)
    final.wait(timeout=600)
    assert final.returncode == 0, output(final)[-3000:]
    assert kills >= 1, "no run was killed: raise the total or lower the delays"
    return total, per_batch


@pytest.mark.parametrize("mode", ["snapshots", "light"])
def test_kill_9_at_random_moments_is_exactly_once(tmp_path, mode):
    """Light mode too: with a replayable source its app transaction alone keeps every
    row once (it keeps no records, so only the table is checked)."""
    total, per_batch = kill_at_random_moments(tmp_path, "7", "--option", f"mode={mode}")
    runner = PipelineRunner(None, tmp_path, total=total, per_batch=per_batch)
    runner.assert_exactly_once()
    if mode == "snapshots":  # light mode leaves a killed attempt's files to VACUUM
        runner.assert_no_orphans()
        runner.assert_records_consistent()


def test_second_driver_fences_the_first(tmp_path):
    second_driver_fences_the_first(tmp_path)


def second_driver_fences_the_first(tmp_path, *flags: str) -> None:
    """Two drivers on one checkpoint: the newer run fences the older one.

    The older driver normally dies with FencedError at its next allocation;
    if both race to write the same Spark offset file first, Spark itself
    stops one (either) for concurrent use. Either way no row is written twice.
    """
    first = start_driver(tmp_path, 10**9, 200, *flags, "--continuous", "400")
    deadline = time.time() + 120
    while committed_batches(tmp_path / "target") < 2:
        assert time.time() < deadline and first.poll() is None, "first driver never committed"
        time.sleep(0.5)
    second = start_driver(tmp_path, 10**9, 200, *flags, "--continuous", "400")
    deadline = time.time() + 180
    try:
        while first.poll() is None and second.poll() is None:
            assert time.time() < deadline, "both drivers kept running: nobody was fenced"
            time.sleep(0.5)
    finally:
        stopped = first if first.poll() is not None else second
        kill_group(second)
        kill_group(first)
    out = output(stopped)
    assert stopped.returncode != 0
    # Fenced by the newer run, or stopped by Spark's own offset-log check when
    # both raced for the same batch (then the second may be the one to stop).
    assert "FencedError" in out or "concurrently" in out or "CONCURRENT_STREAM_LOG_UPDATE" in out, (
        out[-3000:]
    )
    # whatever happened, the target holds each committed row once
    got = DeltaTable(str(tmp_path / "target")).to_pyarrow_table()
    ids = got.column("id").to_pylist()
    assert len(ids) == len(set(ids))
    assert sorted(ids) == list(range(len(ids)))
