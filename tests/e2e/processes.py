"""Running a whole driver (Python, JVM, Spark's Python workers) as its own process group."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path


def start_group(cmd: list[str], log_path: Path, cwd: Path | None = None) -> subprocess.Popen:
    """Start ``cmd`` in a new session; output goes to a file (an unread pipe fills up and
    blocks a long-running driver)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd, text=True
        )
    proc.log_path = log_path
    return proc


def kill_group(proc: subprocess.Popen) -> None:
    """kill -9 the process group: the JVM and the Python workers too."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(60)


def run_group(cmd: list[str], log_path: Path, timeout_s: float, cwd: Path | None = None):
    """Run ``cmd`` to its end: (exit code or None if it ran past ``timeout_s``, output)."""
    proc = start_group(cmd, log_path, cwd)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        kill_group(proc)  # whatever is left of the group
    return rc, Path(log_path).read_text(errors="replace")


# --- observing a running driver through its checkpoint ------------------------


def _batch_ids(folder: Path) -> list[int]:
    try:
        return sorted(int(n) for n in os.listdir(folder) if n.isdigit())
    except FileNotFoundError:
        return []


def committed_batches(checkpoint: Path) -> list[int]:
    """The batches in Spark's commit log (``commits/N``): Spark finished them."""
    return _batch_ids(Path(checkpoint) / "commits")


def open_batch(checkpoint: Path) -> int | None:
    """The batch Spark planned (``offsets/N``) and has not finished (no ``commits/N``)."""
    planned, done = _batch_ids(Path(checkpoint) / "offsets"), committed_batches(checkpoint)
    if planned and planned[-1] not in done:
        return planned[-1]
    return None


def wait_until(proc: subprocess.Popen, what: str, check, timeout_s: float = 300):
    """Poll ``check()`` until it returns something other than None/False; fail if the
    driver ends first or nothing happens in ``timeout_s`` (a hang guard, not a timing
    assertion)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got is not None and got is not False:
            return got
        log = Path(proc.log_path).read_text(errors="replace")[-3000:]
        assert proc.poll() is None, f"the driver ended before {what}:\n{log}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s:\n{log}"
        time.sleep(0.05)


def kill_mid_batch(
    proc: subprocess.Popen, checkpoint: Path, new_commits: int, rng: random.Random
) -> int:
    """kill -9 the driver's group once it has committed ``new_commits`` more batches
    (Spark's commit log) and while a batch runs: the group is frozen (SIGSTOP), the
    checkpoint shows a planned, unfinished batch, then it is killed; otherwise it is
    thawed and the next moment tried. Returns the batch the kill hit."""
    checkpoint = Path(checkpoint)
    target = len(committed_batches(checkpoint)) + new_commits
    wait_until(
        proc,
        f"{new_commits} newly committed batches",
        lambda: len(committed_batches(checkpoint)) >= target,
    )
    while True:
        wait_until(proc, "a running batch", lambda: open_batch(checkpoint) is not None)
        time.sleep(rng.uniform(0.0, 0.4))  # somewhere inside the batch
        os.killpg(proc.pid, signal.SIGSTOP)
        hit = open_batch(checkpoint)
        if hit is not None:
            kill_group(proc)
            return hit
        os.killpg(proc.pid, signal.SIGCONT)
