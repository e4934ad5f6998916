"""Phase 2's retries: decided errors stop at once, an unknown outcome stays unknown."""

import pytest

from pyspark_txn.errors import (
    CorruptSnapshotError,
    IndeterminateCommitError,
    IndeterminateTargetCommitError,
    TargetBusyError,
    TargetUnavailableError,
)
from pyspark_txn.sinks.twophase import _retry


def attempts(*outcomes):
    """A step that raises (or returns) each outcome in turn, counting its calls."""
    calls = []

    def step():
        calls.append(1)
        outcome = outcomes[len(calls) - 1]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return step, calls


def test_retryable_target_errors_are_retried_until_one_attempt_decides():
    step, calls = attempts(TargetUnavailableError("down"), TargetBusyError("lock"), 7)
    assert _retry("phase 2", step, 5, 0) == 7 and len(calls) == 3


def test_a_decided_error_is_not_retried():
    step, calls = attempts(CorruptSnapshotError("gone"), 7)
    with pytest.raises(CorruptSnapshotError):
        _retry("phase 2", step, 5, 0)
    assert len(calls) == 1


def test_an_unknown_commit_the_retries_cannot_decide_stays_unknown():
    """The connection died during COMMIT PREPARED, then the database could not even be
    reached: the outcome is unknown, never reported as 'unavailable' (a failure)."""
    lost = IndeterminateTargetCommitError("connection lost during COMMIT PREPARED")
    step, calls = attempts(lost, TargetUnavailableError("refused"), TargetUnavailableError("x"))
    with pytest.raises(IndeterminateCommitError) as e:
        _retry("phase 2 of snapshot 3", step, 3, 0)
    assert len(calls) == 3 and e.value.__cause__ is lost
    assert "could not decide it" in str(e.value) and "TargetUnavailableError: x" in str(e.value)


def test_an_unknown_commit_a_retry_decides_is_decided():
    step, _ = attempts(IndeterminateTargetCommitError("lost"), 4)
    assert _retry("phase 2", step, 3, 0) == 4
