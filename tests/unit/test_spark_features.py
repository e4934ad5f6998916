"""Spark is found by feature, not by version; without it the package still imports
(CLI, snapshots, admin) and the Spark entry points name what is missing.

PySpark 3.5 itself is installed and checked by scripts/spark_matrix.sh; here the
missing pieces are simulated in a subprocess by blocking their modules."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest

from pyspark_txn import SparkFeatureError, TxnError
from pyspark_txn.spark.features import FEATURES, missing_features, utc_arrow_schema_kwargs


def _run(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_without_pyspark_the_package_imports_and_register_says_it_is_missing():
    out = _run(
        """
        import sys
        sys.modules["pyspark"] = None  # as if PySpark were not installed
        import pyspark_txn, pyspark_txn.cli, pyspark_txn.snapshots, pyspark_txn.admin
        for entry in (lambda: pyspark_txn.register(object()), pyspark_txn.local_session):
            try:
                entry()
            except pyspark_txn.SparkFeatureError as e:
                print("refused:", e)
            else:
                raise SystemExit("not refused")
        """
    )
    lines = out.strip().splitlines()
    assert len(lines) == 2, out
    for line in lines:
        assert "PySpark is not installed" in line and "'spark' extra" in line


def test_a_pyspark_without_the_data_source_api_is_refused_naming_it():
    out = _run(
        """
        import sys
        import pyspark
        sys.modules["pyspark.sql.datasource"] = None  # PySpark 3.5 has no such module
        import pyspark_txn
        from pyspark_txn.spark.features import missing_features
        print(sorted(f.name for f in missing_features() if f.required))
        try:
            pyspark_txn.register(object())
        except pyspark_txn.SparkFeatureError as e:
            print(e)
        """
    )
    required, message = out.strip().splitlines()
    for name in (
        "the Python data source API",
        "Python streaming readers",
        "Python streaming writers",
        "the Arrow stream writer",
    ):
        assert name in required and name in message
    assert "pyspark.sql.datasource.DataSource" in message
    assert "admission control" not in message  # optional: not a reason to refuse


def test_this_environment_has_every_required_feature():
    assert [f.name for f in missing_features() if f.required] == []
    assert {f.name for f in FEATURES if not f.required} == {"admission control for Python sources"}


def test_the_error_is_an_import_error_and_a_txn_error():
    assert issubclass(SparkFeatureError, ImportError)
    assert issubclass(SparkFeatureError, TxnError)


def test_timestamps_map_to_utc_instants_whatever_the_keyword_is_called():
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructField, StructType, TimestampNTZType, TimestampType

    schema = StructType(
        [StructField("at", TimestampType()), StructField("local", TimestampNTZType())]
    )
    kwargs = utc_arrow_schema_kwargs()
    assert kwargs in ({"timezone": "UTC"}, {"timestamp_utc": True})
    arrow = to_arrow_schema(schema, **kwargs)
    assert arrow.field("at").type == pa.timestamp("us", tz="UTC")
    assert arrow.field("local").type == pa.timestamp("us")


@pytest.mark.parametrize("module", ["pyspark_txn.cli", "pyspark_txn.snapshots"])
def test_spark_free_modules_do_not_import_pyspark(module):
    out = _run(
        f"""
        import sys
        import {module}
        print("pyspark" in sys.modules)
        """
    )
    assert out.strip() == "False"
