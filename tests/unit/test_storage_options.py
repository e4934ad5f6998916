"""StorageOptions: parsed once, typed, unknown keys refused; the same keys reach obstore."""

from __future__ import annotations

import pickle

import pytest

from pyspark_txn.errors import ConfigError
from pyspark_txn.storage import StorageOptions, describe_store_error, filesystem


def test_keys_are_case_insensitive_and_booleans_typed():
    opts = StorageOptions.parse(
        '{"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "aws_allow_http": "TRUE", '
        '"AWS_REGION": "us-east-1"}'
    )
    assert opts.for_delta() == {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "aws_allow_http": "true",
        "AWS_REGION": "us-east-1",
    }
    config, client = opts._obstore_config("s3")
    assert config == {"aws_endpoint": "http://127.0.0.1:9", "aws_region": "us-east-1"}
    assert client == {"allow_http": True}
    assert pickle.loads(pickle.dumps(opts)) == opts


@pytest.mark.parametrize(
    "raw, problem",
    [
        ('{"AWS_ENDPOINT_ULR": "x"}', "did you mean AWS_ENDPOINT_URL"),
        ('{"AWS_ALLOW_HTTP": "yes"}', "AWS_ALLOW_HTTP='yes': expected true or false"),
        ('{"AWS_REGION": "a", "region": "b"}', "gives aws_region twice"),
        # the same spelling twice: json.loads kept the last one without a word (trial)
        ('{"AWS_REGION": "a", "AWS_REGION": "b"}', "gives AWS_REGION twice"),
        ("{not json", "not valid JSON"),
        ('{"AWS_REGION": ["a"]}', "JSON object of string values"),
    ],
)
def test_bad_storage_options_are_refused_by_name(raw, problem):
    with pytest.raises(ConfigError, match="storageOptions") as e:
        StorageOptions.parse(raw, "txn-delta sink", "storageOptions")
    assert problem in str(e.value)


def test_fs_overrides_are_typed():
    """fs.* values arrive as Spark strings: "false" must reach fsspec as False."""
    opts = StorageOptions.parse(None, fs_options={"use_listings_cache": "false", "n": "3"})
    assert dict(opts.fs_overrides) == {"use_listings_cache": False, "n": 3}


def test_local_paths_keep_fsspecs_local_filesystem(tmp_path):
    from fsspec.implementations.local import LocalFileSystem

    fs, root = filesystem(str(tmp_path), StorageOptions.parse('{"AWS_REGION": "x"}'))
    assert isinstance(fs, LocalFileSystem) and root == str(tmp_path)


def test_object_stores_use_obstore_without_listing_cache():
    pytest.importorskip("obstore")
    from obstore.fsspec import FsspecStore

    fs, root = filesystem("s3://bkt/t", StorageOptions.parse('{"AWS_REGION": "us-east-1"}'))
    assert isinstance(fs, FsspecStore) and root == "bkt/t"


def test_store_errors_become_one_line():
    err = OSError("Generic S3 error: Error performing PUT http://169.254.169.254/latest/api/token")
    assert describe_store_error(err).startswith("no usable credentials")
    assert describe_store_error(ValueError("x")) is None
    # given but refused (moto with authentication, seen by a new-user trial): not "no
    # usable credentials: give them ..."
    refused = OSError(
        "Generic S3 error: Error performing GET http://127.0.0.1:45125/lake?list-type=2 in "
        "1.2ms - Server returned non-2xx status code: 403 Forbidden: <Error><Code>"
        "InvalidAccessKeyId</Code><Message>The AWS Access Key Id you provided does not exist"
    )
    assert describe_store_error(refused).startswith("the store refused the credentials given")
