"""A deployment plan from measurement: one pod's capacity at a p99 target, replicas for a request
rate, and the HorizontalPodAutoscaler targets of deploy/kubernetes, with the headroom stated.

    torchserve-vision lab plan --p99-ms 150 --target-rps 400 --headroom 0.3
    torchserve-vision lab plan --p99-ms 150 --target-rps 400 --duration 10 --json

The served model (one server = one pod's configuration) is driven with open-loop Poisson load at
rising fractions of its closed-loop ceiling; the capacity is the highest offered rate answered
in full with p99 within the target, every lower rate meeting it too. The planned rate per pod is
capacity x (1 - headroom). At that rate, TorchServe's own counters (`ts_inference_requests_total`,
`ts_queue_latency_microseconds`, scraped before and after) give the two HPA metrics as
prometheus-adapter computes them:

- requests per second per pod: rate(ts_inference_requests_total[1m]); target = the planned rate.
- requests waiting per pod: rate(ts_queue_latency_microseconds[1m]) / 1e6, the time-average
  number of requests queued (Little's law: arrival rate x mean queue wait, batch gathering
  included); target = its value at the planned rate. It rises first when requests get costlier
  (bigger images, a slower version) at the same request rate.

The HPA scales to the larger of the two recommendations.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from torchserve_vision.lab.loadgen import LoadTarget, Report, run_closed_loop, run_open_loop
from torchserve_vision.prometheus_text import scrape, total

FRACTIONS = (0.4, 0.55, 0.7, 0.8, 0.9, 1.0)
QUEUE_COUNTER = "ts_queue_latency_microseconds"
REQUEST_COUNTER = "ts_inference_requests_total"


@dataclass(frozen=True)
class LoadStep:
    offered_rps: float
    answered_rps: float
    p99_ms: float
    failed: int
    requests_per_second: float   # from TorchServe's counters, over the step
    requests_waiting: float      # mean requests queued, from TorchServe's counters

    def meets(self, p99_target_ms: float) -> bool:
        return self.failed == 0 and self.p99_ms <= p99_target_ms


@dataclass(frozen=True)
class DeploymentPlan:
    p99_target_ms: float
    target_rps: float
    headroom: float
    capacity_rps: float          # one pod, at the p99 target
    planned_rps_per_pod: float   # capacity x (1 - headroom)
    replicas: int
    hpa_requests_per_second: float
    hpa_requests_waiting: float
    planned_step: LoadStep

    def table(self) -> str:
        return "\n".join([
            f"one pod: {self.capacity_rps:.1f} requests/s with p99 <= {self.p99_target_ms:g} ms",
            f"planned per pod ({self.headroom:.0%} headroom): {self.planned_rps_per_pod:.1f} requests/s "
            f"(measured there: p99 {self.planned_step.p99_ms:.0f} ms)",
            f"replicas for {self.target_rps:g} requests/s: {self.replicas}",
            "HPA targets (averageValue per pod):",
            f"  ts_inference_requests_per_second: {self.hpa_requests_per_second:.1f}",
            f"  ts_requests_waiting: {self.hpa_requests_waiting:.2f}",
        ])


def per_pod_capacity(steps: Sequence[LoadStep], p99_target_ms: float) -> LoadStep | None:
    """The highest offered rate that met the target with every lower rate meeting it too (a
    lucky run above a failed level does not count); None when the lowest did not."""
    capacity = None
    for step in sorted(steps, key=lambda step: step.offered_rps):
        if not step.meets(p99_target_ms):
            break
        capacity = step
    return capacity


def make_plan(capacity: LoadStep, planned: LoadStep, p99_target_ms: float, target_rps: float,
              headroom: float) -> DeploymentPlan:
    planned_rps = capacity.offered_rps * (1 - headroom)
    return DeploymentPlan(
        p99_target_ms=p99_target_ms, target_rps=target_rps, headroom=headroom,
        capacity_rps=capacity.offered_rps, planned_rps_per_pod=planned_rps,
        replicas=max(1, math.ceil(target_rps / planned_rps)),
        hpa_requests_per_second=round(planned_rps, 1),
        hpa_requests_waiting=round(max(planned.requests_waiting, 0.01), 2),
        planned_step=planned)


def step_from(report: Report, before: str, after: str, seconds: float, model: str) -> LoadStep:
    def rate(name: str, scale: float = 1.0) -> float:
        change = total(after, name, model_name=model) - total(before, name, model_name=model)
        return change / scale / seconds

    return LoadStep(offered_rps=report.offered_rps or 0.0, answered_rps=report.throughput_rps,
                    p99_ms=report.latency_ms.get("p99", math.inf),
                    failed=report.sent - report.succeeded,
                    requests_per_second=rate(REQUEST_COUNTER),
                    requests_waiting=rate(QUEUE_COUNTER, 1e6))


def measure_step(target: LoadTarget, metrics_url: str, model: str, rate_rps: float,
                 duration_s: float) -> LoadStep:
    before, started = scrape(metrics_url, timeout_s=10), time.monotonic()
    report = run_open_loop(target, rate_rps, duration_s, max_requests=10**7)
    after, seconds = scrape(metrics_url, timeout_s=10), time.monotonic() - started
    return step_from(report, before, after, seconds, model)


def plan_deployment(target: LoadTarget, metrics_url: str, model: str, p99_target_ms: float,
                    target_rps: float, headroom: float, duration_s: float,
                    on_step: Callable[[str], None] = lambda line: None) -> DeploymentPlan | None:
    """Measure and plan (None when no load level met the p99 target)."""
    ceiling = run_closed_loop(target, clients=16, duration_s=duration_s, max_requests=10**7)
    on_step(f"closed-loop ceiling: {ceiling.throughput_rps:.1f} requests/s")
    steps = []
    for fraction in FRACTIONS:
        step = measure_step(target, metrics_url, model, fraction * ceiling.throughput_rps, duration_s)
        on_step(f"offered {step.offered_rps:.1f}/s: answered {step.answered_rps:.1f}/s, "
                f"p99 {step.p99_ms:.0f} ms, failed {step.failed}, waiting {step.requests_waiting:.2f}")
        steps.append(step)
    capacity = per_pod_capacity(steps, p99_target_ms)
    if capacity is None:
        return None
    planned = measure_step(target, metrics_url, model, capacity.offered_rps * (1 - headroom), duration_s)
    on_step(f"planned {planned.offered_rps:.1f}/s: p99 {planned.p99_ms:.0f} ms, "
            f"waiting {planned.requests_waiting:.2f}")
    return make_plan(capacity, planned, p99_target_ms, target_rps, headroom)


def plan_document(plan: DeploymentPlan) -> dict[str, object]:
    return asdict(plan)
