"""Spark session helpers: a local session that works on a fresh machine, and ``register``."""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming import DataStreamWriter, StreamingQuery

log = logging.getLogger(__name__)


def register(spark: SparkSession) -> list[str]:
    """Register every pyspark-txn format with ``spark``; returns their names.

    Raises :class:`~pyspark_txn.errors.SparkFeatureError` naming what the
    installed PySpark lacks, before anything is registered.
    """
    from .spark.features import require_spark

    require_spark()
    from .formats import ALL_FORMATS

    for cls in ALL_FORMATS:
        spark.dataSource.register(cls)
    return [cls.name() for cls in ALL_FORMATS]


def local_session(app_name: str = "pyspark-txn", cores: int = 2, **conf: str) -> SparkSession:
    """A local SparkSession with pyspark-txn registered.

    Python workers must run this interpreter (otherwise a streaming query dies
    ~20 s in with "Python worker failed to connect back"), Spark stays on
    loopback, and shuffles use as many partitions as cores.
    """
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from .spark.features import require_spark

    require_spark()  # before a JVM starts for nothing
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.appName(app_name)
        .master(f"local[{cores}]")
        .config("spark.sql.shuffle.partitions", str(cores))
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", os.environ["SPARK_LOCAL_IP"])
        .config("spark.sql.streaming.stopActiveRunOnRestart", "true")
    )
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def process_available(writer: DataStreamWriter) -> StreamingQuery:
    """Start ``writer`` (a ``DataStreamWriter``), process everything available, stop.

    Returns the (stopped) ``StreamingQuery``; a failure raises as from
    ``awaitTermination``. Where PySpark gives Python sources admission control
    (4.2+) this is ``trigger(availableNow=True)``. Before 4.2 Spark's
    ``availableNow`` reads a single batch of a Python source and stops, so a
    processing-time trigger drained with ``processAllAvailable`` runs instead
    (not allowed on serverless compute, which only has ``availableNow``: there
    each run moves one batch of at most the source's per-batch limit).
    """
    from .sources._common import HAS_ADMISSION_CONTROL

    if HAS_ADMISSION_CONTROL:
        query = writer.trigger(availableNow=True).start()
        query.awaitTermination()
        return query
    query = writer.trigger(processingTime="0 seconds").start()
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    return query
