"""Filesystem helpers: one URI convention for delta-rs (URIs) and fsspec (other IO)."""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Mapping, Sequence
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


# --- small objects, whole: one way on every store -----------------------------------
#
# obstore's fsspec ``cat(path)`` answers ``{path: bytes}`` (a new-user trial: restore
# crashed on ``.decode()``), a recursive ``rm`` on Azure bulk-deletes folder names and
# stops at the 404 (files left behind), and a plain PUT is no "create if absent". These
# four are what the package uses instead.


def _is_local_fs(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def _object_store(fs: Any) -> Any | None:
    """``fs._construct_store`` where ``fs`` is obstore's fsspec store, else None."""
    if not type(fs).__module__.startswith("obstore"):
        return None
    return getattr(fs, "_construct_store", None)


def read_bytes(fs: Any, path: str) -> bytes:
    """The whole of the small object ``path`` (never ``fs.cat``, which obstore answers
    with a dict). ``FileNotFoundError`` when there is none, on every store (a local path
    through a file, ``NotADirectoryError``, is none too: ``fs.exists`` says False)."""
    try:
        return bytes(fs.cat_file(path))
    except Exception as e:
        if is_not_found(e) or isinstance(e, NotADirectoryError):
            raise FileNotFoundError(errno.ENOENT, "no such file", path) from None
        raise


def read_text(fs: Any, path: str) -> str:
    """:func:`read_bytes` decoded as UTF-8."""
    return read_bytes(fs, path).decode("utf-8")


#: Keys per bulk delete (S3's DeleteObjects takes 1000; obstore splits for Azure's 256).
_DELETE_CHUNK = 1000


def remove_tree(fs: Any, path: str) -> None:
    """Remove every file under ``path`` (or ``path`` itself, a file), then the folders
    this left empty on a local disk. Files only, by listing: object stores have no
    folders, and Azure answers a delete of a folder name with 404, which a recursive
    ``fs.rm`` stopped at, leaving files behind. Idempotent: nothing there, or a file
    gone meanwhile (another removal of the same tree), is no error."""
    try:
        files = list(fs.find(path))
    except Exception as e:
        if not is_not_found(e):
            raise
        files = []
    delete_files(fs, files)
    if _is_local_fs(fs) and os.path.isdir(path):
        for folder, _dirs, _names in os.walk(path, topdown=False):
            with contextlib.suppress(OSError):  # not empty (written meanwhile) or gone
                os.rmdir(folder)


def delete_files(fs: Any, paths: Sequence[str]) -> None:
    """Delete ``paths`` (files), in bulk where the store has it; not found is fine."""
    construct = _object_store(fs)
    if construct is None:
        for path in paths:
            try:
                fs.rm_file(path)
            except Exception as e:
                if not is_not_found(e):
                    raise
        return
    import obstore

    by_bucket: dict[str, list[str]] = {}
    for path in paths:
        bucket, key = fs._split_path(path)
        by_bucket.setdefault(bucket, []).append(key)
    for bucket, keys in by_bucket.items():
        store = construct(bucket)
        for i in range(0, len(keys), _DELETE_CHUNK):
            chunk = keys[i : i + _DELETE_CHUNK]
            try:
                obstore.delete(store, chunk)
            except Exception as e:
                if not is_not_found(e):
                    raise
                # Azure's batch fails on a key already gone: the rest one by one
                for key in chunk:
                    try:
                        obstore.delete(store, key)
                    except Exception as e2:
                        if not is_not_found(e2):
                            raise


def write_new(fs: Any, path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` only if nothing is there (:func:`create_new`):
    True when this call created it."""
    return create_new(fs, path, data)[0]


def create_new(fs: Any, path: str, data: bytes) -> tuple[bool, str | None]:
    """Create ``path`` holding ``data`` only if nothing is there: (True, the store's
    ETag of it where the store gave one) when this call created it, (False, None) when
    something already was (its content is left as it is).

    Exclusive on a local disk (a hard link of a complete temporary file, so no reader
    ever sees it half written; ``O_EXCL`` where hard links are refused) and on obstore's
    stores (S3, Azure, GCS: a conditional PUT, ``mode="create"``). On another fsspec
    filesystem it is NOT exclusive: a check, a write and a read-back, which two writers
    can both pass. A PUT whose response was lost and whose retry then found its own
    object answers False: put something unique in ``data`` and read it back where that
    matters."""
    construct = _object_store(fs)
    if construct is not None:
        import obstore
        from obstore.exceptions import AlreadyExistsError

        bucket, key = fs._split_path(path)
        try:
            result = obstore.put(construct(bucket), key, data, mode="create")
        except AlreadyExistsError:
            return False, None
        return True, result.get("e_tag")
    if _is_local_fs(fs):
        return _write_new_local(path, data), None
    if fs.exists(path):
        return False, None
    fs.pipe_file(path, data)
    return read_bytes(fs, path) == data, None


def _write_new_local(path: str, data: bytes) -> bool:
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    if os.path.lexists(path):
        return False
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError:  # a filesystem without hard links: exclusive create, then write
        return _write_new_excl(path, data)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    fsync_dir(folder)
    return True


def _write_new_excl(path: str, data: bytes) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(os.path.dirname(path) or ".")
    return True
