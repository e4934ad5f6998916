"""Azurite (Azure Blob emulator, npm) on loopback for the tests: installed by
``scripts/setup.sh --servers`` into a cache folder, or found on PATH."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

from support import stop_process, wait_for_port

#: Azurite's published development account key (not a secret).
DEV_ACCOUNT = "devstoreaccount1"
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
CACHE = Path(os.environ.get("PYSPARK_TXN_SERVERS", Path.home() / ".cache" / "pyspark-txn-servers"))


def azurite_binary() -> str | None:
    """The azurite-blob executable (>= 3.37: older ones ignore list startFrom)."""
    local = CACHE / "azurite" / "node_modules" / ".bin" / "azurite-blob"
    if local.exists():
        return str(local)
    return shutil.which("azurite-blob")


class Azurite:
    def __init__(self, binary: str, location: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [
                binary,
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                str(self.port),
                "--location",
                str(location),
                "--skipApiVersionCheck",
                "--disableTelemetry",
                "--silent",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.proc, self.port, "azurite-blob")
        self.endpoint = f"http://127.0.0.1:{self.port}/{DEV_ACCOUNT}"
        self.options = {
            "AZURE_STORAGE_ACCOUNT_NAME": DEV_ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": DEV_KEY,
            "AZURE_STORAGE_ENDPOINT": self.endpoint,
            "AZURE_ALLOW_HTTP": "true",
        }

    def create_container(self, name: str) -> None:
        from azure.storage.blob import BlobServiceClient

        conn = (
            f"DefaultEndpointsProtocol=http;AccountName={DEV_ACCOUNT};AccountKey={DEV_KEY};"
            f"BlobEndpoint={self.endpoint};"
        )
        BlobServiceClient.from_connection_string(conn).create_container(name)

    def stop(self) -> None:
        stop_process(self.proc)
