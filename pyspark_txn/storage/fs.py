"""Filesystem helpers: one URI convention for delta-rs (URIs) and fsspec (other IO)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

_LOCAL_PREFIXES = ("file://", "file:")


def file_uri_host(path: str) -> str | None:
    """The host of a ``file://host/...`` URI (``""`` for ``file:///...``), None for
    anything else: ``file://localhost/x`` is ``/x``, never ``./localhost/x``."""
    path = path.strip()
    if path[:7].lower() != "file://":
        return None
    return path[7:].partition("/")[0]


def normalize_uri(path: str) -> str:
    """Local paths become absolute plain paths (delta-rs and fsspec agree on those).

    ``file://localhost/x`` is ``/x`` (RFC 8089); a ``file://`` URI naming another
    host is refused, since this machine cannot write there."""
    path = path.strip()
    host = file_uri_host(path)
    if host is not None:
        if host and host.lower() != "localhost":
            from ..errors import ConfigError

            raise ConfigError(
                f"{path!r}: a file:// URI of host {host!r}; only this machine's files can "
                "be used: write file:///path, file://localhost/path or a plain path"
            )
        return os.path.abspath(os.path.expanduser("/" + path[7 + len(host) :].lstrip("/")))
    if path.startswith(_LOCAL_PREFIXES) or "://" not in path:
        for prefix in _LOCAL_PREFIXES:
            if path.startswith(prefix):
                path = path[len(prefix) :]
                break
        while path.startswith("//"):
            path = path[1:]
        return os.path.abspath(os.path.expanduser(path))
    return path.rstrip("/")


def is_local(uri: str) -> bool:
    return "://" not in uri


def resolved(uri: str) -> str:
    """``uri`` for comparing locations: local paths with every symlink resolved."""
    return os.path.realpath(uri) if is_local(uri) else uri.rstrip("/")


# Schemes that name the same store (Hadoop's and delta-rs' spellings): compared as one.
_SAME_STORE = {
    "s3a": "s3",
    "s3n": "s3",
    "gcs": "gs",
    "abfs": "az",
    "abfss": "az",
    "adl": "az",
    "azure": "az",
    "wasb": "az",
    "wasbs": "az",
}


def location_key(uri: str) -> str:
    """``uri`` for asking whether two locations are the same place or nest: local paths
    with every symlink resolved; object-store aliases (``s3a://`` for ``s3://``,
    ``abfss://c@account.dfs.core.windows.net/p`` for ``az://c/p``) in one spelling."""
    if is_local(uri):
        return os.path.realpath(uri)
    scheme, rest = uri.split("://", 1)
    scheme = _SAME_STORE.get(scheme.lower(), scheme.lower())
    if scheme == "az":
        host, _, path = rest.partition("/")
        rest = host.split("@", 1)[0] + ("/" + path if path else "")
    return f"{scheme}://{rest.rstrip('/')}"


def location_identity(uri: str, delta_options: Mapping[str, str] | None = None) -> str:
    """``uri`` as one place, whatever its spelling (:func:`location_key`), with what
    makes the same bucket and path another place: the S3 endpoint (MinIO, R2: buckets
    per endpoint), the Azure account and endpoint. From the options, else the variables
    the stores read (``AWS_ENDPOINT_URL``, ``AZURE_STORAGE_ACCOUNT_NAME``, ...)."""
    from .options import canonical_settings

    key = location_key(uri)
    if is_local(uri):
        return key
    given = canonical_settings(delta_options)

    def setting(name: str, *variables: str) -> str:
        value = given.get(name) or next(filter(None, map(os.environ.get, variables)), "")
        return value.strip().rstrip("/").lower()

    scheme = key.split("://", 1)[0]
    parts = []
    if scheme == "s3":
        parts.append(setting("aws_endpoint", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"))
    elif scheme == "az":
        host = uri.split("://", 1)[1].split("/", 1)[0]
        account = host.split("@", 1)[1].split(".", 1)[0].lower() if "@" in host else ""
        parts.append(
            account
            or setting(
                "azure_storage_account_name", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT"
            )
        )
        parts.append(setting("azure_storage_endpoint", "AZURE_STORAGE_ENDPOINT"))
    return key if not any(parts) else key + "#" + "#".join(parts)


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts)])


def filesystem(uri: str, storage: Any = None):
    """An fsspec filesystem for ``uri`` and the path inside it: ``storage`` is a
    :class:`pyspark_txn.storage.StorageOptions` (or a mapping of ``fs.*`` overrides);
    see that module for why no cached listing is ever used."""
    from .options import filesystem as _filesystem

    return _filesystem(uri, storage)


def fsync_dir(path: str) -> None:
    """Make a new directory entry durable (local disks only; object stores are atomic)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: Object stores whose GET takes a suffix range (the last n bytes) and says the size.
_SUFFIX_GET = frozenset({"s3", "s3a", "gs", "gcs"})


def read_tail(fs: Any, path: str, nbytes: int) -> tuple[int, bytes]:
    """(size, the last ``nbytes`` bytes) of a file: one GET on S3 and GCS through obstore,
    where asking the size first costs a HEAD more. ``FileNotFoundError`` if there is none."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    construct = getattr(fs, "_construct_store", None)
    if protocol in _SUFFIX_GET and construct is not None:
        import obstore

        bucket, key = fs._split_path(path)
        try:
            got = obstore.get(construct(bucket), key, options={"range": {"suffix": nbytes}})
        except Exception as e:
            if is_not_found(e):
                raise FileNotFoundError(path) from None
            raise
        return int(got.meta["size"]), bytes(got.bytes())
    size = int(fs.info(path)["size"])
    return size, (fs.cat_file(path, start=max(0, size - nbytes), end=size) if size else b"")


def is_not_found(error: BaseException) -> bool:
    """Whether ``error`` says there is no such file: obstore's ``NotFoundError`` (what
    its fsspec store's ``cat_file`` raises) is not a ``FileNotFoundError``."""
    if isinstance(error, FileNotFoundError):
        return True
    try:
        from obstore.exceptions import NotFoundError
    except ImportError:  # an install without the object-store extra
        return False
    return isinstance(error, NotFoundError)
