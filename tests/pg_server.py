"""A throwaway PostgreSQL cluster for the txn-postgres tests.

``initdb`` refuses to run as root, so as root the cluster is created and run by
the ``postgres`` user (``runuser``) in a temporary directory it owns; otherwise
by the current user. It listens on a free loopback port only (no Unix socket
in a shared place), with ``max_prepared_transactions`` set, and is stopped by
the fixture that started it.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def pg_bindir() -> str | None:
    """Where ``initdb`` and ``pg_ctl`` live: ``pg_config --bindir``, else Debian's layout."""
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, check=True
            ).stdout.strip()
            if os.access(os.path.join(out, "initdb"), os.X_OK):
                return out
        except (OSError, subprocess.CalledProcessError):
            pass
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    return os.path.dirname(found[0]) if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """One PostgreSQL cluster that this object created, started and alone stops."""

    def __init__(self, bindir: str, max_prepared: int = 64) -> None:
        self.bindir = bindir
        self.port = free_port()
        self.as_root = os.geteuid() == 0
        # A directory the server's user owns (tmp_path may sit under /root, which
        # the postgres user cannot enter).
        self.base = Path(tempfile.mkdtemp(prefix="pyspark-txn-pg-"))
        self.data = self.base / "data"
        self.logfile = self.base / "server.log"
        if self.as_root:
            pw = pwd.getpwnam("postgres")
            os.chown(self.base, pw.pw_uid, pw.pw_gid)
        self.user = "txn"
        self.password = "s3cret-pw"
        pwfile = self.base / "pw"
        pwfile.write_text(self.password + "\n")
        if self.as_root:
            os.chown(pwfile, pw.pw_uid, pw.pw_gid)
        self._run(
            "initdb",
            "-D", str(self.data),
            "-U", self.user,
            "--pwfile", str(pwfile),
            "-A", "scram-sha-256",
            "--no-sync",
            "-E", "UTF8",
            "--locale", "C",
        )  # fmt: skip
        with open(self.data / "postgresql.conf", "a") as f:
            f.write(
                f"listen_addresses = '127.0.0.1'\nport = {self.port}\n"
                f"unix_socket_directories = '{self.base}'\n"
                f"max_prepared_transactions = {max_prepared}\n"
                "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n"
                "max_connections = 100\nshared_buffers = 128MB\n"
            )
        self.start()

    @property
    def url(self) -> str:
        return f"postgresql://{self.user}:{self.password}@127.0.0.1:{self.port}/postgres"

    @property
    def url_without_password(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        cmd = [os.path.join(self.bindir, tool), *args]
        if self.as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=self.base)
        if proc.returncode != 0:
            log = self.logfile.read_text(errors="replace")[-2000:] if self.logfile.exists() else ""
            raise RuntimeError(f"{tool} failed: {proc.stdout}{proc.stderr}\n{log}")

    def start(self) -> None:
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.logfile), "-w", "-t", "60", "start"
        )

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart(self) -> None:
        """Stop (fast: open sessions are cut, prepared transactions stay) and start again."""
        self.stop()
        self.start()

    def connect(self, **kw):
        import psycopg

        deadline = time.monotonic() + 20
        while True:
            try:
                return psycopg.connect(self.url, autocommit=True, **kw)
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def destroy(self) -> None:
        try:
            self.stop("immediate")
        except RuntimeError:
            pass
        shutil.rmtree(self.base, ignore_errors=True)
