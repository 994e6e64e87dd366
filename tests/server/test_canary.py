"""`models canary`: the front (HAProxy, `server run --front-port`) answers a share of a model's
unversioned requests from a candidate version, changed through HAProxy's runtime API under
load, with no failed request; each step is in the rollout history and `models rollback` undoes
one at a time; `--promote` makes the candidate the default and keeps the old version for
`models rollback`. Every answer says which version produced it (X-Model-Version).
"""

from __future__ import annotations

import math
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import tritonclient.http as triton

from tests.images import load_photo, photo_bytes
from tests.server.candidate_archives import reversed_labels_copy
from tests.server.commands import started_command
from tests.server.load import CHANGE_PAUSE_S, ContinuousLoad
from tests.server.test_triton_client import image_input
from torchserve_vision import paths
from torchserve_vision.archives.versions import archive_with_version
from torchserve_vision.canary import canary_of, live_map, set_entry, split_entry
from torchserve_vision.cli import main as command
from torchserve_vision.client import TorchServeClient
from torchserve_vision.front_proxy import CANARY_VERSION_MAP
from torchserve_vision.lab.pods import Pod
from torchserve_vision.rollout_history import CanarySplit, Journal, read_history
from torchserve_vision.server_state import default_version
from torchserve_vision.shadow import traffic_dir_of
from torchserve_vision.torchserve_config import free_ports, server_config
from torchserve_vision.waiting import wait_until

pytestmark = pytest.mark.server
MODEL = "efficientnet_lite0"
CANDIDATE = "2.0-canary"
JPEG = {"Content-Type": "application/octet-stream"}


@pytest.fixture(scope="module")
def fronted(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    archive_with_version(model_store, f"{MODEL}-1.0.mar", CANDIDATE)
    directory = tmp_path_factory.mktemp("canary")
    config = server_config(directory, model_store, paths.DEVELOPMENT_CONFIG,
                           load_models=f"{MODEL}-1.0.mar")
    pod = Pod("canary", config, directory / "run", model_store, drain_delay_s=0.0,
              environment={"TSV_WORKERS": "1"}, front_port=free_ports(1)[0])
    with pod.running():
        yield pod


def models_arguments(pod: Pod, store: Path, *args: str) -> list[str]:
    """`models ARGS` against the pod's server, with its history file."""
    instance = pod.instance
    return ["models", *args, "--management-url", instance.management_url,
            "--inference-url", instance.inference_url, "--metrics-url", instance.metrics_url,
            "--model-store", str(store),
            "--history", str(pod.run_dir / "history.json")]


def models(pod: Pod, store: Path, *args: str) -> int:
    return command(models_arguments(pod, store, *args))


def versions_answering(pod: Pod, count: int, headers: dict[str, str] | None = None,
                       path: str = f"/predictions/{MODEL}") -> Counter[str]:
    photo = load_photo()
    with requests.Session() as session:
        answers = [session.post(f"http://127.0.0.1:{pod.front_port}{path}", timeout=60,
                                data=photo, headers={**JPEG, **(headers or {})})
                   for _ in range(count)]
    assert {a.status_code for a in answers} == {200}
    return Counter(a.headers["X-Model-Version"] for a in answers)


def test_a_canary_answers_its_share_and_is_promoted_without_a_failed_request(fronted, model_store):
    """The load's own requests are answered in every state the steps pass through (each step
    waits for answers to requests sent after it), by the versions that state routes to."""
    client = TorchServeClient(fronted.instance.management_url, fronted.instance.inference_url)
    # each step: (called, returned, the versions the load may get from its return to the next call)
    steps: list[tuple[float, float, set[str]]] = []

    def step(versions: set[str], *args: str) -> None:
        called = time.monotonic()
        assert models(fronted, model_store, *args) == 0
        steps.append((called, time.monotonic(), versions))
        load.wait_for_sent_after(steps[-1][1], 3)

    both = {"1.0", CANDIDATE}
    with ContinuousLoad(f"http://127.0.0.1:{fronted.front_port}/predictions/{MODEL}",
                        load_photo(), clients=3, pause_s=CHANGE_PAUSE_S) as load:
        step(both, "canary", MODEL, f"{MODEL}-{CANDIDATE}.mar", "--percent", "30")
        split = versions_answering(fronted, 200)
        # 30% of 200: 60 +- 5 standard deviations
        assert set(split) == both and 20 <= split[CANDIDATE] <= 100
        # sticky: a key is always on the same side while the percent stays
        sides = {key: versions_answering(fronted, 3, {"X-Canary-Key": key}) for key in ("a", "b", "c", "d")}
        assert all(len(side) == 1 for side in sides.values())
        step({CANDIDATE}, "canary", MODEL, "--percent", "100")
        assert versions_answering(fronted, 5) == Counter({CANDIDATE: 5})
        # each step is in the history, and a rollback undoes one step: 30% again
        step(both, "rollback", MODEL)
        assert set(versions_answering(fronted, 40)) == both
        step({CANDIDATE}, "canary", MODEL, "--percent", "100")
        step({CANDIDATE}, "canary", MODEL, "--promote")
        assert (default_version(client, MODEL) or {}).get("modelVersion") == CANDIDATE
        assert versions_answering(fronted, 5) == Counter({CANDIDATE: 5})
        step({"1.0"}, "rollback", MODEL)      # 1.0 was kept on standby
        assert versions_answering(fronted, 5) == Counter({"1.0": 5})
    assert load.failures() == []
    assert {outcome.model_version for outcome in load.outcomes} == both
    next_calls = [called for called, _, _ in steps[1:]] + [math.inf]
    for (_, began, versions), ended in zip(steps, next_calls, strict=True):
        answered = {o.model_version for o in load.sent_between(began, ended)}
        assert answered and answered <= versions, (began, ended, versions, answered)
    changes = [(e.kind, e.state, e.from_split and e.from_split.percent, e.split and e.split.percent)
               for e in read_history(fronted.run_dir / "history.json")][-6:]
    assert changes == [("canary", "done", None, 30), ("canary", "done", 30, 100),
                       ("rollback", "done", 100, 30), ("canary", "done", 30, 100),
                       ("rollout", "done", None, None), ("rollback", "done", None, None)]


def test_versioned_requests_and_other_models_are_never_split(fronted, model_store):
    assert models(fronted, model_store, "canary", MODEL, f"{MODEL}-{CANDIDATE}.mar", "--percent", "100") == 0
    try:
        assert versions_answering(fronted, 3, path=f"/predictions/{MODEL}/1.0") == Counter({"1.0": 3})
        # the Open Inference Protocol's unversioned infer is split like /predictions/{m}
        front = triton.InferenceServerClient(f"127.0.0.1:{fronted.front_port}")
        answer = front.infer(MODEL, [image_input(photo_bytes("chelsea.png"))]).get_response()
        assert answer["model_version"] == CANDIDATE
    finally:
        assert models(fronted, model_store, "canary", MODEL, "--off") == 0
    assert versions_answering(fronted, 5) == Counter({"1.0": 5})


def test_a_canary_without_the_front_is_refused_with_the_way_in(server, model_store, capsys):
    code = command(["models", "canary", MODEL, "--percent", "10", "--management-url",
                    server.management_url, "--inference-url", server.inference_url])
    assert code == 1 and "--front-port" in capsys.readouterr().err


def test_a_stepped_canary_removes_a_failing_candidate_and_promotes_a_good_one(
        fronted, model_store, capsys):
    """`--steps 50,100 --auto`: a candidate that refuses the photos users send (its pixel limit
    is below the astronaut's, above the smoke test's cat) is judged at 50% from the front's
    request log and removed; the same walk with a good candidate ends promoted, no request
    failed."""
    client = TorchServeClient(fronted.instance.management_url, fronted.instance.inference_url)
    refusing = archive_with_version(model_store, f"{MODEL}-1.0.mar", "3.0-refusing",
                                    handler_changes={"limits": {"max_pixels": 200_000}})
    url = f"http://127.0.0.1:{fronted.front_port}/predictions/{MODEL}"
    walk = ["--steps", "50,100", "--auto", "--hold", "4", "--min-requests", "5"]
    with ContinuousLoad(url, photo_bytes("astronaut.png"), clients=3, pause_s=CHANGE_PAUSE_S) as load:
        capsys.readouterr()
        assert models(fronted, model_store, "canary", MODEL, refusing, *walk) == 1
        assert "stopped at 50%" in capsys.readouterr().err
        load.wait_for(10)
    refused = [o for o in load.outcomes if o.status != 200]
    assert refused and {o.model_version for o in refused} == {"3.0-refusing"}
    (walked,) = [e for e in read_history(fronted.run_dir / "history.json")
                 if e.to_version == "3.0-refusing"]
    assert (walked.kind, walked.state) == ("canary", "aborted") and "gates failed at 50%" in str(walked.note)
    assert (default_version(client, MODEL) or {}).get("modelVersion") == "1.0"
    assert versions_answering(fronted, 5) == Counter({"1.0": 5})

    # The good candidate's walk: a p99 over a few hundred requests on two shared cores trips the
    # latency gate now and then (117 ms against 1.5 x 58 + 25 seen at 100%); that gate is judged
    # on recorded windows by the unit tests, so here only failures may stop the walk.
    good_walk = [*walk, "--p99-slack", "10000"]
    with ContinuousLoad(url, photo_bytes("astronaut.png"), clients=3, pause_s=CHANGE_PAUSE_S) as load:
        assert models(fronted, model_store, "canary", MODEL, f"{MODEL}-{CANDIDATE}.mar", *good_walk) == 0
    assert load.failures() == [] and {o.model_version for o in load.outcomes} >= {CANDIDATE}
    assert (default_version(client, MODEL) or {}).get("modelVersion") == CANDIDATE
    assert models(fronted, model_store, "rollback", MODEL) == 0


def test_a_stepped_canary_stops_when_its_shadow_disagrees_with_production(
        fronted, model_store, capsys):
    """With the candidate also shadowed, `--min-agreement` is a gate: a candidate whose class
    names are reversed answers 200 everywhere, but its answers agree with none of production's."""
    renamed = reversed_labels_copy(model_store, f"{MODEL}-1.0.mar", "4.0-renamed")
    assert models(fronted, model_store, "shadow", MODEL, renamed, "--percent", "100") == 0
    try:
        with ContinuousLoad(f"http://127.0.0.1:{fronted.front_port}/predictions/{MODEL}",
                            load_photo(), clients=3, pause_s=CHANGE_PAUSE_S) as load:
            capsys.readouterr()
            assert models(fronted, model_store, "canary", MODEL, "--steps", "50,100", "--auto",
                          "--hold", "4", "--min-requests", "5", "--min-agreement", "0.9") == 1
            assert "agreed with production's on 0.000" in capsys.readouterr().err
        assert load.failures() == []
        assert versions_answering(fronted, 5) == Counter({"1.0": 5})
    finally:
        assert models(fronted, model_store, "shadow", MODEL, "--off", "--retire") == 0


def test_a_canary_step_a_dead_command_left_half_done_is_undone_by_abort(fronted, model_store, capsys):
    """A step recorded as started whose command died between the maps' writes: rollbacks are
    refused with the way out, `models history` shows it, `models rollout --abort` clears it."""
    client = TorchServeClient(fronted.instance.management_url, fronted.instance.inference_url)
    traffic_dir = traffic_dir_of(client, MODEL, "1.0")
    journal = Journal(fronted.run_dir / "history.json")
    journal.begin(split_entry(client, MODEL, "canary", CanarySplit("1.0", 50), None))
    set_entry(traffic_dir, CANARY_VERSION_MAP, MODEL, "1.0")     # ... and then it died
    capsys.readouterr()
    assert models(fronted, model_store, "rollback", MODEL) == 1
    assert "models rollout --abort" in capsys.readouterr().err
    assert models(fronted, model_store, "history", MODEL, "--last", "1") == 0
    assert "started  canary   efficientnet_lite0  no split -> 50% to 1.0" in capsys.readouterr().out
    assert models(fronted, model_store, "rollout", MODEL, "--abort") == 0
    assert canary_of(traffic_dir, MODEL) is None and live_map(traffic_dir, CANARY_VERSION_MAP) == {}
    assert journal.pending(MODEL) is None and read_history(journal.history_file)[-1].state == "aborted"
    assert versions_answering(fronted, 3) == Counter({"1.0": 3})
    # a dry run says what it would do and changes nothing
    assert models(fronted, model_store, "canary", MODEL, "--percent", "50", "--dry-run") == 0
    assert "[dry-run] would answer 50% from the candidate" in capsys.readouterr().out
    assert canary_of(traffic_dir, MODEL) is None and journal.pending(MODEL) is None


def test_ctrl_c_during_a_walk_restores_the_split_from_before_it(fronted, model_store):
    """SIGINT while a step holds: exit 130, the split before the walk (10%) again, the walk's
    step rewritten as undone, so a rollback then undoes the 10% step itself."""
    history = fronted.run_dir / "history.json"
    traffic_dir = traffic_dir_of(TorchServeClient(fronted.instance.management_url,
                                                  fronted.instance.inference_url), MODEL, "1.0")
    assert models(fronted, model_store, "canary", MODEL, f"{MODEL}-{CANDIDATE}.mar", "--percent", "10") == 0
    walk = started_command(models_arguments(fronted, model_store, "canary", MODEL, "--steps",
                                            "50,100", "--auto", "--hold", "120"))
    try:
        wait_until(lambda: canary_of(traffic_dir, MODEL) == CanarySplit(CANDIDATE, 50), 60,
                   "the walk's first step")
        walk.send_signal(signal.SIGINT)
        _, err = walk.communicate(timeout=60)
    finally:
        walk.kill()
    assert walk.returncode == 130 and "interrupted" in err
    assert canary_of(traffic_dir, MODEL) == CanarySplit(CANDIDATE, 10)
    assert [(e.state, e.split) for e in read_history(history)[-2:]] == [
        ("done", CanarySplit(CANDIDATE, 10)), ("undone", CanarySplit(CANDIDATE, 50))]
    assert models(fronted, model_store, "rollback", MODEL) == 0
    assert canary_of(traffic_dir, MODEL) is None
