"""`models shadow-report`'s reading of TorchServe's /metrics (torchserve_vision/shadow.py)."""

from __future__ import annotations

import pytest

from torchserve_vision.shadow import shadow_reports, shadow_totals

OF_CLASSIFIER = 'ModelName="m",Level="Model",Candidate="2.0",Hostname="vm",'
OF_DETECTOR = 'ModelName="m",Level="Model",Candidate="3.0",Hostname="vm",'
EXPOSITION = f"""# TYPE HandlerShadowCompared counter
HandlerShadowCompared{{{OF_CLASSIFIER}}} 4.0
HandlerShadowCompared{{{OF_DETECTOR}}} 2.0
HandlerShadowAgreement{{{OF_CLASSIFIER}}} 3.0
HandlerShadowAgreement{{{OF_DETECTOR}}} 1.5
HandlerShadowProbabilityShift{{{OF_CLASSIFIER}}} 0.2
HandlerShadowCandidateMs{{{OF_CLASSIFIER}}} 40.0
HandlerShadowCandidateMs{{{OF_DETECTOR}}} 30.0
HandlerShadowFlips{{{OF_CLASSIFIER}From="tabby",To="tiger cat",}} 1.0
HandlerShadowDropped{{{OF_DETECTOR}Reason="QueueFull",}} 5.0
ts_inference_requests_total{{model_name="m",model_version="default",hostname="vm",}} 10.0
ts_inference_latency_microseconds{{model_name="m",model_version="default",hostname="vm",}} 200000.0
"""


def test_each_candidate_is_reported_from_its_own_series():
    classifier, detector = shadow_reports(EXPOSITION, "m")
    assert (classifier.candidate, classifier.compared, classifier.agreement) == ("2.0", 4, 0.75)
    assert classifier.mean_probability_shift == pytest.approx(0.05)
    assert classifier.top_flips == [("tabby", "tiger cat", 1)] and classifier.dropped == {}
    assert classifier.production_latency_ms == pytest.approx(20.0)
    assert classifier.candidate_latency_ms is None          # no request reached it by name
    # a detector candidate has no probability shift, whatever another candidate has
    assert (detector.agreement, detector.mean_probability_shift) == (0.75, None)
    assert detector.dropped == {"QueueFull": 5} and detector.candidate_round_trip_ms == 15.0


def test_totals_are_the_raw_sums_for_one_candidate():
    totals = shadow_totals(EXPOSITION, "m", "3.0")
    assert (totals.compared, totals.agreed, totals.dropped) == (2.0, 1.5, 5.0)
    assert shadow_reports(EXPOSITION, "other") == []
