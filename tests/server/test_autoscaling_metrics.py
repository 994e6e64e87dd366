"""The autoscaler's and the monitoring rules' metrics end to end, with real parts: a real
Prometheus scrapes a real TorchServe's /metrics (the pod's labels added as the PodMonitor adds
them), and the queries of the prometheus-adapter rules (deploy/prometheus-adapter/values.yaml),
filled as the adapter fills them, return what the HorizontalPodAutoscaler will read: the request
rate within 10% of what the load generator sent over the same minute, and a queue metric that
rises under overload. The same Prometheus evaluates deploy/prometheus/model-monitoring.rules.yml:
its drift divergence is the one handlers/drift computes from the same counters, against the
reference profile in the archive, and the latency rules read the frontend agent's histogram. The
server samples payloads: the samples on disk are the photo sent with its answers, within the
bound, counted by outcome."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from handlers.drift.drift_profile import PROFILE_FILE, DriftProfile
from handlers.drift.payload_samples import RESCAN_S
from tests.deployment_files import REPO
from tests.images import CAT_LABELS, photo_bytes
from tests.prometheus_server import Prometheus, prometheus
from tests.server.servers import started_server
from torchserve_vision.deployment_settings import DeploymentSettings
from torchserve_vision.lab.loadgen import LoadTarget, Result, run_closed_loop, run_open_loop
from torchserve_vision.prometheus_text import parse_samples, scrape
from torchserve_vision.server_process import TorchServeInstance
from torchserve_vision.waiting import wait_until

pytestmark = pytest.mark.server
ADAPTER_VALUES = REPO / "deploy" / "prometheus-adapter" / "values.yaml"
MONITORING_RULES = REPO / "deploy" / "prometheus" / "model-monitoring.rules.yml"
SAMPLES_MAX_BYTES = 3_000_000
RULES = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
POD = {"namespace": "serving", "pod": "torchserve-vision-0"}
SCRAPE_INTERVAL_S = 5            # a quarter of the rules' 1-minute windows, or less, as the PodMonitor's
RATE_RPS = 5.0                    # light: nothing queues, also on cores another test keeps busy
# One worker: the overload below keeps one core busy, not every core, and nothing here needs two
WORKERS = 1
SAMPLE_PER_S = 0.5


def adapter_query(metric: str) -> str:
    """The rule that makes `metric`, its metricsQuery filled as prometheus-adapter fills it for
    one pod (`<<.Series>>`, `<<.LabelMatchers>>`, `<<.GroupBy>>`)."""
    rule = next(rule for rule in RULES if rule["name"]["as"] == metric)
    series = re.fullmatch(r"\^(\w+)\$", rule["name"]["matches"])
    assert series is not None
    matchers = ",".join(f'{name}="{value}"' for name, value in POD.items())
    return (rule["metricsQuery"].replace("<<.Series>>", series[1])
            .replace("<<.LabelMatchers>>", matchers).replace("<<.GroupBy>>", "pod"))


def value(scraper: Prometheus, query: str) -> float:
    result = scraper.query(query)
    assert len(result) == 1 and result[0]["metric"] == {"pod": POD["pod"]}, result
    return float(result[0]["value"][1])


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("payload-samples")


@pytest.fixture(scope="module")
def server(model_store: Path, samples: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[TorchServeInstance]:
    """This module's server samples payloads (docs/monitoring.md): the variables are in the
    environment TorchServe starts with, and only then."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TSV_SAMPLE_DIR", str(samples))
        patch.setenv("TSV_SAMPLE_PER_S", str(SAMPLE_PER_S))
        patch.setenv("TSV_SAMPLE_MAX_BYTES", str(SAMPLES_MAX_BYTES))
        running = started_server(tmp_path_factory.mktemp("torchserve"), model_store,
                                 settings=DeploymentSettings(workers=WORKERS),
                                 load_models="efficientnet_lite0-1.0.mar")   # what it measures
        instance = next(running)
    yield instance
    next(running, None)        # stopped


@pytest.fixture(scope="module")
def scraper(server: TorchServeInstance, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    metrics = urlparse(server.metrics_url)
    with prometheus(tmp_path_factory.mktemp("prometheus"), {metrics.netloc: POD}, SCRAPE_INTERVAL_S,
                    rule_files=[MONITORING_RULES]) as found:
        yield found


def test_the_adapter_finds_the_series_and_reads_the_rate_and_the_queue(server: TorchServeInstance,
                                                                       scraper: Prometheus):
    target = LoadTarget(f"{server.inference_url}/predictions/efficientnet_lite0",
                        [photo_bytes("chelsea.png")], timeout_s=60)
    results: list[Result] = []
    stop = threading.Event()
    started = time.perf_counter()
    load = threading.Thread(target=run_open_loop, daemon=True, kwargs={
        "target": target, "rate_rps": RATE_RPS, "duration_s": 600, "max_requests": 10**6,
        "stop": stop, "results": results, "started": started})
    load.start()
    try:
        time.sleep(60 + 3 * SCRAPE_INTERVAL_S)          # a full window of steady load, scraped
        rate = value(scraper, adapter_query("ts_inference_requests_per_second"))
        asked_at = time.perf_counter() - started
        sent = sum(asked_at - 60 <= result.scheduled_s < asked_at for result in list(results)) / 60
        waiting_light = value(scraper, adapter_query("ts_requests_waiting"))
    finally:
        stop.set()
        load.join(timeout=120)
    assert all(result.status == 200 for result in results)
    for rule in RULES:                                   # the adapter's discovery: seriesQuery
        assert scraper.series(rule["seriesQuery"]), rule["seriesQuery"]
    assert abs(rate - sent) <= 0.10 * sent, (rate, sent)

    # 48 clients keep about 40 requests waiting whatever the machine's speed: scraped over at
    # least 10 s of it, the 1-minute rule reads >= 5 waiting, far above the light load's share
    overload = run_closed_loop(target, clients=48, duration_s=10 + 2 * SCRAPE_INTERVAL_S, max_requests=10**6)
    assert overload.succeeded > 0
    waiting_overloaded = value(scraper, adapter_query("ts_requests_waiting"))
    assert waiting_overloaded > max(1.0, 10 * waiting_light), (waiting_light, waiting_overloaded)



def worker_drift(exposition: str, model: str) -> tuple[DriftProfile, dict[tuple[str, str], float]]:
    """The reference profile the workers export and the counts they observed, for `model`."""
    shares: dict[str, dict[str, float]] = {}
    observed: dict[tuple[str, str], float] = {}
    for sample in parse_samples(exposition):
        if sample.labels.get("ModelName") != model:
            continue
        key = (sample.labels.get("Feature", ""), sample.labels.get("Bucket", ""))
        if sample.name == "HandlerDriftReference":
            shares.setdefault(key[0], {})[key[1]] = sample.value
        elif sample.name == "HandlerDriftObserved":
            observed[key] = observed.get(key, 0.0) + sample.value
    return DriftProfile(shares, {}, "the workers' gauges"), observed


def test_the_monitoring_rules_compute_the_workers_drift_and_read_the_latency_histogram(
        server: TorchServeInstance, scraper: Prometheus, model_store: Path):
    """One photo, over and over (the load above, and a few more here). A feature whose every
    observation fell in one bucket has the same share in Prometheus's window as in the raw
    counters, so the recorded divergence must be the Python one; the exported reference must be
    the archive's. (The workers make every bucket's counter at 0 when they start, and the
    frontend agent its histogram; once those are scraped, Prometheus's increase() counts these
    requests even when they are the first.)"""
    wait_until(lambda: all(scraper.query(f'{series}{{{model}="efficientnet_lite0"}}') for series, model in (
        ("HandlerDriftObserved", "ModelName"), ("ts_request_latency_seconds_count", "model_name"))),
        60, "Prometheus to scrape the drift counters and the latency histogram", interval_s=1)
    burst = run_closed_loop(LoadTarget(f"{server.inference_url}/predictions/efficientnet_lite0",
                                       [photo_bytes("chelsea.png")], timeout_s=60),
                            clients=2, duration_s=60, max_requests=10)
    assert burst.succeeded == burst.sent >= 10
    with zipfile.ZipFile(model_store / "efficientnet_lite0-1.0.mar") as archive:
        archived = DriftProfile.from_json(archive.read(PROFILE_FILE).decode())
    exported, observed = worker_drift(scrape(server.metrics_url), "efficientnet_lite0")
    for feature, shares in archived.shares.items():
        assert exported.shares[feature] == pytest.approx(shares, abs=1e-6), feature
    single = sorted(feature for feature in exported.shares
                    if sum(1 for (name, _), count in observed.items() if name == feature and count) == 1)
    assert {"format", "width", "height", "aspect", "brightness"} <= set(single)
    expected = exported.drift(observed)
    query = 'model_version_feature:drift_js_divergence:1h{ModelName="efficientnet_lite0",ModelVersion="1.0"}'

    def recorded() -> dict[str, float]:
        return {item["metric"]["Feature"]: float(item["value"][1]) for item in scraper.query(query)}

    wait_until(lambda: set(single) <= set(recorded()), 90, "the drift rules' first evaluation", interval_s=2)
    divergences = recorded()
    for feature in single:
        assert divergences[feature] == pytest.approx(expected[feature], abs=1e-5), feature
    assert divergences["brightness"] > 0.1       # one photo is not the reference's many
    p99 = scraper.query('histogram_quantile(0.99, sum by (le) (rate(ts_request_latency_seconds_bucket{'
                        'model_name="efficientnet_lite0",model_version="1.0"}[5m])))')
    assert len(p99) == 1 and 0 < float(p99[0]["value"][1]) < 60
    counted = scraper.query('sum(ts_request_latency_seconds_count{model_name="efficientnet_lite0"})')
    assert float(counted[0]["value"][1]) >= 10


def test_payloads_are_sampled_at_the_rate_with_their_answers_and_within_the_bound(
        server: TorchServeInstance, samples: Path):
    """The module's requests (a few hundred of one photo, one worker at 0.5 samples/s;
    a few more here, which at least the rate's burst samples)."""
    burst = run_closed_loop(LoadTarget(f"{server.inference_url}/predictions/efficientnet_lite0",
                                       [photo_bytes("chelsea.png")], timeout_s=60),
                            clients=2, duration_s=60, max_requests=6)
    assert burst.succeeded == burst.sent
    folder = samples / "efficientnet_lite0" / "1.0"
    wait_until(lambda: any(folder.glob("*.json")), 30, "a payload sample")
    photo = photo_bytes("chelsea.png")
    newest = sorted(folder.glob("*.json"))[-3:]        # rotation only ever takes the oldest
    for path in newest:
        record = json.loads(path.read_text())
        assert (record["model"], record["version"], record["format"]) == ("efficientnet_lite0", "1.0", "png")
        assert record["answer"][0]["label"] in CAT_LABELS
        assert path.with_suffix(".png").read_bytes() == photo          # the bytes as received
        assert record["sha256"] == hashlib.sha256(photo).hexdigest()
    # A worker counts its own samples as it writes them, and another's when it rescans the
    # folder: over the bound by at most each other worker's samples between two rescans (their
    # rate for RESCAN_S and a burst of one), and one sample still being written now
    over = (WORKERS - 1) * (RESCAN_S * SAMPLE_PER_S + 1) + 1
    assert size_on_disk(folder) <= SAMPLES_MAX_BYTES + over * (len(photo) + 1000)
    # a worker exports what its writer thread did with its next batch: a few more requests
    run_closed_loop(LoadTarget(f"{server.inference_url}/predictions/efficientnet_lite0", [photo],
                               timeout_s=60), clients=2, duration_s=60, max_requests=6)
    outcomes = {sample.labels["Outcome"]: sample.value for sample in parse_samples(scrape(server.metrics_url))
                if sample.name == "HandlerPayloadSamples"
                and sample.labels.get("ModelName") == "efficientnet_lite0"}
    assert outcomes.get("rate_limited", 0) > 0 and outcomes.get("written", 0) >= 1


def size_on_disk(folder: Path) -> int:
    """Bytes in `folder`, leaving out files a worker's rotation deletes while they are counted."""
    total = 0
    for path in folder.iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total
