"""Spark-facing stream readers, one module per system."""
