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

from handlers.ground.kind_options import ClassificationOptions
from handlers.request.request_options import option_values, parse_count

OPTION_HEADERS = {"top_k": "X-Top-K"}
OPTION_FIELDS = frozenset(OPTION_HEADERS)


def top_k_option(values: Mapping[str, object], default: int, class_count: int) -> int:
    """`top_k` from a request's raw option values (see `option_values`), else `default`: the one
    parser of top-k, for the classifier and the pipelines that classify."""
    return parse_count("top_k", values["top_k"], class_count) if "top_k" in values else default


def parse_classification_options(row: Mapping[str, Any], header: Callable[[str], str | None],
                                 default_top_k: int, class_count: int) -> ClassificationOptions:
    """This request's options: its own values over the archive's; ClientError(400) when invalid."""
    values = option_values(row, header, OPTION_HEADERS)
    return ClassificationOptions(top_k_option(values, default_top_k, class_count))
