"""Overload, a killed worker, and stopping the server, on a real TorchServe."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.images import load_photo, photo_bytes, slow_png
from tests.server.load import ContinuousLoad
from tests.server.servers import started_server
from torchserve_vision.deployment_settings import DeploymentSettings
from torchserve_vision.lab.loadgen import LoadTarget, run_closed_loop, run_open_loop
from torchserve_vision.prometheus_text import scrape, total
from torchserve_vision.server_process import TorchServeInstance, ping, stop
from torchserve_vision.server_state import queued_requests
from torchserve_vision.waiting import wait_until

pytestmark = pytest.mark.server
MODEL = "efficientnet_lite0"
QUEUE_SIZE = 16


def url(server: TorchServeInstance) -> str:
    return f"{server.inference_url}/predictions/{MODEL}"


@pytest.fixture(scope="module")
def fault_server(model_store: Path, tmp_path_factory) -> Iterator[TorchServeInstance]:
    """The classifier alone, with a short job queue so that overload is shed quickly."""
    yield from started_server(tmp_path_factory.mktemp("faults"), model_store,
                              load_models="efficientnet_lite0-1.0.mar", job_queue_size=str(QUEUE_SIZE))


def test_overload_is_shed_with_503_and_the_server_recovers(fault_server):
    target = LoadTarget(url(fault_server), [photo_bytes("chelsea.png")])
    run_closed_loop(target, clients=16, duration_s=1.5, max_requests=10_000)  # warm up
    capacity = run_closed_loop(target, clients=16, duration_s=2, max_requests=10_000).throughput_rps
    assert capacity > 1
    # Six times what was served: on a machine whose other work (another test process) took
    # cores while `capacity` was measured and left them during the overload, the server may
    # serve over twice as much then (seen: 16 % shed at three times), still far from six.
    # Four seconds of it: the queue of 16 is full within the first quarter second.
    overload = run_open_loop(target, rate_rps=6 * capacity, duration_s=4, max_requests=100_000, seed=1)
    shed = overload.errors.get("503", 0)
    assert set(overload.errors) <= {"503"}, overload.errors          # no connection errors, no 500s
    assert shed > 0.2 * overload.sent, overload.table()              # about 5/6 cannot be served
    assert overload.succeeded > 0, overload.table()                   # and the rest is served
    # The queue empties once the offered load stops; then every request is served again.
    wait_until(lambda: queued_requests(fault_server.client()) == 0, 60, "an empty job queue")
    recovered = run_closed_loop(target, clients=1, duration_s=2, max_requests=20)
    assert recovered.errors == {} and recovered.succeeded > 0, recovered.table()
    assert ping(fault_server)


def worker_pids(server: TorchServeInstance) -> list[int]:
    description = requests.get(f"{server.management_url}/models/{MODEL}", timeout=30).json()[0]
    return [int(worker["pid"]) for worker in description["workers"] if worker["status"] == "READY"]


def test_a_killed_worker_is_replaced_and_no_request_hangs(fault_server):
    pids = worker_pids(fault_server)
    pid = pids[0]
    with ContinuousLoad(url(fault_server), load_photo(), clients=4) as load:
        load.wait_for(10)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_until(lambda: pid not in worker_pids(fault_server)
                   and len(worker_pids(fault_server)) == len(pids), 90, "a replacement worker",
                   interval_s=0.5)
        replaced_at = time.monotonic()
        load.wait_for(20)
    assert pid not in worker_pids(fault_server) and len(worker_pids(fault_server)) == len(pids)
    assert ping(fault_server)
    served_after = [o for o in load.outcomes if o.sent_at > replaced_at]
    assert served_after and all(o.status == 200 for o in served_after)
    # Requests caught by the crash fail with a server error; none hangs (a request the server
    # never answered would end in the client's timeout, status 0).
    failed = load.failures()
    assert all(o.status >= 500 for o in failed), [o.status for o in failed]
    assert [o for o in load.outcomes if o.sent_at < killed_at and o.status == 200]


def send_burst(server: TorchServeInstance, count: int) -> tuple[list[int], threading.Thread]:
    """`count` concurrent requests of a slow PNG (tests.images.slow_png: about 20 KB to send, a
    full decode of 6 MP to compute): they arrive faster than any CPU computes a batch of them, so
    requests stay queued for a while however fast the machine is."""
    statuses: list[int] = []
    body = slow_png()

    def one() -> None:
        try:
            statuses.append(requests.post(url(server), data=body, timeout=60,
                                          headers={"Content-Type": "image/png"}).status_code)
        except requests.RequestException:
            statuses.append(0)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    def join_all() -> None:
        for thread in threads:
            thread.join()

    waiter = threading.Thread(target=join_all)
    waiter.start()
    return statuses, waiter


@pytest.fixture
def own_server(model_store: Path, tmp_path) -> Iterator[TorchServeInstance]:
    yield from started_server(tmp_path / "run", model_store,
                              load_models="efficientnet_lite0-1.0.mar")


def wait_until_queued(server: TorchServeInstance) -> None:
    """Until requests wait in the queue (so a batch is being computed and more are queued)."""
    wait_until(lambda: queued_requests(server.client()) > 0, 30, "a queued request", interval_s=0.02)


def test_torchserve_stop_drops_requests_in_flight(own_server):
    """What TorchServe 0.12 itself does: `torchserve --stop` closes every connection at once, so
    requests still queued when it stops get no answer (how many depends on timing; at least the
    ones seen queued cannot all have been answered)."""
    statuses, waiter = send_burst(own_server, 24)
    wait_until_queued(own_server)
    stop(own_server, drain_timeout_s=0)
    waiter.join()
    assert len(statuses) == 24 and statuses.count(0) >= 1, statuses
    assert set(statuses) <= {0, 200}, statuses


def test_a_draining_stop_answers_the_requests_in_flight(own_server):
    statuses, waiter = send_burst(own_server, 24)
    wait_until_queued(own_server)
    stop(own_server, drain_timeout_s=30, drain_grace_s=1.0)
    waiter.join()
    assert statuses == [200] * 24
    assert not ping(own_server)


HOLD_MS, MAX_DELAY_MS = 400, 300
DELAY_BOUND = re.compile(rf'Model "{MODEL}" version 1\.0 has a full queue: (\d+) requests are waiting, '
                         rf'about (\d+) ms at its recent pace of (\d+) ms a batch, over the server\'s '
                         rf'max_queueing_delay_ms of {MAX_DELAY_MS} ms; retry after (\d+) s')


@pytest.fixture(scope="module")
def delay_bound_server(model_store: Path, tmp_path_factory) -> Iterator[TorchServeInstance]:
    """The classifier alone, its queue bounded by queueing delay (as the production profile
    bounds it) with each refusal held, one worker."""
    yield from started_server(tmp_path_factory.mktemp("delay-bound"), model_store,
                              load_models="efficientnet_lite0-1.0.mar",
                              settings=DeploymentSettings(workers=1),
                              max_queueing_delay_ms=str(MAX_DELAY_MS), refusal_hold_ms=str(HOLD_MS))


def test_a_queue_bounded_by_delay_refuses_what_would_wait_past_it_and_holds_each_refusal(
        delay_bound_server):
    """24 closed-loop clients with no back-off, sending 12 MP PNGs (tests.images.slow_png: a full
    decode and a resize of 12 MP each, so 16 waiting, two batches of 8, take past the 300 ms
    bound with room to spare), to one worker: a request is refused once the requests ahead of it
    would take longer than max_queueing_delay_ms at the worker's measured pace, the 503 saying so
    with its figures and a Retry-After, and sent no sooner than refusal_hold_ms after the
    request; every request admitted is answered 200; the refusals are counted."""
    server = delay_bound_server
    refused_before = total(scrape(server.metrics_url), "ts_requests_refused_queue_full_total",
                           model_name=MODEL)
    body = slow_png(4000, 3000)
    assert requests.post(url(server), data=body, timeout=60).ok     # the worker's first batch time
    outcomes: list[tuple[int, float, requests.Response]] = []

    def client() -> None:
        session = requests.Session()
        for _ in range(6):
            sent = time.monotonic()
            reply = session.post(url(server), data=body, timeout=120)
            outcomes.append((reply.status_code, time.monotonic() - sent, reply))

    threads = [threading.Thread(target=client) for _ in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    statuses = [status for status, _, _ in outcomes]
    assert set(statuses) == {200, 503}, statuses
    for status, seconds, reply in outcomes:
        if status == 200:
            assert len(reply.json()) == 5
            continue
        found = DELAY_BOUND.search(reply.json()["message"])
        assert found is not None, reply.json()["message"]
        assert int(found.group(2)) > MAX_DELAY_MS and reply.headers["Retry-After"] == found.group(4)
        assert seconds * 1000 >= HOLD_MS            # held: never answered sooner
    refused = total(scrape(server.metrics_url), "ts_requests_refused_queue_full_total", model_name=MODEL)
    assert refused - refused_before == statuses.count(503)
