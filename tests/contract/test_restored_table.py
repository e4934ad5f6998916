"""A table put back to an older copy of itself (the files copied back: same
size and mtime on disk, same ETag on S3) after our own commit, then one foreign
commit, must not be served as the cached object that still holds our lost commit."""

import shutil

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from deltalake.transaction import CommitProperties, Transaction

from pyspark_txn.sinks.delta_target import _app_version, _app_versions
from pyspark_txn.storage.delta_tables import open_table

SINK = "sink-restore"


def _txn(version):
    return CommitProperties(app_transactions=[Transaction(app_id=SINK, version=version)])


def _keys(client, prefix):
    out = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket="cost", Prefix=prefix):
        out += [o["Key"] for o in page.get("Contents", [])]
    return out


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_table_put_back_to_an_older_copy_is_not_served_from_the_cache(tmp_path, s3, where):
    if where == "local":
        uri, options = str(tmp_path / "t"), None

        def backup():
            shutil.copytree(uri, str(tmp_path / "bak"))  # copy2: size and mtime kept

        def restore():
            shutil.rmtree(uri)
            shutil.copytree(str(tmp_path / "bak"), uri)
    else:
        client, options = s3.client, s3.options
        uri = f"s3://cost/{tmp_path.name}"

        def backup():
            for k in _keys(client, tmp_path.name + "/"):
                client.copy_object(
                    Bucket="cost", Key="bak/" + k, CopySource={"Bucket": "cost", "Key": k}
                )

        def restore():
            for k in _keys(client, tmp_path.name + "/"):
                client.delete_object(Bucket="cost", Key=k)
            for k in _keys(client, "bak/" + tmp_path.name + "/"):
                client.copy_object(
                    Bucket="cost", Key=k[4:], CopySource={"Bucket": "cost", "Key": k}
                )

    for b in range(3):  # batches 0..2 of our sink: versions 0..2
        write_deltalake(
            uri,
            pa.table({"id": [b]}),
            mode="append",
            storage_options=options,
            commit_properties=_txn(b),
        )
    dt = open_table(uri, options)
    assert _app_version(dt, uri, SINK, options) == 2
    backup()  # a copy of the table at version 2
    # our sink commits batch 3 on its cached object (as DeltaTarget._write_commit does)
    write_deltalake(dt, pa.table({"id": [3]}), mode="append", commit_properties=_txn(3))
    dt.update_incremental()
    assert dt.version() == 3
    _app_versions()[(uri, SINK)] = (dt, 3, 3)  # as _write_commit records its own commit
    restore()  # put back to the copy at version 2: batch 3 is gone
    write_deltalake(  # then someone else appends: a version 3 that is not ours
        uri, pa.table({"id": [100]}), mode="append", storage_options=options
    )
    truth = DeltaTable(uri, storage_options=options)
    assert truth.version() == 3 and truth.transaction_version(SINK) == 2
    again = open_table(uri, options)
    rows = sorted(again.to_pyarrow_table()["id"].to_pylist()) if again is not dt else "cached"
    # what the protocol decides on: the sink's batch in the table (2: batch 3 was lost,
    # a refusal is due) -- the cached object says 3
    assert again is not dt and _app_version(again, uri, SINK, options) == 2, (
        f"the cached table object (holding our lost batch 3) was served: rows {rows}"
    )


def test_the_protocol_refuses_a_table_put_back_under_a_running_sink(tmp_path):
    """The same through the protocol (as tests/contract/test_admin.py drives it): the
    table is put back to its copy from before batch 2, someone appends once, and the
    running sink must refuse (TargetGoneError: batch 2 is gone) instead of going on."""
    from test_admin import SinkDriver

    from pyspark_txn.errors import TargetGoneError

    sink = SinkDriver(tmp_path)
    sink.batch(0, [0, 1])
    sink.batch(1, [2, 3])
    shutil.copytree(sink.target, str(tmp_path / "bak"))  # a copy at batch 1 (mtimes kept)
    sink.batch(2, [4, 5])
    assert sink.ids() == [0, 1, 2, 3, 4, 5]
    shutil.rmtree(sink.target)
    shutil.copytree(str(tmp_path / "bak"), sink.target)  # put back: batch 2 is gone
    write_deltalake(  # another writer appends (a row of the table's schema)
        sink.target,
        pa.table({"id": pa.array([100], pa.int64()), "v": pa.array(["x"])}),
        mode="append",
    )
    assert DeltaTable(sink.target).transaction_version(sink.sink_id) == 1
    with pytest.raises(TargetGoneError):
        sink.batch(3, [6, 7])
    # (what happens instead: batch 3 lands, batch 2 is silently missing)
