"""A real ``redis-server`` for the Redis source tests, and a Spark session.

The server runs on a free loopback port in a temporary directory with the
append-only file on (as a durable deployment would), and is shut down at the
end. Tests that need it are skipped, with the reason, only when no
``redis-server`` binary can be found.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from support import stop_process

import pyspark_txn

_CANDIDATES = ("/usr/bin/redis-server", "/usr/sbin/redis-server", "/usr/local/bin/redis-server")


def _redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    return next((p for p in _CANDIDATES if os.access(p, os.X_OK)), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process that this fixture started (and alone stops)."""

    def __init__(self, binary: str, workdir: Path, port: int | None = None) -> None:
        self.binary = binary
        self.port = port or _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.workdir = workdir
        self.log = open(workdir / "redis.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(workdir),
                "--appendonly", "yes",
                "--save", "",
                "--daemonize", "no",
                "--protected-mode", "yes",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        import redis  # redis-py: the project's extra 'redis' (scripts/setup.sh installs it)

        client = self.client()
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    log = (workdir / "redis.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(
                        f"redis-server did not start on {self.url}:\n{log}"
                    ) from None
                time.sleep(0.05)

    def client(self):
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=10)

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()

    def restart(self) -> RedisServer:
        """The same server again (port, directory and so its append-only file)."""
        self.stop()
        return RedisServer(self.binary, self.workdir, self.port)


def _binary() -> str:
    binary = _redis_server_binary()
    if binary is None:
        pytest.skip(
            "redis-server not found (Debian: apt-get install redis-server; scripts/setup.sh "
            "installs it)"
        )
    return binary


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(_binary(), tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def own_redis_server(tmp_path_factory):
    """A server of this test alone, which it may stop and restart."""
    holder = {"server": RedisServer(_binary(), tmp_path_factory.mktemp("own-redis"))}
    yield holder
    holder["server"].stop()


@pytest.fixture
def redis_db(redis_server):
    """A client on an empty database: every test starts from nothing."""
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def spark():
    session = pyspark_txn.local_session("pyspark-txn-redis-tests")
    yield session
    session.stop()
