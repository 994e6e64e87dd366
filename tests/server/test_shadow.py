"""`models shadow` and `models shadow-report` on a real TorchServe: the default version's workers
copy a share of real requests to a candidate version, off the request path, and the comparison
reaches /metrics.

Candidates: 2.0-shadow is the served archive itself under another version, with a response cache
(its answers agree with production's, and copies must never fill its cache); 3.0-shadow has its
class names reversed (the same scores under other names: every top-1 label flips).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.images import CAT_LABELS, load_photo, photo_bytes
from tests.server.candidate_archives import reversed_labels_copy
from tests.server.load import ContinuousLoad
from tests.server.servers import started_server
from torchserve_vision.archives.versions import archive_with_version
from torchserve_vision.cli import main as command
from torchserve_vision.client import TorchServeClient
from torchserve_vision.prometheus_text import total
from torchserve_vision.server_process import TorchServeInstance
from torchserve_vision.server_state import versions_of
from torchserve_vision.waiting import wait_until

pytestmark = pytest.mark.server
MODEL = "efficientnet_lite0"
PHOTOS = ("chelsea.png", "astronaut.png", "coffee.png", "rocket.jpg")


@pytest.fixture(scope="module")
def candidates(model_store: Path) -> dict[str, str]:
    archive = f"{MODEL}-1.0.mar"
    return {"same": archive_with_version(model_store, archive, "2.0-shadow",
                                         handler_changes={"cache": {"enabled": True}}),
            "renamed": reversed_labels_copy(model_store, archive, "3.0-shadow")}


@pytest.fixture(scope="module")
def shadow_server(model_store: Path, candidates, tmp_path_factory) -> Iterator[TorchServeInstance]:
    yield from started_server(tmp_path_factory.mktemp("shadow"), model_store,
                              load_models=f"{MODEL}-1.0.mar")


def models(server: TorchServeInstance, store: Path, *args: str) -> int:
    return command(["models", *args, "--management-url", server.management_url, "--inference-url",
                    server.inference_url, "--metrics-url", server.metrics_url, "--model-store", str(store),
                    "--history", str(server.run_dir / "history.json")])


def metrics(server: TorchServeInstance) -> str:
    return requests.get(f"{server.metrics_url}/metrics", timeout=10).text


def compared(server: TorchServeInstance, candidate: str) -> float:
    return total(metrics(server), "HandlerShadowCompared", ModelName=MODEL, Candidate=candidate)


def report(server: TorchServeInstance, store: Path, capsys, *options: str) -> list[dict]:
    capsys.readouterr()
    assert models(server, store, "shadow-report", MODEL, "--json", *options) == 0
    return json.loads(capsys.readouterr().out)


def send_photos(server: TorchServeInstance, rounds: int) -> list[requests.Response]:
    with requests.Session() as session:
        return [session.post(f"{server.inference_url}/predictions/{MODEL}", data=photo_bytes(name),
                             headers={"Content-Type": "application/octet-stream"}, timeout=60)
                for _ in range(rounds) for name in PHOTOS]


def test_production_answers_while_the_candidate_is_compared_on_copies(
        shadow_server, model_store, candidates, capsys):
    client = TorchServeClient(shadow_server.management_url, shadow_server.inference_url)
    assert models(shadow_server, model_store, "shadow", MODEL, candidates["same"],
                  "--percent", "100") == 0
    answers = send_photos(shadow_server, 5)
    assert {a.status_code for a in answers} == {200}
    assert {a.headers["X-Model-Version"] for a in answers} == {"1.0"}   # production answers
    assert all(len(a.json()) == 5 and "X-Cache" not in a.headers for a in answers)
    wait_until(lambda: compared(shadow_server, "2.0-shadow") >= len(answers), 30,
               "every copy compared")
    (found,) = report(shadow_server, model_store, capsys)
    assert (found["candidate"], found["compared"]) == ("2.0-shadow", len(answers))
    assert found["agreement"] == 1.0 and found["mean_probability_shift"] < 0.02
    assert found["dropped"] == {} and found["top_flips"] == []
    # TorchServe counts the copies under the candidate's version, production's under "default"
    text = metrics(shadow_server)
    copies = total(text, "ts_inference_requests_total", model_name=MODEL, model_version="2.0-shadow")
    assert copies == len(answers) + 1   # and the smoke test
    # the copies were sent with Cache-Control: no-store: the candidate's cache holds none of them
    # (rocket.jpg was copied 5 times; chelsea.png, the smoke test's photo, is cached)
    direct = requests.post(f"{shadow_server.inference_url}/predictions/{MODEL}/2.0-shadow",
                           data=photo_bytes("rocket.jpg"), timeout=60,
                           headers={"Content-Type": "application/octet-stream"})
    assert direct.headers["X-Cache"] == "miss" and direct.headers["X-Model-Version"] == "2.0-shadow"

    assert models(shadow_server, model_store, "shadow", MODEL, "--off", "--retire") == 0
    assert [v["modelVersion"] for v in versions_of(client, MODEL)] == ["1.0"]
    before = compared(shadow_server, "2.0-shadow")
    assert {a.status_code for a in send_photos(shadow_server, 1)} == {200}
    assert compared(shadow_server, "2.0-shadow") == before


def test_a_candidate_that_names_classes_differently_shows_as_flips(shadow_server, model_store,
                                                                  candidates, capsys):
    assert models(shadow_server, model_store, "shadow", MODEL, candidates["renamed"],
                  "--percent", "100") == 0
    with ContinuousLoad(f"{shadow_server.inference_url}/predictions/{MODEL}",
                        load_photo(), clients=4) as load:
        load.wait_for(40)
    assert load.failures() == []
    assert all(o.body[0]["label"] in CAT_LABELS for o in load.outcomes)   # production's names
    wait_until(lambda: compared(shadow_server, "3.0-shadow") >= 20, 30, "copies compared")
    (found,) = report(shadow_server, model_store, capsys, "--candidate", "3.0-shadow")
    assert found["agreement"] == 0.0 and found["compared"] >= 20
    flips = {(ours, theirs) for ours, theirs, _ in found["top_flips"]}
    assert flips and all(ours in CAT_LABELS and theirs not in CAT_LABELS for ours, theirs in flips)
    capsys.readouterr()
    assert models(shadow_server, model_store, "shadow-report", MODEL, "--candidate",
                  "3.0-shadow") == 0
    assert "agreement 0.0000" in capsys.readouterr().out
    assert models(shadow_server, model_store, "shadow", MODEL, "--off", "--retire") == 0


def test_shadowing_the_default_version_itself_is_refused(shadow_server, model_store, capsys):
    assert models(shadow_server, model_store, "shadow", MODEL, f"{MODEL}-1.0.mar",
                  "--percent", "5") == 1
    assert "the default version itself" in capsys.readouterr().err
