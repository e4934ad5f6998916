"""A local Spark Connect server for tests (``SparkSession.builder.remote("local[2]")``),
as Databricks serverless and shared compute give one: availability and its port."""

from __future__ import annotations

import importlib.util
import socket
import time

import pytest

SPARK_CONNECT_PORT = 15002  # remote("local[...]") starts its server there


def spark_connect_available() -> bool:
    """Whether Spark Connect's client packages are installed (pyspark[connect])."""
    needed = ("pandas", "grpc", "grpc_status", "google.protobuf", "zstandard")
    try:
        return all(importlib.util.find_spec(name) is not None for name in needed)
    except ModuleNotFoundError:  # a parent package (google) is missing
        return False


def wait_until_free(port: int = SPARK_CONNECT_PORT, timeout_s: float = 60) -> None:
    """The previous test's server may still be exiting; skip if another one stays."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                return
        if time.monotonic() > deadline:
            pytest.skip(f"port {port} stays busy: another Spark Connect server runs here")
        time.sleep(0.5)


requires_spark_connect = pytest.mark.skipif(
    not spark_connect_available(),
    reason="Spark Connect's client dependencies (pandas, grpcio, ...) are not installed",
)
