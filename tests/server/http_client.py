"""Small HTTP helpers for real-server tests: one keep-alive session per thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import requests

from tests.images import CAT_LABELS, slow_png

_local = threading.local()
T = TypeVar("T")


def session() -> requests.Session:
    if not hasattr(_local, "session"):
        _local.session = requests.Session()
    return _local.session


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any
    batch_size: int | None


def post_image(url: str, image: bytes, content_type: str = "application/octet-stream") -> Reply:
    answer = session().post(url, data=image, headers={"Content-Type": content_type}, timeout=120)
    batch_size = answer.headers.get("X-Batch-Size")
    return Reply(answer.status_code, answer.json(), int(batch_size) if batch_size else None)


def concurrently(calls: Sequence[Callable[[], T]], clients: int) -> list[T]:
    """Run the calls from `clients` threads at once; replies in call order."""
    with ThreadPoolExecutor(max_workers=clients) as pool:
        return list(pool.map(lambda call: call(), calls))


BURST_REQUESTS, KEEP_BUSY = 16, 4     # burst_with_one_bad_upload's requests and slow PNGs


def burst_with_one_bad_upload(send: Callable[[bytes, dict[str, str]], requests.Response],
                              photo: bytes, keep_busy: int = KEEP_BUSY) -> list[requests.Response]:
    """15 concurrent requests of `photo` asking top_k 1, 2, 3 in turn, with one that is not an
    image among them: each answered with its own top_k, the bad one refused alone (400
    NotAnImage). Sent right after `keep_busy` slow PNGs (tests.images.slow_png, answered 200),
    which keep a worker busy while the burst arrives, so that it queues and shares batches
    however slowly the client uploads. Returns every reply of the burst, the refused one last."""
    calls = [partial(send, photo, {"X-Top-K": str(k)}) for k in (1, 2, 3) * 5]
    calls.insert(7, partial(send, b"not an image", {"X-Top-K": "1"}))
    assert len(calls) == BURST_REQUESTS
    with ThreadPoolExecutor(max_workers=max(keep_busy, 1)) as pool:
        busy = [pool.submit(send, slow_png(), {}) for _ in range(keep_busy)]
        answers = concurrently(calls, len(calls))
        assert [reply.result().status_code for reply in busy] == [200] * keep_busy
    bad = answers.pop(7)
    assert bad.status_code == 400 and bad.json()["type"] == "NotAnImage", bad.text
    assert [a.status_code for a in answers] == [200] * 15, \
        [(a.status_code, a.text[:200]) for a in answers if a.status_code != 200]
    assert [len(a.json()) for a in answers] == [1, 2, 3] * 5            # each its own top_k
    assert all(a.json()[0]["label"] in CAT_LABELS for a in answers)
    return [*answers, bad]


# Photos at several sizes for the detector's bursts, and how many copies of each a burst sends.
BURST_PHOTOS = ("astronaut.png", "coffee.png", "rocket.jpg", "motorcycle_left.png", "chelsea.png",
                "motorcycle_right.png")
PHOTO_COPIES, BAD_COPIES = 4, 3             # 6 x 4 photos and 8 x 3 bad payloads: 48 at once


def assert_burst_answers_each_as_alone(url: str, headers: dict[str, str] | None = None,
                                       rounds: int = 2) -> None:
    """`rounds` bursts of 48 simultaneous requests to the detector at `url`: photos (each answered
    alone first) mixed with the bad inputs of tests.images.bad_payloads. Every photo is answered
    200 with its answer alone (the same detections within fp32 rounding), every bad payload its
    own 4xx with a JSON error."""
    from tests.detections import assert_same_detections, rows_from_answer
    from tests.images import bad_payloads, photo_bytes

    extra = headers or {}

    def send(body: bytes, content_type: str) -> requests.Response:
        return requests.post(url, data=body, timeout=180, headers={"Content-Type": content_type, **extra})

    photos = {name: photo_bytes(name) for name in BURST_PHOTOS}
    alone = {}
    for name, body in photos.items():
        reply = send(body, "application/octet-stream")
        assert reply.status_code == 200, reply.text
        alone[name] = reply.json()
    jobs = [(name, body, "application/octet-stream", 200) for name, body in photos.items()] * PHOTO_COPIES
    jobs += [(name, body, kind, status) for name, (body, kind, status) in bad_payloads().items()] * BAD_COPIES
    assert len(jobs) >= 48
    for round_index in range(rounds):
        order = jobs[round_index::2] + jobs[1 - round_index::2]            # interleaved differently
        replies = concurrently([partial(send, body, kind) for _, body, kind, _ in order], len(order))
        for (name, _, _, status), reply in zip(order, replies, strict=True):
            assert reply.status_code == status, (name, reply.status_code, reply.text[:300])
            if status == 200:
                assert_same_detections(reply.json(), rows_from_answer(alone[name]), box_px=0.5, score=1e-4)
            else:
                assert reply.json()["code"] == status and reply.json()["type"], (name, reply.text[:300])
