"""Per-request options shared by the handlers: where a request's values come from (a JSON body,
multipart form fields, request headers; the body beats a header) and the checks every option
type needs. A malformed or out-of-range value is a 400 for that request alone."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

from handlers.ground.errors import ClientError
from handlers.ground.fractions import fraction_of


def invalid_option(name: str, value: object, expected: str) -> ClientError:
    return ClientError(400, "InvalidParameter", f"{name}={value!r}: expected {expected}")


def parse_count(name: str, value: object, cap: int) -> int:
    """A whole number from 1 to `cap` (an int, or its text)."""
    if isinstance(value, bool):
        raise invalid_option(name, value, f"an integer from 1 to {cap}")
    try:
        number = int(str(value).strip())
    except ValueError:
        raise invalid_option(name, value, f"an integer from 1 to {cap}") from None
    if not 1 <= number <= cap:
        raise invalid_option(name, value, f"an integer from 1 to {cap}")
    return number


SWITCH_TEXTS = {"true": True, "1": True, "yes": True, "on": True,
                "false": False, "0": False, "no": False, "off": False}


def parse_switch(name: str, value: object) -> bool:
    """A yes/no option: JSON true / false, or (a form field, a header) true, false, 1, 0, yes, no,
    on, off in any case."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if text not in SWITCH_TEXTS:
        raise invalid_option(name, value, "true or false")
    return SWITCH_TEXTS[text]


def parse_fraction(name: str, value: object, *, allow_zero: bool = True) -> float:
    """A request option that must be a number in [0, 1] ((0, 1] without `allow_zero`)."""
    number = fraction_of(value, allow_zero=allow_zero)
    if number is None:
        raise invalid_option(name, value, "a number in [0, 1]" if allow_zero else "a number in (0, 1]")
    return number


def option_values(row: Mapping[str, Any], header: Callable[[str], str | None],
                  option_headers: Mapping[str, str]) -> dict[str, object]:
    """The raw values a request gives for the options named in `option_headers` (option name ->
    header name): from its JSON body or form fields, else from its headers."""
    body = row.get("body")
    fields: Mapping[str, Any] = body if isinstance(body, Mapping) else row
    values: dict[str, object] = {}
    for name, header_name in option_headers.items():
        value = fields.get(name)
        if isinstance(value, (bytes, bytearray)):
            value = bytes(value).decode("utf-8", errors="replace")
        if value is None:
            value = header(header_name)
        if value is not None:
            values[name] = value
    return values


def canonical_text(options: object) -> str:
    """A request's options (a frozen dataclass of numbers, strings, sets and nested options) as
    one canonical JSON text: equal options, equal text, in every process (sets sorted). Part of
    a response-cache key."""
    def plain(value: object) -> object:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {name: plain(item) for name, item in dataclasses.asdict(value).items()}
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        return value

    return json.dumps(plain(options), sort_keys=True, default=plain)
