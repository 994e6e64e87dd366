"""Shadow traffic, off the request path: a copy of a share of the requests the stable version
answers goes to the candidate version, and the two answers are compared.

`offer` runs after a batch's answers are computed, in the worker's request thread: for each
answered request it draws against the policy's percent and puts a copy (image bytes, the
headers that carry its options, production's answer) on a bounded queue without waiting; a full
queue drops the copy and counts it. A daemon thread sends the copies one at a time to
`/predictions/{model}/{candidate}` with `Cache-Control: no-store` (the candidate's response
cache is neither read nor filled) and `X-Shadow-Of: {stable version}` (such a request is never
mirrored again), compares the candidate's answer with production's (the handler's comparer,
handlers.shadow.answer_comparison) and exports the result as metrics (handlers.batch_metrics).
Production's answer is already on its way: a slow, failing or absent candidate costs it nothing
but the copy.

Only what can be replayed exactly is mirrored: a request with one image (not KServe v1
`instances` nor an Open Inference Protocol request) whose options all come from its headers;
the others are counted as skipped.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from handlers.batch.batch_record import BatchRecord
from handlers.batch.batch_stage import BatchStage
from handlers.batch.request_slot import RequestSlot
from handlers.shadow.answer_comparison import Comparer
from handlers.shadow.shadow_metrics import emit_shadow_comparison, emit_shadow_dropped
from handlers.shadow.shadow_policy import (
    TRAFFIC_DIR_ENVIRONMENT,
    PolicyFile,
    ShadowPolicy,
    policy_path,
)

logger = logging.getLogger(__name__)

SHADOW_OF_HEADER = "X-Shadow-Of"
# Distinct (production label, candidate label) pairs a worker exports as their own series; the
# rest are counted as ("other", "other"), so the metric's label cardinality stays bounded.
MAX_FLIP_PAIRS = 100
# Request headers not replayed: the copy sets its own body, connection and authorization.
NOT_REPLAYED = frozenset({"host", "content-length", "content-type", "transfer-encoding",
                          "connection", "keep-alive", "expect", "authorization", "cache-control",
                          "x-request-id", SHADOW_OF_HEADER.lower()})


@dataclass(frozen=True)
class MirroredRequest:
    image: bytes
    headers: Mapping[str, str]
    answer: Any
    policy: ShadowPolicy
    metrics: Any            # the worker's TorchServe metrics cache (None in unit tests)


def is_shadow_copy(slot: RequestSlot) -> bool:
    return slot.header(SHADOW_OF_HEADER) is not None


def replayed_headers(all_headers: Mapping[str, Any]) -> dict[str, str]:
    """The request's HTTP headers worth replaying. TorchServe mixes each body part's content type
    into the same map, as `{part name: {"content-type": ...}}`: not headers, not replayed."""
    return {name: value for name, value in all_headers.items()
            if isinstance(value, str) and name.lower() not in NOT_REPLAYED}


def inference_key(key_file: str | None) -> str | None:
    """TorchServe's current inference key (its key file is rewritten when keys are renewed)."""
    if key_file is None:
        return None
    return str(json.loads(Path(key_file).read_text(encoding="utf-8"))["inference"]["key"])


class ShadowStage(BatchStage):
    """Mirrors a share of `model` `version`'s answered requests to the candidate its policy file
    names, when that policy's stable version is this one. `compare(production, candidate)` is
    the model kind's comparer; `replayable(slot)` says whether the slot's options all come from
    its headers."""

    name = "Shadow"

    def __init__(self, model: str, version: str, policy_file: PolicyFile, compare: Comparer,
                 replayable: Callable[[RequestSlot], bool],
                 draw: Callable[[], float] = random.random) -> None:
        self.model, self.version = model, version
        self.policy_file = policy_file
        self.compare = compare
        self.replayable = replayable
        self.draw = draw
        # one queue and one sender for the worker's life, started with the first copy; the
        # bound is the policy's queue_size, checked when a copy is offered
        self.copies: queue.SimpleQueue[MirroredRequest] = queue.SimpleQueue()
        self.sender: threading.Thread | None = None
        self.counts = {"mirrored": 0, "compared": 0, "dropped": 0}
        self.flip_pairs: set[tuple[str, str]] = set()

    def active_policy(self) -> ShadowPolicy | None:
        policy = self.policy_file.current()
        if policy is None or (policy.model, policy.stable_version) != (self.model, self.version):
            return None
        return policy

    def answered(self, slots: Sequence[RequestSlot], computed: Sequence[RequestSlot],
                 record: BatchRecord, metrics: Any) -> None:
        self.offer(slots)

    def offer(self, slots: Sequence[RequestSlot]) -> None:
        """Queue copies of a share of `slots`' answered requests (never waits)."""
        policy = self.active_policy()
        if policy is None:
            return
        for slot in slots:
            if slot.error is not None or slot.parsed is None or is_shadow_copy(slot):
                continue
            if self.draw() * 100 >= policy.percent:
                continue
            metrics = slot.context.metrics
            reason = self.unreplayable_reason(slot)
            if reason is not None:
                self.drop(metrics, policy, reason)
                continue
            headers = replayed_headers(slot.context.get_all_request_header(slot.index))
            self.enqueue(MirroredRequest(slot.parsed.images[0], headers, slot.answer, policy,
                                         metrics))

    def unreplayable_reason(self, slot: RequestSlot) -> str | None:
        assert slot.parsed is not None
        if slot.v2 is not None:
            return "OpenInferenceProtocol"
        if slot.parsed.several:
            return "SeveralImages"
        if not self.replayable(slot):
            return "OptionsInBody"
        return None

    def enqueue(self, copy: MirroredRequest) -> None:
        if self.copies.qsize() >= copy.policy.queue_size:
            # only this (request) thread adds copies, so the queue cannot grow past the bound
            self.drop(copy.metrics, copy.policy, "QueueFull")
            return
        if self.sender is None:
            self.sender = threading.Thread(target=self.send_forever, name="shadow-sender",
                                           daemon=True)
            self.sender.start()
        self.copies.put(copy)
        self.counts["mirrored"] += 1

    def drop(self, metrics: Any, policy: ShadowPolicy, reason: str) -> None:
        self.counts["dropped"] += 1
        emit_shadow_dropped(metrics, self.model, policy.candidate_version, reason)

    def send_forever(self) -> None:
        connection: http.client.HTTPConnection | None = None
        while True:
            copy = self.copies.get()
            if self.policy_file.policy != copy.policy:
                # the policy changed or ended since the copy was made (the request thread looks
                # at the file before every batch): the copy is not sent, so turning the shadow off
                # stops the candidate's work at once
                self.drop(copy.metrics, copy.policy, "PolicyChanged")
                continue
            try:
                connection = connection or open_connection(copy.policy)
                started = time.perf_counter()
                status, body = send_copy(connection, copy, self.version)
                candidate_ms = (time.perf_counter() - started) * 1000
            except (OSError, http.client.HTTPException, ValueError, KeyError) as error:
                logger.warning("shadow copy to %s not answered: %s", copy.policy.candidate_url, error)
                connection = None
                self.drop(copy.metrics, copy.policy, "CandidateUnreachable")
                continue
            except Exception:
                logger.exception("shadow copy to %s failed", copy.policy.candidate_url)
                connection = None
                self.drop(copy.metrics, copy.policy, "ShadowFault")
                continue
            self.record(copy, status, body, candidate_ms)

    def record(self, copy: MirroredRequest, status: int, body: bytes, candidate_ms: float) -> None:
        if status != 200:
            self.drop(copy.metrics, copy.policy, "CandidateError")
            return
        try:
            comparison = self.compare(copy.answer, json.loads(body))
        except (ValueError, KeyError, TypeError, IndexError):
            self.drop(copy.metrics, copy.policy, "CandidateAnswerUnreadable")
            return
        self.counts["compared"] += 1
        if comparison.flip is not None and comparison.flip not in self.flip_pairs:
            if len(self.flip_pairs) < MAX_FLIP_PAIRS:
                self.flip_pairs.add(comparison.flip)
            else:
                comparison = replace(comparison, flip=("other", "other"))
        emit_shadow_comparison(copy.metrics, self.model, copy.policy.candidate_version,
                               comparison, candidate_ms)

    def describe(self) -> dict[str, Any]:
        """What `describe` shows: the policy file, the policy this version follows (None: it is
        not the stable version of one), and this worker's counts."""
        policy = self.active_policy()
        return {"policy_file": str(self.policy_file.path), "error": self.policy_file.error,
                "policy": policy.to_json() if policy is not None else None,
                "queued": self.copies.qsize(), **self.counts}


def open_connection(policy: ShadowPolicy) -> http.client.HTTPConnection:
    parts = urlsplit(policy.candidate_url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return kind(parts.netloc, timeout=policy.timeout_s)


def send_copy(connection: http.client.HTTPConnection, copy: MirroredRequest,
              stable_version: str) -> tuple[int, bytes]:
    headers = {**copy.headers, "Content-Type": "application/octet-stream",
               "Cache-Control": "no-store", SHADOW_OF_HEADER: stable_version}
    key = inference_key(copy.policy.key_file)
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    connection.request("POST", urlsplit(copy.policy.candidate_url).path, body=copy.image,
                       headers=headers)
    response = connection.getresponse()
    return response.status, response.read()


def shadow_stage_for(model: str, version: str, compare: Comparer,
                     replayable: Callable[[RequestSlot], bool],
                     environment: Mapping[str, str] = os.environ) -> ShadowStage | None:
    """The worker's shadow stage, reading `<TSV_TRAFFIC_DIR>/<model>.json`; None when the server
    was started without a traffic directory (then no version of it can be shadowed)."""
    traffic_dir = environment.get(TRAFFIC_DIR_ENVIRONMENT, "").strip()
    if not traffic_dir:
        return None
    return ShadowStage(model, version, PolicyFile(policy_path(Path(traffic_dir), model)), compare,
                       replayable)
