"""The autoscaler's metrics end to end, with real parts: a real Prometheus scrapes a real
TorchServe's /metrics (the pod's labels added as the PodMonitor adds them), and the queries of
the prometheus-adapter rules (deploy/prometheus-adapter/values.yaml), filled as the adapter fills
them, return what the HorizontalPodAutoscaler will read: the request rate within 10% of what the
load generator sent over the same minute, and a queue metric that rises under overload."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest
import yaml

from tests.deployment_files import REPO
from tests.images import photo_bytes
from tests.prometheus_server import Prometheus, prometheus
from torchserve_vision.lab.loadgen import LoadTarget, Result, run_closed_loop, run_open_loop
from torchserve_vision.server_process import TorchServeInstance

pytestmark = pytest.mark.server
ADAPTER_VALUES = REPO / "deploy" / "prometheus-adapter" / "values.yaml"
RULES = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
POD = {"namespace": "serving", "pod": "torchserve-vision-0"}
SCRAPE_INTERVAL_S = 5            # a quarter of the rules' 1-minute windows, or less, as the PodMonitor's
RATE_RPS = 20.0


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
def scraper(server: TorchServeInstance, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    metrics = urlparse(server.metrics_url)
    with prometheus(tmp_path_factory.mktemp("prometheus"), {metrics.netloc: POD}, SCRAPE_INTERVAL_S) as found:
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

    overload = run_closed_loop(target, clients=48, duration_s=20 + 2 * SCRAPE_INTERVAL_S, max_requests=10**6)
    assert overload.succeeded > 0
    waiting_overloaded = value(scraper, adapter_query("ts_requests_waiting"))
    assert waiting_overloaded > max(1.0, 10 * waiting_light), (waiting_light, waiting_overloaded)

