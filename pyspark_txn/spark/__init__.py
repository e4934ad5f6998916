"""Spark glue shared by the sources and the sinks: option parsing, Spark<->Arrow types,
and the Spark features this package needs. Imports neither a source nor a sink."""
