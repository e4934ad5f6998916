"""A two-query pipeline driven without Spark, for the backup tests (local and object
stores): ``a`` written from a sequence by a txn-delta sink, ``b`` fed by the real
``txn-delta`` stream reader over ``a``'s table, so the offsets ``b`` records are the
source's own (with the table id) and a restored ``b`` reads on from its restored
checkpoint's offsets exactly as Spark would hand them to the source."""

from __future__ import annotations

import json
import shutil

from contract.test_admin import SinkDriver
from deltalake import DeltaTable

from pyspark_txn import storage
from pyspark_txn.sources.delta import DeltaSourceOptions, DeltaStreamReader
from pyspark_txn.storage import fs as _fs
from pyspark_txn.storage.checkpoint import latest_batch, read_batch_offsets

PER_BATCH = 5


def ids(table, options=None):
    dt = DeltaTable(table, storage_options=options)
    return sorted(dt.to_pyarrow_table().column("id").to_pylist())


class Pipe:
    """``a`` (a sequence of ids) -> ``b`` (every row of ``a``'s table, once)."""

    def __init__(
        self, tmp_path, a_chk=None, a_path=None, b_chk=None, b_path=None, *, options=None, **sink
    ):
        """``options``: storage options for every table (``sink``: more sink options, such
        as record tables on a store: ``recordTable_a`` / ``recordTable_b``)."""
        self.options = options
        extra = {"storageOptions": json.dumps(options)} if options else {}
        with storage.using(options):
            self.a = SinkDriver(
                tmp_path, name="a", chk=a_chk, target=a_path, **extra, **_of(sink, "_a")
            )
            self.b = SinkDriver(
                tmp_path, name="b", chk=b_chk, target=b_path, **extra, **_of(sink, "_b")
            )
        self.next_a = self.next_b = 0
        self.b_offset = None  # where b's source stands (None: its first batch)
        self.reads = self.a.target  # the table b's source reads

    @classmethod
    def restored(cls, tmp_path, restored, *, b_reads=None, options=None, **sink):
        """The pipeline on restored members: each query goes on from its checkpoint."""
        pipe = cls(
            tmp_path,
            a_chk=restored[0].checkpoint,
            a_path=restored[0].path,
            b_chk=restored[1].checkpoint,
            b_path=restored[1].path,
            options=options,
            **sink,
        )
        with storage.using(options):
            pipe.next_a = latest_batch(pipe.a.chk, "commits") + 1
            pipe.next_b = latest_batch(pipe.b.chk, "commits") + 1
            (pipe.b_offset,) = read_batch_offsets(pipe.b.chk, pipe.next_b - 1)
        pipe.reads = b_reads or restored[1].reads[0]
        return pipe

    def step_a(self, batches=1):
        for _ in range(batches):
            n = self.next_a
            with storage.using(self.options):
                self.a.batch(n, list(range(n * PER_BATCH, (n + 1) * PER_BATCH)))
            self.next_a += 1

    def step_b(self):
        source = {"path": self.reads}
        if self.options:
            source["storageOptions"] = json.dumps(self.options)
        opts = DeltaSourceOptions.parse(source)
        reader = DeltaStreamReader(opts, opts.spark_schema_ddl())
        start = self.b_offset or reader.initialOffset()
        end = reader.latestOffset(start, None)
        got = []
        for part in reader.partitions(start, end):
            for batch in reader.read(part):
                got += batch.column("id").to_pylist()
        with storage.using(self.options):
            self.b.batch(self.next_b, got, source_offsets=[json.dumps(end, sort_keys=True)])
        self.next_b += 1
        self.b_offset = end

    def ids(self, which):
        return ids(getattr(self, which).target, self.options)

    @property
    def chks(self):
        return [self.a.chk, self.b.chk]

    @property
    def declared(self):
        return {self.b.chk: [self.a.target]}


def lose_everything(pipe):
    """The disaster: every checkpoint, record table and target gone."""
    for s in (pipe.a, pipe.b):
        for place in (s.chk, s.target, s.opts.record_table):
            fs, root = _fs.filesystem(place, storage.StorageOptions.coerce(pipe.options))
            _fs.remove_tree(fs, root)
        shutil.rmtree(s.chk, ignore_errors=True)


def _of(options, suffix):
    return {k[: -len(suffix)]: v for k, v in options.items() if k.endswith(suffix)}


class Killed(Exception):
    """A restore stopped at a fault point (as kill -9 would stop it there)."""


def restore_killed_at(monkeypatch, point, *args, **kwargs):
    """``backups.restore(*args, **kwargs)`` stopped at the fault point ``point``."""
    import importlib

    import pytest

    from pyspark_txn.operations import backups

    restore_module = importlib.import_module("pyspark_txn.operations.backups.restore")

    def stop(at):
        if at == point:
            raise Killed(at)

    with monkeypatch.context() as m:
        m.setattr(restore_module, "_fault", stop)
        with pytest.raises(Killed):
            backups.restore(*args, **kwargs)
