"""The versions the rollout tests roll out and the commands they run (the modules here, each
with a server of its own: conftest.py).

v1 and v2 are the same real classifier with top-5 and top-3 answers, so every response shows
which version served it. The "bad" version has its class names scrambled, so its smoke test fails.
The "slow" version sleeps in `initialize` before loading, like a version with a slow start; the
"broken" one has a model-config.yaml TorchServe cannot parse, so registering it is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.images import CAT_LABELS, photo_bytes
from tests.server.load import ContinuousLoad
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
    RolloutPlan,
    unregister_retrying,
    wait_for_drain,
)
from torchserve_vision.server_process import TorchServeInstance
from torchserve_vision.server_state import versions_of
from torchserve_vision.waiting import wait_until

MODEL = "efficientnet_lite0"
V1_LENGTH, V2_LENGTH = 5, 3
SETTINGS = ServingSettings(batch_size=8, max_batch_delay_ms=20, min_workers=1, max_workers=1,
                           response_timeout_s=60)
SLOW_START_S = 12
ROLLOUT_ARCHIVES = frozenset({"v2", "bad", "slow", "refused", "crashing"})
SLOW_START_HANDLER = f"""
import time

from handlers.image_classifier import ImageClassifierHandler


class SlowStartClassifier(ImageClassifierHandler):
    def initialize(self, context):
        time.sleep({SLOW_START_S})
        super().initialize(context)
"""


def describe_version(version: str, top_k: int, labels: str) -> dict:
    return {"name": MODEL, "version": version, "labels": labels,
            "model": {"source": "timm", "architecture": "efficientnet_lite0",
                      "weights": "package:efficientnet_lite0"},
            "handler": {"top_k": top_k, "preprocess": {"mean": [0.5] * 3, "std": [0.5] * 3}}}


def built_rollout_archives(model_store: Path, tmp_path_factory: pytest.TempPathFactory,
                           names: frozenset[str] = ROLLOUT_ARCHIVES) -> dict[str, str]:
    """Of ROLLOUT_ARCHIVES, `names`, built next to v1 in the model store: v2 (top-3 answers),
    "bad" (scrambled class names), "slow" (a slow start), "refused" (a runtime TorchServe does
    not know) and "crashing" (a YAML it cannot parse; both copies of v2)."""
    built: dict[str, Path] = {}
    if names & {"v2", "refused", "crashing"}:
        built["v2"] = build_archive(parse_description(describe_version("2.0", 3, "imagenet")),
                                    model_store, reference_requests=0)  # no drift profile needed
    if "bad" in names:
        scrambled = tmp_path_factory.mktemp("labels") / "scrambled.json"
        scrambled.write_text(json.dumps(list(reversed(resolve_labels("imagenet")))))
        built["bad"] = build_archive(parse_description(describe_version("3.0", 5, str(scrambled))),
                                     model_store, reference_requests=0)
    if "slow" in names:
        built["slow"] = build_slow_start_archive(
            parse_description(describe_version("4.0", 5, "imagenet")), model_store)
    if "refused" in names:
        built["refused"] = copy_with_changes(built["v2"], model_store / f"{MODEL}-5.0.mar",
                                             {"modelVersion": "5.0"}, runtime="no-such-runtime")
    if "crashing" in names:
        built["crashing"] = copy_with_changes(built["v2"], model_store / f"{MODEL}-6.0.mar",
                                              {"modelVersion": "6.0"},
                                              yaml_text=b"handler: [unclosed\n")
    return {name: path.name for name, path in built.items() if name in names}


def build_slow_start_archive(description: ModelDescription, store: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp)
        weights = stage_files(description, staging)
        handler = staging / "extra" / "slow_start_classifier.py"
        handler.write_text(SLOW_START_HANDLER)
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


def cli(server: TorchServeInstance, store: Path, history: Path, *args: str) -> int:
    return command(["models", *args, "--management-url", server.management_url, "--inference-url",
                    server.inference_url, "--model-store", str(store), "--history", str(history)])


def states(history: Path) -> list[str]:
    """The outcome of each change the history records, in order."""
    return [entry["state"] for entry in json.loads(history.read_text())]


def plan(archive: str, **overrides) -> RolloutPlan:
    return RolloutPlan(**{"model": MODEL, "archive": archive, "settings": SETTINGS,
                          "smoke_image": photo_bytes("chelsea.png"),
                          "expect_labels": frozenset(CAT_LABELS), **overrides})



def load_on_server(client: TorchServeClient) -> ContinuousLoad:
    return ContinuousLoad(f"{client.inference_url}/predictions/{MODEL}", photo_bytes("chelsea.png"),
                          clients=4)



def models_command(server: TorchServeInstance, store: Path, history: Path, *args: str) -> list[str]:
    """`torchserve-vision models ...` as its own process (to be killed), with the test's batch
    settings and one worker."""
    return [sys.executable, "-m", "torchserve_vision", "models", *args, "--batch-size", "8",
            "--max-batch-delay", "20", "--workers", "1", "--drain-grace", "3",
            "--management-url", server.management_url, "--inference-url", server.inference_url,
            "--model-store", str(store), "--history", str(history)]


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
    ending = {"after its workers are ready": "1 worker(s) ready; smoke test"}.get(
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
        unregister_retrying(client, MODEL, old_version)


def assert_only_serving(client: TorchServeClient, load: ContinuousLoad, settled_at: float,
                        version: str) -> None:
    """No request failed, `version` is the only one registered, and it answered every request
    sent after `settled_at`."""
    assert load.failures() == []
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == [version]
    length = {"1.0": V1_LENGTH, "2.0": V2_LENGTH}[version]
    assert {len(o.body) for o in load.outcomes if o.sent_at > settled_at} == {length}


