"""The fast path commits the files of the task attempts Spark committed, not whatever
its output folder holds: a committer that leaves a failed attempt's files in place (as
Databricks' transactional commit protocol does) must not put them in the table.

Task retries need their own Spark (``local[2,4]``) and the committer a JVM class, so
the query runs in a subprocess; ``javac`` comes with the JDK (scripts/setup.sh).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark

HERE = Path(__file__).parent


def _leaky_committer_jar(tmp_path: Path) -> str:
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    classpath = os.pathsep.join(str(j) for j in jars.glob("hadoop-client-api-*.jar"))
    classes = tmp_path / "classes"
    subprocess.run(
        ["javac", "-d", str(classes), "-cp", classpath, str(HERE / "jvm" / "LeakyCommitter.java")],
        check=True,
    )
    jar = tmp_path / "leaky.jar"
    shutil.make_archive(str(jar.with_suffix("")), "zip", classes)
    os.rename(jar.with_suffix(".zip"), jar)
    return str(jar)


def test_a_failed_task_attempt_s_files_are_not_committed(tmp_path):
    jar = _leaky_committer_jar(tmp_path)
    (tmp_path / "src").mkdir()
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    proc = subprocess.run(
        [sys.executable, str(HERE / "failed_attempt_driver.py"), str(tmp_path), jar],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # every id once, all from the attempt that succeeded (attempt 0 failed at id 90,000
    # after writing files of the ids before it)
    assert got == {"rows": 100_000, "distinct": 100_000, "min": 0, "max": 99_999, "attempts": [1]}
