"""Option parsing shared by every format: one spelling of each rule and its message."""

from __future__ import annotations

import json

from .errors import ConfigError

STORAGE_OPTIONS_EXAMPLE = '{"AWS_REGION": "eu-west-1"}'


def parse_storage_options(raw: str | None, where: str, option: str) -> tuple[tuple[str, str], ...]:
    """A JSON object of string values (delta-rs storage options), sorted: ``()`` when unset.

    ``where`` names the format (``"txn-delta sink"``) and ``option`` the option as the
    user spells it, so the error says exactly what to fix.
    """
    if not raw:
        return ()
    try:
        parsed = json.loads(raw)
    except ValueError as e:
        raise ConfigError(
            f"{where}: option {option} is not valid JSON ({e}); expected a JSON object of "
            f"strings, e.g. {STORAGE_OPTIONS_EXAMPLE}"
        ) from None
    if not isinstance(parsed, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in parsed.items()
    ):
        raise ConfigError(
            f"{where}: option {option} must be a JSON object of string values, e.g. "
            f"{STORAGE_OPTIONS_EXAMPLE}; got {raw!r}"
        )
    return tuple(sorted(parsed.items()))
