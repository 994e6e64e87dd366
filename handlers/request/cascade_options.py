"""Per-request cascade options, from a JSON body, multipart form fields or request headers.

    JSON body:   {"data": "<base64>", "escalation": "always", "escalation_threshold": 0.7,
                  "top_k": 3}                       (v2: request "parameters")
    form fields: escalation=never (beside the image field)
    headers:     X-Escalation: auto|never|always, X-Escalation-Threshold: 0.7, X-Top-K: 3

`auto` (the default) escalates when the first model's confidence is below the threshold (the
archive's `escalation.threshold` unless the request gives one); `never` keeps the first model's
answer; `always` asks the second model. A body value beats a header; a malformed value is a 400
for that request alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, get_args

from handlers.ground.kind_options import CascadeOptions, EscalationMode
from handlers.request.classification_options import OPTION_HEADERS as TOP_K_HEADERS
from handlers.request.classification_options import top_k_option
from handlers.request.request_options import invalid_option, option_values, parse_fraction

OPTION_HEADERS = {**TOP_K_HEADERS, "escalation": "X-Escalation",
                  "escalation_threshold": "X-Escalation-Threshold"}
OPTION_FIELDS = frozenset(OPTION_HEADERS)
ESCALATION_MODES: tuple[str, ...] = get_args(EscalationMode)


def parse_escalation_mode(value: object) -> EscalationMode:
    text = str(value).strip().lower()
    if text not in ESCALATION_MODES:
        raise invalid_option("escalation", value, " | ".join(ESCALATION_MODES))
    return text  # type: ignore[return-value]


def parse_cascade_options(row: Mapping[str, Any], header: Callable[[str], str | None],
                          default_top_k: int, default_threshold: float,
                          class_count: int) -> CascadeOptions:
    """This request's options; ClientError(400) when a value is invalid."""
    values = option_values(row, header, OPTION_HEADERS)
    return CascadeOptions(
        top_k=top_k_option(values, default_top_k, class_count),
        escalation=parse_escalation_mode(values["escalation"]) if "escalation" in values else "auto",
        threshold=parse_fraction("escalation_threshold", values["escalation_threshold"])
        if "escalation_threshold" in values else default_threshold,
    )
