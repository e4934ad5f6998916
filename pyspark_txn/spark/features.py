"""What the installed PySpark can do, detected by feature rather than by version.

``import pyspark_txn`` works without PySpark (the CLI, the admin and snapshot
APIs and every Delta read need none); the Spark parts check here, once, and
name the missing feature in a :class:`SparkFeatureError`. Detection by feature
matters on Databricks, whose runtimes report Spark 3.5 yet ship the Python
data source API, and where pip must not replace the runtime's PySpark.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from ..errors import SparkFeatureError

INSTALL_HINT = (
    "pyspark-txn needs PySpark >= 4.0 (install pyspark-txn with its 'spark' extra) or a "
    "runtime that ships the Python data source API with streaming readers and writers "
    "(see docs/databricks.md#runtimes)"
)


@dataclass(frozen=True)
class Feature:
    """One capability: where it lives, and whether pyspark-txn cannot work without it."""

    name: str
    module: str
    attributes: tuple[str, ...]  # any one of them is enough
    required: bool
    without: str  # what happens (or what to do) when it is missing


FEATURES = (
    Feature(
        "the Python data source API",
        "pyspark.sql.datasource",
        ("DataSource",),
        True,
        "no txn-* format can be registered",
    ),
    Feature(
        "Python streaming readers",
        "pyspark.sql.datasource",
        ("DataSourceStreamReader",),
        True,
        "the txn-* sources cannot run",
    ),
    Feature(
        "Python streaming writers",
        "pyspark.sql.datasource",
        ("DataSourceStreamWriter",),
        True,
        "the txn-* sinks cannot run",
    ),
    Feature(
        "the Arrow stream writer",
        "pyspark.sql.datasource",
        ("DataSourceStreamArrowWriter", "DataSourceArrowWriter"),
        True,
        "rows cannot reach the sinks as Arrow batches",
    ),
    Feature(
        "admission control for Python sources",
        "pyspark.sql.streaming.datasource",
        ("ReadMaxRows", "SupportsTriggerAvailableNow"),
        False,
        "Trigger.AvailableNow reads one batch per start and maxRowsPerBatch-style "
        "Spark read limits are ignored (the sources' own per-batch limits still apply)",
    ),
)


def _present(feature: Feature) -> bool:
    try:
        module = importlib.import_module(feature.module)
    except ImportError:
        return False
    return any(hasattr(module, a) for a in feature.attributes)


def pyspark_version() -> str | None:
    try:
        import pyspark
    except ImportError:
        return None
    return str(getattr(pyspark, "__version__", "unknown"))


@cache
def missing_features() -> tuple[Feature, ...]:
    """Every feature of :data:`FEATURES` the installed PySpark lacks (all of them without it)."""
    return tuple(f for f in FEATURES if not _present(f))


def require_spark() -> None:
    """Raise :class:`SparkFeatureError` naming each required feature that is missing."""
    version = pyspark_version()
    if version is None:
        raise SparkFeatureError(f"PySpark is not installed: {INSTALL_HINT}")
    missing = [f for f in missing_features() if f.required]
    if missing:
        names = "; ".join(f"{f.name} ({f.module}.{f.attributes[0]}): {f.without}" for f in missing)
        raise SparkFeatureError(f"PySpark {version} lacks {names}. {INSTALL_HINT}")


def _keyword_adapter(func: Callable, options: dict[str, dict]) -> dict:
    """The first keyword set of ``options`` whose key ``func`` accepts (else none)."""
    params = inspect.signature(func).parameters
    for key, kwargs in options.items():
        if key in params:
            return kwargs
    return {}


@cache
def utc_arrow_schema_kwargs() -> dict:
    """Keywords that make ``to_arrow_schema`` map TimestampType to UTC instants.

    PySpark 4.2+ takes ``timezone="UTC"``; 4.0 and 4.1 take ``timestamp_utc=True``
    (their default, spelled out so a changed default cannot shift our timestamps).
    """
    from pyspark.sql.pandas.types import to_arrow_schema

    return _keyword_adapter(
        to_arrow_schema,
        {"timezone": {"timezone": "UTC"}, "timestamp_utc": {"timestamp_utc": True}},
    )
