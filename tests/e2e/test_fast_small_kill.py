"""The fast path's small-batch route with its driver killed: ``exit`` faults at the
protocol steps (the callback runs in the driver, so ``os._exit`` kills the whole Python
driver, and the JVM with it), kill -9 of the process group in the middle of batches,
and a stalled driver fenced by a newer one. Batches of 1000 rows, smallBatchRows=5000:
every batch is collected to the driver and staged there. Every row is counted after.
Spark's route: tests/e2e/test_fast_kill.py.
"""

import pytest
from test_fast_kill import _check, exit_at_a_step_then_restart
from test_kill import a_stalled_driver_is_fenced, kill_mid_batches

pytestmark = [pytest.mark.spark]

SMALL = ("--fast", "--option", "smallBatchRows=5000")


@pytest.mark.parametrize(
    ("fault", "partitioned"),
    [
        # about a minute each (two driver starts): one in the bounded set, the rest slow
        ("mid_phase1:exit@batch=2", True),  # collected, staged in c=v/ folders, no record
        pytest.param("phase1:exit@snapshot=2", False, marks=pytest.mark.slow),
        pytest.param("before_record:exit@batch=1", False, marks=pytest.mark.slow),
        pytest.param("after_record:exit@batch=2", False, marks=pytest.mark.slow),
        pytest.param("after_phase2:exit@batch=1", True, marks=pytest.mark.slow),
        pytest.param("after_commit:exit@batch=3", False, marks=pytest.mark.slow),
    ],
)
def test_driver_exit_at_a_protocol_step_then_restart(tmp_path, fired_faults, fault, partitioned):
    exit_at_a_step_then_restart(tmp_path, fired_faults, fault, partitioned, SMALL)


@pytest.mark.chaos
def test_one_kill_9_mid_batch_is_exactly_once(tmp_path):
    total, per_batch = kill_mid_batches(tmp_path, "13", *SMALL, runs=1, total=8000)
    _check(tmp_path, total, per_batch)


@pytest.mark.slow
@pytest.mark.chaos
def test_kill_9_mid_batches_is_exactly_once(tmp_path):
    total, per_batch = kill_mid_batches(tmp_path, "17", *SMALL)
    _check(tmp_path, total, per_batch)


@pytest.mark.slow
def test_a_stalled_driver_is_fenced_by_a_newer_run(tmp_path):
    a_stalled_driver_is_fenced(tmp_path, *SMALL)
