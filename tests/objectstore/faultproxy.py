"""A small HTTP fault proxy in front of an object-store server on loopback.

It forwards every request and can, per request: answer 5xx without forwarding, drop
the response after the server applied the request (the client sees a reset), refuse
everything for a while (an outage), or hold the response longer than the client's
timeout. It counts requests by method. Faults are drawn from a seeded RNG.
"""

from __future__ import annotations

import http.client
import random
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "content-length"}


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int, seed: int = 0, shim=None) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.shim = shim  # rewrites requests for a server that lacks part of the API (gcs.py)
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.error_rate = 0.0  # 500 without forwarding
        self.drop_rate = 0.0  # forward, then drop the response
        self.delay_rate = 0.0  # forward, then hold the response for delay_s
        self.delay_s = 0.0
        self.outage_until = 0.0  # monotonic time: before it, connections are reset
        self.outage_after: tuple[int, float] | None = None  # (requests, seconds), see below
        self.counts: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _handle(self) -> None:
                proxy._serve(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # a client that gave up on a response (a cancelled range read)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    # --- control ----------------------------------------------------------------
    def calm(self) -> None:
        """No more faults (counts are kept)."""
        self.error_rate = self.drop_rate = self.delay_rate = 0.0
        self.outage_until = 0.0
        self.outage_after = None

    def outage(self, seconds: float) -> None:
        self.outage_until = time.monotonic() + seconds

    def outage_at(self, requests: int, seconds: float) -> None:
        """An outage of ``seconds`` that starts when ``requests`` more requests have come:
        mid-run by the work done, not by a clock that a slow or fast run outlives."""
        with self.lock:
            self.outage_after = (sum(self.counts.values()) + requests, seconds)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # --- serving ----------------------------------------------------------------
    def _draw(self) -> float:
        with self.lock:
            return self.rng.random()

    def _reset(self, handler: BaseHTTPRequestHandler) -> None:
        handler.close_connection = True
        try:
            handler.connection.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
            handler.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        method = h.command
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        with self.lock:
            self.counts[method] += 1
            if self.outage_after and sum(self.counts.values()) >= self.outage_after[0]:
                self.outage_until = time.monotonic() + self.outage_after[1]
                self.outage_after = None
        if time.monotonic() < self.outage_until:
            self.faults["outage"] += 1
            self._reset(h)
            return
        if self.error_rate and self._draw() < self.error_rate:
            self.faults["500"] += 1
            payload = (
                b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
                b"<Message>injected</Message></Error>"
            )
            h.send_response(500)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            if method != "HEAD":
                h.wfile.write(payload)
            return
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
        if self.shim is None:
            status, reason, resp_headers, data = self._forward(method, h.path, headers, body)
        else:
            sent, path, headers, t = self.shim.request(method, h.path, headers)
            try:
                if t.refusal is not None:
                    status, data = t.refusal
                    reason, resp_headers = "", [("Content-Type", "application/xml")]
                else:
                    status, reason, resp_headers, data = self._forward(sent, path, headers, body)
                    status, resp_headers, data = self.shim.response(t, status, resp_headers, data)
            finally:
                self.shim.release(t)
        if self.drop_rate and self._draw() < self.drop_rate:
            self.faults["drop"] += 1  # the server applied it; the client never hears
            self._reset(h)
            return
        if self.delay_rate and self._draw() < self.delay_rate:
            self.faults["delay"] += 1
            time.sleep(self.delay_s)
        h.send_response(status, reason)
        for k, v in resp_headers:
            if k.lower() not in _HOP:
                h.send_header(k, v)
        upstream_length = dict((k.lower(), v) for k, v in resp_headers).get("content-length", "0")
        h.send_header("Content-Length", upstream_length if method == "HEAD" else str(len(data)))
        h.end_headers()
        if method != "HEAD":
            h.wfile.write(data)

    def _forward(self, method: str, path: str, headers: dict[str, str], body: bytes):
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            if body or method in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, resp.reason, resp.getheaders(), data
        finally:
            conn.close()
