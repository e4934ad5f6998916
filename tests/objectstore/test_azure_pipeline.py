"""txn-delta with its target and record table on Azure Blob (Azurite >= 3.37)."""

from __future__ import annotations

import pytest
from s3_pipeline import S3Pipeline

pytestmark = pytest.mark.spark


def test_txn_delta_on_azurite_is_exactly_once(spark, tmp_path, azure):
    p = S3Pipeline(spark, tmp_path, azure, total=300, per_batch=100)
    assert p.run() is None
    p.assert_exactly_once()
    p.assert_no_orphans()
    p.assert_records_consistent()
