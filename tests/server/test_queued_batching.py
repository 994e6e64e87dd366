"""Queued batching (the frontend agent's, torchserve_vision/frontend) on a real TorchServe: a
worker takes what is queued when it is free and never waits for company. A lone request runs at
once even with an hour of batch delay registered; requests that queue behind a busy worker share
its next batch; a bad upload fails only itself; TorchServe's describe job travels alone; scaling
and unregistering work; an archive without it keeps TorchServe's own batching on the same server.
Deadlines: a request that can no longer be answered within its deadline (its X-Request-Timeout-Ms
header, or the model's) is answered 504 and never reaches the handler; one whose deadline passes
while its batch runs gets its answer; a bad header is a 400 for that request alone."""

from __future__ import annotations

import base64
import json
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import psutil
import pytest
import requests

from tests.images import CAT_LABELS, photo_bytes, slow_png
from tests.server.http_client import burst_with_one_bad_upload, concurrently
from tests.server.logs import batch_records, log_lines, wait_for_log
from tests.server.servers import fork_server_of_its_own, started_server
from torchserve_vision.archives.versions import archive_with_version
from torchserve_vision.lab.benchmark_images import benchmark_jpeg
from torchserve_vision.prometheus_text import scrape, total
from torchserve_vision.rollout import wait_for_workers
from torchserve_vision.server_process import TorchServeInstance, frontend_pid, ping
from torchserve_vision.waiting import wait_until

pytestmark = pytest.mark.server
MODEL = "efficientnet_lite0"
QUEUED, DELAYED, WITH_DEADLINE, PRIORITIES = "1.0-queued", "1.0-delayed", "1.0-deadline", "1.0-priorities"
AN_HOUR_MS = 3_600_000
# More than a lone request may wait for its worker on a loaded 2-core machine (11 ms seen against
# a deadline of 10); a batch slower than it is made by measurement (request_slower_than).
MODEL_DEADLINE_MS = 50
# Slow PNGs sent at once to keep one worker busy while more than a batch queues behind it (see
# slow_png): three batches of 8 for the deadline test, which waits for 8 queued, four for the
# priority test, which waits for 16. However the first batch is cut (the worker takes what has
# arrived, as little as one request), that many stay queued through the whole second batch. With
# 16 for the deadline test, a first batch of one left 15 queued for its 160 ms only, and a loaded
# machine's uploads arrived over that time: 8 were never seen queued at once.
SLOW_BUSY, SLOW_BUSY_FOR_PRIORITY = 24, 32
WIDE_QUEUE = 100
EXPIRED = "ts_requests_expired_total"
SHED_FOR_PRIORITY = "ts_requests_shed_for_priority_total"


@pytest.fixture(scope="module")
def queued_server(model_store: Path, tmp_path_factory) -> Iterator[TorchServeInstance]:
    """Lite0 four times on a server of its own, one worker each, batch size 8 and an hour of
    batch delay: version 1.0-queued with queued batching, 1.0-delayed with TorchServe's,
    1.0-deadline queued with a deadline of MODEL_DEADLINE_MS, 1.0-priorities queued (for the
    priority tests, whose high-priority requests change how its queue is kept)."""
    store = tmp_path_factory.mktemp("queued-store")
    shutil.copy(model_store / f"{MODEL}-1.0.mar", store)
    frontends: dict[str, dict[str, object]] = {
        QUEUED: {"continuousBatching": True}, DELAYED: {"continuousBatching": False},
        WITH_DEADLINE: {"continuousBatching": True, "clientTimeoutInMills": MODEL_DEADLINE_MS},
        PRIORITIES: {"continuousBatching": True}}
    # each with TorchServe's default queue of 100, the server's here, over the archive's own
    archives = {version: archive_with_version(store, f"{MODEL}-1.0.mar", version,
                                              frontend_changes={**changes, "jobQueueSize": WIDE_QUEUE})
                for version, changes in frontends.items()}
    servers = started_server(tmp_path_factory.mktemp("queued"), store, load_models="")
    with fork_server_of_its_own():       # the frontend's environment is set at its start
        server = next(servers)
    try:
        client = server.client(timeout_s=60)   # a register answers once the archive is read
        for archive in archives.values():      # the four workers start side by side
            client.register(archive, batch_size=8, max_batch_delay_ms=AN_HOUR_MS, initial_workers=1,
                            response_timeout_s=120, startup_timeout_s=240)
        for version in archives:
            wait_for_workers(client, MODEL, version, 1, 300)
        client.set_default(MODEL, QUEUED)
        yield server
    finally:
        servers.close()                        # stops it


def post(server: TorchServeInstance, body: bytes, version: str = QUEUED,
         headers: dict[str, str] | None = None, timeout_s: float = 60) -> requests.Response:
    return requests.post(f"{server.inference_url}/predictions/{MODEL}/{version}", data=body,
                         timeout=timeout_s,
                         headers={"Content-Type": "application/octet-stream", **(headers or {})})


def test_the_frontend_runs_the_agents_batching_for_the_archive_that_asks_for_it(queued_server):
    described = {v["modelVersion"]: v for v in queued_server.client().describe(MODEL, "all")}
    assert described[QUEUED]["continuousBatching"] is True
    assert described[DELAYED]["continuousBatching"] is False
    assert "-javaagent:" in queued_server.effective_config.read_text()
    log = "\n".join(log_lines(queued_server.log_dir / "ts_log.log"))
    assert f"queued batching for {MODEL} (batch size 8, deadline 0 ms)" in log
    assert f"queued batching for {MODEL} (batch size 8, deadline {MODEL_DEADLINE_MS} ms)" in log
    # and each worker, forked by the fork server, knows its frontend and that it runs the agent
    described = queued_server.client().describe(MODEL, QUEUED, customized=True)[0]
    assert described["customizedMetadata"]["batching"]["frontend_agent"] is True
    assert described["customizedMetadata"]["frontend"]["pid"] == frontend_pid(queued_server)
    worker_pid = described["workers"][0]["pid"]
    fork_server = psutil.Process(int(worker_pid)).parent()
    assert fork_server.pid != frontend_pid(queued_server)
    assert "--owner-pid-file" in fork_server.cmdline()     # the one started beside the frontend


def test_a_lone_request_runs_at_once_whatever_the_batch_delay(queued_server):
    """With TorchServe's batching the same request would wait the hour for company."""
    answer = post(queued_server, photo_bytes("chelsea.png"), timeout_s=60)
    assert answer.status_code == 200, answer.text
    assert answer.headers["X-Batch-Size"] == "1"
    assert answer.json()[0]["label"] in CAT_LABELS
    with pytest.raises(requests.Timeout):
        post(queued_server, photo_bytes("chelsea.png"), version=DELAYED, timeout_s=5)


def test_requests_queued_behind_a_busy_worker_share_its_next_batch(queued_server):
    """Sent while slow PNGs keep the worker busy, the burst queues behind them and shares its
    next batches. Each gets its own answer and options; a bad upload among them fails alone."""
    replies = burst_with_one_bad_upload(lambda body, headers: post(queued_server, body, headers=headers),
                                        benchmark_jpeg("phone"))
    batch_sizes = [int(a.headers["X-Batch-Size"]) for a in replies]
    assert max(batch_sizes) > 1 and max(batch_sizes) <= 8


def test_the_describe_job_travels_alone_between_predictions(queued_server):
    """TorchServe's describe job (`?customized=true`) queued among predictions: answered once,
    alone, and the predictions around it each get theirs."""
    photo = benchmark_jpeg("phone")
    client = queued_server.client()
    described: list[dict] = []

    def describe() -> int:
        described.extend(client.describe(MODEL, QUEUED, customized=True))
        return 200

    calls: list[Callable[[], int]] = [lambda: post(queued_server, photo).status_code] * 6
    calls.insert(3, describe)
    assert concurrently(calls, len(calls)) == [200] * 7
    assert described[0]["customizedMetadata"]["v2"]["inputs"][0]["name"] == "image"
    assert post(queued_server, photo_bytes("coffee.png")).json()[0]["label"] == "espresso"


def logged_batches(server: TorchServeInstance, version: str, since: float) -> list[dict]:
    """The `batch` log records of `version` whose batch began at `since` (time.time()) or later."""
    records = batch_records(log_lines(server.log_dir / "model_log.log"), since)
    return [record for record in records if record["version"] == version]


def computed_requests(server: TorchServeInstance, version: str, since: float) -> int:
    """Requests the handler of `version` took into batches begun since `since`."""
    return sum(batch["size"] for batch in logged_batches(server, version, since))


def expired_count(server: TorchServeInstance, version: str, metric: str = EXPIRED) -> float:
    return total(scrape(server.metrics_url), metric, model_name=MODEL, model_version=version)


def test_a_request_past_its_deadline_is_answered_504_and_never_reaches_the_handler(queued_server):
    """SLOW_BUSY slow PNGs keep the worker busy for a few batches; a request with a deadline of
    1 ms sent behind them waits at least a batch: 504 with a JSON error, absent from the
    handler's batches, counted; a request without a deadline sent with it is answered."""
    client = queued_server.client()
    since = time.time()
    expired_before = expired_count(queued_server, QUEUED)

    def pending() -> int:
        return int(client.describe(MODEL, QUEUED)[0]["jobQueueStatus"]["pendingRequests"])

    with ThreadPoolExecutor(max_workers=SLOW_BUSY) as pool:
        busy = [pool.submit(post, queued_server, slow_png()) for _ in range(SLOW_BUSY)]
        # A batch runs and the next one is queued: what is sent now waits at least a batch.
        wait_until(lambda: pending() >= 8, 60, "8 queued requests", interval_s=0.005)
        expired, fresh = concurrently([
            lambda: post(queued_server, photo_bytes("chelsea.png"), headers={"X-Request-Timeout-Ms": "1"}),
            lambda: post(queued_server, photo_bytes("chelsea.png"))], 2)
        assert [reply.result().status_code for reply in busy] == [200] * SLOW_BUSY
    assert expired.status_code == 504, expired.text
    assert expired.headers["Content-Type"].startswith("application/json")
    assert expired.json()["type"] == "DeadlineExceeded" and "1 ms" in expired.json()["message"]
    assert fresh.status_code == 200 and fresh.json()[0]["label"] in CAT_LABELS
    wait_for_log(queued_server.log_dir / "model_log.log",
                 lambda lines: computed_requests(queued_server, QUEUED, since) >= SLOW_BUSY + 1)
    assert computed_requests(queued_server, QUEUED, since) == SLOW_BUSY + 1    # not the expired one
    assert expired_count(queued_server, QUEUED) == expired_before + 1


def test_bad_deadline_headers_get_a_400_each_and_their_batch_mates_are_answered(queued_server):
    bad_values = ["soon", "0", "-5", "1.5", "+20", ""]
    headers = [{"X-Request-Timeout-Ms": value} for value in bad_values]
    headers.insert(3, {"x-request-timeout-ms": "60000"})
    replies = concurrently([partial(post, queued_server, photo_bytes("chelsea.png"), headers=h)
                            for h in headers], len(headers))
    good = replies.pop(3)
    assert good.status_code == 200 and good.json()[0]["label"] in CAT_LABELS
    for value, reply in zip(bad_values, replies, strict=True):
        assert reply.status_code == 400, (value, reply.text)
        assert reply.json()["type"] == "InvalidRequestTimeout", reply.text
    assert ping(queued_server)


def pending_requests(server: TorchServeInstance, version: str) -> int:
    return int(server.client().describe(MODEL, version)[0]["jobQueueStatus"]["pendingRequests"])


def test_a_high_priority_request_is_taken_before_the_normal_ones_queued_ahead_of_it(queued_server):
    """SLOW_BUSY_FOR_PRIORITY slow PNGs keep the one worker busy for a few batches; a request
    with `X-Request-Priority: high` sent while two batches' worth are queued joins the next
    batch, so it is answered before normal requests that were queued before it. A bad priority
    is a 400 for that request alone."""
    finished: dict[str, float] = {}

    def timed(name: str, headers: dict[str, str] | None = None) -> requests.Response:
        reply = post(queued_server, slow_png() if name != "high" else photo_bytes("chelsea.png"),
                     version=PRIORITIES, headers=headers)
        finished[name] = time.monotonic()
        return reply

    with ThreadPoolExecutor(max_workers=SLOW_BUSY_FOR_PRIORITY) as pool:
        normal = [pool.submit(timed, f"normal {index}") for index in range(SLOW_BUSY_FOR_PRIORITY)]
        wait_until(lambda: pending_requests(queued_server, PRIORITIES) >= 16, 60, "16 queued requests",
                   interval_s=0.005)
        high, bad = concurrently([partial(timed, "high", {"X-Request-Priority": "HIGH"}),
                                  partial(timed, "bad", {"X-Request-Priority": "urgent"})], 2)
        assert [reply.result().status_code for reply in normal] == [200] * SLOW_BUSY_FOR_PRIORITY
    assert high.status_code == 200 and high.json()[0]["label"] in CAT_LABELS
    assert bad.status_code == 400 and bad.json()["type"] == "InvalidRequestPriority", bad.text
    later = [name for name, at in finished.items() if name.startswith("normal") and at > finished["high"]]
    assert len(later) >= 8, finished


def test_while_high_priority_requests_come_the_oldest_normal_ones_are_shed_to_keep_room(queued_server):
    """After a high-priority request, a burst of 90 normal ones (3 MP slow PNGs, about 50 ms of a
    core each) fills more than half of the queue (TorchServe's job_queue_size, 100, here): the
    oldest beyond half are answered 503 with Retry-After 1 and a JSON error, counted; every other
    request is answered, and only those were computed."""
    queue = queued_server.client().describe(MODEL, PRIORITIES)[0]["jobQueueStatus"]
    assert queue["remainingCapacity"] + queue["pendingRequests"] == WIDE_QUEUE
    photo = slow_png(2000, 1500)
    since = time.time()
    shed_before = expired_count(queued_server, PRIORITIES, SHED_FOR_PRIORITY)
    assert post(queued_server, photo, version=PRIORITIES, headers={"X-Request-Priority": "high"}).ok
    replies = concurrently([partial(post, queued_server, photo, version=PRIORITIES)] * 90, 90)
    statuses = [reply.status_code for reply in replies]
    assert set(statuses) <= {200, 503}, statuses
    shed = [reply for reply in replies if reply.status_code == 503]
    assert shed, "the queue never held more than half its size"
    for reply in shed:
        assert reply.headers["Retry-After"] == "1" and reply.json()["type"] == "ServiceUnavailable"
    answered = statuses.count(200) + 1
    wait_for_log(queued_server.log_dir / "model_log.log",
                 lambda lines: computed_requests(queued_server, PRIORITIES, since) >= answered)
    assert computed_requests(queued_server, PRIORITIES, since) == answered
    assert expired_count(queued_server, PRIORITIES, SHED_FOR_PRIORITY) == shed_before + len(shed)


def batch_times_ms(server: TorchServeInstance, version: str, since: float) -> list[float]:
    """The handler's own time for each batch of `version` begun since `since` (`batch_ms`)."""
    return [batch["batch_ms"] for batch in logged_batches(server, version, since)]


def batch_logged(server: TorchServeInstance, version: str, since: float, lines: list[str]) -> bool:
    """Whether a batch of `version` begun since `since` was logged (for wait_for_log)."""
    return bool(batch_times_ms(server, version, since))


def slow_instances(count: int) -> bytes:
    """A KServe v1 body of `count` slow PNGs (one request: one batch of its own)."""
    image = base64.b64encode(slow_png(4000, 3000)).decode()
    return json.dumps({"instances": [{"data": image}] * count}).encode()


def request_slower_than(server: TorchServeInstance, floor_ms: float) -> bytes:
    """A request whose batch takes the handler at least `floor_ms` on this machine, found by
    sending 1, 2, 4 ... slow PNGs in one request to version 1.0-queued (the same archive and
    worker settings as 1.0-deadline) until one batch of them took that long: how fast the CPU is
    decides how many, never whether the test holds."""
    for count in (1, 2, 4, 8, 16):          # 16: the archive's limits.max_images_per_request
        body = slow_instances(count)
        since = time.time()
        assert post(server, body, headers={"Content-Type": "application/json"}).ok
        wait_for_log(server.log_dir / "model_log.log", partial(batch_logged, server, QUEUED, since))
        if max(batch_times_ms(server, QUEUED, since)) >= floor_ms:
            return body
    raise AssertionError(f"16 slow PNGs in one batch took under {floor_ms} ms")


def test_the_models_deadline_applies_without_a_header_and_caps_a_longer_one(queued_server):
    """Version 1.0-deadline (MODEL_DEADLINE_MS). Its fresh worker has no batch time yet, so its
    first request is taken into a batch and answered, after its deadline passed (TorchServe
    itself would drop that answer): a request of slow PNGs measured beforehand to take four
    deadlines. From then on a batch is known to take longer than the deadline: a request without
    a header, one asking for an hour (capped by the model's deadline) and one asking for less
    are each answered 504 at once and never computed, and counted; describe reports the
    deadline."""
    client = queued_server.client()
    assert client.describe(MODEL, WITH_DEADLINE)[0]["clientTimeoutInMills"] == MODEL_DEADLINE_MS
    slow = request_slower_than(queued_server, 4 * MODEL_DEADLINE_MS)
    photo = benchmark_jpeg("phone")
    since = time.time()
    expired_before = expired_count(queued_server, WITH_DEADLINE)

    first = post(queued_server, slow, version=WITH_DEADLINE, headers={"Content-Type": "application/json"})
    assert first.status_code == 200, first.text
    wait_for_log(queued_server.log_dir / "model_log.log",
                 partial(batch_logged, queued_server, WITH_DEADLINE, since))
    assert batch_times_ms(queued_server, WITH_DEADLINE, since)[0] > MODEL_DEADLINE_MS
    for headers in ({}, {"X-Request-Timeout-Ms": str(AN_HOUR_MS)}, {"X-Request-Timeout-Ms": "5"}):
        reply = post(queued_server, photo, version=WITH_DEADLINE, headers=headers)
        assert reply.status_code == 504 and reply.json()["type"] == "DeadlineExceeded", (headers, reply.text)
        deadline_ms = 5 if headers.get("X-Request-Timeout-Ms") == "5" else MODEL_DEADLINE_MS
        assert f"deadline of {deadline_ms} ms" in reply.json()["message"], reply.text
    wait_for_log(queued_server.log_dir / "model_log.log",
                 lambda lines: computed_requests(queued_server, WITH_DEADLINE, since) >= 1)
    assert computed_requests(queued_server, WITH_DEADLINE, since) == 1
    assert expired_count(queued_server, WITH_DEADLINE) == expired_before + 3


def test_scaling_and_unregistering_work(queued_server, model_store: Path):
    client = queued_server.client()
    client.scale(MODEL, QUEUED, 2, 2)
    wait_for_workers(client, MODEL, QUEUED, 2, 300)
    answers = concurrently([lambda: post(queued_server, photo_bytes("chelsea.png"))] * 8, 8)
    assert [a.status_code for a in answers] == [200] * 8
    client.scale(MODEL, QUEUED, 1, 1)
    wait_for_workers(client, MODEL, QUEUED, 1, 300)
    client.set_default(MODEL, DELAYED)
    client.unregister(MODEL, QUEUED)
    client.unregister(MODEL, WITH_DEADLINE)
    client.unregister(MODEL, PRIORITIES)
    assert [v["modelVersion"] for v in client.describe(MODEL, "all")] == [DELAYED]
    assert ping(queued_server)
