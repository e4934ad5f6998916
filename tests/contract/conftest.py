"""One contract suite, every EventLog backend: memory and a real Delta table."""

from dataclasses import dataclass
from typing import Any

import pytest
from support import FaultyLog

from pyspark_txn.state import DeltaEventLog, MemoryEventLog


@pytest.fixture(params=["memory", "delta"])
def backend(request, tmp_path):
    if request.param == "memory":
        return MemoryEventLog()
    log = DeltaEventLog(str(tmp_path / "records"), compact_every=4)
    log.create_if_missing()
    return log


@pytest.fixture
def faulty(backend):
    return FaultyLog(backend)


@dataclass
class MotoS3:
    """A bucket of moto's S3 server on loopback, in this process."""

    bucket: Any  # boto3's Bucket
    client: Any  # boto3's S3 client
    options: dict[str, str]  # delta-rs storage options

    def delete(self, prefix: str) -> None:
        self.bucket.objects.filter(Prefix=prefix.rstrip("/") + "/").delete()


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on loopback with a bucket ``cost`` (one server per module)."""
    boto3 = pytest.importorskip("boto3")
    server_mod = pytest.importorskip("moto.server")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    kw = {
        "endpoint_url": endpoint,
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
        "region_name": "us-east-1",
    }
    bucket = boto3.resource("s3", **kw).Bucket("cost")
    bucket.create()
    options = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }
    yield MotoS3(bucket, boto3.client("s3", **kw), options)
    server.stop()
