"""Smoke run of benchmarks/small_batches.py (issue 10): tiny micro-batches into
noop, txn-delta and foreachBatch + delta-rs in one driver. Slow (5-6 minutes): not
in CI's bounded set (``-m 'not slow'``), run with the slow set.

Asserts correctness only (every sink ran all its batches, each Delta target
holds rows 0..n-1 exactly once, the JSON has a block of numbers per block);
never timings. The benchmark runs in its own process, with its own SparkSession,
so it cannot stop a session other tests share.
"""

import json
import math
import sys
from pathlib import Path

import pytest
from processes import run_group

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "small_batches.py"
BLOCK = 100
# foreachBatch runs fewer batches: all 300 of the three sinks took ~6 min here
BATCHES = {"noop": 300, "txn-delta": 300, "foreachBatch": 100}
SINKS = list(BATCHES)
# a kill limit for a stuck run, not a timing check: ~5 min here, slower CI machines vary
LIMIT_S = 1500

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(LIMIT_S + 60)]


def test_small_batches_smoke(tmp_path):
    out = tmp_path / "small_batches.json"
    log_path = tmp_path / "small_batches.log"
    cmd = [
        sys.executable,
        str(BENCH),
        "--batches",
        "300",
        "--sink-batches",
        f"foreachBatch={BATCHES['foreachBatch']}",
        "--block",
        str(BLOCK),
        "--sinks",
        ",".join(SINKS),
        "--warmup",
        "0",
        "--json",
        str(out),
    ]
    rc, log = run_group(cmd, log_path, LIMIT_S, cwd=tmp_path)
    tail = log[-6000:]
    assert rc == 0, f"benchmark exited with {rc}:\n{tail}"
    res = json.loads(out.read_text())

    assert list(res["sinks"]) == SINKS
    for sink in SINKS:
        r = res["sinks"][sink]
        assert r["status"] == "ok", (sink, r.get("error", "")[:2000])
        n = BATCHES[sink]
        assert r["batches"] == n, sink
        assert len(r["trigger_ms"]) == n, sink
        if sink != "noop":
            rc_ = r["rows_check"]
            assert rc_["ok"], (sink, rc_)
            assert rc_["rows"] == rc_["distinct"] == n * 10, (sink, rc_)
        blocks = r["blocks"]
        assert len(blocks) == n // BLOCK, (sink, blocks)
        for b in blocks:
            for key in ("median_ms", "p99_ms", "median_add_batch_ms", "rss_jvm_mb"):
                assert isinstance(b[key], (int, float)) and math.isfinite(b[key]), (sink, key, b)
                assert b[key] > 0, (sink, key, b)
            assert math.isfinite(b["added_over_noop_ms"]), (sink, b)
            if b["block"] < BATCHES["foreachBatch"] // BLOCK:
                assert b["ratio_vs_foreachBatch"] > 0, (sink, b)
            if sink == "txn-delta":
                assert b["records_files"] > 0 and b["records_bytes"] > 0, b
                assert b["records_log_files"] > 0, b
            if sink != "noop":
                assert b["target_log_files"] > 0, b
