"""The confidence cascade: its decision rule, its per-request options, and the cascade handler
in-process on two tiny classifier archives built by the real builder (a cascade archive built from
them), checked against each stage's own classifier archive."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from handlers.classification_cascade import ANSWERED_BY_HEADER, ClassificationCascadeHandler
from handlers.ground.errors import ClientError
from handlers.ground.kind_options import CascadeOptions
from handlers.image_classifier import ImageClassifierHandler
from handlers.model.answer_agreement import probability_bound
from handlers.request.cascade_options import parse_cascade_options
from handlers.task.cascade import confidences, escalated
from tests.archives import extract_archive, initialized
from tests.images import photo_bytes
from tests.v2_metadata import assert_outputs_follow_metadata
from torchserve_vision.archives.build import BuildError, build_archive
from torchserve_vision.local_handler import LocalContext, archive_context
from torchserve_vision.model_descriptions import parse_description

PHOTOS = ["chelsea.png", "coffee.png", "rocket.jpg", "astronaut.png", "motorcycle_left.png"]


# --- the rule -------------------------------------------------------------------------------------
def test_confidence_is_the_top1_probability_or_the_top1_top2_margin():
    probabilities = torch.tensor([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25]])
    assert confidences(probabilities, "probability").tolist() == pytest.approx([0.7, 0.4])
    assert confidences(probabilities, "margin").tolist() == pytest.approx([0.5, 0.05])


def test_a_request_escalates_below_its_own_threshold_or_when_it_asks():
    requests = [CascadeOptions(5, "auto", 0.5), CascadeOptions(5, "auto", 0.3),
                CascadeOptions(5, "never", 0.9), CascadeOptions(5, "always", 0.0)]
    assert escalated(torch.tensor([0.4, 0.4, 0.1, 0.99]), requests) == [True, False, False, True]


# --- options --------------------------------------------------------------------------------------
def options(body: dict[str, Any], headers: dict[str, str] | None = None):
    return parse_cascade_options({"body": body}, (headers or {}).get, 5, 0.5, 1000)


def test_options_come_from_the_body_over_headers_and_default_to_auto():
    assert options({}) == CascadeOptions(5, "auto", 0.5)
    assert options({"escalation": "ALWAYS", "escalation_threshold": 0.8, "top_k": 2}) == \
        CascadeOptions(2, "always", 0.8)
    headers = {"X-Escalation": "never", "X-Escalation-Threshold": "0.25", "X-Top-K": "3"}
    assert options({}, headers) == CascadeOptions(3, "never", 0.25)
    assert options({"escalation": "auto"}, headers).escalation == "auto"


@pytest.mark.parametrize("body", [{"escalation": "sometimes"}, {"escalation_threshold": 1.5},
                                  {"escalation_threshold": "nan"}, {"escalation_threshold": "high"},
                                  {"top_k": 0}])
def test_a_bad_option_is_a_400(body):
    with pytest.raises(ClientError) as raised:
        options(body)
    assert raised.value.status == 400


# --- the handler on tiny archives -------------------------------------------------------------------
def tiny(name: str, seed: int, input_size: int) -> dict[str, Any]:
    return {"name": name, "version": "1.0", "labels": "imagenet",
            "model": {"source": "timm", "architecture": "test_efficientnet",
                      "weights": f"fixed-seed:{seed}"},
            "handler": {"preprocess": {"resize_size": input_size + 8, "input_size": input_size}}}


def cascade_description(first: str = "tiny_first-1.0", second: str = "tiny_second-1.0",
                        **handler: Any):
    return parse_description({"name": "tiny_cascade", "version": "1.0", "task": "cascade",
                              "stages": {"first": first, "second": second},
                              "handler": {"escalation": {"threshold": 0.5}, **handler}})


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("cascade_store")
    build_archive(parse_description(tiny("tiny_first", 1, 64)), store)
    build_archive(parse_description(tiny("tiny_second", 3, 80)), store)
    build_archive(cascade_description(), store)
    return store


def loaded(handler, store: Path, archive: str, work: Path):
    return initialized(handler, extract_archive(store / archive, work / archive), batch_size=8)


@pytest.fixture(scope="module")
def handlers(store: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("cascade_work")
    return (loaded(ClassificationCascadeHandler(), store, "tiny_cascade-1.0.mar", work),
            loaded(ImageClassifierHandler(), store, "tiny_first-1.0.mar", work),
            loaded(ImageClassifierHandler(), store, "tiny_second-1.0.mar", work))


def run(handler, bodies: list[Any]) -> tuple[list[Any], LocalContext]:
    rows = [{"body": body} for body in bodies]
    context = archive_context(handler.model_dir, request_headers=[{} for _ in rows])
    return [json.loads(answer) for answer in handler.handle(rows, context)], context


def as_json(name: str, **fields: Any) -> dict[str, Any]:
    return {"data": base64.b64encode(photo_bytes(name)).decode(), **fields}


def solo(handler, name: str) -> list[dict[str, Any]]:
    answers, context = run(handler, [bytearray(photo_bytes(name))])
    assert context.status(0) == 200
    return answers[0]


def same_classes(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert [a["index"] for a in got] == [a["index"] for a in expected]
    assert [a["probability"] for a in got] == pytest.approx([a["probability"] for a in expected],
                                                            abs=1e-5)


@pytest.mark.slow
def test_the_tiny_stages_tell_the_photos_apart_and_disagree(handlers):
    _, first, second = handlers
    first_top1 = [solo(first, name)[0]["index"] for name in PHOTOS]
    second_top1 = [solo(second, name)[0]["index"] for name in PHOTOS]
    assert len(set(first_top1)) >= 4 and len(set(second_top1)) >= 4
    assert first_top1 != second_top1  # otherwise a wrong stage could not be seen


@pytest.mark.slow
def test_never_and_always_answer_with_the_first_and_the_second_model(handlers):
    cascade, first, second = handlers
    bodies = [as_json(name, escalation=mode) for name in PHOTOS for mode in ("never", "always")]
    answers, context = run(cascade, bodies)
    for position, name in enumerate(PHOTOS):
        kept, escalated_answer = answers[2 * position], answers[2 * position + 1]
        same_classes(kept, solo(first, name))
        same_classes(escalated_answer, solo(second, name))
        assert {a["model"] for a in kept} == {"tiny_first-1.0"}
        assert {a["model"] for a in escalated_answer} == {"tiny_second-1.0"}
        assert context.response_headers[2 * position][ANSWERED_BY_HEADER] == "tiny_first-1.0"
        assert context.response_headers[2 * position + 1][ANSWERED_BY_HEADER] == "tiny_second-1.0"


@pytest.mark.slow
def test_auto_escalates_exactly_the_requests_below_the_threshold_in_a_mixed_batch(handlers):
    cascade, first, second = handlers
    top1 = {name: solo(first, name)[0]["probability"] for name in PHOTOS}
    ordered = sorted(top1.values())
    # Midway between the second and third photo: two below, three above, and no photo within
    # rounding of the threshold (a batch may round a probability differently from batch 1).
    assert ordered[2] - ordered[1] > 2 * probability_bound("fp32")
    threshold = (ordered[1] + ordered[2]) / 2
    answers, _ = run(cascade, [as_json(name, escalation_threshold=threshold) for name in PHOTOS])
    for name, answer in zip(PHOTOS, answers, strict=True):
        below = top1[name] < threshold
        same_classes(answer, solo(second if below else first, name))
        assert answer[0]["model"] == ("tiny_second-1.0" if below else "tiny_first-1.0")
    assert sum(answer[0]["model"] == "tiny_second-1.0" for answer in answers) == 2


@pytest.mark.slow
def test_a_bad_upload_or_option_fails_only_itself_and_metrics_count_escalations(handlers, caplog):
    cascade, first, second = handlers
    bodies = [as_json("chelsea.png", escalation="always"), bytearray(b"not an image"),
              as_json("coffee.png", escalation="bogus"), as_json("rocket.jpg", escalation="never")]
    with caplog.at_level("INFO", logger="handlers.serving"):
        answers, context = run(cascade, bodies)
    assert [context.status(i) for i in range(4)] == [200, 400, 400, 200]
    assert answers[1]["type"] == "NotAnImage" and "escalation" in answers[2]["message"]
    same_classes(answers[0], solo(second, "chelsea.png"))
    same_classes(answers[3], solo(first, "rocket.jpg"))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("batch ")]
    record = json.loads(line.removeprefix("batch "))
    assert record["counters"] == {"EscalatedRequests": 1}
    assert record["gauges"] == {"EscalationRate": 0.5}


@pytest.mark.slow
def test_an_open_inference_protocol_request_names_the_model_that_answered(handlers):
    cascade, _, second = handlers
    body = {"id": "7", "parameters": {"escalation": "always", "top_k": 2},
            "inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                        "data": [base64.b64encode(photo_bytes("coffee.png")).decode()]}]}
    (answer,), _ = run(cascade, [body])
    outputs = {output["name"]: output["data"] for output in answer["outputs"]}
    assert outputs["model"] == ["tiny_second-1.0"]
    assert outputs["class_ids"] == [a["index"] for a in solo(second, "coffee.png")[:2]]


# --- building ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_cascade_needs_its_stage_archives_in_the_store(store, tmp_path):
    with pytest.raises(BuildError, match=r"tiny_missing-1.0.mar.*build it first"):
        build_archive(cascade_description(second="tiny_missing-1.0"), store)


@pytest.mark.slow
def test_a_cascade_stage_must_be_a_classifier(store, tmp_path):
    build_archive(parse_description({
        "name": "tiny_detector", "version": "1.0", "task": "detection", "labels": "coco",
        "model": {"source": "torchvision", "architecture": "ssdlite320_mobilenet_v3_large",
                  "weights": "fixed-seed:0"}}), tmp_path, reference_requests=0)   # not what is checked
    for name in ("tiny_first-1.0.mar",):
        (tmp_path / name).write_bytes((store / name).read_bytes())
    with pytest.raises(BuildError, match="must be a classification archive"):
        build_archive(cascade_description(second="tiny_detector-1.0"), tmp_path)


@pytest.mark.slow
def test_a_bad_escalation_setting_stops_the_build(store):
    with pytest.raises(BuildError, match=r"escalation\.threshold"):
        build_archive(cascade_description(escalation={"threshold": 2}), store)


@pytest.mark.slow
def test_the_serving_labs_profiler_runs_a_cascade_archive(store):
    """Pipelines are archives like any other: `lab profile` loads them by their entry module."""
    from torchserve_vision.lab.profile import profile_archive

    profile = profile_archive(store / "tiny_cascade-1.0.mar", 2, 1, photo_bytes("coffee.png"), "coffee")
    assert profile.batch_sizes == [1, 2] and all(ms > 0 for ms in profile.handler_ms)


@pytest.mark.slow
def test_the_v2_metadata_declares_what_the_cascade_answers(handlers):
    cascade = handlers[0]
    body = {"inputs": [{"name": "image", "shape": [2], "datatype": "BYTES",
                        "data": [as_json(name)["data"] for name in PHOTOS[:2]]}]}
    (answer,), context = run(cascade, [body])
    assert context.status(0) == 200
    assert_outputs_follow_metadata(answer["outputs"], cascade.describe()["v2"], images=2)
