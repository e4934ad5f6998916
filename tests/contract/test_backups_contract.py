"""Backups of sinks driven without Spark (SinkDriver): where parts live, what is refused
before anything is written, and the messages (issue 25's trial)."""

import os
import shutil

import pytest
from deltalake import DeltaTable
from test_admin import SinkDriver

from pyspark_txn.errors import ConfigError
from pyspark_txn.operations import backups


@pytest.fixture
def sink(tmp_path):
    s = SinkDriver(tmp_path)
    for b in range(2):
        s.batch(b, list(range(b * 10, b * 10 + 10)))
    return s


def ids_of(uri):
    return sorted(DeltaTable(uri).to_pyarrow_table().column("id").to_pylist())


def test_the_same_id_in_two_locations_are_two_backups(sink, tmp_path):
    x, y = str(tmp_path / "X"), str(tmp_path / "Y")
    x1 = backups.take(1, [sink.chk], x)
    assert x1.state == "completed" and x1.members[0].batch_id == 1
    sink.batch(2, list(range(20, 30)))
    y1 = backups.take(1, [sink.chk], y)
    # Y's part is its own copy, of the newer batch, not X's part found by name
    assert y1.state == "completed"
    assert y1.members[0].location.startswith(y) and y1.members[0].batch_id == 2
    backups.delete(1, y)
    # deleting Y's backup 1 leaves X's alone
    x1 = backups.status(1, x)
    assert x1.state == "completed" and x1.members[0].location.startswith(x)
    assert ids_of(os.path.join(x1.members[0].location, "data")) == list(range(20))
    assert backups.verify(1, x).ok


def test_a_wiped_location_does_not_find_its_old_parts(sink, tmp_path):
    x = str(tmp_path / "X")
    backups.take(1, [sink.chk], x)
    shutil.rmtree(x)
    sink.batch(2, list(range(20, 30)))
    again = backups.take(1, [sink.chk], x)
    assert again.state == "completed" and again.members[0].batch_id == 2
    assert ids_of(os.path.join(again.members[0].location, "data")) == list(range(30))
