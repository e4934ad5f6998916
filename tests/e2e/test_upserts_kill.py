"""Upserting pipelines (tests/e2e/upsert_driver.py) with their whole driver killed: kill -9
of the process group (Python, JVM, workers) in the middle of batches, and ``os._exit`` at
a protocol step of the update route (``delta_batch_writer`` commits in the driver, so
``exit`` there kills the whole driver). Each is restarted and run to the end; the table
must equal the oracle, every change applied once, every batch in one commit.

The bounded set: one kill -9 mid-batch of the update route (its commit and its state are
in the driver; txn-delta's commit worker is killed at a step in the bounded set of
tests/spark/test_upserts_spark.py). SLOW=1: kill -9 of every kind, the update route's
driver exited at every step.
"""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pytest
import upsert_driver as pipelines
from processes import kill_group, kill_mid_batch, start_group

pytestmark = [pytest.mark.spark]

DRIVER = str(Path(__file__).with_name("upsert_driver.py"))
_LOGS = itertools.count()


def start(base: Path, kind: str, total: int, per_batch: int, *options: str):
    args = [a for o in options for a in ("--option", o)]
    log_path = base / f"upsert-driver-{next(_LOGS)}.log"
    cmd = [sys.executable, DRIVER, str(base), kind, str(total), str(per_batch), *args]
    return start_group(cmd, log_path)


def output(proc) -> str:
    return proc.log_path.read_text(errors="replace")


def run_to_end(base: Path, kind: str, total: int, per_batch: int) -> None:
    final = start(base, kind, total, per_batch)
    final.wait(timeout=600)
    assert final.returncode == 0, output(final)[-3000:]


@pytest.mark.chaos
@pytest.mark.parametrize(
    "kind",
    ["update", *(pytest.param(k, marks=pytest.mark.slow) for k in ("cdc", "scd2", "complete"))],
)
def test_kill_9_mid_batch_then_restart_applies_every_change_once(tmp_path, kind):
    total, per_batch = 3200, 400
    proc = start(tmp_path, kind, total, per_batch)
    hit = kill_mid_batch(proc, tmp_path / "chk", 2, random.Random(35))
    assert hit is not None
    run_to_end(tmp_path, kind, total, per_batch)
    pipeline = pipelines.Pipeline(kind, tmp_path, total, per_batch)
    pipeline.check()


_STEPS = ["before_record", "after_record", "after_phase2", "after_commit"]


@pytest.mark.parametrize(
    "step",
    [pytest.param(s, marks=pytest.mark.slow) for s in _STEPS],
)
def test_the_update_route_exited_at_a_step_then_restart_applies_every_change_once(
    tmp_path, fired_faults, step
):
    total, per_batch = 2000, 400
    fault = f"{step}:exit@batch=2"
    crashed = start(tmp_path, "update", total, per_batch, f"faultInjection={fault}")
    crashed.wait(timeout=300)
    assert crashed.returncode == 86, output(crashed)[-3000:]  # faults.EXIT_CODE
    fired_faults.assert_fired(fault)
    kill_group(crashed)  # the JVM of the dead driver, if it lingers
    run_to_end(tmp_path, "update", total, per_batch)
    pipelines.Pipeline("update", tmp_path, total, per_batch).check()
