"""Shared IO: where the sink, the sources and the operations read and write.

``options`` (:class:`StorageOptions`: credentials and store settings), ``fs`` (one URI
convention for delta-rs and fsspec), ``delta_tables`` (cached delta-rs tables) and
``checkpoint`` (reading Spark's checkpoint folder). Imports nothing above it but
:mod:`pyspark_txn.errors`."""

from .options import (
    STORAGE_OPTIONS_EXAMPLE,
    StorageOptions,
    current,
    describe_store_error,
    filesystem,
    store_errors,
    takes_storage_options,
    using,
)

__all__ = [
    "STORAGE_OPTIONS_EXAMPLE",
    "StorageOptions",
    "current",
    "describe_store_error",
    "filesystem",
    "store_errors",
    "takes_storage_options",
    "using",
]
