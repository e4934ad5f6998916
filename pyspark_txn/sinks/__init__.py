"""Spark-facing sinks and the target-independent two-phase protocol."""
