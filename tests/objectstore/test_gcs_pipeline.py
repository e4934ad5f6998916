"""txn-delta with its target and record table on GCS: fake-gcs-server behind the XML-API
shim of gcs.py (fake-gcs-server lacks part of the API object_store writes with)."""

from __future__ import annotations

import pytest
from s3_pipeline import S3Pipeline

pytestmark = pytest.mark.spark


def test_the_shim_keeps_create_if_absent(gcs):
    """What every Delta commit rests on, through object_store (the crate delta-rs and
    obstore share): a second create of one object is refused and the first stays."""
    import obstore
    from obstore.exceptions import AlreadyExistsError
    from obstore.store import GCSStore

    store = GCSStore(gcs.bucket, service_account_path=gcs.options["GOOGLE_SERVICE_ACCOUNT"])
    obstore.put(store, "k", b"first", mode="create")
    with pytest.raises(AlreadyExistsError):
        obstore.put(store, "k", b"second", mode="create")
    assert bytes(obstore.get(store, "k").bytes()) == b"first"
    assert gcs.keys() == ["k"]


@pytest.mark.slow  # the 5xx/dropped-responses test below runs the same path in the bounded set
def test_txn_delta_on_gcs_is_exactly_once(spark, tmp_path, gcs):
    p = S3Pipeline(spark, tmp_path, gcs, total=300, per_batch=100)
    assert p.run() is None
    p.assert_exactly_once()
    p.assert_no_orphans()
    p.assert_records_consistent()


def test_txn_delta_on_gcs_under_5xx_and_dropped_responses(spark, tmp_path, gcs):
    gcs.proxy.error_rate = 0.03
    gcs.proxy.drop_rate = 0.03
    before = sum(gcs.proxy.faults.values())
    p = S3Pipeline(spark, tmp_path, gcs, total=500, per_batch=100)
    assert p.run() is None
    gcs.proxy.calm()
    assert sum(gcs.proxy.faults.values()) > before, gcs.proxy.faults
    p.assert_exactly_once()
    p.assert_no_orphans()
    p.assert_records_consistent()
