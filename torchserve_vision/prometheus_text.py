"""Samples of a Prometheus text exposition (TorchServe's `:8082/metrics`), by the series names
Prometheus stores: exactly as exposed (TorchServe's counters have no `_total` suffix)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def parse_samples(text: str) -> list[Sample]:
    samples = []
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        labels = dict(LABEL.findall(match["labels"] or ""))
        samples.append(Sample(match["name"], labels, float(match["value"])))
    return samples


def series_names(text: str) -> set[str]:
    """Every series name with at least one sample."""
    return {sample.name for sample in parse_samples(text)}


def total(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when there are none)."""
    return sum(sample.value for sample in parse_samples(text)
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))
