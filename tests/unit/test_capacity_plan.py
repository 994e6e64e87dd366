"""The deployment plan's arithmetic and the Prometheus text it reads, without a server."""

from __future__ import annotations

import pytest

from torchserve_vision.lab.capacity_plan import LoadStep, make_plan, per_pod_capacity, step_from
from torchserve_vision.lab.loadgen import Report
from torchserve_vision.prometheus_text import parse_samples, series_names, total

EXPOSITION = """\
# HELP ts_queue_latency_microseconds Cumulative queue duration in microseconds
# TYPE ts_queue_latency_microseconds counter
ts_queue_latency_microseconds{model_name="a",model_version="default",hostname="vm",} 2000000.0
ts_queue_latency_microseconds{model_name="b",model_version="default",hostname="vm",} 5.0
# TYPE ts_inference_requests_total counter
ts_inference_requests_total{model_name="a",model_version="default",hostname="vm",} 100.0
QueueTime{Level="Host",Hostname="vm",} 5.0
"""


def step(rate: float, p99: float, failed: int = 0, waiting: float = 0.5) -> LoadStep:
    return LoadStep(rate, rate, p99, failed, rate, waiting)


def test_series_are_read_as_exposed_and_summed_by_label():
    assert series_names(EXPOSITION) == {"ts_queue_latency_microseconds", "ts_inference_requests_total",
                                         "QueueTime"}
    assert total(EXPOSITION, "ts_queue_latency_microseconds", model_name="a") == 2_000_000.0
    assert total(EXPOSITION, "ts_queue_latency_microseconds") == 2_000_005.0
    assert total(EXPOSITION, "missing") == 0.0
    assert parse_samples(EXPOSITION)[0].labels == {"model_name": "a", "model_version": "default",
                                                   "hostname": "vm"}


def test_capacity_is_the_last_rate_that_met_the_target_with_every_lower_rate():
    steps = [step(10, 50), step(20, 80), step(30, 200), step(40, 90), step(50, 400)]
    assert per_pod_capacity(steps, 100) == steps[1]            # 40/s met it by luck after 30/s did not
    assert per_pod_capacity([step(10, 50, failed=1)], 100) is None
    assert per_pod_capacity([step(10, 150)], 100) is None


def test_the_plan_sizes_replicas_and_autoscaler_targets_from_the_planned_rate():
    plan = make_plan(step(100, 90), step(70, 60, waiting=0.4), p99_target_ms=100, target_rps=500,
                     headroom=0.3)
    assert plan.planned_rps_per_pod == pytest.approx(70)
    assert plan.replicas == 8                                   # ceil(500 / 70)
    assert plan.hpa_requests_per_second == 70 and plan.hpa_requests_waiting == 0.4
    assert "replicas for 500 requests/s: 8" in plan.table()


def test_a_step_reads_rates_from_counter_differences():
    before = EXPOSITION
    after = EXPOSITION.replace("2000000.0", "6000000.0").replace("} 100.0", "} 300.0")
    report = Report("open loop", 10.0, 200, 200, {}, 20.0, {"p99": 80.0}, offered_rps=20.0)
    measured = step_from(report, before, after, seconds=10.0, model="a")
    assert measured.requests_per_second == 20.0                  # 200 more requests in 10 s
    assert measured.requests_waiting == pytest.approx(0.4)      # 4 s waited per 10 s
    assert measured.failed == 0 and measured.p99_ms == 80.0
