"""``txn-sequence``: a deterministic, replayable generator source.

Row ``i`` is a pure function of ``i``, and an offset is the next index, so the
same offset range yields the same rows forever: the reference source for
demos, crash tests (the expected set is known exactly) and benchmarks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition

from ..errors import ConfigError
from ..spark.options import reject_unknown_options
from ._common import SupportsTriggerAvailableNow, canonical, check_batch_order, limit_rows

SEQUENCE_OPTIONS = {
    "rowsPerBatch": "most rows per micro-batch (default 10000)",
    "totalRows": "stop producing after this many rows (default: unbounded)",
    "rowsPerSecond": "make rows available at this rate (default: as fast as asked)",
    "numPartitions": "read partitions per batch (default 2)",
    "width": "extra int64 payload columns c1..cN (default 0)",
    "start": "first row index (default 0)",
}
BATCH_ROWS = 65536
_MIX = 2654435761  # Knuth's multiplicative hash: a value column that is not just the id


def _int_option(opts: Mapping[str, str], name: str, default: int | None, minimum: int):
    raw = opts.get(name.lower())
    if raw is None:
        return default
    try:
        n = int(raw)
    except ValueError:
        n = minimum - 1
    if n < minimum:
        raise ConfigError(f"txn-sequence: option {name}={raw!r}: expected an integer >= {minimum}")
    return n


@dataclass(frozen=True)
class SequenceOptions:
    rows_per_batch: int = 10_000
    total_rows: int | None = None
    rows_per_second: int | None = None
    num_partitions: int = 2
    width: int = 0
    start: int = 0

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SequenceOptions:
        opts = {k.lower(): v for k, v in options.items()}
        reject_unknown_options("txn-sequence", opts, SEQUENCE_OPTIONS, implicit=("path",))
        return cls(
            rows_per_batch=_int_option(opts, "rowsPerBatch", 10_000, 1),
            total_rows=_int_option(opts, "totalRows", None, 0),
            rows_per_second=_int_option(opts, "rowsPerSecond", None, 1),
            num_partitions=_int_option(opts, "numPartitions", 2, 1),
            width=_int_option(opts, "width", 0, 0),
            start=_int_option(opts, "start", 0, 0),
        )

    @property
    def ddl(self) -> str:
        return ", ".join(
            ["id long", "value long"] + [f"c{k} long" for k in range(1, self.width + 1)]
        )

    def arrow_schema(self):
        import pyarrow as pa

        names = ["id", "value"] + [f"c{k}" for k in range(1, self.width + 1)]
        return pa.schema([pa.field(n, pa.int64()) for n in names])


def expected_rows(start: int, end: int, width: int = 0):
    """The exact rows of indexes ``[start, end)`` as an Arrow table (for tests and checks)."""
    import pyarrow as pa

    return pa.Table.from_batches(
        list(generate(start, end, width)), schema=SequenceOptions(width=width).arrow_schema()
    )


def generate(start: int, end: int, width: int = 0, batch_rows: int = BATCH_ROWS):
    import numpy as np
    import pyarrow as pa

    schema = SequenceOptions(width=width).arrow_schema()
    for lo in range(start, end, batch_rows):
        ids = np.arange(lo, min(end, lo + batch_rows), dtype=np.int64)
        cols = [ids, (ids * _MIX) % (1 << 32)] + [ids * (k + 1) for k in range(1, width + 1)]
        yield pa.RecordBatch.from_arrays([pa.array(c) for c in cols], schema=schema)


class SequenceRange(InputPartition):
    def __init__(self, start: int, end: int, width: int) -> None:
        self.start, self.end, self.width = start, end, width


class SequenceStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, opts: SequenceOptions) -> None:
        self.opts = opts
        self.started_at = time.monotonic()
        self.target: int | None = None  # set by Trigger.AvailableNow
        # where this process last planned up to; None until then (see latestOffset)
        self.current: int | None = None

    def initialOffset(self) -> dict[str, Any]:
        return canonical({"index": self.opts.start})

    def _available(self) -> float:  # inf: unbounded
        o = self.opts
        avail = float("inf") if o.total_rows is None else o.start + o.total_rows
        if o.rows_per_second is not None:
            avail = min(
                avail, o.start + int((time.monotonic() - self.started_at) * o.rows_per_second)
            )
        if self.target is not None:
            avail = min(avail, self.target)
        return avail

    def getDefaultReadLimit(self):
        from ._common import HAS_ADMISSION_CONTROL, ReadMaxRows

        return ReadMaxRows(self.opts.rows_per_batch) if HAS_ADMISSION_CONTROL else None

    def latestOffset(self, start: dict | None = None, limit: Any = None) -> dict[str, Any]:
        # PySpark < 4.2 passes no start: where this process planned last (a restarted
        # query re-plans its last batch first, see partitions), else where it begins
        if start is not None:
            begin = start["index"]
        else:
            begin = self.opts.start if self.current is None else self.current
        cap = self.opts.rows_per_batch
        by_limit = limit_rows(limit)
        if by_limit is not None:
            cap = min(cap, by_limit)
        end = int(min(self._available(), begin + cap))
        end = max(end, begin)
        self.current = end
        return canonical({"index": end})

    def prepareForTriggerAvailableNow(self) -> None:
        avail = self._available()
        here = self.opts.start if self.current is None else self.current
        self.target = int(avail) if avail != float("inf") else here + self.opts.rows_per_batch

    def partitions(self, start: dict, end: dict) -> list[SequenceRange]:
        lo, hi = start["index"], end["index"]
        check_batch_order("txn-sequence", lo, hi)
        self.current = hi
        n = self.opts.num_partitions
        bounds = [lo + (hi - lo) * k // n for k in range(n + 1)]
        return [
            SequenceRange(a, b, self.opts.width) for a, b in zip(bounds, bounds[1:], strict=False)
        ]

    def read(self, partition: SequenceRange):  # type: ignore[override]  # our partitions
        return generate(partition.start, partition.end, partition.width)

    def commit(self, end: dict) -> None:
        pass  # replayable: nothing to acknowledge
