"""Shared pieces of our stream readers: canonical offsets and PySpark feature detection."""

from __future__ import annotations

import json
from typing import Any

from ..errors import SourceError

try:  # PySpark >= 4.2: admission control and Trigger.AvailableNow for Python sources
    from pyspark.sql.streaming.datasource import (
        ReadAllAvailable,
        ReadMaxRows,
        SupportsTriggerAvailableNow,
    )

    HAS_ADMISSION_CONTROL = True
except ImportError:  # older PySpark: one batch per AvailableNow trigger, our own limits only
    HAS_ADMISSION_CONTROL = False
    ReadAllAvailable = ReadMaxRows = None  # type: ignore[assignment,misc]

    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]
        pass


def canonical(offset: dict[str, Any]) -> dict[str, Any]:
    """Offsets round-trip through JSON with sorted keys: Spark compares them as strings."""
    return json.loads(json.dumps(offset, sort_keys=True))


def limit_rows(limit: Any) -> int | None:
    """Max rows allowed by a Spark ReadLimit, or None when it does not bound rows."""
    if HAS_ADMISSION_CONTROL and isinstance(limit, ReadMaxRows):
        return limit.max_rows
    return None


def check_batch_order(fmt: str, start: Any, end: Any) -> None:
    """Refuse a batch whose end precedes its start, rather than read rows again.

    PySpark without admission control (before 4.2) asks a Python source for its
    latest offset without saying where the query stands; our readers take it
    from the last batch planned (Spark 4.0 re-plans a restarted query's last
    batch before asking). Should a Spark ever not, this fails loudly instead of
    handing back rows a committed batch already had.
    """
    if end < start:
        raise SourceError(
            f"{fmt}: Spark planned a batch from offset {start} back to {end}. This PySpark "
            "has no admission control for Python sources (PySpark < 4.2) and did not tell "
            "the source where the restarted query stands; please report this with the "
            "PySpark version. PySpark >= 4.2 passes the start and is not affected"
        )
