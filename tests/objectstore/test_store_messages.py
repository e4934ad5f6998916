"""What the CLI says on Azure and GCS when a storage option is missing (issue 34, item
7): the store's own keys, in one line, exit 2, from real servers (Azurite,
fake-gcs-server)."""

from __future__ import annotations

import json
import os
import re

from azurite import DEV_ACCOUNT, DEV_KEY
from support import run_cli_process

STORE_ENV = [k for k in os.environ if k.startswith(("AWS_", "AZURE_", "GOOGLE_"))]


def _status(uri: str, options: dict[str, str] | None) -> tuple[int, str, str]:
    extra = [] if options is None else ["--storage-options", json.dumps(options)]
    return run_cli_process("status", uri, *extra, unset=STORE_ENV)


def _one_line(rc: int, err: str) -> str:
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return re.split(r" \(\w+: ", err, maxsplit=1)[0]  # the hint, without the store's text


def test_azure_without_credentials_or_http_names_the_azure_keys(azure):
    where = azure.uri("records")
    endpoint = azure.server.endpoint
    # no options at all, and an endpoint without an account: the client is never built
    for options in (None, {"AZURE_STORAGE_ENDPOINT": endpoint, "AZURE_ALLOW_HTTP": "true"}):
        rc, _out, err = _status(where, options)
        hint = _one_line(rc, err)
        assert "no usable credentials" in hint and "AZURE_STORAGE_ACCOUNT_NAME" in hint, err
        assert "AWS_" not in hint, err
    # an account and no key: the client asks a token service, which is not there
    account_only = {
        "AZURE_STORAGE_ACCOUNT_NAME": DEV_ACCOUNT,
        "AZURE_STORAGE_ENDPOINT": endpoint,
        "AZURE_ALLOW_HTTP": "true",
    }
    hint = _one_line(*_status(where, account_only)[::2])
    assert "no usable credentials" in hint and "AZURE_STORAGE_ACCOUNT_KEY" in hint, hint
    # Azurite over http without AZURE_ALLOW_HTTP; AWS_ALLOW_HTTP (the old hint) is no cure
    keyed = {**account_only, "AZURE_STORAGE_ACCOUNT_KEY": DEV_KEY}
    del keyed["AZURE_ALLOW_HTTP"]
    for options in (keyed, {**keyed, "AWS_ALLOW_HTTP": "true"}):
        hint = _one_line(*_status(where, options)[::2])
        assert "set AZURE_ALLOW_HTTP=true" in hint and "AWS_" not in hint, hint
    # and the key named works, with delta-rs (the record table) as with obstore
    rc, _out, err = _status(where, {**keyed, "AZURE_ALLOW_HTTP": "true"})
    assert rc == 2 and "no record table at" in err, err


def test_azure_allow_http_works_with_delta_rs_and_obstore(azure):
    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    from pyspark_txn.storage import StorageOptions
    from pyspark_txn.storage import fs as _fs

    options = {k: v for k, v in azure.options.items() if "ALLOW_HTTP" not in k}
    options["AZURE_ALLOW_HTTP"] = "true"
    uri = azure.uri("t")
    write_deltalake(uri, pa.table({"id": [1, 2]}), storage_options=options)
    assert DeltaTable(uri, storage_options=options).to_pyarrow_table().num_rows == 2
    fs, root = StorageOptions.parse(options).filesystem(uri)
    assert _fs.read_text(fs, _fs.join(root, "_delta_log", "00000000000000000000.json"))


def test_gcs_over_http_names_google_allow_http(gcs):
    options = {**gcs.options, "GOOGLE_ALLOW_HTTP": "false"}
    hint = _one_line(*_status(gcs.uri("records"), options)[::2])
    assert "set GOOGLE_ALLOW_HTTP=true" in hint and "AWS_" not in hint, hint


def test_gcs_with_an_unusable_key_file_names_the_google_keys(gcs, tmp_path):
    options = {"GOOGLE_SERVICE_ACCOUNT": str(tmp_path / "missing.json")}
    hint = _one_line(*_status(gcs.uri("records"), options)[::2])
    assert "no usable credentials" in hint and "GOOGLE_SERVICE_ACCOUNT" in hint, hint
    assert "AWS_" not in hint, hint
