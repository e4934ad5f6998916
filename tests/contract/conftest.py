"""One contract suite, every EventLog backend: memory and a real Delta table."""

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
