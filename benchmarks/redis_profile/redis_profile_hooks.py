"""Wrappers that time the steps of ``txn-redis`` -> ``txn-delta`` (see sitecustomize)."""

from __future__ import annotations

import cProfile
import functools
import itertools
import json
import os
import time
from typing import Any

_OUT = os.environ.get("TXN_REDIS_BENCH_PROFILE", "")
_CPROFILE = os.environ.get("TXN_REDIS_BENCH_CPROFILE") == "1"
_seq = itertools.count()


def record(step: str, t0: float, t1: float, cpu: float, **extra: Any) -> None:
    line = {"step": step, "pid": os.getpid(), "t0": t0, "t1": t1, "wall": t1 - t0, "cpu": cpu}
    line.update(extra)
    with open(os.path.join(_OUT, f"steps-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


def timed(cls: type, name: str, step: str) -> None:
    fn = getattr(cls, name, None)
    if fn is None or getattr(fn, "_bench_wrapped", False):  # (a step this code lacks)
        return

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.time(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            record(step, t0, time.time(), time.process_time() - c0)

    wrapper._bench_wrapped = True  # type: ignore[attr-defined]
    setattr(cls, name, wrapper)


def _profiler(kind: str) -> cProfile.Profile | None:
    if not _CPROFILE:
        return None
    return cProfile.Profile()


def _dump(p: cProfile.Profile | None, kind: str) -> None:
    if p is not None:
        p.dump_stats(os.path.join(_OUT, f"{kind}-{os.getpid()}-{next(_seq)}.prof"))


def install() -> None:
    from pyspark_txn.sinks.delta import TxnDeltaStreamWriter
    from pyspark_txn.sources.acknowledging import AcknowledgingStreamReader

    for name, step in [
        ("latestOffset", "driver.latestOffset"),
        ("partitions", "driver.partitions"),
        ("commit", "driver.source_commit"),
    ]:
        timed(AcknowledgingStreamReader, name, step)
    timed(TxnDeltaStreamWriter, "commit", "driver.sink_commit")
    # inside latestOffset: the ack, waiting for the read-ahead, the claim-log append,
    # and the broker's XREADGROUP (in the read-ahead thread or in latestOffset)
    from pyspark_txn.sources import acknowledging
    from pyspark_txn.sources.redis_broker import RedisBroker

    timed(acknowledging.ClaimCoordinator, "join_ahead", "driver.latest.join_ahead")
    timed(acknowledging.ClaimCoordinator, "_claim", "driver.latest.claim_append")
    timed(RedisBroker, "claim", "driver.xreadgroup")
    timed(RedisBroker, "ack", "driver.xack")
    timed(acknowledging, "_ack_through", "driver.latest.ack_and_record")
    timed(TxnDeltaStreamWriter, "__getstate__", "driver.sink_prepare")

    read = AcknowledgingStreamReader.read
    if not getattr(read, "_bench_wrapped", False):

        def read_wrapper(self: Any, partition: Any) -> Any:
            """Time inside the reader (producing) vs. outside (Spark consuming)."""
            prof = _profiler("read")
            t0, c0 = time.time(), time.process_time()
            inside = outside = 0.0
            rows = 0
            gen = read(self, partition)
            try:
                while True:
                    a = time.time()
                    if prof:
                        prof.enable()
                    try:
                        b = next(gen)
                    except StopIteration:
                        break
                    finally:
                        if prof:
                            prof.disable()
                    z = time.time()
                    inside += z - a
                    rows += getattr(b, "num_rows", 1)
                    yield b
                    outside += time.time() - z
            finally:
                record("task.read", t0, time.time(), time.process_time() - c0,
                       produce=inside, consumer=outside, rows=rows)  # fmt: skip
                _dump(prof, "read")

        read_wrapper._bench_wrapped = True  # type: ignore[attr-defined]
        AcknowledgingStreamReader.read = read_wrapper  # type: ignore[method-assign]

    write = TxnDeltaStreamWriter.write
    if not getattr(write, "_bench_wrapped", False):

        def write_wrapper(self: Any, iterator: Any) -> Any:
            """Time waiting for input (upstream: the JVM, the read) vs. writing."""
            prof = _profiler("write")
            t0, c0 = time.time(), time.process_time()
            waits = [0.0, 0]

            def counted() -> Any:
                it = iter(iterator)
                while True:
                    if prof:
                        prof.disable()
                    a = time.time()
                    try:
                        b = next(it)
                    except StopIteration:
                        return
                    finally:
                        waits[0] += time.time() - a
                        if prof:
                            prof.enable()
                    waits[1] += getattr(b, "num_rows", 1)
                    yield b

            if prof:
                prof.enable()
            try:
                return write(self, counted())
            finally:
                if prof:
                    prof.disable()
                record("task.write", t0, time.time(), time.process_time() - c0,
                       waiting=waits[0], rows=waits[1])  # fmt: skip
                _dump(prof, "write")

        write_wrapper._bench_wrapped = True  # type: ignore[attr-defined]
        TxnDeltaStreamWriter.write = write_wrapper  # type: ignore[method-assign]
