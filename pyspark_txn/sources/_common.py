"""Shared pieces of our stream readers: canonical offsets and PySpark feature detection."""

from __future__ import annotations

import json
from typing import Any

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
