"""The response cache on a real TorchServe with a real Redis: a repeat answered from the worker's
memory, hits shared between workers through Redis, bypass, metrics, a Redis killed in the
middle of continuous load costing no request, and two versions of a model sharing one Redis
never answering with each other's answers."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.images import photo_bytes
from tests.redis_server import RedisServer, redis_server
from tests.server.candidate_archives import reversed_labels_copy
from tests.server.http_client import concurrently, session
from torchserve_vision.archives.versions import archive_with_version
from torchserve_vision.lab.compare import register, unregister_all
from torchserve_vision.lab.loadgen import LoadTarget, run_closed_loop
from torchserve_vision.model_descriptions import ServingSettings
from torchserve_vision.rollout import wait_for_workers
from torchserve_vision.server_process import TorchServeInstance
from torchserve_vision.server_state import versions_of
from torchserve_vision.waiting import wait_until

pytestmark = pytest.mark.server
PHOTOS = ["chelsea.png", "coffee.png", "rocket.jpg", "astronaut.png", "motorcycle_left.png"]
# The Redis-kill test: answers before Redis is killed, requests sent after it (computed)
ANSWERED_BEFORE_THE_KILL, SENT_AFTER_THE_KILL = 20, 40
MEMORY, SHARED = "cache_memory", "cache_redis"


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def cached(server: TorchServeInstance, model_store: Path, redis: RedisServer) -> Iterator[TorchServeInstance]:
    """Copies of the classifier archive with a cache: in-worker only (1 worker), and Redis only
    (memory tier off, 2 workers: every hit comes from Redis), unregistered afterwards."""
    client = server.client()
    memory = archive_with_version(model_store, "efficientnet_lite0-1.0.mar", "cache-memory",
                                  {"cache": {"memory_bytes": 8_000_000}})
    shared = archive_with_version(model_store, "efficientnet_lite0-1.0.mar", "cache-redis",
                                  {"cache": {"memory_bytes": 0, "redis_url": redis.url,
                                             "redis_timeout_ms": 50, "breaker_errors": 2,
                                             "breaker_open_s": 1}})
    register(client, model_store, memory, MEMORY, ServingSettings(8, 5, 1, 1))
    register(client, model_store, shared, SHARED, ServingSettings(8, 5, 2, 2))
    try:
        yield server
    finally:
        for name in (MEMORY, SHARED):
            unregister_all(client, name)


def post(server: TorchServeInstance, model: str, image: bytes,
         headers: dict[str, str] | None = None) -> requests.Response:
    return session().post(f"{server.inference_url}/predictions/{model}", data=image,
                          headers=headers or {}, timeout=60)


def test_a_repeat_is_a_hit_with_the_same_answer_and_bypass_skips_the_cache(cached):
    server = cached
    image = photo_bytes("coffee.png")
    first = post(server, MEMORY, image)
    again = post(server, MEMORY, image)
    assert (first.headers["X-Cache"], again.headers["X-Cache"]) == ("miss", "hit")
    assert again.json() == first.json()
    assert first.json()[0]["index"] == post(server, "efficientnet_lite0", image).json()[0]["index"]
    bypass = post(server, MEMORY, image, {"Cache-Control": "no-cache"})
    assert bypass.headers["X-Cache"] == "bypass" and bypass.json()[0]["index"] == first.json()[0]["index"]
    assert "X-Cache" not in post(server, "efficientnet_lite0", image).headers  # not configured
    text = requests.get(f"{server.metrics_url}/metrics", timeout=30).text
    hits = re.findall(rf'^HandlerCacheMemoryHits\{{.*ModelName="{MEMORY}".*\}} (\S+)$', text, re.M)
    assert hits and float(hits[0]) >= 1


def test_workers_share_hits_through_redis(cached, redis):
    server = cached
    images = [photo_bytes(name) for name in PHOTOS]
    misses = concurrently([functools.partial(post, server, SHARED, image) for image in images], 5)
    assert {reply.headers["X-Cache"] for reply in misses} == {"miss"}
    assert len(redis.client().keys("tsv:*")) == len(PHOTOS)
    repeats = concurrently([functools.partial(post, server, SHARED, image) for image in images * 4], 10)
    assert {reply.headers["X-Cache"] for reply in repeats} == {"hit"}  # memory tier is off
    for reply, first in zip(repeats, misses * 4, strict=True):
        assert reply.json() == first.json()


def test_a_redis_killed_under_load_fails_no_request_and_hits_resume_when_it_is_back(cached, redis):
    server = cached
    bodies = [photo_bytes(name) for name in PHOTOS]
    target = LoadTarget(f"{server.inference_url}/predictions/{SHARED}", bodies)

    def kill_redis_at(answered: int) -> None:
        # Called under the load's lock: the clients wait while Redis is killed, so all but the
        # requests then in flight (one a client) are sent once it is gone.
        if answered == ANSWERED_BEFORE_THE_KILL:
            redis.kill()

    # ends on the request count; its duration only bounds how long a broken run hangs
    report = run_closed_loop(target, clients=4, duration_s=300, progress=kill_redis_at,
                             max_requests=ANSWERED_BEFORE_THE_KILL + SENT_AFTER_THE_KILL)
    assert report.sent >= ANSWERED_BEFORE_THE_KILL + SENT_AFTER_THE_KILL, report.table()
    assert report.succeeded == report.sent, report.errors
    assert post(server, SHARED, bodies[0]).headers["X-Cache"] == "miss"  # computed, Redis down
    redis.start()
    # Once the breaker's pause is over, an answer is stored again and its repeat is a hit.
    wait_until(lambda: post(server, SHARED, bodies[1]).headers["X-Cache"] == "hit", 30,
               "hits after Redis came back", interval_s=0.5)
    text = requests.get(f"{server.metrics_url}/metrics", timeout=30).text
    errors = re.findall(rf'^HandlerCacheRedisErrors\{{.*ModelName="{SHARED}".*\}} (\S+)$', text, re.M)
    assert errors and float(errors[0]) >= 1


def test_two_versions_sharing_one_redis_never_answer_with_each_others_answers(
        cached, model_store, redis):
    """A candidate beside the served version (a canary, a shadow) whose answers differ: its class
    names reversed, the same Redis. Each version's repeat is a hit with its own answer, never the
    other's."""
    client = cached.client()
    served = versions_of(client, SHARED)[0]
    renamed = reversed_labels_copy(model_store, served["modelUrl"], "cache-redis-renamed")
    client.call("POST", "/models", {"url": renamed, "model_name": SHARED, "batch_size": 8,
                                    "max_batch_delay": 5, "initial_workers": 1,
                                    "synchronous": "false"})
    wait_for_workers(client, SHARED, "cache-redis-renamed", 1, 300)
    image = photo_bytes("chelsea.png")
    try:
        rounds = [{version: post(cached, f"{SHARED}/{version}", image)
                   for version in (served["modelVersion"], "cache-redis-renamed")} for _ in range(2)]
    finally:
        client.unregister(SHARED, "cache-redis-renamed")
    first, again = rounds
    assert first[served["modelVersion"]].json()[0]["label"] != first["cache-redis-renamed"].json()[0]["label"]
    for version, answer in again.items():
        assert answer.headers["X-Cache"] == "hit" and answer.headers["X-Model-Version"] == version
        assert answer.json() == first[version].json()
