"""`torchserve-vision server run` as a pod's container runs it: the production config (token
authorization on), settings from the environment, probes on a port of their own, SIGTERM under
load, and a worker crash-loop seen by readiness (not by /ping) and recovered from."""

from __future__ import annotations

import json
import os
import signal
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.images import CAT_LABELS, load_photo, photo_bytes, slow_png
from tests.server.http_client import concurrently
from tests.server.load import ContinuousLoad
from tests.server.logs import wait_for_log
from torchserve_vision import paths
from torchserve_vision.lab.pods import Pod
from torchserve_vision.model_descriptions import load_descriptions
from torchserve_vision.server_process import frontend_pid
from torchserve_vision.server_state import queued_requests
from torchserve_vision.torchserve_config import server_config
from torchserve_vision.waiting import wait_until

pytestmark = pytest.mark.server
MODEL = "efficientnet_lite0"
FAIL_MARKER_VARIABLE = "TSV_TEST_FAIL_WHILE_EXISTS"
FAIL_WHILE_MARKED_HANDLER = f"""
import os

from handlers.image_classifier import ImageClassifierHandler


class FailWhileMarkedClassifier(ImageClassifierHandler):
    def initialize(self, context):
        marker = os.environ.get("{FAIL_MARKER_VARIABLE}")
        if marker and os.path.exists(marker):
            raise RuntimeError("failing on purpose while " + marker + " exists")
        super().initialize(context)
"""


def classifier_description():
    return next(d for d in load_descriptions(paths.MODEL_DESCRIPTIONS) if d.name == MODEL)


@pytest.fixture(scope="module")
def pod_store(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The classifier as built for the session (fast start: ahead-of-time packages), its entry
    module replaced by one that fails to load while a marker file exists."""
    store = tmp_path_factory.mktemp("pod_store")
    name = classifier_description().archive_name
    with zipfile.ZipFile(model_store / name) as old, zipfile.ZipFile(store / name, "w") as new:
        for item in old.infolist():
            data = old.read(item.filename)
            if item.filename == "MAR-INF/MANIFEST.json":
                manifest = json.loads(data)
                manifest["model"]["handler"] = "fail_while_marked_classifier.py"
                data = json.dumps(manifest).encode()
            new.writestr(item, data)
        new.writestr("fail_while_marked_classifier.py", FAIL_WHILE_MARKED_HANDLER)
    return store


def started_pod(pod_store: Path, directory: Path) -> Iterator[Pod]:
    """`server run` with the production config and a deployment's environment (one worker)."""
    config = server_config(directory, pod_store, paths.PRODUCTION_CONFIG,
                           load_models=f"{classifier_description().archive_name}")
    pod = Pod("pod", config, directory / "run", pod_store, drain_delay_s=1.0,
              environment={"TSV_WORKERS": "1", "TSV_TOKEN_AUTHORIZATION": "on",
                           FAIL_MARKER_VARIABLE: str(directory / "fail-marker")})
    with pod.running():
        yield pod


@pytest.fixture(scope="module")
def steady_pod(pod_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    """A pod the tests leave running and ready."""
    yield from started_pod(pod_store, tmp_path_factory.mktemp("steady_pod"))


@pytest.fixture
def pod(pod_store: Path, tmp_path: Path) -> Iterator[Pod]:
    """A pod for one test, which stops it."""
    yield from started_pod(pod_store, tmp_path)


def inference_url(pod: Pod) -> str:
    return f"{pod.instance.inference_url}/predictions/{MODEL}"


def test_environment_settings_are_applied_and_the_probes_need_no_key(steady_pod: Pod):
    pod = steady_pod
    client = pod.instance.client()
    assert len(client.describe(MODEL, None)[0]["workers"]) == 1       # TSV_WORKERS=1 (config: 2)
    unauthenticated = requests.post(inference_url(pod), data=photo_bytes("chelsea.png"), timeout=30)
    assert unauthenticated.status_code in (400, 401)                  # token authorization on
    assert pod.probe("/ready") == (200, {"ready": True})
    assert pod.probe("/live") == (200, {"live": True})
    assert "from the environment: 1 workers per model, token authorization on" in pod.output()


def test_sigterm_answers_every_accepted_request_and_exits_zero(pod: Pod):
    """A burst queued at SIGTERM is answered in full; then the process exits 0 within its bound.
    Slow PNGs (tests.images.slow_png): they arrive faster than any CPU computes a batch of them,
    so requests are seen queued."""
    headers = {"Content-Type": "image/png", **pod.instance.client().auth_headers("inference")}
    url, image = inference_url(pod), slow_png()
    answers: list[requests.Response] = []
    answered: list[int] = []

    def one_request() -> requests.Response:
        answer = requests.post(url, data=image, headers=headers, timeout=60)
        answered.append(answer.status_code)
        return answer

    def in_the_server() -> int:
        """The burst's requests the server has: answered, in a batch (the frontend agent's count),
        queued, read in that order, against the way a request goes, so that none is counted
        twice (one that moves on between two reads is missed, and counted at the next poll)."""
        client = pod.instance.client()
        done = len(answered)
        in_batch = client.requests_in_batch()
        assert in_batch is not None and (MODEL, "1.0") in in_batch, in_batch
        return done + in_batch[(MODEL, "1.0")] + queued_requests(client)

    burst = threading.Thread(target=lambda: answers.extend(concurrently([one_request] * 24, 24)))
    burst.start()
    # The signal comes once every request of the burst is in the server: one still on its way
    # more than the drain delay after the signal is refused with 503, as it should be. Signalled
    # once all but a batch's worth were queued or answered, one was, its client slower than the
    # worker's first batch was full (2.5 times less CPU: docs/testing.md, "A slower machine").
    wait_until(lambda: in_the_server() == 24, 30, "the burst in the server", interval_s=0.02)
    pod.terminate()
    burst.join(120)
    code, seconds = pod.wait(timeout_s=120)
    assert [a.status_code for a in answers] == [200] * 24
    assert all(len(a.json()) == 5 and "label" in a.json()[0] for a in answers)
    assert code == 0, pod.output()[-2000:]
    bound = 1.0 + 30.0 + 1.0 + 30.0          # drain delay + drain timeout + grace + stop timeout
    assert seconds < bound
    assert "stopped" in pod.output() and "TorchServe has stopped" in pod.output()


def test_continuous_load_that_follows_readiness_sees_no_failure_through_a_stop(pod: Pod):
    """Clients that stop sending when readiness turns false, as a load balancer does: every
    request they sent is answered, those in flight at the signal included, and a request that
    arrives in the drain delay (a load balancer that has not noticed yet) is served too."""
    headers = pod.instance.client().auth_headers("inference")
    with ContinuousLoad(inference_url(pod), load_photo("coffee.png"), clients=4,
                        headers=lambda: headers) as load:
        load.wait_for(20)
        pod.terminate()
        wait_until(lambda: pod.probe("/ready")[0] != 200, 10, "readiness to turn false",
                   interval_s=0.05)
        status, body = pod.probe("/ready")
        late = requests.post(inference_url(pod), data=photo_bytes("coffee.png"), timeout=30,
                             headers={"Content-Type": "image/png", **headers})
    code, _ = pod.wait(timeout_s=120)
    assert (status, body) == (503, {"ready": False, "reason": "draining"})
    assert late.status_code == 200
    assert load.outcomes and all(outcome.status == 200 for outcome in load.outcomes), \
        [o for o in load.outcomes if o.status != 200][:3]
    signalled = pod.signalled_at or 0
    assert [o for o in load.outcomes if o.sent_at < signalled < o.received_at]   # in flight
    assert code == 0


def test_sigterm_while_starting_stops_at_once_and_leaves_nothing_running(pod_store: Path, tmp_path: Path):
    config = server_config(tmp_path, pod_store, paths.PRODUCTION_CONFIG,
                           load_models=classifier_description().archive_name)
    pod = Pod("starting", config, tmp_path / "run", pod_store)
    try:
        pod.start()
        wait_until(lambda: pod.probe("/ready") == (503, {"ready": False,
                                                       "reason": "TorchServe is starting"}),
                   30, "the pod to be starting", interval_s=0.05)
        pod.terminate()
        code, seconds = pod.wait(timeout_s=60)
        assert code == 0, pod.output()
        assert seconds < 20
        assert frontend_pid(pod.instance) is None
        assert "is ready at" not in pod.output()
    finally:
        pod.kill()


def test_readiness_is_false_while_a_worker_crash_loops_and_true_after_recovery(steady_pod: Pod):
    pod = steady_pod
    marker = Path(pod.environment[FAIL_MARKER_VARIABLE])
    marker.touch()
    worker = pod.instance.client().describe(MODEL, None)[0]["workers"][0]
    os.kill(int(worker["pid"]), signal.SIGKILL)      # its replacement fails to load, again and again
    reasons: list[str] = []

    def twenty_not_ready() -> bool:
        status, body = pod.probe("/ready")
        if status == 503:
            reasons.append(str(body["reason"]))
        return len(reasons) >= 20

    wait_until(twenty_not_ready, 60, "20 not-ready answers", interval_s=0.25)
    assert len(reasons) == 20 and all(f"{MODEL}: 0 of 1 workers READY" == r for r in reasons), reasons
    assert pod.probe("/live") == (200, {"live": True})    # a crash-looping model is not a dead pod
    model_log = wait_for_log(pod.run_dir / "logs" / "model_log.log",
                             lambda lines: any("failing on purpose" in line for line in lines), 30)
    assert any("failing on purpose" in line for line in model_log)
    marker.unlink()
    wait_until(pod.ready, 120, "readiness after recovery", interval_s=0.25)
    headers = {"Content-Type": "image/png", **pod.instance.client().auth_headers("inference")}
    answer = requests.post(inference_url(pod), data=photo_bytes("chelsea.png"), headers=headers,
                           timeout=60)
    assert answer.status_code == 200 and answer.json()[0]["label"] in CAT_LABELS
