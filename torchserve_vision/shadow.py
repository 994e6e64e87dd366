"""Shadow a candidate version on real traffic: `models shadow` and `models shadow-report`.

start_shadow: register the candidate archive beside the default version (its own workers),
smoke-test it, then write the model's shadow policy where the default version's workers read it
(each worker says where in `describe`: handlers.shadow) and wait until a worker follows it. From
then on the workers copy that share of the requests they answer to the candidate, off the
request path, and export the comparison as metrics. Production's answers never come from the
candidate. stop_shadow removes the policy (and, when asked, the candidate).

shadow_report reads those metrics (TorchServe's Prometheus text, summed over workers) and
TorchServe's own latency per version: agreement, probability shift, both latencies, dropped
copies by reason and the label flips seen most.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from handlers.shadow.shadow_policy import ShadowPolicy, write_policy
from torchserve_vision.client import ManagementError, TorchServeClient
from torchserve_vision.model_descriptions import ServingSettings
from torchserve_vision.prometheus_text import Sample, parse_samples, total_of
from torchserve_vision.rollout import (
    WORKERS_DEADLINE_MARGIN_S,
    Log,
    RolloutError,
    checked_manifest,
    smoke_test,
    wait_for_workers,
)
from torchserve_vision.server_state import default_version, versions_of
from torchserve_vision.waiting import wait_until


class ShadowError(RolloutError):
    """The shadow could not be set up or removed; the message says why."""


def worker_shadow_state(client: TorchServeClient, model: str, version: str) -> dict[str, Any]:
    """What a worker of the version says of its shadow stage (handlers.shadow.shadow_stage:
    `describe`); ShadowError when its server has no traffic directory."""
    metadata = client.describe(model, version, customized=True)[0].get("customizedMetadata")
    if isinstance(metadata, str):
        metadata = json.loads(metadata)
    state = metadata.get("shadow") if isinstance(metadata, dict) else None
    if not isinstance(state, dict):
        raise ShadowError(f"{model} {version}'s workers cannot shadow: their server was started "
                          "without a traffic directory (start it with `torchserve-vision server "
                          "start` or `server run`)")
    return state


def wait_until_followed(client: TorchServeClient, model: str, version: str,
                        policy: ShadowPolicy | None, timeout_s: float = 10.0) -> None:
    """Until a worker of `version` reports `policy` (None: no policy) as the one it follows.
    (TorchServe's describe drops null members, so those are not compared.)"""
    expected = without_nulls(policy.to_json()) if policy is not None else None

    def followed() -> bool:
        state = worker_shadow_state(client, model, version).get("policy")
        return (without_nulls(state) if isinstance(state, dict) else state) == expected

    wait_until(followed,
               timeout_s, f"{model} {version}'s workers to take up the shadow policy",
               interval_s=0.25, error=ShadowError)


def without_nulls(document: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in document.items() if value is not None}


@dataclass(frozen=True)
class ShadowPlan:
    model: str
    archive: str              # the candidate's .mar in the model store
    percent: float
    settings: ServingSettings  # the candidate's batching; its own worker counts
    smoke_image: bytes
    queue_size: int = 64


def stable_version(client: TorchServeClient, model: str) -> dict[str, Any]:
    """The description of `model`'s default version; ShadowError when it has none."""
    stable = default_version(client, model)
    if stable is None:
        raise ShadowError(f"{model} is not registered: no default version to compare with")
    return stable


def register_candidate(client: TorchServeClient, plan: ShadowPlan, stable: dict[str, Any],
                       store: Path, log: Log) -> str:
    """The candidate's version: its archive registered beside `stable` (the default version's
    description; or already there), its workers READY and smoke-tested."""
    candidate = str(checked_manifest(store, plan.archive, plan.model)["modelVersion"])
    if candidate == stable["modelVersion"]:
        raise ShadowError(f"{plan.archive} is {plan.model} {candidate}, the default version itself")
    if candidate not in {v["modelVersion"] for v in versions_of(client, plan.model)}:
        log(f"registering {plan.archive} as {plan.model} {candidate} (no traffic of its own)")
        settings = plan.settings
        client.register(plan.archive, settings.batch_size, settings.max_batch_delay_ms,
                        settings.min_workers, settings.response_timeout_s, settings.startup_timeout_s)
        client.scale(plan.model, candidate, settings.min_workers, settings.max_workers)
    wait_for_workers(client, plan.model, candidate, plan.settings.min_workers,
                     plan.settings.startup_timeout_s + WORKERS_DEADLINE_MARGIN_S)
    smoke_test(client, plan.model, candidate, plan.smoke_image, (), None)
    return candidate


def traffic_dir_of(client: TorchServeClient, model: str, version: str) -> Path:
    """The server's traffic directory, as a worker of the version reports it."""
    return Path(worker_shadow_state(client, model, version)["policy_file"]).parent


def start_shadow(client: TorchServeClient, plan: ShadowPlan, store: Path, log: Log) -> ShadowPolicy:
    """Register (or keep) the candidate, smoke-test it, and have the default version's workers
    mirror `plan.percent` % of their requests to it. Returns the policy they follow."""
    stable = stable_version(client, plan.model)
    # where the workers read their policy (ShadowError before anything is registered when they
    # cannot shadow at all)
    policy_file = Path(worker_shadow_state(client, plan.model, stable["modelVersion"])["policy_file"])
    candidate = register_candidate(client, plan, stable, store, log)
    policy = ShadowPolicy(plan.model, stable["modelVersion"], candidate, plan.percent,
                          client.inference_url,
                          str(client.key_file.path.resolve()) if client.key_file else None,
                          plan.queue_size)
    write_policy(policy_file, policy)
    wait_until_followed(client, plan.model, stable["modelVersion"], policy)
    log(f"{plan.model} {stable['modelVersion']} mirrors {plan.percent:g}% of its requests to "
        f"{candidate}")
    return policy


def stop_shadow(client: TorchServeClient, model: str, retire: bool, log: Log) -> str | None:
    """Stop mirroring (and unregister the candidate with `retire`); the candidate's version, or
    None when no shadow was on."""
    stable = stable_version(client, model)
    state = worker_shadow_state(client, model, stable["modelVersion"])
    policy = state.get("policy")
    Path(state["policy_file"]).unlink(missing_ok=True)
    wait_until_followed(client, model, stable["modelVersion"], None)
    if policy is None:
        log(f"{model} had no shadow")
        return None
    candidate = str(policy["candidate_version"])
    log(f"{model} {stable['modelVersion']} no longer mirrors to {candidate}")
    if retire:
        try:
            client.unregister(model, candidate)
            log(f"unregistered {model} {candidate}")
        except ManagementError as error:
            raise ShadowError(f"the shadow is off, but {model} {candidate} stays registered: "
                              f"{error}") from None
    return candidate


# --- the report --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShadowReport:
    """One candidate's comparison with production, summed over every worker."""

    model: str
    candidate: str
    compared: int
    agreement: float | None                 # mean agreement (top-1 / matched-box F1)
    mean_probability_shift: float | None    # classifiers
    candidate_round_trip_ms: float | None   # as the shadow sender measured it
    production_latency_ms: float | None     # TorchServe's, requests to the default version
    candidate_latency_ms: float | None      # TorchServe's, requests to the candidate's version
    dropped: dict[str, int] = field(default_factory=dict)
    top_flips: list[tuple[str, str, int]] = field(default_factory=list)

    def lines(self) -> list[str]:
        def number(value: float | None, form: str) -> str:
            return "-" if value is None else format(value, form)
        lines = [f"{self.model}: production vs candidate {self.candidate}: {self.compared} "
                 f"requests compared",
                 f"  agreement {number(self.agreement, '.4f')}  mean probability shift "
                 f"{number(self.mean_probability_shift, '.4f')}",
                 f"  latency ms (TorchServe, mean): production "
                 f"{number(self.production_latency_ms, '.1f')}  candidate "
                 f"{number(self.candidate_latency_ms, '.1f')} (round trip from the worker "
                 f"{number(self.candidate_round_trip_ms, '.1f')})",
                 "  dropped: " + (", ".join(f"{reason} {count}" for reason, count
                                            in sorted(self.dropped.items())) or "none")]
        lines += [f"  flip {count:>5}  {ours} -> {theirs}" for ours, theirs, count in self.top_flips]
        return lines


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def mean_latency_ms(samples: list[Sample], model: str, version_label: str) -> float | None:
    requests = total_of(samples, "ts_inference_requests_total", model_name=model,
                      model_version=version_label)
    return ratio(total_of(samples, "ts_inference_latency_microseconds", model_name=model,
                        model_version=version_label) / 1000, requests)


@dataclass(frozen=True)
class ShadowTotals:
    """The workers' shadow counters for one candidate so far, summed over workers."""

    compared: float
    agreed: float      # the sum of the compared requests' agreement
    dropped: float


def shadow_totals(metrics_text: str, model: str, candidate: str) -> ShadowTotals:
    samples = parse_samples(metrics_text)
    of = {"ModelName": model, "Candidate": candidate}
    return ShadowTotals(*(total_of(samples, f"HandlerShadow{name}", **of)
                          for name in ("Compared", "Agreement", "Dropped")))


def shadow_reports(metrics_text: str, model: str, top: int = 10) -> list[ShadowReport]:
    """Every candidate `model`'s workers compared answers with, from TorchServe's `/metrics`."""
    samples = parse_samples(metrics_text)
    mine = [s for s in samples if s.name.startswith("HandlerShadow") and s.labels.get("ModelName") == model]
    reports = []
    for candidate in sorted({s.labels.get("Candidate", "") for s in mine} - {""}):
        of = {"ModelName": model, "Candidate": candidate}
        compared = total_of(mine, "HandlerShadowCompared", **of)
        dropped: Counter[str] = Counter()
        flips: Counter[tuple[str, str]] = Counter()
        for s in mine:
            if s.labels.get("Candidate") != candidate:
                continue
            if s.name == "HandlerShadowDropped":
                dropped[s.labels.get("Reason", "")] += int(s.value)
            elif s.name == "HandlerShadowFlips":
                flips[(s.labels.get("From", ""), s.labels.get("To", ""))] += int(s.value)
        reports.append(ShadowReport(
            model, candidate, int(compared),
            ratio(total_of(mine, "HandlerShadowAgreement", **of), compared),
            ratio(total_of(mine, "HandlerShadowProbabilityShift", **of), compared)
            if any(s.name == "HandlerShadowProbabilityShift" and s.labels.get("Candidate") == candidate
                   for s in mine) else None,
            ratio(total_of(mine, "HandlerShadowCandidateMs", **of), compared),
            mean_latency_ms(samples, model, "default"), mean_latency_ms(samples, model, candidate),
            dict(dropped), [(a, b, n) for (a, b), n in flips.most_common(top)]))
    return reports
