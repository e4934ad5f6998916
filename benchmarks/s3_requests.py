"""S3 requests and latency per committed batch, counted by a proxy in front of moto.

    .venv/bin/python benchmarks/s3_requests.py [--batches 100] [--block 50]
        [--sinks txn-delta,txn-delta-light,foreachBatch] [--rows 100] [--json FILE]

A moto S3 server on loopback, and in front of it :class:`CountingProxy`, a
small HTTP proxy that forwards every request and counts it by method and
path class: ``commit`` (``_delta_log/N.json``), ``checkpoint``
(``*.checkpoint.parquet``, ``_last_checkpoint``), ``data`` (``.parquet``
files), ``list`` (a ``list-type=2`` query), ``other`` (markers, the staging
area). One SparkSession (local[2]) runs each sink on ``rate-micro-batch``
(``--rows`` rows per batch, one partition: one write task), target and
record table on ``s3://`` through the proxy, Spark's own checkpoint on local
disk (this machine has no S3A):

  txn-delta        snapshots mode, ``recordTable`` on S3 too
  txn-delta-light  mode=light
  foreachBatch     the hand-written alternative: ``toArrow()`` then delta-rs
                   ``write_deltalake`` with ``Transaction(app_id, batch_id)``,
                   skipping batch ids the table already holds

Per block of ``--block`` batches: mean requests per batch by class and the
median ``triggerExecution`` (batch 0 left out). The staging IO of the sink
goes through fsspec; with no s3fs in the environment the bench registers
obstore's fsspec store for ``s3://`` in every Python process (a
``sitecustomize`` on ``PYTHONPATH``), configured from the same values.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("s3_requests")

ALL_SINKS = ["txn-delta", "txn-delta-light", "foreachBatch"]
APP_ID = "s3-requests-bench"
BUCKET = "bench"
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


def path_class(method: str, target: str) -> str:
    """``METHOD class`` of one request: what a per-batch cost is made of."""
    parts = urlsplit(target)
    path, query = parts.path, parts.query
    name = path.rsplit("/", 1)[-1]
    if "list-type=" in query or (method == "GET" and path.count("/") <= 1 and not name):
        kind = "list"
    elif "/_delta_log/" in path:
        if ".checkpoint" in name or name == "_last_checkpoint":
            kind = "checkpoint"
        elif name.endswith(".json"):
            kind = "commit"
        else:
            kind = "log-other"
    elif name.endswith(".parquet"):
        kind = "data"
    else:
        kind = "other"
    return f"{method} {kind}"


class CountingProxy:
    """Forward HTTP requests to ``upstream`` (host, port) and count them by class."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.trace = bool(os.environ.get("S3_BENCH_TRACE"))
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    conn.connect()
                    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                with proxy.lock:
                    proxy.counts[path_class(self.command, self.path)] += 1
                if proxy.trace:
                    log.info(
                        "%s %s (%d bytes) -> %s (%d bytes)",
                        self.command,
                        self.path,
                        length,
                        resp.status,
                        len(data),
                    )
                self.send_response(resp.status, resp.reason)
                head = self.command == "HEAD"  # keeps the object's own Content-Length
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head or resp.getheader("Content-Length") is None:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    try:
                        self.wfile.write(data)
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # the client stopped reading (delta-rs drops unneeded reads)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> CountingProxy:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counts)


def start_moto():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    return server, server.get_host_and_port()


def create_bucket(host: str, port: int) -> None:
    """The benchmark's bucket, made on moto directly (not through the counting proxy)."""
    import boto3

    boto3.client(
        "s3",
        endpoint_url=f"http://{host}:{port}",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=BUCKET)


_SITECUSTOMIZE = '''\
"""Written by benchmarks/s3_requests.py: obstore's fsspec store for s3:// (no s3fs here)."""
import json, os
try:
    import fsspec
    import obstore.fsspec

    class FreshS3(obstore.fsspec.FsspecStore):
        """obstore 0.12's ``info`` answers from its listing cache (a file staged after a
        listing reads as an empty directory): never consult it."""

        protocol = "s3"

        def _ls_from_cache(self, path):
            return None

    fsspec.register_implementation("s3", FreshS3, clobber=True)
    fsspec.config.conf.setdefault("s3", {}).update(json.loads(os.environ["S3_BENCH_OBSTORE"]))
except Exception:  # a benchmark helper: never break an interpreter's start
    pass
'''


def setup_environment(endpoint: str, work: str) -> dict[str, str]:
    """delta-rs storage options; obstore's fsspec store for staging IO in every process."""
    creds = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }
    obstore_cfg = {
        "config": {
            "aws_endpoint": endpoint,
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
            "aws_region": "us-east-1",
        },
        "client_options": {"allow_http": True},
    }
    site = os.path.join(work, "site")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(_SITECUSTOMIZE)
    os.environ["S3_BENCH_OBSTORE"] = json.dumps(obstore_cfg)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [site, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    exec(compile(_SITECUSTOMIZE, "sitecustomize", "exec"), {})  # this process too
    return creds


def foreach_batch_to_delta(uri: str, options: dict[str, str], app_id: str = APP_ID):
    """The hand-written exactly-once Delta writer (as in small_batches.py), on S3."""

    def write(df, batch_id: int) -> None:
        from deltalake import DeltaTable, write_deltalake
        from deltalake.exceptions import TableNotFoundError
        from deltalake.transaction import CommitProperties, Transaction

        try:
            dt: Any = DeltaTable(uri, storage_options=options)
        except TableNotFoundError:
            dt = None
        if dt is not None:
            done = dt.transaction_version(app_id)
            if done is not None and done >= batch_id:
                return
        write_deltalake(
            dt if dt is not None else uri,
            df.toArrow(),
            mode="append",
            storage_options=None if dt is not None else options,
            commit_properties=CommitProperties(
                app_transactions=[Transaction(app_id=app_id, version=batch_id)]
            ),
        )

    return write


def run_sink(spark, proxy: CountingProxy, sink: str, work: str, creds, args) -> dict[str, Any]:
    from pyspark.sql.streaming import StreamingQueryListener

    marks: dict[int, tuple[dict[str, int], int]] = {}
    cond = threading.Condition()

    class Listener(StreamingQueryListener):
        def onQueryStarted(self, event) -> None:
            pass

        def onQueryIdle(self, event) -> None:
            pass

        def onQueryTerminated(self, event) -> None:
            with cond:
                cond.notify_all()

        def onQueryProgress(self, event) -> None:
            p = event.progress
            if proxy.trace:
                log.info("batch %s done", p.batchId)
            with cond:
                marks[int(p.batchId)] = (
                    proxy.snapshot(),
                    int((p.durationMs or {}).get("triggerExecution", -1)),
                )
                cond.notify_all()

    listener = Listener()
    spark.streams.addListener(listener)
    n = args.batches
    uri = f"s3://{BUCKET}/{sink}/table"
    chk = os.path.join(work, sink, "chk")
    df = (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", args.rows)
        .option("numPartitions", 1)
        .load()
        .where(f"value < {(n + 1) * args.rows}")
    )
    w = df.writeStream.option("checkpointLocation", chk).queryName(f"s3_{sink}".replace("-", "_"))
    if sink == "foreachBatch":
        q = w.foreachBatch(foreach_batch_to_delta(uri, creds)).start()
    else:
        w = w.format("txn-delta").option("storageOptions", json.dumps(creds))
        if sink == "txn-delta-light":
            w = w.option("mode", "light")
        else:
            w = w.option("recordTable", f"s3://{BUCKET}/{sink}/records")
        q = w.start(uri)
    start = time.monotonic()
    try:
        with cond:
            while len(marks) < n + 1 and q.isActive:
                cond.wait(5)
                if q.exception() is not None:
                    raise RuntimeError(str(q.exception()))
    finally:
        q.stop()
        spark.streams.removeListener(listener)
    wall = time.monotonic() - start
    blocks = []
    ids = sorted(b for b in marks if b <= n)
    for lo in range(1, n + 1, args.block):
        hi = min(lo + args.block, n + 1)
        per, ms = [], []
        for b in range(lo, hi):
            if b in marks and b - 1 in marks:
                now, before = marks[b][0], marks[b - 1][0]
                per.append({k: now.get(k, 0) - before.get(k, 0) for k in now})
                ms.append(marks[b][1])
        if not per:
            continue
        keys = sorted({k for d in per for k in d})
        mean = {k: round(sum(d.get(k, 0) for d in per) / len(per), 1) for k in keys}
        blocks.append(
            {
                "batches": f"{lo}-{hi - 1}",
                "requests_per_batch": round(sum(mean.values()), 1),
                "by_class": {k: v for k, v in mean.items() if v},
                "median_ms": statistics.median(ms),
            }
        )
    return {"sink": sink, "batches": len(ids), "wall_s": round(wall, 1), "blocks": blocks}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--block", type=int, default=50)
    ap.add_argument("--rows", type=int, default=100)
    ap.add_argument("--sinks", default=",".join(ALL_SINKS))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for quiet in ("werkzeug", "py4j"):  # one line per request / per callback otherwise
        logging.getLogger(quiet).setLevel(logging.WARNING)
    work = tempfile.mkdtemp(prefix="s3req-")
    moto, (host, port) = start_moto()
    proxy = CountingProxy((host, port)).start()
    endpoint = f"http://127.0.0.1:{proxy.port}"
    creds = setup_environment(endpoint, work)
    create_bucket(host, port)
    import pyspark_txn

    spark = pyspark_txn.local_session(
        "bench-s3-requests",
        **{"spark.ui.showConsoleProgress": "false"},
    )
    results = []
    try:
        for sink in args.sinks.split(","):
            log.info("running %s for %d batches", sink, args.batches)
            r = run_sink(spark, proxy, sink, work, creds, args)
            results.append(r)
            for b in r["blocks"]:
                print(
                    f"{sink:16} batches {b['batches']:>9}: {b['requests_per_batch']:6.1f} "
                    f"requests/batch, median {b['median_ms']} ms  {b['by_class']}",
                    flush=True,
                )
    finally:
        spark.stop()
        proxy.stop()
        moto.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
