"""kill -9 of the whole driver while txn-delta writes to S3 (moto behind the fault
proxy): the bounded set kills once, the slow loop ``PYSPARK_TXN_KILL_RUNS`` times (5)."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest
from s3_pipeline import S3Pipeline

sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))  # the kill tests' helpers
from processes import kill_group, start_group  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.chaos]

DRIVER = str(Path(__file__).parents[1] / "e2e" / "driver.py")


def _run(tmp_path, s3, kills: int, seed: int) -> None:
    rng = random.Random(seed)
    total, per_batch = 1500, 100
    p = S3Pipeline(None, tmp_path, s3, total=total, per_batch=per_batch)
    argv = [
        sys.executable,
        DRIVER,
        str(tmp_path),
        str(total),
        str(per_batch),
        "--option",
        f"path={p.target}",
        "--option",
        f"recordTable={p.records}",
        "--option",
        f"storageOptions={json.dumps(s3.options)}",
    ]
    s3.proxy.error_rate = 0.02
    s3.proxy.drop_rate = 0.02
    killed = 0
    for n in range(kills):
        proc = start_group(argv, tmp_path / f"driver-{n}.log")
        try:
            proc.wait(timeout=rng.uniform(12.0, 30.0))  # Spark starts in ~5-10 s
        except Exception:
            kill_group(proc)
            killed += 1
    final = start_group(argv, tmp_path / "driver-final.log")
    final.wait(timeout=900)
    log = (tmp_path / "driver-final.log").read_text(errors="replace")
    assert final.returncode == 0, log[-3000:]
    assert killed >= 1, "no run was killed: raise the total or lower the delays"
    s3.proxy.calm()
    p.assert_exactly_once()
    p.assert_no_orphans()
    p.assert_records_consistent()


def test_kill_9_on_s3_is_exactly_once(tmp_path, s3):
    _run(tmp_path, s3, kills=1, seed=int(os.environ.get("PYSPARK_TXN_KILL_SEED", "22")))


@pytest.mark.slow
def test_kill_9_loop_on_s3_is_exactly_once(tmp_path, s3):
    kills = int(os.environ.get("PYSPARK_TXN_KILL_RUNS", "5"))
    _run(tmp_path, s3, kills=kills, seed=int(os.environ.get("PYSPARK_TXN_KILL_SEED", "23")))
