"""Shadow copies off the request path (handlers/shadow/shadow_stage.py, shadow_policy.py), against
a real HTTP server standing in for the candidate version."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from handlers.batch.request_slot import RequestSlot
from handlers.ground.decoded_requests import ParsedRequest
from handlers.request.inference_protocol import V2Request
from handlers.shadow.answer_comparison import compare_classifications
from handlers.shadow.shadow_policy import (
    PolicyFile,
    ShadowPolicy,
    parse_shadow_policy,
    policy_path,
    write_policy,
)
from handlers.shadow.shadow_stage import SHADOW_OF_HEADER, ShadowStage, shadow_stage_for
from handlers.torchserve_context import header_reader
from tests.recording_metrics import RecordingMetrics
from torchserve_vision.local_handler import LocalContext
from torchserve_vision.waiting import wait_until

PRODUCTION = [{"label": "tabby", "index": 281, "probability": 0.6}]


@dataclass
class Candidate:
    """What the candidate received, and what it answers."""

    received: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)
    answer: Any = field(default_factory=lambda: [{"label": "tabby", "index": 281, "probability": 0.5}])
    status: int = 200
    release: threading.Event = field(default_factory=threading.Event)


@pytest.fixture
def candidate() -> Iterator[tuple[Candidate, str]]:
    state = Candidate()
    state.release.set()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            state.received.append((self.path, dict(self.headers), body))
            state.release.wait()
            payload = json.dumps(state.answer).encode()
            self.send_response(state.status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    # polled every 50 ms (not 500), so that shutdown() returns at once
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield state, f"http://127.0.0.1:{server.server_port}"
    state.release.set()
    server.shutdown()


def policy(url: str, **changes: Any) -> ShadowPolicy:
    fields = {"model": "m", "stable_version": "1.0", "candidate_version": "2.0", "percent": 100.0,
              "inference_url": url, **changes}
    return ShadowPolicy(**fields)


def stage_with(tmp_path: Path, written: ShadowPolicy | None, version: str = "1.0",
               replayable: bool = True) -> ShadowStage:
    path = policy_path(tmp_path, "m")
    if written is not None:
        write_policy(path, written)
    return ShadowStage("m", version, PolicyFile(path), compare_classifications,
                       lambda slot: replayable)


def answered_slots(count: int, headers: dict[str, Any] | None = None) -> list[RequestSlot]:
    context = LocalContext(".", {}, {}, request_headers=[dict(headers or {"X-Top-K": "1"})] * count)
    context.metrics = RecordingMetrics()
    slots = []
    for index in range(count):
        slot = RequestSlot(index, {"body": b"jpeg"}, header_reader(context, index), context)
        slot.parsed = ParsedRequest((f"image {index}".encode(),), options=None)
        slot.answer_with(PRODUCTION)
        slots.append(slot)
    return slots


def hold_first_copy(state: Candidate, stage: ShadowStage, slots: list[RequestSlot]) -> None:
    """Offer `slots`, the candidate holding the first copy (until `state.release` is set)."""
    state.release.clear()
    stage.offer(slots)
    wait_until(lambda: len(state.received) == 1, 10, "the first copy to arrive")


def counters(slots: list[RequestSlot], name: str) -> list[tuple[str, float, dict]]:
    return [call for call in slots[0].context.metrics.counters if call[0] == name]


def test_a_copy_replays_the_image_and_option_headers_and_is_compared(candidate, tmp_path):
    state, url = candidate
    stage = stage_with(tmp_path, policy(url))
    # TorchServe puts each body part's content type among the headers, as a dict
    slots = answered_slots(2, {"X-Top-K": "1", "Authorization": "Bearer user", "Host": "x",
                               "body": {"content-type": "image/jpeg"}})
    stage.offer(slots)
    wait_until(lambda: len(counters(slots, "HandlerShadowCompared")) == 2, 10, "two comparisons")
    assert sorted(body for _, _, body in state.received) == [b"image 0", b"image 1"]
    path, headers, _ = state.received[0]
    assert path == "/predictions/m/2.0"
    assert headers["X-Top-K"] == "1" and headers["Cache-Control"] == "no-store"
    assert headers[SHADOW_OF_HEADER] == "1.0" and "Bearer user" not in headers.values()
    assert headers["Content-Type"] == "application/octet-stream" and "body" not in headers
    agreement = counters(slots, "HandlerShadowAgreement")
    assert [value for _, value, _ in agreement] == [1.0, 1.0]
    assert agreement[0][2] == {"ModelName": "m", "Level": "Model", "Candidate": "2.0"}
    shifts = [value for _, value, _ in counters(slots, "HandlerShadowProbabilityShift")]
    assert shifts == [pytest.approx(0.1)] * 2


def test_a_flip_is_counted_with_both_labels(candidate, tmp_path):
    state, url = candidate
    state.answer = [{"label": "tiger cat", "index": 282, "probability": 0.7}]
    stage = stage_with(tmp_path, policy(url))
    slots = answered_slots(1)
    stage.offer(slots)
    wait_until(lambda: bool(counters(slots, "HandlerShadowFlips")), 10, "a flip")
    (_, value, dimensions), = counters(slots, "HandlerShadowFlips")
    assert value == 1 and (dimensions["From"], dimensions["To"]) == ("tabby", "tiger cat")
    assert [value for _, value, _ in counters(slots, "HandlerShadowAgreement")] == [0.0]


def test_a_full_queue_drops_copies_at_once_and_counts_them(candidate, tmp_path):
    state, url = candidate
    stage = stage_with(tmp_path, policy(url, queue_size=1))
    hold_first_copy(state, stage, answered_slots(1))
    more = answered_slots(5)
    stage.offer(more)                  # one waits in the queue, four are dropped, none waits
    dropped = counters(more, "HandlerShadowDropped")
    assert len(dropped) == 4 and {d["Reason"] for _, _, d in dropped} == {"QueueFull"}
    state.release.set()
    wait_until(lambda: len(state.received) == 2, 10, "the queued copy")


def test_only_the_stable_version_named_by_the_policy_mirrors(candidate, tmp_path):
    state, url = candidate
    for stage in (stage_with(tmp_path / "other", policy(url), version="2.0"),
                  stage_with(tmp_path / "none", None)):
        slots = answered_slots(3)
        stage.offer(slots)
        assert stage.sender is None and stage.copies.qsize() == 0 and slots[0].context.metrics.counters == []
    assert state.received == []


def test_the_percent_is_the_share_of_answered_requests_drawn(candidate, tmp_path):
    state, url = candidate
    draws = iter([0.04, 0.05, 0.5, 0.01])
    stage = ShadowStage("m", "1.0", PolicyFile(policy_path(tmp_path, "m")),
                        compare_classifications, lambda slot: True, draw=lambda: next(draws))
    write_policy(policy_path(tmp_path, "m"), policy(url, percent=5.0))
    slots = answered_slots(4)
    stage.offer(slots)
    wait_until(lambda: len(state.received) == 2, 10, "two copies")
    assert sorted(body for _, _, body in state.received) == [b"image 0", b"image 3"]


def test_what_cannot_be_replayed_exactly_is_skipped_and_counted(candidate, tmp_path):
    state, url = candidate
    slots = answered_slots(4)
    slots[1].v2 = V2Request(id=None)
    slots[2].parsed = ParsedRequest((b"a", b"b"), options=None, several=True)
    stage_with(tmp_path, policy(url), replayable=True).offer(slots[:3])
    stage_with(tmp_path, policy(url), replayable=False).offer(slots[3:])
    reasons = [d["Reason"] for _, _, d in counters(slots, "HandlerShadowDropped")]
    assert reasons == ["OpenInferenceProtocol", "SeveralImages", "OptionsInBody"]
    wait_until(lambda: len(state.received) == 1, 10, "the one replayable copy")


def test_a_copy_is_never_mirrored_again(candidate, tmp_path):
    state, url = candidate
    stage = stage_with(tmp_path, policy(url))
    stage.offer(answered_slots(2, {SHADOW_OF_HEADER: "0.9"}))
    assert stage.sender is None and stage.copies.qsize() == 0 and state.received == []


def test_a_failing_candidate_is_counted_and_never_touches_production(candidate, tmp_path):
    state, url = candidate
    state.status = 500
    slots = answered_slots(1)
    stage_with(tmp_path, policy(url)).offer(slots)
    wait_until(lambda: bool(counters(slots, "HandlerShadowDropped")), 10, "the failure")
    assert counters(slots, "HandlerShadowDropped")[0][2]["Reason"] == "CandidateError"
    assert slots[0].answer == PRODUCTION and slots[0].error is None
    unreachable = answered_slots(1)
    stage_with(tmp_path, policy("http://127.0.0.1:9")).offer(unreachable)
    wait_until(lambda: bool(counters(unreachable, "HandlerShadowDropped")), 10, "the failure")
    assert counters(unreachable, "HandlerShadowDropped")[0][2]["Reason"] == "CandidateUnreachable"


def test_the_policy_file_is_read_again_only_when_it_changed(tmp_path):
    path = policy_path(tmp_path, "m")
    file = PolicyFile(path)
    assert file.current() is None
    write_policy(path, policy("http://x", percent=5.0))
    assert file.current() == policy("http://x", percent=5.0)      # seen at the next look
    stamp = path.stat().st_mtime_ns
    path.write_text("{not json")
    os.utime(path, ns=(stamp, stamp))
    assert file.current() == policy("http://x", percent=5.0)      # same time: not read again
    os.utime(path, ns=(stamp + 1_000_000, stamp + 1_000_000))
    assert file.current() is None and file.error is not None
    path.unlink()
    assert file.current() is None and file.error is None


@pytest.mark.parametrize("bad", [{"percent": 0}, {"percent": 101}, {"candidate_version": "1.0"},
                                 {"queue_size": 0}, {"timeout_s": -1}, {"extra": 1}])
def test_a_bad_policy_is_refused_with_its_reason(bad):
    fields = {**policy("http://x").to_json(), **bad}
    with pytest.raises(ValueError):
        parse_shadow_policy(fields)


def test_workers_shadow_only_on_a_server_with_a_traffic_directory(tmp_path):
    assert shadow_stage_for("m", "1.0", compare_classifications, lambda slot: True, {}) is None
    stage = shadow_stage_for("m", "1.0", compare_classifications, lambda slot: True,
                             {"TSV_TRAFFIC_DIR": str(tmp_path)})
    assert stage is not None and stage.describe()["policy_file"] == str(tmp_path / "m.json")


def test_copies_still_queued_when_the_shadow_ends_are_not_sent(candidate, tmp_path):
    state, url = candidate
    stage = stage_with(tmp_path, policy(url, queue_size=8))
    slots = answered_slots(4)
    hold_first_copy(state, stage, slots)
    policy_path(tmp_path, "m").unlink()
    stage.offer(answered_slots(1))     # the next batch sees the policy gone
    state.release.set()
    wait_until(lambda: len(counters(slots, "HandlerShadowDropped")) == 3, 10, "three drops")
    assert {d["Reason"] for _, _, d in counters(slots, "HandlerShadowDropped")} == {"PolicyChanged"}
    assert len(state.received) == 1
