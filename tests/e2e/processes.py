"""Running a whole driver (Python, JVM, Spark's Python workers) as its own process group."""

from __future__ import annotations

import os
import signal
import subprocess
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
