"""Versioned rollouts, rollbacks and scaling on a real TorchServe under continuous load.

v1 and v2 are the same real classifier with top-5 and top-3 answers, so every response shows
which version served it. The "bad" version has its class names scrambled, so its smoke test fails.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.build_archives import build_archive, parse_description, resolve_labels
from scripts.manage_models import main as manage
from scripts.management_client import TorchServeClient
from scripts.rollout import RolloutError, RolloutPlan, ServingSettings, rollout, versions_of
from scripts.torchserve_process import TorchServeInstance
from tests.images import CAT_LABELS, photo_bytes
from tests.server.conftest import started_server
from tests.server.load import ContinuousLoad

pytestmark = pytest.mark.server
MODEL = "efficientnet_lite0"
V1_LENGTH, V2_LENGTH = 5, 3
SETTINGS = ServingSettings(batch_size=8, max_batch_delay_ms=20, min_workers=1, max_workers=1,
                           response_timeout_s=60)


def describe_version(version: str, top_k: int, labels: str) -> dict:
    return {"name": MODEL, "version": version, "labels": labels,
            "model": {"source": "timm", "architecture": "efficientnet_lite0",
                      "weights": "package:efficientnet_lite0"},
            "handler": {"top_k": top_k, "preprocess": {"mean": [0.5] * 3, "std": [0.5] * 3}}}


@pytest.fixture(scope="module")
def archives(model_store: Path, tmp_path_factory) -> dict[str, str]:
    """v2 (top-3 answers) and a version with scrambled labels, next to v1 in the model store."""
    scrambled = tmp_path_factory.mktemp("labels") / "scrambled.json"
    scrambled.write_text(json.dumps(list(reversed(resolve_labels("imagenet")))))
    built = {"v2": build_archive(parse_description(describe_version("2.0", 3, "imagenet")),
                                 model_store),
             "bad": build_archive(parse_description(describe_version("3.0", 5, str(scrambled))),
                                  model_store)}
    return {name: path.name for name, path in built.items()}


@pytest.fixture(scope="module")
def rollout_server(model_store: Path, archives, tmp_path_factory) -> Iterator[TorchServeInstance]:
    yield from started_server(tmp_path_factory.mktemp("rollouts"), model_store,
                              load_models="efficientnet_lite0-1.0.mar")


@pytest.fixture
def client(rollout_server: TorchServeInstance, model_store: Path) -> TorchServeClient:
    """A client for a server where v1 is the only version of the model, and the default."""
    client = TorchServeClient(rollout_server.management_url, rollout_server.inference_url)
    versions = {v["modelVersion"] for v in versions_of(client, MODEL)}
    if "1.0" not in versions:
        client.register("efficientnet_lite0-1.0.mar", 8, 20, 1, 60)
    client.set_default(MODEL, "1.0")
    for version in versions - {"1.0"}:
        client.unregister(MODEL, version)
    return client


def cli(server: TorchServeInstance, store: Path, history: Path, *args: str) -> int:
    return manage([*args, "--management-url", server.management_url, "--inference-url",
                   server.inference_url, "--model-store", str(store), "--history", str(history)])


def plan(archive: str, **overrides) -> RolloutPlan:
    return RolloutPlan(model=MODEL, archive=archive, settings=SETTINGS,
                       smoke_image=photo_bytes("chelsea.png"), expect_labels=frozenset(CAT_LABELS),
                       **overrides)


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
    assert (entry["from_version"], entry["to_version"]) == ("1.0", "2.0")


def load_on_server(client: TorchServeClient) -> ContinuousLoad:
    return ContinuousLoad(f"{client.inference_url}/predictions/{MODEL}", photo_bytes("chelsea.png"),
                          clients=4)


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
    assert not (tmp_path / "history.json").exists()


def test_a_rollout_to_a_registered_version_is_refused_without_changes(client, archives,
                                                                        model_store):
    with pytest.raises(RolloutError, match="already registered"):
        rollout(client, plan("efficientnet_lite0-1.0.mar"), model_store, print)
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]


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


def test_new_batch_settings_roll_out_as_a_new_version_under_load(client, rollout_server,
                                                                 model_store, tmp_path):
    with load_on_server(client) as load:
        load.wait_for(10)
        assert cli(rollout_server, model_store, tmp_path / "h.json", "rollout", MODEL,
                   "--same-archive", "--batch-size", "4", "--max-batch-delay", "5") == 0
        load.wait_for(20)
    assert load.failures() == []
    (current,) = client.describe(MODEL, "all")
    assert current["modelVersion"] == "1.0-bs4-d5"
    assert (current["batchSize"], current["maxBatchDelay"]) == (4, 5)


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
