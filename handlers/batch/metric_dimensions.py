"""The dimensions of the metrics a worker exports through TorchServe's metrics cache, shaped like
`ts.metrics.dimension.Dimension`, and how a label value is made safe for Prometheus."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class MetricDimension:
    """A metric dimension, shaped like `ts.metrics.dimension.Dimension` (name, value)."""

    name: str
    value: str


def metric_label_value(text: str) -> str:
    """A class name as a dimension value: TorchServe's metric lines separate dimensions with ',',
    names from values with ':' and sections with '|' and '#', so anything but letters, digits
    and ` _'.-` becomes '_'."""
    return re.sub(r"[^A-Za-z0-9 _'.-]", "_", text)
