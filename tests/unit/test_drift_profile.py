"""The reference profile and the Jensen-Shannon divergence (handlers/drift/drift_profile.py)."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

from handlers.drift.drift_features import BUCKETS
from handlers.drift.drift_profile import (
    DriftProfile,
    DriftProfileError,
    jensen_shannon,
    shares_of,
)

REFERENCE = Counter({("brightness", "96"): 60, ("brightness", "128"): 40, ("format", "JPEG"): 100})


def test_shares_cover_every_fixed_bucket():
    profile = DriftProfile.from_counts(REFERENCE, ["brightness", "format", "class"], "test")
    for feature in ("brightness", "format"):
        assert set(profile.shares[feature]) == set(BUCKETS[feature])
        assert sum(profile.shares[feature].values()) == pytest.approx(1.0)
    assert profile.shares["brightness"]["96"] == pytest.approx(0.6)
    assert profile.shares["class"] == dict.fromkeys(BUCKETS["class"], 0.0)
    assert profile.observations == {"brightness": 100, "format": 100, "class": 0}


def test_divergence_is_near_zero_for_the_reference_and_grows_with_the_share_that_moved():
    profile = DriftProfile.from_counts(REFERENCE, ["brightness"], "test")
    same = profile.drift(Counter({("brightness", "96"): 600, ("brightness", "128"): 400}))["brightness"]
    assert same == pytest.approx(0.0)
    moved = [profile.drift(Counter({("brightness", "96"): 600 * (1 - share),
                                    ("brightness", "128"): 400 * (1 - share),
                                    ("brightness", "32"): 1000 * share}))["brightness"]
             for share in (0.1, 0.4, 1.0)]
    assert same < moved[0] < moved[1] < moved[2] == pytest.approx(1.0)   # no bucket in common


def test_divergence_is_the_formula_and_none_without_traffic():
    reference = shares_of({"a": 3, "b": 1}, ["a", "b", "c"])
    live = {"a": 0.2, "b": 0.6, "c": 0.2}
    middle = {k: (live[k] + reference[k]) / 2 for k in "abc"}
    expected = 0.5 * sum(reference[k] * math.log2(reference[k] / middle[k]) for k in "ab") + \
        0.5 * sum(live[k] * math.log2(live[k] / middle[k]) for k in "abc")
    assert jensen_shannon(reference, {"a": 1, "b": 3, "c": 1}) == pytest.approx(expected)
    assert jensen_shannon(reference, {}) is None
    assert DriftProfile.from_counts(REFERENCE, ["brightness"], "test").drift(Counter()) == {}


def test_one_unusual_request_in_a_small_window_moves_the_divergence_by_little():
    profile = DriftProfile.from_counts(REFERENCE, ["brightness"], "test")
    window = Counter({("brightness", "96"): 30, ("brightness", "128"): 19, ("brightness", "224"): 1})
    assert profile.drift(window)["brightness"] < 0.02


def test_a_profile_survives_its_file_and_a_file_with_other_buckets_is_refused():
    profile = DriftProfile.from_counts(REFERENCE, ["brightness", "format"], "the project's photos")
    assert DriftProfile.from_json(profile.to_json()) == profile
    document = json.loads(profile.to_json())
    document["shares"]["brightness"] = {"dark": 0.5, "light": 0.5}
    with pytest.raises(DriftProfileError, match="brightness"):
        DriftProfile.from_json(json.dumps(document))
