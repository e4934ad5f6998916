"""storage.fs' small-object IO (read_bytes, read_text, remove_tree, write_new) as one
contract over local disk, moto's S3 and Azurite, and what rests on it: an export's
marker is exclusive on every store; `snapshots delete` on Azure removes every file
(a new-user trial: a recursive fs.rm bulk-deleted folder names, Azure answered 404 and
manifest/ and the marker stayed behind)."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from typing import Any

import pytest
from support import run_cli_process

from pyspark_txn.errors import ConfigError
from pyspark_txn.operations.snapshots.exports import _write_marker
from pyspark_txn.operations.snapshots.location import _read_marker, _remove_export
from pyspark_txn.operations.snapshots.registry import EXPORT_MARKER
from pyspark_txn.storage import StorageOptions
from pyspark_txn.storage import fs as _fs

STORE_ENV = [k for k in os.environ if k.startswith(("AWS_", "AZURE_", "GOOGLE_"))]


@dataclass
class Place:
    """A folder on one store: its fsspec filesystem and path, and the files under it
    listed without the code under test (boto3, the Azure SDK, os.walk)."""

    fs: Any
    root: str
    store: Any  # the S3 / AzureContainer fixture, None on local disk
    local_dir: str | None = None

    def path(self, *parts: str) -> str:
        return _fs.join(self.root, *parts)

    def files(self) -> list[str]:
        if self.store is not None:
            return [k.split("place/", 1)[1] for k in self.store.keys("place/")]
        out = []
        for folder, _dirs, names in os.walk(self.local_dir or self.root):
            out += [os.path.relpath(os.path.join(folder, n), self.root) for n in names]
        return sorted(out)

    def folders(self) -> list[str]:
        """Folders left on a local disk (object stores have none)."""
        if self.store is not None:
            return []
        return sorted(
            os.path.relpath(os.path.join(folder, d), self.root)
            for folder, dirs, _names in os.walk(self.root)
            for d in dirs
        )


@pytest.fixture(params=["local", "s3", "azure"])
def place(request, tmp_path) -> Place:
    if request.param == "local":
        root = str(tmp_path / "place")
        os.makedirs(root)
        fs, path = _fs.filesystem(root)
        return Place(fs, path, None)
    store = request.getfixturevalue(request.param)
    fs, path = StorageOptions.parse(store.options).filesystem(store.uri("place"))
    return Place(fs, path, store)


def _write(place: Place, rel: str, data: bytes) -> None:
    path = place.path(rel)
    if place.store is None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    place.fs.pipe_file(path, data)


def test_read_a_missing_object_is_file_not_found_and_a_present_one_whole(place):
    with pytest.raises(FileNotFoundError):
        _fs.read_bytes(place.fs, place.path("nothing"))
    with pytest.raises(FileNotFoundError):
        _fs.read_text(place.fs, place.path("no", "such", "file.json"))
    body = json.dumps({"name": "né", "n": list(range(2000))}).encode()
    _write(place, "a/marker.json", body)
    got = _fs.read_bytes(place.fs, place.path("a/marker.json"))
    assert type(got) is bytes and got == body  # obstore's fs.cat gives {path: bytes}
    assert _fs.read_text(place.fs, place.path("a/marker.json")) == body.decode("utf-8")


def test_remove_tree_removes_every_file_below_and_nothing_beside(place):
    for rel in ["t/1", "t/a/2", "t/a/b/3", "t/a/b/c/_delta_log/4.json", "t2/keep", "keep"]:
        _write(place, rel, rel.encode())
    _fs.remove_tree(place.fs, place.path("t"))
    assert place.files() == ["keep", "t2/keep"]  # "t2" shares the prefix "t"
    assert place.folders() == (["t2"] if place.store is None else [])
    _fs.remove_tree(place.fs, place.path("t"))  # again: nothing there is no error
    _fs.remove_tree(place.fs, place.path("never", "was"))
    _fs.remove_tree(place.fs, place.path("keep"))  # a file: itself
    assert place.files() == ["t2/keep"]


def test_remove_tree_tolerates_files_that_go_while_it_runs(place, monkeypatch):
    """Two removals of one folder at once (a rerun beside a slow first run): files the
    other removed between the listing and the delete are not an error."""
    for i in range(6):
        _write(place, f"t/{i % 2}/{i}", b"x")
    listed = place.fs.find(place.path("t"))
    for p in listed[:3]:
        place.fs.rm_file(p)
    monkeypatch.setattr(type(place.fs), "find", lambda self, path, **kw: listed)
    _fs.remove_tree(place.fs, place.path("t"))
    monkeypatch.undo()
    assert place.files() == []


def test_write_new_creates_once_and_keeps_the_first_writers_content(place):
    path = place.path("new", "folder", "marker.json")
    assert _fs.write_new(place.fs, path, b"first") is True
    assert _fs.write_new(place.fs, path, b"second") is False
    assert _fs.read_bytes(place.fs, path) == b"first"
    assert place.files() == ["new/folder/marker.json"]


def test_write_new_racing_writers_one_wins(place):
    path = place.path("race", "marker.json")
    results: dict[int, bool] = {}
    start = threading.Barrier(6)

    def writer(i: int) -> None:
        start.wait()
        results[i] = _fs.write_new(place.fs, path, f"writer {i}".encode())

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [i for i, won in results.items() if won]
    assert len(results) == 6 and len(winners) == 1, results
    assert _fs.read_text(place.fs, path) == f"writer {winners[0]}"


def test_an_export_marker_is_exclusive_on_every_store(place):
    """Protocol review "S3": the marker was a plain PUT and a read-back, so two exports
    to one object-store location that interleaved both went ahead."""
    root = place.path("export")
    uri = place.root if place.store is None else place.store.uri("place", "export")
    first = {"sink_id": "s", "snapshot_id": 1, "name": "a", "owner": {"token": "t1", "pid": 1}}
    second = {"sink_id": "s", "snapshot_id": 2, "name": "b", "owner": {"token": "t2", "pid": 2}}
    if place.store is None:
        os.makedirs(root)
    _write_marker(place.fs, root, first, uri)
    with pytest.raises(ConfigError, match="another export"):
        _write_marker(place.fs, root, second, uri)
    assert _read_marker(place.fs, root) == first


def test_removing_an_export_takes_the_marker_last(place, monkeypatch):
    """A removal killed half way keeps the marker, which lets a rerun (or a later export
    there) finish it; the marker only goes once the rest is gone."""
    root = place.path("export")
    for rel in ["data/_delta_log/0.json", "data/part-0.parquet", "manifest/files.json"]:
        _write(place, f"export/{rel}", b"x")
    _write(place, "export/state/0/1.delta", b"x")
    _write(place, f"export/{EXPORT_MARKER}", json.dumps({"snapshot_id": 1}).encode())
    real = _fs.remove_tree

    def dies_on_state(fs, path):
        if path.rstrip("/").endswith("/state"):
            raise OSError("killed")
        real(fs, path)

    monkeypatch.setattr(_fs, "remove_tree", dies_on_state)
    with pytest.raises(OSError, match="killed"):
        _remove_export(place.fs, root, root)
    assert f"export/{EXPORT_MARKER}" in place.files()
    monkeypatch.undo()
    _remove_export(place.fs, root, root)
    assert place.files() == []
    assert place.folders() == []


@pytest.mark.spark
def test_snapshots_delete_on_azure_removes_every_file_and_exits_0(spark, tmp_path, azure):
    from s3_pipeline import S3Pipeline

    p = S3Pipeline(spark, tmp_path, azure, total=100, per_batch=50)
    assert p.run() is None
    options = json.dumps(azure.options)
    to = azure.uri("exports", "n2")
    rc, out, err = run_cli_process(
        "snapshots", "export", p.records, "n2", "--to", to, "--state", "skip",
        "--storage-options", options, unset=STORE_ENV,
    )  # fmt: skip
    assert rc == 0, (out, err)
    assert f"exports/n2/{EXPORT_MARKER}" in azure.keys("exports/")
    assert any(k.startswith("exports/n2/manifest/") for k in azure.keys("exports/"))
    rc, out, err = run_cli_process(
        "snapshots", "delete", p.records, "n2", "--yes", "--storage-options", options,
        unset=STORE_ENV,
    )  # fmt: skip
    assert rc == 0, (out, err)
    assert azure.keys("exports/") == []
    rc, out, err = run_cli_process(
        "snapshots", "list", p.records, "--json", "--storage-options", options, unset=STORE_ENV
    )
    assert rc == 0 and json.loads(out) == [], (out, err)
