"""One storage configuration for every byte read or written at a URI.

Users give the object_store / delta-rs keys they know (``AWS_*``, ``AZURE_*``,
``GOOGLE_*``) once, as ``storageOptions``. :class:`StorageOptions` parses them once
(case-insensitive, booleans typed, unknown keys refused by name) and hands out

- :meth:`StorageOptions.for_delta`: the dict for delta-rs (``storage_options=``), and
- :meth:`StorageOptions.filesystem`: an fsspec filesystem for the other IO (staged
  files, markers, checkpoints, claim logs, exports).

On object stores the filesystem is obstore's ``FsspecStore`` (the same Rust
object_store crate delta-rs uses: same option names, retries and credential chain).
It lists fresh on every call: no cached listing ever decides what exists (s3fs's
listing cache reported freshly staged files as missing, DESIGN §8). Without obstore,
or with ``fs.*`` options (an override), fsspec's own implementation is used with its
listing and instance caches off. Local paths keep fsspec's local filesystem (fsync).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from ..errors import ConfigError, StorageError, TxnError

log = logging.getLogger(__name__)

STORAGE_OPTIONS_EXAMPLE = '{"AWS_REGION": "eu-west-1"}'

# Client options of object_store, valid for every store; users may prefix them with
# the store's prefix (AWS_ALLOW_HTTP, as delta-rs documents). Value: True when boolean.
_CLIENT_KEYS: dict[str, bool] = {
    "allow_http": True,
    "allow_invalid_certificates": True,
    "connect_timeout": False,
    "timeout": False,
    "pool_idle_timeout": False,
    "pool_max_idle_per_host": False,
    "proxy_url": False,
    "proxy_ca_certificate": False,
    "proxy_excludes": False,
    "user_agent": False,
    "randomize_addresses": True,
}

# object_store's S3 keys (canonical name -> boolean?) and their aliases.
_S3_KEYS: dict[str, bool] = {
    "aws_access_key_id": False,
    "aws_secret_access_key": False,
    "aws_session_token": False,
    "aws_region": False,
    "aws_default_region": False,
    "aws_endpoint": False,
    "aws_bucket": False,
    "aws_virtual_hosted_style_request": True,
    "aws_s3_express": True,
    "aws_imdsv1_fallback": True,
    "aws_metadata_endpoint": False,
    "aws_unsigned_payload": True,
    "aws_skip_signature": True,
    "aws_checksum_algorithm": False,
    "aws_container_credentials_relative_uri": False,
    "aws_container_credentials_full_uri": False,
    "aws_copy_if_not_exists": False,
    "aws_conditional_put": False,
    "aws_disable_tagging": True,
    "aws_request_payer": True,
    "aws_server_side_encryption": False,
    "aws_sse_kms_key_id": False,
    "aws_sse_bucket_key_enabled": True,
    "aws_role_arn": False,
    "aws_role_session_name": False,
    "aws_web_identity_token_file": False,
    "aws_sts_endpoint": False,
}
_S3_ALIASES = {
    "aws_endpoint_url": "aws_endpoint",
    "aws_token": "aws_session_token",
    "access_key_id": "aws_access_key_id",
    "secret_access_key": "aws_secret_access_key",
    "session_token": "aws_session_token",
    "region": "aws_region",
    "endpoint": "aws_endpoint",
    "endpoint_url": "aws_endpoint",
}
_AZURE_KEYS: dict[str, bool] = {
    "azure_storage_account_name": False,
    "azure_storage_account_key": False,
    "azure_storage_client_id": False,
    "azure_storage_client_secret": False,
    "azure_storage_tenant_id": False,
    "azure_storage_authority_host": False,
    "azure_storage_sas_key": False,
    "azure_storage_token": False,
    "azure_storage_use_emulator": True,
    "azure_storage_endpoint": False,
    "azure_use_fabric_endpoint": True,
    "azure_msi_endpoint": False,
    "azure_object_id": False,
    "azure_msi_resource_id": False,
    "azure_federated_token_file": False,
    "azure_use_azure_cli": True,
    "azure_skip_signature": True,
    "azure_container_name": False,
    "azure_disable_tagging": True,
}
_AZURE_ALIASES = {
    "account_name": "azure_storage_account_name",
    "azure_storage_account": "azure_storage_account_name",
    "account_key": "azure_storage_account_key",
    "access_key": "azure_storage_account_key",
    "azure_storage_access_key": "azure_storage_account_key",
    "azure_storage_key": "azure_storage_account_key",
    "azure_client_id": "azure_storage_client_id",
    "client_id": "azure_storage_client_id",
    "azure_client_secret": "azure_storage_client_secret",
    "client_secret": "azure_storage_client_secret",
    "azure_tenant_id": "azure_storage_tenant_id",
    "tenant_id": "azure_storage_tenant_id",
    "azure_storage_sas_token": "azure_storage_sas_key",
    "sas_key": "azure_storage_sas_key",
    "sas_token": "azure_storage_sas_key",
    "bearer_token": "azure_storage_token",
    "use_emulator": "azure_storage_use_emulator",
    "azure_endpoint": "azure_storage_endpoint",
}
_GCS_KEYS: dict[str, bool] = {
    "google_service_account": False,
    "google_service_account_key": False,
    "google_bucket": False,
    "google_application_credentials": False,
    "google_skip_signature": True,
}
_GCS_ALIASES = {
    "google_service_account_path": "google_service_account",
    "service_account": "google_service_account",
    "service_account_path": "google_service_account",
    "service_account_key": "google_service_account_key",
    "google_bucket_name": "google_bucket",
    "bucket": "google_bucket",
}
# Keys only delta-rs reads (its S3 locking / rename knobs): passed to delta-rs only.
_DELTA_ONLY: dict[str, bool] = {
    "aws_s3_allow_unsafe_rename": True,
    "aws_s3_locking_provider": False,
    "delta_dynamo_table_name": False,
    "aws_profile": False,
    "aws_force_credential_load": True,
    "aws_ec2_metadata_disabled": True,
    "timeout_retry": False,
    "max_retries": False,
    "retry_timeout": False,
}

_STORES = {"s3": "aws_", "azure": "azure_", "gcs": "google_"}
_SCHEME_STORE = {
    "s3": "s3",
    "s3a": "s3",
    "az": "azure",
    "azure": "azure",
    "abfs": "azure",
    "abfss": "azure",
    "adl": "azure",
    "gs": "gcs",
    "gcs": "gcs",
}


def _canonical(key: str) -> tuple[str, str | None, bool] | None:
    """(canonical key, store or None for client/delta-only keys, boolean?) or None."""
    low = key.strip().lower()
    for table, aliases, store in (
        (_S3_KEYS, _S3_ALIASES, "s3"),
        (_AZURE_KEYS, _AZURE_ALIASES, "azure"),
        (_GCS_KEYS, _GCS_ALIASES, "gcs"),
    ):
        name = aliases.get(low, low)
        if name in table:
            return name, store, table[name]
    if low in _DELTA_ONLY:
        return low, "delta", _DELTA_ONLY[low]
    for prefix in ("", "aws_", "azure_", "google_"):
        if low.startswith(prefix) and low[len(prefix) :] in _CLIENT_KEYS:
            name = low[len(prefix) :]
            return name, None, _CLIENT_KEYS[name]
    return None


def _all_names() -> list[str]:
    """Every key a user may write: the client keys with each store's prefix too, so
    ``AWS_ALOW_HTTP`` is taken for ``AWS_ALLOW_HTTP``, not ``ALLOW_HTTP``."""
    names = [*_S3_KEYS, *_AZURE_KEYS, *_GCS_KEYS, *_DELTA_ONLY, *_CLIENT_KEYS]
    names += [*_S3_ALIASES, *_AZURE_ALIASES, *_GCS_ALIASES]
    names += [prefix + key for prefix in _STORES.values() for key in _CLIENT_KEYS]
    return names


def _parse_bool(where: str, option: str, key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "false"):
        return text == "true"
    raise ConfigError(f"{where}: option {option}: key {key}={value!r}: expected true or false")


def _typed_fs_value(value: Any) -> Any:
    """``fs.*`` values arrive as Spark strings: "false" must not reach fsspec truthy."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() in ("none", "null"):
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        pass
    if text[:1] in "{[":
        try:
            return json.loads(text)
        except ValueError:
            pass
    return value


class _RepeatedKey(ValueError):
    pass


def _refuse_repeated_keys(where: str, option: str) -> Callable[[list[tuple[str, Any]]], dict]:
    """json.loads keeps the last of two equal keys without a word: say so instead."""

    def build(pairs: list[tuple[str, Any]]) -> dict:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise _RepeatedKey(key)
            out[key] = value
        return out

    return build


@dataclass(frozen=True)
class StorageOptions:
    """Storage configuration parsed once: plain data, safe to pickle to executors.

    ``items``: (key as the user spelled it, value as text) for delta-rs;
    ``fs_overrides``: typed ``fs.*`` options (an override: fsspec's own filesystem).
    """

    items: tuple[tuple[str, str], ...] = ()
    fs_overrides: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def parse(
        cls,
        raw: str | Mapping[str, Any] | None,
        where: str = "storage options",
        option: str = "storageOptions",
        fs_options: Mapping[str, Any] | None = None,
    ) -> StorageOptions:
        """Parse a JSON object (or a mapping) of storage options; ``fs_options``: the
        ``fs.*`` options without their prefix. Raises :class:`ConfigError` naming the
        option and key on bad JSON, a non-scalar value, a bad boolean or an unknown key."""
        parsed: Any
        if raw is None or raw == "":
            parsed = {}
        elif isinstance(raw, Mapping):
            parsed = dict(raw)
        else:
            try:
                parsed = json.loads(raw, object_pairs_hook=_refuse_repeated_keys(where, option))
            except _RepeatedKey as e:
                raise ConfigError(
                    f"{where}: option {option} gives {e} twice; give each key once"
                ) from None
            except ValueError as e:
                raise ConfigError(
                    f"{where}: option {option} is not valid JSON ({e}); expected a JSON "
                    f"object of strings, e.g. {STORAGE_OPTIONS_EXAMPLE}"
                ) from None
        if not isinstance(parsed, dict) or not all(
            isinstance(k, str) and isinstance(v, (str, bool, int, float)) for k, v in parsed.items()
        ):
            raise ConfigError(
                f"{where}: option {option} must be a JSON object of string values, e.g. "
                f"{STORAGE_OPTIONS_EXAMPLE}; got {raw!r}"
            )
        items: dict[str, str] = {}
        seen: dict[str, str] = {}
        unknown: list[str] = []
        for key, value in parsed.items():
            found = _canonical(key)
            if found is None:
                unknown.append(key)
                continue
            name, _store, is_bool = found
            if name in seen:
                raise ConfigError(
                    f"{where}: option {option} gives {name} twice ({seen[name]!r} and {key!r})"
                )
            seen[name] = key
            if is_bool:
                text = "true" if _parse_bool(where, option, key, value) else "false"
            elif isinstance(value, bool):
                text = "true" if value else "false"
            else:
                text = str(value)
            items[key] = text
        if unknown:
            choices = _all_names()

            def describe(key: str) -> str:
                near = difflib.get_close_matches(key.lower(), choices, n=1, cutoff=0.75)
                return f"{key!r} (did you mean {near[0].upper()}?)" if near else repr(key)

            raise ConfigError(
                f"{where}: option {option}: unknown key{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(describe(k) for k in sorted(unknown))}; expected object_store / "
                "delta-rs keys (AWS_*, AZURE_*, GOOGLE_*, case-insensitive), see "
                "docs/object-stores.md"
            )
        overrides = tuple(
            sorted((k, _typed_fs_value(v)) for k, v in dict(fs_options or {}).items())
        )
        return cls(items=tuple(sorted(items.items())), fs_overrides=overrides)

    @classmethod
    def of(cls, items: Any = (), fs_options: Any = ()) -> StorageOptions:
        """From already parsed parts: ``items`` (``parse_storage_options``' result) and
        ``fs_options`` (the ``fs.*`` options without their prefix, values as given)."""
        return cls(
            items=tuple(sorted(dict(items or ()).items())),
            fs_overrides=tuple(
                sorted((k, _typed_fs_value(v)) for k, v in dict(fs_options or ()).items())
            ),
        )

    @classmethod
    def coerce(cls, value: StorageOptions | Mapping[str, Any] | str | None) -> StorageOptions:
        """``value`` as StorageOptions: a JSON text or a mapping of storage options."""
        if isinstance(value, StorageOptions):
            return value
        return cls.parse(value)

    # --- delta-rs ---------------------------------------------------------------
    def for_delta(self) -> dict[str, str] | None:
        """The dict for delta-rs' ``storage_options=`` (None when empty)."""
        return dict(self.items) or None

    def __bool__(self) -> bool:
        return bool(self.items or self.fs_overrides)

    # --- fsspec -----------------------------------------------------------------
    def _obstore_config(self, store: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """(config, client_options) for obstore: object_store's canonical lower-case keys
        of ``store`` (keys of other stores and delta-only keys are left out)."""
        config: dict[str, Any] = {}
        client: dict[str, Any] = {}
        for key, value in self.items:
            found = _canonical(key)
            assert found is not None  # parse refused the rest
            name, owner, is_bool = found
            typed: Any = value == "true" if is_bool else value
            if owner is None:
                client[name] = typed
            elif owner == store:
                config[name] = typed
        return config, client

    def filesystem(self, uri: str) -> tuple[Any, str]:
        """(fsspec filesystem, path inside it) for ``uri``; nothing cached decides what
        exists. Raises :class:`ConfigError` when the options cannot build a store."""
        import fsspec

        if "://" not in uri:  # a local path (fs.is_local; fs imports this module)
            return fsspec.core.url_to_fs(uri, **dict(self.fs_overrides))
        scheme = uri.split("://", 1)[0].lower()
        store = _SCHEME_STORE.get(scheme)
        if self.fs_overrides or store is None or not _has_obstore():
            opts = dict(self.fs_overrides)
            opts.setdefault("use_listings_cache", False)
            opts.setdefault("skip_instance_cache", True)
            return fsspec.core.url_to_fs(uri, **opts)
        return _obstore_fs(uri, scheme, *self._obstore_config(store))


def object_store_fs(uri: str, delta_options: Mapping[str, str] | None) -> tuple[Any, str] | None:
    """obstore's filesystem for a remote ``uri`` configured from delta-rs' storage
    options (the same client the staging IO uses), or None where there is none (local
    paths, stores obstore lacks, obstore not installed): callers then use delta-rs."""
    if "://" not in uri or not _has_obstore():
        return None
    scheme = uri.split("://", 1)[0].lower()
    store = _SCHEME_STORE.get(scheme)
    if store is None:
        return None
    try:
        options = StorageOptions.parse(dict(delta_options or {}))
    except ConfigError:  # keys only delta-rs knows: let it do the IO
        return None
    return _obstore_fs(uri, scheme, *options._obstore_config(store))


def canonical_settings(delta_options: Mapping[str, str] | None) -> dict[str, str]:
    """The object-store settings among ``delta_options``, by their canonical names
    (``endpoint_url`` and ``AWS_ENDPOINT_URL`` are both ``aws_endpoint``)."""
    given: dict[str, str] = {}
    for k, v in (delta_options or {}).items():
        canonical = _canonical(k)
        if canonical is not None:
            given[canonical[0]] = str(v)
    return given


def _has_obstore() -> bool:
    try:
        import obstore.fsspec  # noqa: F401
    except ImportError:  # pragma: no cover - an install without the object-store extra
        log.debug("obstore is not installed: object stores use fsspec's own filesystems")
        return False
    return True


def _obstore_fs(
    uri: str, scheme: str, config: dict[str, Any], client: dict[str, Any]
) -> tuple[Any, str]:
    protocol = {"s3a": "s3", "gcs": "gs"}.get(scheme, scheme)
    rest = uri.split("://", 1)[1]
    bucket = rest.split("/", 1)[0]
    # A new client per call: one kept per process was freed at interpreter exit and
    # aborted short-lived processes (the CLI: "terminate called without an active
    # exception").
    return _new_obstore_fs(uri, protocol, bucket, config, client), rest.rstrip("/")


def _new_obstore_fs(
    uri: str, protocol: str, bucket: str, config: dict[str, Any], client: dict[str, Any]
) -> Any:
    from obstore.fsspec import FsspecStore

    try:
        fs = cast(Any, FsspecStore)(
            protocol,
            config=config or None,
            client_options=client or None,
            skip_instance_cache=True,
        )
        # Its info() answers from fsspec's listing cache when one is kept: keep none, so a
        # file written since a listing is never reported as missing or as a folder.
        from fsspec.dircache import DirCache

        fs.dircache = DirCache(use_listings_cache=False)
        fs._construct_store(bucket)  # build it now: bad options fail here, not mid-batch
    except BaseException as e:  # obstore's pyo3 PanicException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        problem = describe_store_error(e, uri) if isinstance(e, Exception) else None
        if problem is None or problem.startswith("the store failed"):
            problem = f"the object store client refused them: {_one_line(e)}"
        raise ConfigError(f"storage options for {uri}: {problem}") from None
    return fs


# The storage configuration of the operation in progress: the CLI's --storage-options
# and the storage_options= of the Python APIs, for every nested read or write that is
# not given one explicitly (the operations reach many helpers; none should be missed).
_CURRENT: ContextVar[StorageOptions | None] = ContextVar("pyspark_txn_storage", default=None)


def current() -> StorageOptions:
    """The storage configuration in effect (empty: the environment's credentials)."""
    return _CURRENT.get() or StorageOptions()


@contextlib.contextmanager
def using(options: StorageOptions | Mapping[str, Any] | str | None) -> Iterator[StorageOptions]:
    """Make ``options`` (None: the one in effect) the configuration of the IO inside."""
    parsed = current() if options is None else StorageOptions.coerce(options)
    token = _CURRENT.set(parsed)
    try:
        yield parsed
    finally:
        _CURRENT.reset(token)


F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def store_errors() -> Iterator[None]:
    """At the package's edges (public API calls, Spark's calls into a data source): a store
    client's failure leaves as one :class:`StorageError` line naming the likely cause,
    instead of delta-rs' or obstore's multi-line, colour-coded text."""
    try:
        yield
    except TxnError:
        raise
    except Exception as e:
        module = type(e).__module__.split(".")[0]
        if type(e) is not OSError and module not in ("obstore", "deltalake", "botocore"):
            raise  # a local FileNotFoundError & co. stay what they are
        problem = describe_store_error(e)
        if problem is None:
            raise
        error = StorageError(problem)
        error.original = e  # not chained: Spark would print the client's text again
        raise error from None


def takes_storage_options(func: F) -> F:
    """Run ``func`` with its keyword argument ``storage_options`` (JSON text, a mapping of
    delta-rs keys, or StorageOptions) in effect for every store it touches."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with using(kwargs.get("storage_options")), store_errors():
            return func(*args, **kwargs)

    return cast(F, wrapper)


def filesystem(
    uri: str, storage: StorageOptions | Mapping[str, Any] | None = None
) -> tuple[Any, str]:
    """An fsspec filesystem for ``uri`` and the path inside it. ``storage``: the
    StorageOptions (None: the one in effect, :func:`current`), or a mapping of ``fs.*``
    overrides (older call sites)."""
    if not storage:
        return current().filesystem(uri)
    if isinstance(storage, StorageOptions):
        return storage.filesystem(uri)
    return StorageOptions(
        fs_overrides=tuple(sorted((k, _typed_fs_value(v)) for k, v in storage.items()))
    ).filesystem(uri)


#: What each store's hints name: its http switch, its credential keys, its endpoint key.
_STORE_HINT_KEYS: dict[str | None, dict[str, str]] = {
    "s3": {
        "allow_http": "set AWS_ALLOW_HTTP=true (or allow_http=true)",
        "credentials": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, plus AWS_SESSION_TOKEN "
        "for temporary ones",
        "endpoint": "AWS_ENDPOINT_URL",
    },
    "azure": {
        "allow_http": "set AZURE_ALLOW_HTTP=true (or allow_http=true)",
        "credentials": "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY, "
        "AZURE_STORAGE_SAS_KEY or AZURE_STORAGE_CLIENT_ID, AZURE_STORAGE_CLIENT_SECRET "
        "and AZURE_STORAGE_TENANT_ID",
        "endpoint": "AZURE_STORAGE_ENDPOINT",
    },
    "gcs": {
        "allow_http": "set GOOGLE_ALLOW_HTTP=true (or allow_http=true)",
        "credentials": "GOOGLE_SERVICE_ACCOUNT (a key file) or GOOGLE_SERVICE_ACCOUNT_KEY "
        "(the key's JSON)",
        "endpoint": "the gcs_base_url of the service account file",
    },
    None: {
        "allow_http": "set the store's key to true: AWS_ALLOW_HTTP (S3), AZURE_ALLOW_HTTP "
        "(Azure) or GOOGLE_ALLOW_HTTP (GCS), or allow_http=true",
        "credentials": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AZURE_STORAGE_ACCOUNT_NAME "
        "and AZURE_STORAGE_ACCOUNT_KEY, GOOGLE_SERVICE_ACCOUNT ...",
        "endpoint": "AWS_ENDPOINT_URL, AZURE_STORAGE_ENDPOINT ...",
    },
}

#: (needles, hint): the first hint whose needle is in the error's text (lower case);
#: ``{allow_http}``, ``{credentials}`` and ``{endpoint}`` are the store's (above).
_HINTS = (
    (
        (
            "nosuchbucket",
            "bucket does not exist",
            "containernotfound",
            "container does not exist",
            "no such bucket",
        ),
        "the bucket or container does not exist: create it, or check the URI",
    ),
    (
        ("url scheme is not allowed", "badscheme"),  # delta-rs' text; obstore's
        "the endpoint is plain http:// but http is not allowed: {allow_http} in "
        "storageOptions / --storage-options",
    ),
    (
        (
            "invalidaccesskeyid",
            "signaturedoesnotmatch",
            "authenticationfailed",
            "invalidclienttokenid",
            "invalid access key",
        ),
        "the store refused the credentials given: check the key id and secret "
        "(storageOptions / --storage-options, or the environment)",
    ),
    (
        (
            "credential",
            "metadata",
            "169.254.169.254",
            "unauthenticated",
            "no valid",
            "account must be specified",  # Azure without AZURE_STORAGE_ACCOUNT_NAME
            "missingaccount",
        ),
        "no usable credentials: give them in storageOptions / --storage-options "
        "({credentials}) or in the environment",
    ),
    (
        ("403", "forbidden", "accessdenied", "access denied", "permission"),
        "the store denied the request: check the credentials' permissions on this location",
    ),
    (
        ("connect", "connection refused", "dns", "error sending request", "timed out", "timeout"),
        "the store cannot be reached: check the endpoint ({endpoint}) and the network",
    ),
)

#: How object_store / delta-rs name the store in their errors (first match wins: the
#: "Generic <store> error" head before what a URL or bucket name might also contain).
_STORE_IN_TEXT = (
    ("generic s3 error", "s3"),
    ("generic microsoftazure error", "azure"),
    ("generic gcs error", "gcs"),
    ("gcp credential error", "gcs"),
    ("imds", "s3"),  # the AWS SDK's credential chain (delta-rs' S3 client)
    ("amazonaws.com", "s3"),
    (".windows.net", "azure"),
    ("storage.azure.com", "azure"),
    ("googleapis.com", "gcs"),
)


def _store_of(low: str, uri: str | None) -> str | None:
    """Which store (``s3``, ``azure``, ``gcs``) an error is about: the URI's scheme where
    known, else what the error's text names; None when neither says."""
    if uri and "://" in uri:
        store = _SCHEME_STORE.get(uri.split("://", 1)[0].lower())
        if store is not None:
            return store
    return next((store for needle, store in _STORE_IN_TEXT if needle in low), None)


def _one_line(error: BaseException) -> str:
    """``error``'s text on one line: no colour codes, no obstore "Debug source" dump."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).split("Debug source:", 1)[0]
    text = " ".join(text.replace("↳", "-").split())
    return text if len(text) <= 600 else text[:597] + "..."


def describe_store_error(error: BaseException, uri: str | None = None) -> str | None:
    """One line for an object-store failure (missing credentials, an unreachable endpoint,
    a denied request), or None if ``error`` is not one. For the CLI: no tracebacks. The
    hint names the keys of the store ``uri`` is on, else of the store the error's text
    names (object_store's "Generic MicrosoftAzure error", ...)."""
    module = type(error).__module__.split(".")[0]
    if not (
        isinstance(error, OSError) or module in ("obstore", "deltalake", "botocore", "aiohttp")
    ):
        return None
    detail = _one_line(error)
    low = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(error)).split()).lower()
    # status codes are matched without the URLs the text names: a bucket "b-0403d45f"
    # is no HTTP 403 (CI saw one refused connection called a denied request)
    bare = re.sub(r"[a-z][a-z0-9+.-]*://\S+", " ", low)
    for needles, hint in _HINTS:
        if any(n in (bare if n.isdigit() else low) for n in needles):
            keys = _STORE_HINT_KEYS[_store_of(low, uri)]
            return f"{hint.format(**keys)} ({type(error).__name__}: {detail})"
    return f"the store failed: {type(error).__name__}: {detail}"
