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


# Texts of real failures (issue 34, item 7): the CLI against Azurite, fake-gcs-server and
# moto without the key that was needed, as object_store / delta-rs wrote them.
_AZ_HTTP = (
    "Generic MicrosoftAzure error: Error performing list request: Error performing GET "
    "http://127.0.0.1:10999/devstoreaccount1/ctest?restype=container&comp=list&prefix=r%2F "
    "in 8.3µs - HTTP error: builder error: URL scheme is not allowed"
)
_S3_HTTP = (
    "Generic S3 error: Error performing list request: Error performing GET "
    "http://127.0.0.1:10998/bk?list-type=2&prefix=r%2F in 166.9µs - HTTP error: builder "
    "error: URL scheme is not allowed"
)
_GCS_HTTP = (
    "Generic GCS error: Error performing list request: Error performing GET "
    "http://127.0.0.1:35069/bkt?list-type=2&prefix=r%2F in 15.5µs - HTTP error: builder "
    "error: URL scheme is not allowed"
)
_AZ_NO_ACCOUNT = "Generic MicrosoftAzure error: Account must be specified"
_AZ_NO_KEY = (
    "Generic MicrosoftAzure error: Error performing token request: Error performing GET "
    "http://169.254.169.254/metadata/identity/oauth2/token?api-version=2019-08-01&resource="
    "https%3A%2F%2Fstorage.azure.com in 1.7ms - Server returned non-2xx status code: 403 "
    "Forbidden: resolve_deny: denied destination"
)
_GCS_NO_CREDENTIALS = (
    "Generic GCS error: Error performing token request: Error performing GET "
    "http://169.254.169.254/computeMetadata/v1/instance/service-accounts/default/token?"
    "audience=https%3A%2F%2Fwww.googleapis.com%2Foauth2%2Fv4%2Ftoken in 2.6ms - Server "
    "returned non-2xx status code: 403 Forbidden: resolve_deny: denied destination"
)
_GCS_NO_FILE = (
    "Generic GCS error: GCP credential error: Unable to open service account file from "
    "/nonexistent.json: No such file or directory (os error 2)"
)
_S3_NO_CREDENTIALS = (
    "Operation not supported\n  ↳ an error occurred while loading credentials\n   ↳ failed to "
    "load IMDS session token\n    ↳ service error"
)


@pytest.mark.parametrize(
    "text, key, others",
    [
        (_AZ_HTTP, "AZURE_ALLOW_HTTP=true", ["AWS_", "GOOGLE_"]),
        (_S3_HTTP, "AWS_ALLOW_HTTP=true", ["AZURE_", "GOOGLE_"]),
        (_GCS_HTTP, "GOOGLE_ALLOW_HTTP=true", ["AWS_", "AZURE_"]),
    ],
)
def test_the_allow_http_hint_names_the_key_of_the_store_in_use(text, key, others):
    """A new-user trial on Azurite was told to set AWS_ALLOW_HTTP, which Azure ignores."""
    problem = describe_store_error(OSError(text))
    assert problem.startswith("the endpoint is plain http:// but http is not allowed")
    hint = problem.split(" (OSError: ", 1)[0]
    assert key in hint and not any(o in hint for o in others), problem


@pytest.mark.parametrize(
    "text, keys, others",
    [
        (_AZ_NO_ACCOUNT, ["AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY"], ["AWS_"]),
        (_AZ_NO_KEY, ["AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_KEY"], ["AWS_"]),
        (_GCS_NO_CREDENTIALS, ["GOOGLE_SERVICE_ACCOUNT"], ["AWS_", "AZURE_"]),
        (_GCS_NO_FILE, ["GOOGLE_SERVICE_ACCOUNT"], ["AWS_", "AZURE_"]),
        (_S3_NO_CREDENTIALS, ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"], ["AZURE_"]),
    ],
)
def test_missing_credentials_are_one_clear_line_naming_the_stores_keys(text, keys, others):
    problem = describe_store_error(OSError(text))
    assert problem.startswith("no usable credentials: give them in storageOptions"), problem
    hint = problem.split(" (OSError: ", 1)[0]
    assert all(k in hint for k in keys) and not any(o in hint for o in others), problem
    assert "\n" not in problem


def test_the_store_comes_from_the_uri_where_the_text_does_not_name_it():
    problem = describe_store_error(OSError("builder error: URL scheme is not allowed"), "az://c/p")
    assert "AZURE_ALLOW_HTTP=true" in problem and "AWS_" not in problem.split(" (")[0]
    unknown = describe_store_error(OSError("builder error: URL scheme is not allowed"))
    assert all(k in unknown for k in ("AWS_ALLOW_HTTP", "AZURE_ALLOW_HTTP", "GOOGLE_ALLOW_HTTP"))


def test_a_client_refusing_the_options_is_one_line(monkeypatch):
    """obstore's own text carries a multi-line "Debug source:"; Azure without an account
    fails when the client is built, before any request."""
    pytest.importorskip("obstore")
    for k in [k for k in __import__("os").environ if k.startswith("AZURE_")]:
        monkeypatch.delenv(k)
    with pytest.raises(ConfigError) as e:
        filesystem("az://c/p", StorageOptions.parse({"AZURE_STORAGE_ENDPOINT": "http://x"}))
    message = str(e.value)
    assert "\n" not in message and "Debug source" not in message, message
    assert "no usable credentials" in message and "AZURE_STORAGE_ACCOUNT_NAME" in message


@pytest.mark.parametrize(
    "key, meant",
    [
        ("AWS_ALOW_HTTP", "AWS_ALLOW_HTTP"),
        ("AZURE_ALOW_HTTP", "AZURE_ALLOW_HTTP"),
        ("GOOGLE_ALOW_HTTP", "GOOGLE_ALLOW_HTTP"),
        ("ALOW_HTTP", "ALLOW_HTTP"),
        ("AWS_ENDPOINT_ULR", "AWS_ENDPOINT_URL"),
        ("AZURE_STORAGE_ACOUNT_KEY", "AZURE_STORAGE_ACCOUNT_KEY"),
        ("aws_alow_http", "AWS_ALLOW_HTTP"),
    ],
)
def test_an_unknown_key_gets_the_key_that_was_meant(key, meant):
    with pytest.raises(ConfigError) as e:
        StorageOptions.parse({key: "true"})
    assert f"did you mean {meant}?" in str(e.value)


def test_obstores_own_http_refusal_gets_the_hint_too():
    """obstore (the staging IO, the checkpoint reads) says "builder error" on top and
    names BadScheme only in its debug dump."""
    text = (
        "Generic MicrosoftAzure error: Error performing GET http://127.0.0.1:10999/"
        "devstoreaccount1/ctest/records/x in 153.3µs - HTTP error: builder error\n\nDebug "
        'source:\nGeneric {\n    store: "MicrosoftAzure",\n    source: RetryError(\n        '
        "inner: Http(\n HttpError {\n kind: Unknown,\n source: reqwest::Error {\n kind: "
        "Builder,\n source: BadScheme,\n },\n },\n ),\n }"
    )
    problem = describe_store_error(OSError(text))
    assert problem.startswith(
        "the endpoint is plain http:// but http is not allowed: set AZURE_ALLOW_HTTP=true"
    ), problem
    assert "\n" not in problem and "Debug source" not in problem
