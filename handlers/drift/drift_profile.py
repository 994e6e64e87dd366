"""A model version's reference profile and the drift measure computed against it.

The profile is the share of observations in each bucket of each feature
(handlers.drift.drift_features), recorded at build time from a reference photo set and stored in
the archive as `drift_reference.json`; a bucket the reference set never reached has a share
of 0.

The measure is the Jensen-Shannon divergence in bits, JS = 1/2 sum p log2(p / m) + 1/2 sum q
log2(q / m) over the buckets, with p the live shares, q the reference's and m = (p + q) / 2.
Chosen over the population stability index, which needs every share above 0 on both sides:
smoothing the counts makes the index depend on the window's size (a window of the reference's
own distribution read 0.06, from the empty buckets alone), and one unusual request in a small
window can read as a shift. JS needs no smoothing (a bucket with a share of 0 adds nothing to
its sum), is symmetric and lies in [0, 1]: 0 for the same shares, 1 for shares with no bucket in common,
and grows with the share of traffic that moved. Prometheus computes it from per-bucket counters
with `log2` and sums (deploy/prometheus/model-drift.rules.yml computes exactly `jensen_shannon`).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from handlers.drift.drift_features import BUCKETS, Observation

PROFILE_FILE = "drift_reference.json"


class DriftProfileError(ValueError):
    """A profile file that does not describe the fixed buckets."""


def shares_of(counts: Mapping[str, float], buckets: Iterable[str]) -> dict[str, float]:
    """Each bucket's share of `counts` (all 0 without counts)."""
    names = list(buckets)
    total = sum(counts.get(name, 0.0) for name in names)
    return {name: counts.get(name, 0.0) / total if total else 0.0 for name in names}


def jensen_shannon(reference: Mapping[str, float], live_counts: Mapping[str, float]) -> float | None:
    """JS divergence (bits) of the live counts' shares from the reference shares, over the
    reference's buckets; None when either side has nothing."""
    live = shares_of(live_counts, reference)
    if not any(live.values()) or not any(reference.values()):
        return None
    divergence = 0.0
    for name, share in reference.items():
        middle = (live[name] + share) / 2
        divergence += sum(side * math.log2(side / middle) for side in (share, live[name]) if side > 0)
    return divergence / 2


def counts_by_feature(observations: Mapping[Observation, float]) -> dict[str, dict[str, float]]:
    """(feature, bucket) -> count, regrouped as feature -> bucket -> count."""
    grouped: dict[str, dict[str, float]] = {}
    for (feature, bucket), count in observations.items():
        grouped.setdefault(feature, {})[bucket] = grouped.get(feature, {}).get(bucket, 0.0) + count
    return grouped


@dataclass(frozen=True)
class DriftProfile:
    """feature -> bucket -> reference share (every bucket of BUCKETS); how many
    observations each feature's shares come from; what they were recorded from."""

    shares: Mapping[str, Mapping[str, float]]
    observations: Mapping[str, int]
    source: str

    @classmethod
    def from_counts(cls, counts: Counter[Observation], features: Iterable[str], source: str) -> DriftProfile:
        grouped = counts_by_feature(counts)
        shares = {feature: shares_of(grouped.get(feature, {}), BUCKETS[feature]) for feature in features}
        return cls(shares, {feature: int(sum(grouped.get(feature, {}).values())) for feature in features},
                   source)

    def drift(self, live: Mapping[Observation, float]) -> dict[str, float]:
        """feature -> JS divergence of `live` counts from this profile (features with counts)."""
        grouped = counts_by_feature(live)
        divergences = {feature: jensen_shannon(shares, grouped.get(feature, {}))
                       for feature, shares in self.shares.items()}
        return {feature: value for feature, value in divergences.items() if value is not None}

    def to_json(self) -> str:
        return json.dumps({"measure": "jensen-shannon", "source": self.source,
                           "observations": dict(self.observations),
                           "shares": {feature: dict(shares) for feature, shares in self.shares.items()}},
                          indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DriftProfile:
        document = json.loads(text)
        shares = document["shares"]
        for feature, buckets in shares.items():
            if feature not in BUCKETS or set(buckets) != set(BUCKETS[feature]):
                raise DriftProfileError(f"the profile's {feature!r} buckets are not the fixed ones")
        return cls(shares, document["observations"], document["source"])


def read_profile(model_dir: Path) -> DriftProfile | None:
    """The archive's profile (None: built without one)."""
    path = model_dir / PROFILE_FILE
    return DriftProfile.from_json(path.read_text(encoding="utf-8")) if path.exists() else None
