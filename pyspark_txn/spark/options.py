"""Option parsing shared by every format: one spelling of each rule and its message."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence

from ..errors import ConfigError
from ..storage import fs as _fs

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")
_NO_DELTA_RS = ("dbfs",)


def check_location(option: str, value: str) -> None:
    """One check of a location for every entry point (the sinks' and the source's
    options, the CLI's locations and ``--to``, the Python API's): schemes delta-rs
    cannot use, a scheme without ``//`` (a local folder of that name would be written),
    and characters delta-rs cannot take in a table URL, or that a path would lose
    (it is read as a URL: ``%20`` becomes a space, in a ``file:`` URI and an object
    store's key alike, since object_store percent-decodes a URL's path, while the
    staging and copying IO keeps the name literally), are refused by name. ``option``
    is the name the user gave it (``path``, ``--to``)."""
    name = option if option.startswith("-") else f"option {option}"
    scheme = _SCHEME.match(value.strip())
    if scheme and scheme.group(1).lower() in _NO_DELTA_RS:
        raise ConfigError(
            f"{name}={value!r}: delta-rs cannot read or write Databricks' DBFS; use a "
            "cloud URI (s3://, abfss://, gs://) with storageOptions (docs/databricks.md)"
        )
    if scheme and scheme.group(1).lower() != "file" and "://" not in value:
        raise ConfigError(
            f"{name}={value!r}: {scheme.group(1)}: looks like a URI scheme without "
            "'//' (it would be read as a local folder of that name); write "
            f"{scheme.group(1)}://... or a local path"
        )
    host = _fs.file_uri_host(value)
    if host and host.lower() != "localhost":
        raise ConfigError(
            f"{name}={value!r}: a file:// URI of host {host!r}; only this machine's files "
            "can be used: write file:///path, file://localhost/path or a plain path"
        )
    # '#' and '?' end a URL's path: delta-rs wrote and read such a table, but its
    # history() came back empty (a snapshot export then pinned an older batch)
    bad = sorted(set(value) & set("[]%#?"))
    if bad:
        raise ConfigError(
            f"{name}={value!r}: {' and '.join(repr(c) for c in bad)} cannot be used "
            "in a location (delta-rs reads it as a URL); rename the folder"
        )


def parse_storage_options(raw: str | None, where: str, option: str) -> tuple[tuple[str, str], ...]:
    """A JSON object of delta-rs / object_store storage options, validated and typed by
    :class:`pyspark_txn.storage.StorageOptions`, sorted: ``()`` when unset.

    ``where`` names the format (``"txn-delta sink"``) and ``option`` the option as the
    user spells it, so the error says exactly what to fix.
    """
    from ..storage.options import StorageOptions

    return StorageOptions.parse(raw, where, option).items


#: Options a format accepts but never lists to users (crash plans of the tests).
HIDDEN_OPTIONS = frozenset({"faultinjection"})


def reject_unknown_options(
    where: str,
    given: Iterable[str],
    known: Iterable[str],
    prefixes: Mapping[str, str] | None = None,
    implicit: Iterable[str] = (),
    hints: Mapping[str, str] | None = None,
) -> None:
    """Raise :class:`ConfigError` naming every option in ``given`` that ``known`` (names
    as users spell them; matched case-insensitively, as Spark does) does not have, with
    the closest known name where one is near ("did you mean ...?").

    ``prefixes`` maps an accepted prefix (``"fs."``) to how to list it
    (``"fs.<fsspec option>"``); ``implicit`` are names Spark passes itself (``path`` of
    a source): accepted, never listed. ``hints`` maps a name users bring from elsewhere
    (Spark's ``columnNameOfCorruptRecord``) to what to write instead, which no spelling
    distance would find.
    """
    hints = {k.lower(): v for k, v in (hints or {}).items()}
    prefixes = prefixes or {}
    canonical = {name.lower(): name for name in known}
    accepted = set(canonical) | {name.lower() for name in implicit}
    unknown = sorted(
        key
        for key in given
        if key.lower() not in accepted and not key.lower().startswith(tuple(prefixes))
    )
    if not unknown:
        return
    listed = sorted((n for low, n in canonical.items() if low not in HIDDEN_OPTIONS), key=str.lower)
    choices = [low for low in canonical if low not in HIDDEN_OPTIONS]

    def describe(key: str) -> str:
        if key.lower() in hints:
            return f"{key!r} (did you mean {hints[key.lower()]}?)"
        near = difflib.get_close_matches(key.lower(), choices, n=1, cutoff=0.75)
        return f"{key!r} (did you mean {canonical[near[0]]}?)" if near else repr(key)

    allowed = ", ".join(listed + list(prefixes.values()))
    raise ConfigError(
        f"{where}: unknown option{'s' if len(unknown) > 1 else ''} "
        f"{', '.join(describe(k) for k in unknown)}; allowed (case-insensitive): {allowed}"
    )


def parse_choice(
    where: str, opts: Mapping[str, str], option: str, allowed: Sequence[str], default: str
) -> str:
    """The value of ``option`` (looked up lowercased in ``opts``, as the formats keep
    them), lowercased, one of ``allowed``; ``default`` when unset. A ConfigError names the
    option, the value and what is allowed."""
    raw = opts.get(option.lower())
    if raw is None:
        return default
    value = str(raw).strip().lower()
    if value not in allowed:
        raise ConfigError(
            f"{where}: option {option}={raw!r}: expected one of {', '.join(allowed)}"
            f" (default {default})"
        )
    return value
