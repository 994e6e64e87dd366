"""Samples of a Prometheus text exposition (TorchServe's `:8082/metrics`), by the series names
Prometheus stores: exactly as exposed (TorchServe's counters have no `_total` suffix)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import requests

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
    return total_of(parse_samples(text), name, **labels)


def total_of(samples: Sequence[Sample], name: str, **labels: str) -> float:
    """`total` over samples parsed once (for several sums over one exposition)."""
    return sum(sample.value for sample in samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def scrape(metrics_url: str, timeout_s: float = 30.0) -> str:
    """The exposition at `<metrics_url>/metrics` (HTTPError for a non-2xx answer)."""
    response = requests.get(f"{metrics_url.rstrip('/')}/metrics", timeout=timeout_s)
    response.raise_for_status()
    return response.text
