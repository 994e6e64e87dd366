"""The one check of a fraction, for request options and archive settings alike."""

from __future__ import annotations

import math


def fraction_of(value: object, *, allow_zero: bool = True) -> float | None:
    """`value` (a number or its text) as a float in [0, 1] ((0, 1] without `allow_zero`), or
    None when it is not one. The one check of a fraction, for options and settings alike."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if math.isnan(number) or number > 1 or number < 0 or (number == 0 and not allow_zero):
        return None
    return number
