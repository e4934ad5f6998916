"""txn-delta with its target and record table on Azure Blob (Azurite >= 3.37)."""

from __future__ import annotations

import pytest
from s3_pipeline import S3Pipeline

pytestmark = pytest.mark.spark


def test_txn_delta_on_azurite_is_exactly_once_across_crashes(spark, tmp_path, azure, fired_faults):
    """The commit worker dies right after the record is safe (phase 2 not run), then a
    task dies while staging: each restart finishes what the record table says, and every
    row lands once with no orphan blob."""
    p = S3Pipeline(spark, tmp_path, azure, total=300, per_batch=100)
    for fault in ["after_record:exit@batch=0", "phase1:exit@partition=0"]:
        assert p.run(fault) is not None, fault
        fired_faults.assert_fired(fault)
    assert p.run() is None
    p.assert_exactly_once()
    p.assert_no_orphans()
    p.assert_records_consistent()
