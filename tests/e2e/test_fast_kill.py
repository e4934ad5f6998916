"""The fast path with its driver killed: ``exit`` faults at every protocol step (the
callback runs in the driver, so ``os._exit`` kills the whole Python driver, and
the JVM with it), kill -9 of the process group in the middle of batches, and a
stalled driver fenced by a newer one on the same checkpoint. Every row is
counted after.
"""

import pytest
from pipeline_checks import PipelineRunner
from processes import kill_group
from test_kill import a_stalled_driver_is_fenced, kill_mid_batches, output, start_driver

pytestmark = [pytest.mark.spark]

TOTAL, PER_BATCH = 6000, 1000
# Spark's writer for every batch: the small-batch route has test_fast_small_kill.py
FAST = ("--fast", "--option", "smallBatchRows=0")


# A partitioned table: the column the driver adds (PipelineRunner.partitions' form)
PARTITIONS = {"bucket": ("CAST(id % 3 AS STRING)", lambda i: str(i % 3))}
PARTITIONED = ("--column", f"bucket={PARTITIONS['bucket'][0]}", "--option", "partitionBy=bucket")


def _check(base, total=TOTAL, per_batch=PER_BATCH, partitioned=False):
    runner = PipelineRunner(None, base, total=total, per_batch=per_batch)
    if partitioned:
        runner.partitions = PARTITIONS
    runner.assert_exactly_once()
    runner.assert_no_orphans()
    runner.assert_records_consistent()


@pytest.mark.parametrize(
    ("fault", "partitioned"),
    [
        # about a minute each (two driver starts): one in the bounded set, the rest slow
        ("after_record:exit@batch=2", False),
        pytest.param("phase1:exit@snapshot=2", False, marks=pytest.mark.slow),
        # markers written, some of Spark's files in partition folders, the rest not
        pytest.param("mid_phase1:exit@batch=2", True, marks=pytest.mark.slow),
        pytest.param("before_record:exit@batch=1", False, marks=pytest.mark.slow),
        pytest.param("after_phase2:exit@batch=1", True, marks=pytest.mark.slow),
        pytest.param("after_commit:exit@batch=3", False, marks=pytest.mark.slow),
    ],
)
def test_driver_exit_at_a_protocol_step_then_restart(tmp_path, fired_faults, fault, partitioned):
    exit_at_a_step_then_restart(tmp_path, fired_faults, fault, partitioned, FAST)


def exit_at_a_step_then_restart(tmp_path, fired_faults, fault, partitioned, flags) -> None:
    """The driver (``flags``: the fast path's) exits at ``fault``; a restart finishes
    the run; every row is checked."""
    layout = PARTITIONED if partitioned else ()
    crashed = start_driver(
        tmp_path, TOTAL, PER_BATCH, *flags, *layout, "--option", f"faultInjection={fault}"
    )
    crashed.wait(timeout=300)
    assert crashed.returncode == 86, output(crashed)[-3000:]  # faults.EXIT_CODE
    fired_faults.assert_fired(fault)
    kill_group(crashed)  # the JVM of the dead driver, if it lingers
    final = start_driver(tmp_path, TOTAL, PER_BATCH, *flags, *layout)
    final.wait(timeout=300)
    assert final.returncode == 0, output(final)[-3000:]
    _check(tmp_path, partitioned=partitioned)


@pytest.mark.chaos
def test_one_kill_9_mid_batch_is_exactly_once(tmp_path):
    """The bounded variant of the next test: one kill, mid-batch."""
    total, per_batch = kill_mid_batches(tmp_path, "5", *FAST, runs=1, total=8000)
    _check(tmp_path, total, per_batch)


@pytest.mark.slow
@pytest.mark.chaos
def test_kill_9_mid_batches_is_exactly_once(tmp_path):
    total, per_batch = kill_mid_batches(tmp_path, "11", *FAST)
    _check(tmp_path, total, per_batch)


def test_a_stalled_driver_is_fenced_by_a_newer_run(tmp_path):
    a_stalled_driver_is_fenced(tmp_path, *FAST)
