"""Versioned rollouts, rollbacks and scaling on a real TorchServe under continuous load.

v1 and v2 are the same real classifier with top-5 and top-3 answers, so every response shows
which version served it. The "bad" version has its class names scrambled, so its smoke test fails.
The "slow" version sleeps in `initialize` before loading, like a version with a slow start; the
"slow batch" one sleeps in every batch, longer than a drain's grace; the "broken" one has a
model-config.yaml TorchServe cannot parse, so registering it is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.images import CAT_LABELS, load_photo, photo_bytes
from tests.server.commands import started_command
from tests.server.load import CHANGE_PAUSE_S, ContinuousLoad
from tests.server.servers import started_server
from torchserve_vision.archives.build import build_archive, run_archiver, stage_files
from torchserve_vision.cli import main as command
from torchserve_vision.client import TorchServeClient
from torchserve_vision.model_descriptions import (
    ModelDescription,
    ServingSettings,
    parse_description,
    resolve_labels,
)
from torchserve_vision.rollout import (
    RolloutError,
    RolloutPlan,
    rollout,
    wait_for_drain,
    wait_for_workers,
)
from torchserve_vision.rollout_history import HistoryEntry, Journal, now_text
from torchserve_vision.server_process import TorchServeInstance
from torchserve_vision.server_state import served_default_version, versions_of
from torchserve_vision.waiting import wait_until

pytestmark = pytest.mark.server
MODEL = "efficientnet_lite0"
V1_LENGTH, V2_LENGTH = 5, 3
SETTINGS = ServingSettings(batch_size=8, max_batch_delay_ms=20, min_workers=1, max_workers=1,
                           response_timeout_s=60)
SLOW_START_S = 12
SLOW_START_HANDLER = f"""
import time

from handlers.image_classifier import ImageClassifierHandler


class SlowStartClassifier(ImageClassifierHandler):
    def initialize(self, context):
        time.sleep({SLOW_START_S})
        super().initialize(context)
"""
SLOW_BATCH_S = 3
SLOW_BATCH_HANDLER = f"""
import time

from handlers.image_classifier import ImageClassifierHandler


class SlowBatchClassifier(ImageClassifierHandler):
    def handle(self, data, context):
        time.sleep({SLOW_BATCH_S})
        return super().handle(data, context)
"""


def describe_version(version: str, top_k: int, labels: str) -> dict:
    """Lite0 as config/models.yaml describes it but without `compile:` (eager, fp32), with v1's
    worker settings: one thread and channels-last. At PyTorch's default (a thread per core in
    each of the two workers) the eager versions' batches took about 88 ms per image in a run of
    this module on the 2-core Zen 4 EPYC; one thread with channels-last computes an image of
    Lite0 there in about 22 ms of a core, two threads on a contiguous tensor in about 51."""
    return {"name": MODEL, "version": version, "labels": labels,
            "model": {"source": "timm", "architecture": "efficientnet_lite0",
                      "weights": "package:efficientnet_lite0"},
            "handler": {"top_k": top_k, "preprocess": {"mean": [0.5] * 3, "std": [0.5] * 3},
                        "torch_threads": 1, "channels_last": True}}


@pytest.fixture(scope="module")
def archives(model_store: Path, tmp_path_factory) -> dict[str, str]:
    """v2 (top-3 answers) and a version with scrambled labels, next to v1 in the model store."""
    scrambled = tmp_path_factory.mktemp("labels") / "scrambled.json"
    scrambled.write_text(json.dumps(list(reversed(resolve_labels("imagenet")))))
    built = {"v2": build_archive(parse_description(describe_version("2.0", 3, "imagenet")),
                                 model_store, reference_requests=0),     # no drift profile needed
             "bad": build_archive(parse_description(describe_version("3.0", 5, str(scrambled))),
                                  model_store, reference_requests=0),
             "slow": build_with_handler(parse_description(describe_version("4.0", 5, "imagenet")),
                                        model_store, SLOW_START_HANDLER),
             "slow batch": build_with_handler(parse_description(describe_version("7.0", 5, "imagenet")),
                                              model_store, SLOW_BATCH_HANDLER)}
    built["refused"] = copy_with_changes(built["v2"], model_store / f"{MODEL}-5.0.mar",
                                         {"modelVersion": "5.0"}, runtime="no-such-runtime")
    built["crashing"] = copy_with_changes(built["v2"], model_store / f"{MODEL}-6.0.mar",
                                          {"modelVersion": "6.0"}, yaml_text=b"handler: [unclosed\n")
    return {name: path.name for name, path in built.items()}


def build_with_handler(description: ModelDescription, store: Path, handler_text: str) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp)
        weights = stage_files(description, staging)
        handler = staging / "extra" / "changed_classifier.py"
        handler.write_text(handler_text)
        return run_archiver(description, staging, weights, store, handler)


def copy_with_changes(source: Path, target: Path, model_changes: dict, runtime: str | None = None,
                      yaml_text: bytes | None = None) -> Path:
    """A copy of an archive with its manifest (and optionally its YAML) changed."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for item in old.infolist():
            data = old.read(item.filename)
            if item.filename == "model-config.yaml" and yaml_text is not None:
                data = yaml_text
            elif item.filename == "MAR-INF/MANIFEST.json":
                document = json.loads(data)
                document["model"].update(model_changes)
                document["runtime"] = runtime or document["runtime"]
                data = json.dumps(document).encode()
            new.writestr(item, data)
    return target


@pytest.fixture(scope="module")
def rollout_server(model_store: Path, archives, tmp_path_factory) -> Iterator[TorchServeInstance]:
    yield from started_server(tmp_path_factory.mktemp("rollouts"), model_store,
                              load_models="efficientnet_lite0-1.0.mar")


@pytest.fixture
def client(rollout_server: TorchServeInstance, model_store: Path) -> TorchServeClient:
    """A client for a server where v1 is the only version of the model, and the default."""
    client = TorchServeClient(rollout_server.management_url, rollout_server.inference_url,
                              metrics_url=rollout_server.metrics_url)
    versions = {v["modelVersion"] for v in versions_of(client, MODEL)}
    if "1.0" not in versions:
        client.register("efficientnet_lite0-1.0.mar", 8, 20, 1, 60)
        wait_for_workers(client, MODEL, "1.0", 1, 60)
    client.set_default(MODEL, "1.0")
    for version in versions - {"1.0"}:
        client.unregister(MODEL, version)
    return client


def cli(server: TorchServeInstance, store: Path, history: Path, *args: str) -> int:
    return command(["models", *args, "--management-url", server.management_url, "--inference-url",
                    server.inference_url, "--metrics-url", server.metrics_url, "--model-store",
                    str(store), "--history", str(history)])


def states(history: Path) -> list[str]:
    """The outcome of each change the history records, in order."""
    return [entry["state"] for entry in json.loads(history.read_text())]


def plan(archive: str, **overrides) -> RolloutPlan:
    return RolloutPlan(**{"model": MODEL, "archive": archive, "settings": SETTINGS,
                          "smoke_image": photo_bytes("chelsea.png"),
                          "expect_labels": frozenset(CAT_LABELS), **overrides})


def test_rollout_under_load_fails_no_request_and_switches_to_v2(client, archives, model_store):
    events: dict[str, float] = {}

    def log(message: str) -> None:
        if message.endswith("is the default"):
            events["default"] = time.monotonic()

    with load_on_server(client) as load:
        load.wait_for(20)
        entry = rollout(client, plan(archives["v2"]), model_store, log)
        load.wait_for(40)
    assert load.failures() == []
    lengths_before = {len(o.body) for o in load.outcomes if o.received_at < events["default"]}
    lengths_after = {len(o.body) for o in load.outcomes if o.sent_at > events["default"]}
    assert V1_LENGTH in lengths_before
    assert lengths_after == {V2_LENGTH}
    assert all(o.body[0]["label"] in CAT_LABELS for o in load.outcomes)
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["2.0"]
    assert (entry.from_version, entry.to_version) == ("1.0", "2.0")


def load_on_server(client: TorchServeClient) -> ContinuousLoad:
    return ContinuousLoad(f"{client.inference_url}/predictions/{MODEL}", load_photo(),
                          clients=4, pause_s=CHANGE_PAUSE_S)


def test_a_failed_smoke_test_leaves_v1_serving_and_removes_the_new_version(
        client, archives, model_store, rollout_server, tmp_path, capsys):
    with load_on_server(client) as load:
        load.wait_for(10)
        code = cli(rollout_server, model_store, tmp_path / "history.json", "rollout", MODEL,
                   archives["bad"], *[arg for label in sorted(CAT_LABELS)
                                      for arg in ("--expect-label", label)])
        load.wait_for(20)
    assert code == 1
    error = capsys.readouterr().err
    assert "smoke test" in error and "failed and was undone" in error
    assert load.failures() == []
    assert {len(o.body) for o in load.outcomes} == {V1_LENGTH}
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]
    assert states(tmp_path / "history.json") == ["undone"]


def test_a_rollout_to_a_registered_version_is_refused_without_changes(client, archives,
                                                                        model_store):
    with pytest.raises(RolloutError, match="already registered and is the default"):
        rollout(client, plan("efficientnet_lite0-1.0.mar"), model_store, print)
    client.register(archives["v2"], 4, 20, 1, 60)         # not as the rollout would register it
    wait_for_workers(client, MODEL, "2.0", 1, 120)
    with pytest.raises(RolloutError, match=r"already registered, with batch size 4 \(this rollout: 8\)"):
        rollout(client, plan(archives["v2"]), model_store, print)
    assert sorted(v["modelVersion"] for v in versions_of(client, MODEL)) == ["1.0", "2.0"]
    assert served_default_version(client, MODEL)["modelVersion"] == "1.0"


def test_a_half_done_rollout_whose_archive_changed_since_is_not_taken_up(client, archives,
                                                                        rollout_server,
                                                                        model_store, tmp_path):
    """A rollout that died after registering v2, recorded with v2's archive digest; the archive
    in the store has changed since (rebuilt): running it again refuses to take the registered
    version as its own, and --abort undoes it."""
    history = tmp_path / "history.json"
    client.register(archives["v2"], SETTINGS.batch_size, SETTINGS.max_batch_delay_ms, 1, 60)
    wait_for_workers(client, MODEL, "2.0", 1, 120)
    died = HistoryEntry(kind="rollout", model=MODEL, to_version="2.0", to_archive=archives["v2"],
                        to_settings=SETTINGS, from_version="1.0", from_archive="efficientnet_lite0-1.0.mar",
                        from_settings=SETTINGS, time=now_text(), to_archive_sha256="0" * 64)
    Journal(history).begin(died)
    with pytest.raises(RolloutError, match="changed since the rollout that registered"):
        rollout(client, plan(archives["v2"]), model_store, print, Journal(history))
    assert cli(rollout_server, model_store, history, "rollout", MODEL, "--abort") == 0
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]
    assert states(history) == ["aborted"]


def models_command(server: TorchServeInstance, store: Path, history: Path, *args: str) -> list[str]:
    """`torchserve-vision models ...` as its own process (to be killed), with the test's batch
    settings and one worker."""
    return [sys.executable, "-m", "torchserve_vision", "models", *args, "--batch-size", "8",
            "--max-batch-delay", "20", "--workers", "1", "--drain-grace", "3",
            "--management-url", server.management_url, "--inference-url", server.inference_url,
            "--metrics-url", server.metrics_url, "--model-store", str(store), "--history", str(history)]


def killed_once(arguments: list[str], reached: Callable[[], bool], point: str) -> None:
    """Start the command, SIGKILL it as soon as `reached()` holds (polled every 50 ms)."""
    killed_at(arguments, lambda _said: reached(), point)


def killed_at(arguments: list[str], reached: Callable[[list[str]], bool], point: str) -> None:
    """Start the command, SIGKILL it as soon as `reached(lines it has printed so far)` holds."""
    process = subprocess.Popen(arguments, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    said: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            said.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_until(lambda: reached(said), 120, point, interval_s=0.05)
    process.kill()
    process.wait(timeout=30)
    reader.join(timeout=30)


def kill_point_reached(point: str, client: TorchServeClient, new_version: str,
                       said: list[str]) -> bool:
    """Whether a change bringing `new_version` (from one other version) has passed `point`: one
    of KILL_POINTS."""
    if point == "after registering":
        return len(versions_of(client, MODEL)) == 2
    ending = {"after its workers are ready": " worker(s) ready; smoke test"}.get(
        point, f"{MODEL} {new_version} is the default")
    return any(line.rstrip().endswith(ending) for line in said)


# Where a change is killed: after each step it takes; the last one is staged (the command is
# killed once the new version is the default, and the test retires the old one as it would).
KILL_POINTS = ("after registering", "after its workers are ready",
               "after set-default, during the drain", "after unregistering the old version")


def kill_change_at(point: str, arguments: list[str], client: TorchServeClient, old_version: str,
                   new_version: str) -> None:
    killed_at(arguments, lambda said: kill_point_reached(point, client, new_version, said), point)
    if point == "after unregistering the old version":
        wait_for_drain(client, MODEL, old_version, 60, 2.0)
        client.unregister(MODEL, old_version)


def assert_only_serving(client: TorchServeClient, load: ContinuousLoad, settled_at: float,
                        version: str) -> None:
    """No request failed, `version` is the only one registered, and it answered every request
    sent after `settled_at`."""
    assert load.failures() == []
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == [version]
    length = {"1.0": V1_LENGTH, "2.0": V2_LENGTH}[version]
    assert {len(o.body) for o in load.outcomes if o.sent_at > settled_at} == {length}


def killed_rollout_then(then: str, client: TorchServeClient, server: TorchServeInstance, store: Path,
                        history: Path, archive: str, point: str, capsys) -> None:
    """v1 serving: the real `models rollout` to v2 is SIGKILLed at `point` (no undo can run);
    `models list` shows the half-done rollout; then the same command again (`then` "run again")
    or `--abort`. One history entry, `started` until then."""
    arguments = models_command(server, store, history, "rollout", MODEL, archive)
    kill_change_at(point, arguments, client, "1.0", "2.0")
    assert states(history) == ["started"]
    capsys.readouterr()
    assert cli(server, store, history, "list") == 0
    listed = capsys.readouterr().out
    assert "half-done: a rollout of efficientnet_lite0 from 1.0 to 2.0" in listed
    assert "models rollout --abort efficientnet_lite0" in listed
    if then == "run again":
        done = subprocess.run(arguments, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (done.stdout, done.stderr)
    else:
        assert cli(server, store, history, "rollout", MODEL, "--abort") == 0
    assert states(history) == ["done" if then == "run again" else "aborted"]
    if then == "abort":
        assert cli(server, store, history, "rollout", MODEL, "--abort") == 1


def killed_rollback_then(then: str, client: TorchServeClient, server: TorchServeInstance,
                         store: Path, history: Path, point: str) -> None:
    """v2 serving, rolled out from v1 as `history` records: its rollback (re-registering v1
    from its archive) is SIGKILLed at `point`, then run again (v1 serves, v2 retired) or
    aborted (v2 serves, v1 gone)."""
    kill_change_at(point, models_command(server, store, history, "rollback", MODEL), client, "2.0", "1.0")
    assert states(history) == ["done", "started"]
    if then == "run again":
        assert cli(server, store, history, "rollback", MODEL) == 0
    else:
        assert cli(server, store, history, "rollout", MODEL, "--abort") == 0
    assert states(history) == ["done", "done" if then == "run again" else "aborted"]


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_rollout_or_rollback_killed_at_any_step_finishes_when_run_again_or_is_aborted(
        client, archives, rollout_server, model_store, tmp_path, capsys, point):
    """SIGKILL of the real command at `point`, under one continuous load, in four changes that
    each leave what the next starts from: a rollout killed then aborted (v1 serves), killed
    then run again (v2 serves); that rollout's rollback killed then aborted (v2 serves), killed
    then run again (v1 serves). After each: zero failed requests, the one version expected
    registered and answering every request sent since, the history's entries as above."""
    rolled_out = tmp_path / "rollout.json"
    with load_on_server(client) as load:
        load.wait_for(10)
        for then, serving in (("abort", "1.0"), ("run again", "2.0")):
            history = tmp_path / f"rollout-{then}.json"
            killed_rollout_then(then, client, rollout_server, model_store, history, archives["v2"],
                                point, capsys)
            settled_at = time.monotonic()
            load.wait_for(10)
            assert_only_serving(client, load, settled_at, serving)
        shutil.copy(history, rolled_out)       # the done rollout, which each rollback undoes
        for then, serving in (("abort", "2.0"), ("run again", "1.0")):
            history = tmp_path / f"rollback-{then}.json"
            shutil.copy(rolled_out, history)
            killed_rollback_then(then, client, rollout_server, model_store, history, point)
            settled_at = time.monotonic()
            load.wait_for(10)
            assert_only_serving(client, load, settled_at, serving)


def test_a_half_done_rollout_refuses_other_changes_of_the_model(client, archives, rollout_server,
                                                                model_store, tmp_path, capsys):
    history = tmp_path / "history.json"
    killed_once(models_command(rollout_server, model_store, history, "rollout", MODEL, archives["v2"]),
                lambda: len(versions_of(client, MODEL)) == 2, "v2's registration")
    for change in (("rollout", MODEL, "--same-archive", "--batch-size", "4"), ("rollback", MODEL),
                   ("scale", MODEL, "--workers", "2")):
        capsys.readouterr()
        assert cli(rollout_server, model_store, history, *change) == 1, change
        assert "is half-done" in capsys.readouterr().err, change
    assert cli(rollout_server, model_store, history, "rollout", MODEL, "--abort") == 0
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]


def test_rollback_refuses_a_change_recorded_on_another_server(client, rollout_server, model_store,
                                                              tmp_path, capsys):
    """A history written before the server was restarted: its latest change to 1.0 is not this
    server's to undo."""
    history = tmp_path / "history.json"
    assert cli(rollout_server, model_store, history, "scale", MODEL, "--workers", "2") == 0
    (scaled,) = json.loads(history.read_text())
    assert scaled["state"] == "done" and scaled["server"]
    scaled["server"] = "1@2000-01-01T00:00:00Z"              # as if made on an earlier server
    history.write_text(json.dumps([scaled]))
    capsys.readouterr()
    assert cli(rollout_server, model_store, history, "rollback", MODEL) == 1
    assert "was made on another server" in capsys.readouterr().err
    assert len(client.describe(MODEL, "1.0")[0]["workers"]) == 2       # nothing undone
    client.scale(MODEL, "1.0", 1, 1)


def test_scaling_up_and_down_under_load_fails_no_request(client, rollout_server, model_store,
                                                         tmp_path):
    history = tmp_path / "history.json"
    with load_on_server(client) as load:
        load.wait_for(10)
        assert cli(rollout_server, model_store, history, "scale", MODEL,
                   "--min", "2", "--max", "2") == 0
        workers_up = len(client.describe(MODEL, "1.0")[0]["workers"])
        load.wait_for(20)
        assert cli(rollout_server, model_store, history, "scale", MODEL, "--workers", "1") == 0
        load.wait_for(20)
    assert workers_up == 2
    assert load.failures() == []
    (scaled_down,) = client.describe(MODEL, None)  # scaled down by swapping in a 1-worker copy
    assert len(scaled_down["workers"]) == 1 and scaled_down["minWorkers"] == 1


def test_rollback_under_load_fails_no_request(client, archives, rollout_server, model_store,
                                              tmp_path):
    history = tmp_path / "history.json"
    assert cli(rollout_server, model_store, history, "rollout", MODEL, archives["v2"]) == 0
    with load_on_server(client) as load:
        load.wait_for(10)
        assert cli(rollout_server, model_store, history, "rollback", MODEL) == 0
        rolled_back_at = time.monotonic()
        load.wait_for(20)
    assert load.failures() == []
    assert {len(o.body) for o in load.outcomes if o.sent_at > rolled_back_at} == {V1_LENGTH}
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]


def in_batch(client: TorchServeClient, version: str) -> int:
    counts = client.requests_in_batch()
    assert counts is not None, "the metrics address did not answer"
    return counts[(MODEL, version)]


@pytest.fixture
def slow_batch_version(client, archives) -> Iterator[str]:
    """The slow-batch version registered beside v1 (one worker, queued batching)."""
    client.register(archives["slow batch"], 8, 20, 1, 60)
    wait_for_workers(client, MODEL, "7.0", 1, 60)
    yield "7.0"
    if "7.0" in {v["modelVersion"] for v in versions_of(client, MODEL)}:
        client.unregister(MODEL, "7.0")


def predict_version(client: TorchServeClient, version: str) -> requests.Response:
    return requests.post(f"{client.inference_url}/predictions/{MODEL}/{version}",
                         data=photo_bytes("chelsea.png"), timeout=60)


def test_a_version_is_unregistered_only_once_its_last_batch_is_answered(client,
                                                                        slow_batch_version):
    """The drain reads the requests workers hold (the frontend agent's count), not a fixed
    grace: with no grace at all, batches slower than any grace are all answered."""
    with ThreadPoolExecutor(3) as pool:
        sent = [pool.submit(predict_version, client, slow_batch_version) for _ in range(3)]
        wait_until(lambda: in_batch(client, slow_batch_version) > 0, 30, "a batch being computed",
                   interval_s=0.05)
        wait_for_drain(client, MODEL, slow_batch_version, 60, grace_s=0)
        client.unregister(MODEL, slow_batch_version)
        answers = [future.result() for future in sent]
    assert [answer.status_code for answer in answers] == [200] * 3
    assert {len(answer.json()) for answer in answers} == {V1_LENGTH}
    assert in_batch(client, slow_batch_version) == 0


def test_a_request_whose_version_is_unregistered_mid_batch_is_answered_503(client,
                                                                           slow_batch_version):
    """Unregistered without a drain, TorchServe 0.12 puts the batch back in a queue no worker
    will ever read; the frontend agent answers each of its requests 503 instead."""
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(predict_version, client, slow_batch_version)
        wait_until(lambda: in_batch(client, slow_batch_version) > 0, 30, "a batch being computed",
                   interval_s=0.05)
        client.unregister(MODEL, slow_batch_version)
        answer = sent.result()
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "1", answer.text
    assert answer.json()["type"] == "ServiceUnavailable"
    assert "unregistered" in answer.json()["message"]
    assert in_batch(client, slow_batch_version) == 0
    assert len(client.predict(MODEL, "1.0", photo_bytes("chelsea.png"))) == V1_LENGTH


def test_new_batch_settings_roll_out_as_a_new_version_under_load(client, rollout_server,
                                                                 model_store, tmp_path):
    with load_on_server(client) as load:
        load.wait_for(10)
        assert cli(rollout_server, model_store, tmp_path / "h.json", "rollout", MODEL,
                   "--same-archive", "--batch-size", "4", "--batching", "delayed",
                   "--max-batch-delay", "5") == 0
        load.wait_for(20)
    assert load.failures() == []
    (current,) = client.describe(MODEL, "all")
    assert current["modelVersion"] == "1.0-bs4-d5"
    assert (current["batchSize"], current["maxBatchDelay"], current["continuousBatching"]) == (4, 5, False)


def test_dry_run_prints_the_calls_and_changes_nothing(client, archives, rollout_server,
                                                      model_store, tmp_path, capsys):
    assert cli(rollout_server, model_store, tmp_path / "h.json", "rollout", MODEL, archives["v2"],
               "--dry-run") == 0
    printed = capsys.readouterr().out
    assert f"[dry-run] POST {rollout_server.management_url}/models?url={archives['v2']}" in printed
    assert f"[dry-run] DELETE {rollout_server.management_url}/models/{MODEL}/1.0" in printed
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]


def test_list_and_describe_as_json_and_text(rollout_server, client, model_store, tmp_path, capsys):
    assert cli(rollout_server, model_store, tmp_path / "h.json", "describe", MODEL, "--json") == 0
    described = json.loads(capsys.readouterr().out)
    assert described[0]["modelVersion"] == "1.0" and "jobQueueStatus" in described[0]
    assert cli(rollout_server, model_store, tmp_path / "h.json", "list") == 0
    text = capsys.readouterr().out
    assert f"{MODEL} 1.0" in text and "worker" in text and "queue:" in text


# --- whatever a version costs to start, and whatever goes wrong ------------------------------------
class FrontendWatch:
    """Polls /ping and GET /models every 0.5 s; records how long each answer took (None: none
    within 8 s, less than the slow version's start). A call that waits for workers inside the
    frontend shows here."""

    def __init__(self, server: TorchServeInstance) -> None:
        self.server = server
        self.seconds: list[float | None] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for url in (f"{self.server.inference_url}/ping", f"{self.server.management_url}/models"):
                started = time.monotonic()
                try:
                    requests.get(url, timeout=8).raise_for_status()
                    self.seconds.append(time.monotonic() - started)
                except requests.RequestException:
                    self.seconds.append(None)
            self._stop.wait(0.5)

    def __enter__(self) -> FrontendWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=20)


def test_a_slow_starting_version_rolls_out_and_back_under_load_without_holding_the_frontend(
        client, archives, rollout_server, model_store, tmp_path):
    history = tmp_path / "history.json"
    with load_on_server(client) as load, FrontendWatch(rollout_server) as watch:
        load.wait_for(10)
        started = time.monotonic()
        assert cli(rollout_server, model_store, history, "rollout", MODEL, archives["slow"]) == 0
        assert time.monotonic() - started > SLOW_START_S
        load.wait_for(10)
        assert cli(rollout_server, model_store, history, "rollback", MODEL) == 0
        load.wait_for(10)
    assert load.failures() == []
    # Every poll was answered within its 8 s timeout while the version took 12 s to start: the
    # frontend never waited for it.
    assert watch.seconds and None not in watch.seconds, watch.seconds
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]
    kinds = [entry.get("kind", "rollout") for entry in json.loads(history.read_text())]
    assert kinds == ["rollout", "rollback"]


def test_a_version_not_ready_by_its_deadline_is_undone(client, archives, rollout_server,
                                                      model_store, tmp_path, capsys):
    history = tmp_path / "history.json"
    with load_on_server(client) as load:
        load.wait_for(10)
        code = cli(rollout_server, model_store, history, "rollout", MODEL, archives["slow"],
                   "--timeout", "3")
        load.wait_for(10)
    assert code == 1
    error = capsys.readouterr().err
    assert "timed out after 3 s waiting for" in error and "READY workers of efficientnet_lite0" in error
    assert "undone (efficientnet_lite0 1.0 is the default)" in error
    assert load.failures() == []
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]
    assert states(history) == ["undone"]


def test_a_refused_registration_is_undone_and_reported(client, archives, rollout_server,
                                                      model_store, tmp_path, capsys):
    code = cli(rollout_server, model_store, tmp_path / "history.json", "rollout", MODEL,
               archives["refused"])
    assert code == 1
    error = capsys.readouterr().err
    assert "failed and was undone" in error and "POST /models" in error and "Runtime" in error
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]
    assert states(tmp_path / "history.json") == ["undone"]


def test_a_version_whose_workers_die_while_loading_is_undone_without_waiting_out_the_deadline(
        client, archives, rollout_server, model_store, tmp_path, capsys):
    with load_on_server(client) as load:
        load.wait_for(10)
        code = cli(rollout_server, model_store, tmp_path / "history.json", "rollout", MODEL,
                   archives["crashing"])
        load.wait_for(10)
    assert code == 1
    # Said only when the workers' restarts are counted, not when the deadline (startupTimeout +
    # 30 s = 150 s) runs out.
    assert "died while loading" in capsys.readouterr().err
    assert load.failures() == []
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]


def test_an_interrupted_rollout_is_undone_and_exits_non_zero(client, archives, rollout_server,
                                                             model_store, tmp_path):
    history = tmp_path / "history.json"
    arguments = ["models", "rollout", MODEL, archives["slow"],
                 "--management-url", rollout_server.management_url,
                 "--inference-url", rollout_server.inference_url,
                 "--metrics-url", rollout_server.metrics_url,
                 "--model-store", str(model_store), "--history", str(history)]
    with load_on_server(client) as load:
        load.wait_for(10)
        process = started_command(arguments)
        wait_until(lambda: len(versions_of(client, MODEL)) == 2, 30, "the new version's registration",
                   interval_s=0.2)
        process.send_signal(signal.SIGINT)   # what Ctrl-C does, while it waits for the workers
        out, err = process.communicate(timeout=60)
        load.wait_for(10)
    assert process.returncode == 130, (out, err)
    assert "interrupted and undone" in err
    assert "unregistered efficientnet_lite0 4.0" in out
    assert load.failures() == []
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]
    assert states(history) == ["undone"]


def test_rollback_after_a_scale_down_explains_itself_then_restores_the_workers(
        client, rollout_server, model_store, tmp_path, capsys):
    history = tmp_path / "history.json"
    assert cli(rollout_server, model_store, history, "scale", MODEL, "--workers", "2") == 0
    assert cli(rollout_server, model_store, history, "scale", MODEL, "--workers", "1") == 0
    assert client.describe(MODEL, None)[0]["modelVersion"] == "1.0-w1"
    capsys.readouterr()
    assert cli(rollout_server, model_store, history, "rollback", MODEL, "--dry-run") == 0
    said = capsys.readouterr().out
    assert "undoing the scale of" in said and "1.0 is gone; re-registering it" in said
    assert "workers 2/2" in said and "[dry-run] POST" in said
    assert client.describe(MODEL, None)[0]["modelVersion"] == "1.0-w1"   # nothing changed
    with load_on_server(client) as load:
        load.wait_for(10)
        assert cli(rollout_server, model_store, history, "rollback", MODEL) == 0
        load.wait_for(10)
    assert load.failures() == []
    (restored,) = client.describe(MODEL, "all")
    assert restored["modelVersion"] == "1.0" and restored["minWorkers"] == 2
    client.scale(MODEL, "1.0", 1, 1)


def test_a_rollout_carries_the_current_settings_and_timeouts_forward(client, archives, rollout_server,
                                                                   model_store, tmp_path):
    (before,) = client.describe(MODEL, None)
    assert cli(rollout_server, model_store, tmp_path / "h.json", "rollout", MODEL, archives["v2"]) == 0
    (after,) = client.describe(MODEL, None)
    assert after["modelVersion"] == "2.0"
    # Compared as settings: with queued batching TorchServe reports 100 ms for the unused delay
    # of 0 that config.properties gave, and 0 for the one a register call gave.
    assert ServingSettings.of_version(after) == ServingSettings.of_version(before)
    for key in ("batchSize", "minWorkers", "maxWorkers", "responseTimeout", "startupTimeout"):
        assert after[key] == before[key], key
