"""Per-request classification options, from a JSON body, multipart form fields or a header.

    JSON body:   {"data": "<base64>", "top_k": 3}      (v2: request "parameters": {"top_k": 3})
    form field:  top_k=3 (beside the image field)
    header:      X-Top-K: 3

A value in the body beats the header, the header beats the archive's `top_k`; at most the number
of classes. A malformed or out-of-range value is a 400 for that request alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from handlers.request_options import option_values, parse_count

OPTION_HEADERS = {"top_k": "X-Top-K"}
OPTION_FIELDS = frozenset(OPTION_HEADERS)


def parse_top_k(row: Mapping[str, Any], header: Callable[[str], str | None], default: int,
                class_count: int) -> int:
    """This request's top-k: its own value over `default`; ClientError(400) when invalid."""
    values = option_values(row, header, OPTION_HEADERS)
    return parse_count("top_k", values["top_k"], class_count) if "top_k" in values else default
