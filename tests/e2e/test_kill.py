"""kill -9 of the whole driver (Python, JVM and workers) in the middle of batches.

CI runs a bounded number of kills (``PYSPARK_TXN_KILL_RUNS``, default 2; light
mode one);
offline, set it to 1000. Every run: start the driver, let it commit a few
batches (Spark's commit log shows them), kill its whole process group while a
batch runs, repeat, then run to the end and check every row.
"""

import itertools
import os
import random
import signal
import sys
from pathlib import Path

import pytest
from pipeline_checks import PipelineRunner
from processes import (
    committed_batches,
    kill_group,
    kill_mid_batch,
    open_batch,
    start_group,
    wait_until,
)

pytestmark = [pytest.mark.spark, pytest.mark.chaos]

DRIVER = str(Path(__file__).with_name("driver.py"))
KILL_RUNS = int(os.environ.get("PYSPARK_TXN_KILL_RUNS", "2"))


_LOGS = itertools.count()


def start_driver(base, total, per_batch, *extra):
    log_path = Path(base) / f"driver-{next(_LOGS)}.log"
    return start_group(
        [sys.executable, DRIVER, str(base), str(total), str(per_batch), *extra], log_path
    )


def output(proc) -> str:
    return proc.log_path.read_text(errors="replace")


def kill_mid_batches(
    tmp_path, seed: str, *flags: str, runs: int | None = None, total: int = 20_000
) -> tuple[int, int]:
    """Start the driver ``runs`` times (default ``KILL_RUNS``); kill -9 each after it
    committed 1-2 more batches (seen in Spark's commit log) while a batch runs, then run
    it to the end; return (total, per_batch) for the checks. Every kill must hit a
    running batch: one landing before the first commit or between batches proves less."""
    rng = random.Random(int(os.environ.get("PYSPARK_TXN_KILL_SEED", seed)))
    per_batch = 1000
    runs = KILL_RUNS if runs is None else runs
    hit = []
    for _ in range(runs):
        proc = start_driver(tmp_path, total, per_batch, *flags)
        hit.append(kill_mid_batch(proc, tmp_path / "chk", rng.randint(1, 2), rng))
    # each kill hit the batch after the last one Spark finished, and each run moved on
    assert None not in hit and hit == sorted(set(hit)), f"batches the kills hit: {hit}"
    final = start_driver(tmp_path, total, per_batch, *flags)
    final.wait(timeout=600)
    assert final.returncode == 0, output(final)[-3000:]
    return total, per_batch


# light: slow-only (a driver start or two more); light mode's failures at its steps stay in
# the bounded set (tests/spark/test_modes.py, the fast path's light cases)
@pytest.mark.parametrize("mode", ["snapshots", pytest.param("light", marks=pytest.mark.slow)])
def test_kill_9_mid_batches_is_exactly_once(tmp_path, mode):
    """Light mode too: with a replayable source its app transaction alone keeps every
    row once (it keeps no records, so only the table is checked)."""
    runs = 1 if mode == "light" else None  # every driver start costs ~0.5-1.5 min in CI
    total, per_batch = kill_mid_batches(tmp_path, "7", "--option", f"mode={mode}", runs=runs)
    runner = PipelineRunner(None, tmp_path, total=total, per_batch=per_batch)
    runner.assert_exactly_once()
    if mode == "snapshots":  # light mode leaves a killed attempt's files to VACUUM
        runner.assert_no_orphans()
        runner.assert_records_consistent()


def test_a_stalled_driver_is_fenced_by_a_newer_run(tmp_path):
    a_stalled_driver_is_fenced(tmp_path)


def recorded_batches(base: Path) -> set[int]:
    """The batches the sink's record table holds a safe record of."""
    runner = PipelineRunner(None, base)
    if not os.path.exists(os.path.join(runner.checkpoint, "pyspark_txn", "records")):
        return set()
    return {r.batch_id for r in runner.sink_state().records.values()}


def a_stalled_driver_is_fenced(tmp_path, *flags: str) -> None:
    """A stalled driver resumes after a newer run took over: its commit is refused with
    the project's ``FencedError``, and every check holds afterwards.

    Driver A streams (processing-time trigger); once it committed two batches it is
    frozen (SIGSTOP of its whole group: Python, JVM, workers) while a batch runs that it
    has not recorded. Driver B starts on the same checkpoint, takes over (its first commit
    takes the next epoch), replays A's open batch and runs to the end. Then A is thawed
    (SIGCONT): it finishes its batch, and its commit must fail with FencedError (not
    Spark's own concurrent-update check: Spark writes its logs only after our commit).
    """
    chk = tmp_path / "chk"
    total = 20_000
    first = start_driver(tmp_path, total, 200, *flags, "--continuous", "400")
    try:
        wait_until(first, "two committed batches", lambda: len(committed_batches(chk)) >= 2)
        while True:  # freeze A inside a batch it has not recorded yet
            wait_until(first, "a running batch", lambda: open_batch(chk) is not None)
            os.killpg(first.pid, signal.SIGSTOP)
            stalled = open_batch(chk)
            if stalled is not None and stalled not in recorded_batches(tmp_path):
                break
            os.killpg(first.pid, signal.SIGCONT)
        second = start_driver(tmp_path, total, 2000, *flags)
        second.wait(timeout=600)
        assert second.returncode == 0, output(second)[-3000:]
        assert stalled in recorded_batches(tmp_path)  # B replayed and recorded it
        os.killpg(first.pid, signal.SIGCONT)
        first.wait(timeout=300)
    finally:
        kill_group(first)
    out = output(first)
    assert first.returncode != 0, out[-3000:]
    assert "FencedError" in out, out[-5000:]
    assert "CONCURRENT_STREAM_LOG_UPDATE" not in out, out[-5000:]
    assert committed_batches(chk)[-1] >= stalled  # B's, not A's: A never wrote its commit
    runner = PipelineRunner(None, tmp_path, total=total)
    runner.assert_exactly_once()
    runner.assert_no_orphans()
    runner.assert_records_consistent()
