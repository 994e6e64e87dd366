"""An SSD-family detector's backbone and head on OpenVINO / ONNX Runtime: the check of their head
outputs against the eager network's (pure), then, on the real SSDlite archive, every engine
serving alone answers as the eager network does at every batch size, an engine that fails to
load or answers for another model is refused, and the choice is described and counted; on the
default detector's archive, bf16 where the CPU has it, within bf16's bound of fp32's answers."""

from __future__ import annotations

import base64
import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torchvision.models.detection._utils import BoxCoder

from handlers.model import runner_selection
from handlers.model.answer_agreement import PROBABILITY_BOUNDS
from handlers.model.model_loading import cpu_has_native_bf16
from handlers.model.ssd_engine import SsdBackboneHead, head_output_disagreement
from handlers.object_detector import ObjectDetectorHandler
from tests.archives import archive_context, extract_archive, initialized
from tests.detections import assert_detections_within, assert_same_detections, rows_from_answer
from tests.images import photo_bytes
from tests.recording_metrics import RecordingMetrics
from tests.runners import first_runner_here, noting_calls
from torchserve_vision.archives.engine_exports import convert_openvino

PHOTOS = ["astronaut.png", "rocket.jpg", "chelsea.png", "coffee.png", "motorcycle_left.png"]
ANCHORS = torch.tensor([[0.0, 0.0, 100.0, 50.0], [10.0, 10.0, 30.0, 40.0]])   # float[A=2, 4]
CODER = BoxCoder(weights=(10.0, 10.0, 5.0, 5.0))                              # an SSD's
# fp32 engines against the eager network: scores moved by up to 1.6e-5, boxes by 1.8e-4 px
# (OpenVINO on an AVX2 EPYC); these are the tolerances of the comparison (the load-time check
# holds every anchor to answer_agreement's fp32 bound). Answers give boxes rounded to 0.01 px, so
# a side 1.8e-4 px away may round to the next step: two steps.
SCORE_TOLERANCE, BOX_TOLERANCE_PX = 1e-4, 0.02


# --- the check (pure) ------------------------------------------------------------------------------
def head_outputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, 4, generator=generator), torch.randn(3, 2, 5, generator=generator) * 4


def test_outputs_within_the_bound_agree_and_a_moved_score_or_box_does_not():
    expected = head_outputs(0)
    assert head_output_disagreement(expected, expected, ANCHORS, CODER, 1e-3) is None
    regression, logits = (tensor.clone() for tensor in expected)
    logits[1, 0, 2] += 1e-5                     # rounding: scores move by far less than 1e-3
    assert head_output_disagreement((regression, logits), expected, ANCHORS, CODER, 1e-3) is None
    logits[2, 1, 4] += 1.0                      # a score moves by more than 0.01
    reason = head_output_disagreement((regression, logits), expected, ANCHORS, CODER, 1e-2)
    assert reason is not None and "class score moved" in reason
    regression, logits = (tensor.clone() for tensor in expected)
    # dx of anchor 0 (100 px wide) by 0.2: its box moves 0.2 / 10 * 100 = 2 px, 0.02 of its width
    regression[1, 0, 0] += 0.2
    reason = head_output_disagreement((regression, logits), expected, ANCHORS, CODER, 1e-2)
    assert reason is not None and reason.startswith("image 1: a box side moved by 0.02")
    assert head_output_disagreement((regression, logits), expected, ANCHORS, CODER, 0.03) is None


def test_outputs_of_another_shape_or_a_nan_never_agree():
    regression, logits = head_outputs(0)
    reason = head_output_disagreement((regression, logits[:, :, :4]), (regression, logits), ANCHORS,
                                      CODER, 0.15)
    assert reason is not None and "output shapes" in reason
    broken = logits.clone()
    broken[0, 0, 0] = float("nan")
    assert head_output_disagreement((regression, broken), (regression, logits), ANCHORS, CODER, 0.15)
    broken = regression.clone()
    broken[2, 1, 3] = float("inf")
    assert head_output_disagreement((broken, logits), (regression, logits), ANCHORS, CODER, 0.15) == (
        "a head output is not finite")


def test_only_what_an_answer_can_come_from_is_compared():
    """Scores below the lowest a request may ask for on both sides, the background's, and the
    boxes of anchors with no such score move freely; lifting a score to it does not."""
    regression = torch.zeros(1, 2, 4)
    logits = torch.full((1, 2, 3), -6.0)         # sigmoid scores 0.0025: nothing answerable
    logits[0, 0, 1] = 2.0                         # anchor 0, class 1: 0.88
    expected = (regression, logits)

    def moved(anchor: int, cls: int, logit: float, box: float = 0.0) -> str | None:
        ours_regression, ours_logits = regression.clone(), logits.clone()
        ours_logits[0, anchor, cls] = logit
        ours_regression[0, anchor, 0] = box
        return head_output_disagreement((ours_regression, ours_logits), expected, ANCHORS, CODER, 0.15,
                                        "sigmoid", 0.05)

    assert moved(1, 2, -3.5) is None              # 0.0025 -> 0.029: below 0.05 both times
    assert moved(1, 0, 4.0) is None               # the background: never answered
    assert moved(1, 2, -6.0, box=1.0) is None     # anchor 1 answers nothing: its box is free
    lifted = moved(1, 2, -1.0)                    # 0.0025 -> 0.27: answerable, moved by 0.27
    assert lifted is not None and "class score moved by 0.266" in lifted
    boxed = moved(0, 1, 2.0, box=1.0)             # anchor 0 answers: dx 1.0 / 10 of 100 px = 0.1
    assert boxed is None
    boxed = moved(0, 1, 2.0, box=2.0)             # 0.2 of its width: past 0.15
    assert boxed is not None and "a box side moved by 0.2 of its anchor's size" in boxed


# --- on the real archive ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def detector_dir(model_store, tmp_path_factory) -> Path:
    return extract_archive(model_store / "ssdlite320-1.0.mar", tmp_path_factory.mktemp("ssdlite"))


def with_handler_settings(model_dir: Path, target: Path, **settings: Any) -> Path:
    """A copy of an extracted archive with `settings` set in its YAML's `handler:` section (its
    files otherwise the same)."""
    shutil.copytree(model_dir, target, ignore=shutil.ignore_patterns("openvino-cache"))
    config_path = target / "model-config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["handler"].update(settings)
    config_path.write_text(yaml.safe_dump(config))
    return target


def with_order(detector_dir: Path, target: Path, order: list[str]) -> Path:
    """The detector's extracted archive, its order for every CPU kind set to `order`."""
    return with_handler_settings(detector_dir, target, runner_order={"avx512_bf16": order, "avx2": order})


def detect(handler: ObjectDetectorHandler, names: list[str], **options: Any) -> list[list[dict]]:
    rows = [{"body": {"data": base64.b64encode(photo_bytes(name)).decode(), **options}} for name in names]
    context = archive_context(handler.model_dir)
    answers = [json.loads(body) for body in handler.handle(rows, context)]
    assert [context.status(index) for index in range(len(rows))] == [200] * len(rows), answers
    return answers


def threshold_in_a_gap(answer: list[dict]) -> float:
    """A score threshold halfway across the widest gap between the scores ranked 10 to 200 of an
    answer: two score tolerances or more from every score, so rounding cannot move a detection
    across it, and below the cap (300)."""
    scores = [detection["score"] for detection in answer[10:201]]
    width, middle = max((high - low, (high + low) / 2) for high, low in itertools.pairwise(scores))
    assert width > 4 * SCORE_TOLERANCE, "no clear gap to put a threshold in"
    return middle


@pytest.fixture(scope="module")
def eager(detector_dir, tmp_path_factory) -> tuple[list[list[dict]], list[float]]:
    """The eager network's answers to PHOTOS (an order with no runner) at thresholds in gaps of
    its own answers, and those thresholds."""
    handler = initialized(ObjectDetectorHandler(),
                          with_order(detector_dir, tmp_path_factory.mktemp("eager") / "m", []), 4)
    assert handler.runner == "eager" and handler.runners["detector"].refusals == ()
    thresholds = [threshold_in_a_gap(detect(handler, [name], score_threshold=0.0, max_detections=300)[0])
                  for name in PHOTOS]
    return [detect(handler, [name], score_threshold=threshold, max_detections=300)[0]
            for name, threshold in zip(PHOTOS, thresholds, strict=True)], thresholds


def detect_at(handler: ObjectDetectorHandler, names: list[str], thresholds: list[float]) -> list[list[dict]]:
    """One batch of `names`, each request at its own threshold."""
    rows = [{"body": {"data": base64.b64encode(photo_bytes(name)).decode(), "score_threshold": threshold,
                      "max_detections": 300}} for name, threshold in zip(names, thresholds, strict=True)]
    context = archive_context(handler.model_dir)
    return [json.loads(body) for body in handler.handle(rows, context)]


def test_the_archive_holds_the_backbone_and_head_for_both_engines_and_its_workers_use_one(detector_dir):
    """SSDlite asks for fp32: its workers skip the bf16 runner its order has for CPUs with bf16."""
    handler_yaml = yaml.safe_load((detector_dir / "model-config.yaml").read_text())["handler"]
    assert {model["engine"] for model in handler_yaml["engine_models"]} == {"openvino", "onnxruntime"}
    assert {model["weights"] for model in handler_yaml["engine_models"]} == {"fp32"}
    assert handler_yaml["runner_order"]["avx512_bf16"][0] == "openvino-bf16"
    handler = initialized(ObjectDetectorHandler(), detector_dir, 4)
    choice = handler.runners["detector"]
    first = first_runner_here(handler_yaml, "detector")
    assert first.endswith("-fp32") and (choice.runner, choice.refusals) == (first, ())
    assert handler.describe()["runners"]["detector"]["runner"] == handler.runner == first


@pytest.mark.parametrize("runner", ["openvino-fp32", "onnxruntime-fp32"])
def test_every_engine_serves_alone_and_answers_as_eager_at_every_batch_size(
        detector_dir, eager, tmp_path, runner):
    expected, thresholds = eager
    handler = initialized(ObjectDetectorHandler(), with_order(detector_dir, tmp_path / "m", [runner]), 4)
    choice = handler.runners["detector"]
    assert (choice.runner, choice.refusals) == (runner, ())
    for count in (1, 4, len(PHOTOS)):
        answers = [answer for start in range(0, len(PHOTOS), count)
                   for answer in detect_at(handler, PHOTOS[start:start + count],
                                           thresholds[start:start + count])]
        for got, want in zip(answers, expected, strict=True):
            assert 10 <= len(want) <= 201
            assert_same_detections(got, rows_from_answer(want), BOX_TOLERANCE_PX, SCORE_TOLERANCE)
    assert len({tuple(d["score"] for d in answer[:3]) for answer in expected}) == len(PHOTOS)


def test_an_engine_that_fails_to_load_is_refused_and_the_next_one_serves(detector_dir, eager, tmp_path):
    model_dir = with_order(detector_dir, tmp_path / "m", ["openvino-fp32", "onnxruntime-fp32"])
    weights = model_dir / "compiled" / "model-openvino.bin"
    weights.write_bytes(weights.read_bytes()[:4096])
    metrics = RecordingMetrics()
    handler = initialized(ObjectDetectorHandler(), model_dir, 4, metrics)
    choice = handler.runners["detector"]
    assert (choice.runner, [(r.runner, r.error.kind) for r in choice.refusals]) == (
        "onnxruntime-fp32", [("openvino-fp32", "load_failed")])
    described = handler.describe()["runners"]["detector"]
    assert described["runner"] == "onnxruntime-fp32" and described["file"] == "compiled/model.onnx"
    assert metrics.counters_of("HandlerRunnerSelected", "HandlerCompiledModelRefusals") == [
        ("HandlerRunnerSelected", 1, {"Network": "detector", "Runner": "onnxruntime-fp32"}),
        ("HandlerCompiledModelRefusals", 1, {"Reason": "load_failed", "Runner": "openvino-fp32"})]
    expected, thresholds = eager
    for got, want in zip(detect_at(handler, PHOTOS, thresholds), expected, strict=True):
        assert_same_detections(got, rows_from_answer(want), BOX_TOLERANCE_PX, SCORE_TOLERANCE)


def test_both_loads_of_an_engine_are_checked_against_the_eager_outputs_computed_once(
        detector_dir, tmp_path, monkeypatch):
    """With solo_threads, an engine is loaded twice (handlers.model.host_batches) and each load is
    checked; the eager network runs the probe photos once for both."""
    model_dir = with_handler_settings(detector_dir, tmp_path / "m", torch_threads=1, solo_threads=2,
                                      runner_order={"avx512_bf16": ["onnxruntime-fp32"],
                                                    "avx2": ["onnxruntime-fp32"]})
    calls: list[str] = []
    noting_calls(runner_selection, ("probe_head_reference", "check_head_outputs"), calls, monkeypatch)
    handler = initialized(ObjectDetectorHandler(), model_dir, 4)
    assert (handler.runner, handler.runners["detector"].solo_threads) == ("onnxruntime-fp32", 2)
    assert calls == ["probe_head_reference", "check_head_outputs", "check_head_outputs"]


def test_an_engine_of_another_model_is_refused_for_its_answers_and_the_eager_network_serves(
        detector_dir, tmp_path):
    # The same network with every weight moved a little (seed 1), converted as the builder does.
    model_dir = with_order(detector_dir, tmp_path / "m", ["openvino-fp32"])
    network = initialized(ObjectDetectorHandler(), detector_dir, 4).network
    torch.manual_seed(1)
    state = {name: value + 0.05 * torch.randn_like(value) if value.is_floating_point() else value
             for name, value in network.state_dict().items()}
    network.load_state_dict(state)
    convert_openvino(SsdBackboneHead(network).eval(), (3, 320, 320),
                     model_dir / "compiled" / "model-openvino.xml")
    refused = initialized(ObjectDetectorHandler(), model_dir, 4)
    choice = refused.runners["detector"]
    assert choice.runner == "eager"
    assert [(refusal.runner, refusal.error.kind) for refusal in choice.refusals] == [
        ("openvino-fp32", "wrong_output")]
    assert "differ from the fp32 eager network's" in str(choice.refusals[0].error)


def test_the_default_detector_serves_bf16_where_the_cpu_has_it_within_bf16s_bound_of_fp32(
        model_store, tmp_path):
    """config/models.yaml's detector asks for bf16: on a CPU with native bf16 its worker serves
    OpenVINO at bf16, past the check at worker start, and elsewhere an fp32 runner; either way
    its answers at the default 0.3 are the same archive's in fp32 within bf16's bound."""
    served_dir = extract_archive(model_store / "ssd_mobilenet_v2-1.0.mar", tmp_path / "served")
    handler_yaml = yaml.safe_load((served_dir / "model-config.yaml").read_text())["handler"]
    assert handler_yaml["precision"] == "bf16"
    served = initialized(ObjectDetectorHandler(), served_dir, 4)
    reference = initialized(ObjectDetectorHandler(),
                            with_handler_settings(served_dir, tmp_path / "fp32", precision="fp32"), 4)
    choice = served.runners["detector"]
    assert (choice.runner, choice.refusals) == (first_runner_here(handler_yaml, "detector"), ())
    assert choice.runner == ("openvino-bf16" if cpu_has_native_bf16() else reference.runner)
    assert reference.runner.endswith("-fp32")
    found = 0
    for name in PHOTOS:
        got, = detect(served, [name])
        want, = detect(reference, [name])
        assert_detections_within(got, want, PROBABILITY_BOUNDS["bf16"], 0.3)
        found += len(want)
    assert found >= 5
