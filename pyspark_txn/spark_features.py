"""Kept so ``from pyspark_txn.spark_features import missing_features`` (older docs) works;
the module is :mod:`pyspark_txn.spark.features`."""

from .spark.features import FEATURES, missing_features, require_spark

__all__ = ["FEATURES", "missing_features", "require_spark"]
