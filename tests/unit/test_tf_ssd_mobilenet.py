"""The converted SSD MobileNetV2 COCO against references no one here wrote: OpenCV's `dnn` running
the same frozen graph (raw outputs of every anchor, anchors, final detections), the graph's own
anchor constants, and ONNX Runtime's Resize for TensorFlow 1's bilinear resize."""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import cv2
import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnx import TensorProto, helper
from PIL import Image
from torchvision.transforms.v2 import functional as F

from handlers.model.settings import parse_detection_defaults
from handlers.model.ssd_engine import SsdBackboneHead, image_anchors_xyxy, ssd_input_batch, transformed_batch
from handlers.model.tf_ssd_mobilenet import (
    ARCHITECTURE,
    GRAPH_SCORE_THRESHOLD,
    INPUT_SIZE,
    TfSsdMobileNetV2,
    anchor_boxes,
    layer_scales,
    tf1_bilinear_resize,
)
from tests.images import PHOTOS_DIR
from torchserve_vision import paths
from torchserve_vision.archives.tensorflow_graph import graph_constants, node_attributes
from torchserve_vision.archives.tf_ssd_weights import packaged_graph, ssd_mobilenet_v2_coco_state_dict
from torchserve_vision.model_descriptions import load_descriptions

PHOTOS = ("astronaut.png", "coffee.png", "chelsea.png", "motorcycle_left.png", "rocket.jpg")
TEXT_GRAPH = "ssd_mobilenet_v2_coco_2018_03_29.pbtxt"
# float32 through some 70 layers, computed in another order: seen at most 7e-5 on logits of up to
# 17.5 and 4e-5 on box encodings (AVX2 EPYC); the bound keeps a tenfold margin.
RAW_OUTPUT_BOUND = 1e-3
BOX_BOUND_PX = 1.5             # final boxes, in the 300 x 300 frame
SCORE_BOUND = 0.01
# OpenCV's text graph gives the fifth aspect ratio as 1/3, the frozen graph as 0.3333: those
# anchors differ by up to 0.11 px of 300.
OPENCV_ANCHOR_BOUND_PX = 0.12


@cache
def network() -> TfSsdMobileNetV2:
    model = TfSsdMobileNetV2(score_thresh=0.01)
    model.load_state_dict(ssd_mobilenet_v2_coco_state_dict())
    return model.eval()


def photo_300(name: str) -> np.ndarray:
    """`uint8[300, 300, 3]` RGB: the photo resized by Pillow (any resize: both sides get this array)."""
    image = Image.open(PHOTOS_DIR / name).convert("RGB")
    image = image.resize((INPUT_SIZE, INPUT_SIZE), Image.Resampling.BILINEAR)
    return np.array(image)


def opencv_net(text_graph: Path | None = None) -> cv2.dnn.Net:
    graph = packaged_graph()
    return cv2.dnn.readNetFromTensorflow(str(graph), str(text_graph or graph.parent / TEXT_GRAPH),
                                         cv2.dnn.ENGINE_CLASSIC)


def opencv_outputs(net: cv2.dnn.Net, pixels: np.ndarray, *names: str) -> list[np.ndarray]:
    """The named layers' outputs for raw RGB pixels (the graph scales them to [-1, 1] itself)."""
    net.setInput(cv2.dnn.blobFromImage(pixels, 1.0, (INPUT_SIZE, INPUT_SIZE), (0, 0, 0), swapRB=False))
    return list(net.forward(list(names)))


def module_head_outputs(pixels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Box encodings `[1917, 4]` and class logits `[1917, 91]` for the same pixels: the module's
    own transform (scaling to [-1, 1]; resizing 300 to 300 is the identity), backbone and head."""
    model = network()
    image = torch.from_numpy(pixels).permute(2, 0, 1).float() / 255
    with torch.inference_mode():
        batch = model.transform([image])[0].tensors
        regression, logits = SsdBackboneHead(model)(batch)
    return regression[0], logits[0]


@pytest.fixture(scope="module")
def opencv() -> cv2.dnn.Net:
    return opencv_net()


@pytest.mark.parametrize("name", PHOTOS)
def test_every_anchors_raw_outputs_are_opencvs(opencv: cv2.dnn.Net, name: str) -> None:
    pixels = photo_300(name)
    boxes, logits = opencv_outputs(opencv, pixels, "BoxEncodingPredictor/concat", "ClassPredictor/concat")
    regression, our_logits = module_head_outputs(pixels)
    # OpenCV's concatenated encodings are (x, y, w, h), the order the converted head keeps
    np.testing.assert_allclose(regression.numpy(), boxes.reshape(-1, 4), atol=RAW_OUTPUT_BOUND, rtol=0)
    np.testing.assert_allclose(our_logits.numpy(), logits.reshape(-1, 91), atol=RAW_OUTPUT_BOUND, rtol=0)
    assert regression.shape == (1917, 4)


def test_the_scaling_to_minus_one_one_happens_once() -> None:
    """The transform maps 0 and 255 to -1 and 1: the handler's [0, 1] pixels are scaled once, and
    the backbone's first layer sees the graph's `Preprocessor/sub` output."""
    model = network()
    image = torch.zeros(3, INPUT_SIZE, INPUT_SIZE)
    image[:, :, INPUT_SIZE // 2:] = 1.0
    batch = model.transform([image])[0].tensors
    assert set(batch.unique().tolist()) == {-1.0, 1.0}


def test_anchors_are_the_graphs_and_opencvs(opencv: cv2.dnn.Net) -> None:
    """The graph computes its anchors from per-layer scales and aspect ratios (constants of
    MultipleGridAnchorGenerator): ours use the same numbers, and land where OpenCV's priors do."""
    constants = graph_constants(packaged_graph(), ("MultipleGridAnchorGenerator/",))
    ratios = [constants[f"MultipleGridAnchorGenerator/Sqrt{'' if layer == 0 else f'_{layer}'}/x"]
              for layer in range(6)]
    scales = layer_scales(6)
    for layer in range(6):
        ours = np.array(anchor_boxes(layer, scales[layer], scales[layer + 1]), dtype=np.float32)
        np.testing.assert_array_equal(ours[:, 1], ratios[layer])
    priors = opencv_outputs(opencv, photo_300("astronaut.png"), "PriorBox/concat")[0][0, 0].reshape(-1, 4)
    anchors = image_anchors_xyxy(network()).numpy()
    assert anchors.shape == (1917, 4)
    np.testing.assert_allclose(anchors, priors * INPUT_SIZE, atol=OPENCV_ANCHOR_BOUND_PX, rtol=0)


def text_graph_with_graph_nms(directory: Path) -> Path:
    """OpenCV's text graph with its DetectionOutput set as the frozen graph's NMS: OpenCV's keeps
    scores > 0.01 and the best 100 of a class before NMS; the graph keeps scores > 0.3 and (up to
    100 of a class) after NMS, which is no limit before it."""
    text = (packaged_graph().parent / TEXT_GRAPH).read_text()
    threshold = r'(key: "confidence_threshold"\s*value \{\s*f: )[0-9.e-]+'
    text = re.sub(threshold, rf"\g<1>{GRAPH_SCORE_THRESHOLD}", text)
    text = re.sub(r'(key: "top_k"\s*value \{\s*i: )\d+', r"\g<1>-1", text)
    path = directory / TEXT_GRAPH
    path.write_text(text)
    return path


def test_the_graphs_postprocess_settings_are_the_modules() -> None:
    constants = graph_constants(packaged_graph(), ("Postprocessor/BatchMultiClassNonMaxSuppression/",))

    def values(suffix: str) -> set[float]:
        return {float(value) for name, value in constants.items() if name.endswith(suffix)}

    model = network()
    assert values("FilterGreaterThan/Greater/y") == {float(np.float32(GRAPH_SCORE_THRESHOLD))}
    assert values("iou_threshold") == {float(np.float32(model.nms_thresh))}
    assert values("MultiClassNonMaxSuppression/Minimum/x") == {model.detections_per_img}   # per class
    assert values("PadOrClipBoxList/Greater/y") == {model.detections_per_img}              # in all
    resize = node_attributes(packaged_graph(), "ResizeBilinear")
    assert [node["align_corners"] for node in resize.values()] == [False]
    assert all("half_pixel_centers" not in node for node in resize.values())   # TensorFlow 1's legacy


def test_the_served_default_score_threshold_is_the_graphs() -> None:
    """config/models.yaml serves ssd_mobilenet_v2 at the graph's own threshold by default (a
    request may ask for another): a change to either is a change to both."""
    (described,) = [d for d in load_descriptions(paths.MODEL_DESCRIPTIONS) if d.name == "ssd_mobilenet_v2"]
    assert described.architecture == ARCHITECTURE
    defaults, _ = parse_detection_defaults(described.handler_options["detection"])
    assert defaults.score_threshold == GRAPH_SCORE_THRESHOLD


@pytest.fixture(scope="module")
def opencv_graph_nms(tmp_path_factory: pytest.TempPathFactory) -> cv2.dnn.Net:
    return opencv_net(text_graph_with_graph_nms(tmp_path_factory.mktemp("opencv")))


def clear_of_threshold(scores: np.ndarray) -> np.ndarray:
    return np.abs(scores - GRAPH_SCORE_THRESHOLD) > SCORE_BOUND


@pytest.mark.parametrize("name", PHOTOS)
def test_final_detections_are_opencvs(opencv_graph_nms: cv2.dnn.Net, name: str) -> None:
    pixels = photo_300(name)
    rows = opencv_outputs(opencv_graph_nms, pixels, "detection_out")[0][0, 0]
    rows = rows[rows[:, 2] > GRAPH_SCORE_THRESHOLD]
    rows = rows[clear_of_threshold(rows[:, 2])]
    model = network()
    with torch.inference_mode():
        found = model([torch.from_numpy(pixels).permute(2, 0, 1).float() / 255])[0]
    keep = (found["scores"] > GRAPH_SCORE_THRESHOLD).numpy() & clear_of_threshold(found["scores"].numpy())
    ours = [(int(label), float(score), box) for label, score, box in
            zip(found["labels"][keep], found["scores"][keep], found["boxes"][keep].numpy(), strict=True)]
    assert len(ours) == len(rows)
    for (label, score, box), row in zip(ours, rows, strict=True):
        assert label == int(row[1])
        assert score == pytest.approx(float(row[2]), abs=SCORE_BOUND)
        np.testing.assert_allclose(box, row[3:7] * INPUT_SIZE, atol=BOX_BOUND_PX, rtol=0)


def onnx_asymmetric_resize(size_hw: tuple[int, int]) -> onnxruntime.InferenceSession:
    """ONNX Runtime's Resize, linear, `coordinate_transformation_mode=asymmetric`: the source
    position of output pixel i is i * scale, TensorFlow 1's legacy mapping."""
    node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="linear",
                            coordinate_transformation_mode="asymmetric")
    graph = helper.make_graph(
        [node], "resize", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [helper.make_tensor("sizes", TensorProto.INT64, [4], [1, 3, *size_hw])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    return onnxruntime.InferenceSession(onnx.load_from_string(model.SerializeToString()).SerializeToString(),
                                        providers=["CPUExecutionProvider"])


def resize_cases() -> Iterator[tuple[tuple[int, int], tuple[int, int]]]:
    yield (720, 720), (300, 300)          # a served photo, down
    yield (512, 383), (300, 300)          # sides that do not divide
    yield (37, 53), (300, 300)            # up
    yield (300, 300), (300, 300)          # the identity


@pytest.mark.parametrize(("in_hw", "out_hw"), list(resize_cases()))
def test_tf1_resize_is_onnx_runtimes_asymmetric_linear_resize(in_hw: tuple[int, int],
                                                              out_hw: tuple[int, int]) -> None:
    generator = torch.Generator().manual_seed(in_hw[0])
    images = torch.rand(1, 3, *in_hw, generator=generator) * 255
    expected = onnx_asymmetric_resize(out_hw).run(None, {"x": images.numpy()})[0]
    # ONNX Runtime divides by out / in where TensorFlow multiplies by in / out: a source position
    # rounds differently by up to about in_size x 2**-23, which moves a 0..255 value by up to 0.02
    # at 720 px
    np.testing.assert_allclose(tf1_bilinear_resize(images, out_hw).numpy(), expected, atol=0.05, rtol=0)
    if in_hw == out_hw:
        assert torch.equal(tf1_bilinear_resize(images, out_hw), images)


def test_the_batched_uint8_transform_is_the_networks_own_resize_then_scaling_bit_for_bit() -> None:
    """`ssd_input_batch` on uint8 photos of three sizes (two alike, so resized as one batch) is
    the network's own transform of the same photos as floats, bit for bit, and each image is its
    TensorFlow 1 resize alone, then scaled to [-1, 1]: the graph's order (it resizes the pixels,
    then scales them), and no image of a batch reads another's pixels."""
    model = TfSsdMobileNetV2().eval()        # the transform has no weights
    generator = torch.Generator().manual_seed(3)
    uint8 = [torch.randint(0, 256, (3, *size_hw), dtype=torch.uint8, generator=generator)
             for size_hw in [(480, 640), (300, 451), (480, 640)]]
    floats = [F.to_dtype(image, torch.float32, scale=True) for image in uint8]
    expected = transformed_batch(model, floats)
    assert torch.equal(ssd_input_batch(model, uint8, torch.device("cpu")), expected.tensors)
    for image, batch_row in zip(floats, expected.tensors, strict=True):
        alone = tf1_bilinear_resize(image[None], (INPUT_SIZE, INPUT_SIZE))[0]
        assert torch.equal(batch_row, (alone - 0.5) / 0.5)
    assert expected.image_sizes == [(INPUT_SIZE, INPUT_SIZE)] * 3
