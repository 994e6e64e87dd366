"""On a GPU: the same archive gives the CPU's answers (the rule of handlers.model.answer_agreement,
`cross_device_bound`), the batch's JPEGs decoded together on the device give each image what it
gets alone and every refusal the CPU's status and body for the same bytes, rotated JPEGs come
out upright (with either batched decoder: torchvision's nvJPEG and nvImageCodec's), and the
device's resize is the CPU's bit for bit.

Marked `gpu`: deselected unless pytest runs with --gpu (`lab gpu` and docs/testing.md run them:
`pytest --gpu -m gpu tests/gpu`); `--gpu-device cpu` rehearses them on a CPU machine, where they
compare the CPU with itself.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from handlers.ground.errors import ClientError
from handlers.ground.limits import ImageLimits
from handlers.request.decode import decode_images
from handlers.request.jpeg_batches import JPEG_DECODERS
from handlers.task.fixed_point_resize import resize_exact
from tests.answers import default_classifier
from tests.archives import stage_model_dir
from tests.detections import rows_from_answer
from tests.images import (
    corrupted_jpegs,
    decoded,
    encode,
    exif_with_orientation,
    jpeg_with_broken_huffman_table,
    textured_rgb,
)
from tests.ultralytics_models import assert_detections_within, comparison_photos
from torchserve_vision.lab.device_answers import STORED_TURNED, answer_check_images, compare_devices
from torchserve_vision.local_handler import archive_context, load_handler
from torchserve_vision.model_descriptions import parse_description
from torchserve_vision.photo_sets import jpeg, project_photos

pytestmark = pytest.mark.gpu

LIMITS = ImageLimits()
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def lite0_for_gpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default classifier (EfficientNet-Lite0, real weights) staged as `build --target gpu`
    stages it: no CPU packages, JPEGs decoded in full."""
    description = dataclasses.replace(default_classifier(), handler_options={
        **default_classifier().handler_options, "precision": "fp32"})
    return stage_model_dir(description, tmp_path_factory.mktemp("lite0-gpu"), "gpu")


def outcome(result: torch.Tensor | ClientError) -> tuple[object, ...]:
    if isinstance(result, ClientError):
        return ("refused", result.status, result.error_type, result.message)
    return ("decoded", tuple(result.shape))


def test_every_answer_on_the_gpu_is_the_cpus_within_the_device_bound(lite0_for_gpus, gpu_id):
    results = compare_devices(lite0_for_gpus, gpu_id, ["fp32", "tf32", "fp16", "bf16"],
                              answer_check_images(), decode_share=True, nvimgcodec=True)
    assert [(result.precision, result.decoded_on) for result in results] == [
        ("fp32", "device"), ("tf32", "device"), ("fp16", "device"), ("bf16", "device"), ("fp32", "cpu"),
        ("fp32", "nvimgcodec")]
    for result in results:
        assert result.agrees, (result.precision, result.decoded_on, result.disagreements)
    # Given the CPU's decoded pixels, the GPU's fp32 is the CPU's within fp32's own 1e-3: the
    # resize and the arithmetic add nothing; the decoder is the whole difference.
    assert results[4].bound == 1e-3
    assert results[0].top1_changes == results[4].top1_changes == results[5].top1_changes == 0


def test_fp32_answers_from_the_devices_decoder_are_within_the_0_02_target(lite0_for_gpus, gpu_id):
    """The target of interpolating nvJPEG's chroma (handlers.request.chroma_upsampling): with the
    chroma repeated as nvJPEG repeats it, emulated on a CPU, 0.034; interpolated, 0.006. What is
    left on a GPU is nvJPEG's own IDCT and colour conversion."""
    (fp32,) = compare_devices(lite0_for_gpus, gpu_id, ["fp32"], answer_check_images())
    assert fp32.max_change < 0.02, (fp32.worst_image, fp32.max_change)
    assert fp32.top1_changes == 0


def test_the_resize_on_the_device_is_the_cpus_bit_for_bit(device):
    generator = torch.Generator().manual_seed(0)
    for input_hw, output_hw in [((720, 720), (256, 256)), ((427, 640), (256, 383)),
                                ((3000, 4000), (256, 341)), ((48, 64), (256, 341))]:
        images = torch.randint(0, 256, (4, 3, *input_hw), dtype=torch.uint8, generator=generator)
        expected = F.interpolate(images, size=list(output_hw), mode="bilinear", antialias=True)
        assert torch.equal(resize_exact(images.to(device), output_hw).cpu(), expected)


@pytest.mark.parametrize("decoder", JPEG_DECODERS)
def test_a_mixed_batch_on_the_device_gets_what_each_image_gets_alone_there(device, decoder):
    good = encode(textured_rgb(60, 80, seed=1), "JPEG", quality=90)
    batch = [good, encode(textured_rgb(90, 70, seed=2), "JPEG"),
             encode(textured_rgb(60, 80, seed=3), "JPEG", progressive=True),
             encode(textured_rgb(40, 56, seed=4).convert("CMYK"), "JPEG"),
             jpeg_with_broken_huffman_table(good), good[: len(good) // 2], b"", b"text\n",
             encode(textured_rgb(30, 40, seed=5), "PNG"), jpeg(project_photos()[0].image, 90)]
    together = decode_images(batch, LIMITS, device, decoder=decoder)
    for data, result in zip(batch, together, strict=True):
        (alone,) = decode_images([data], LIMITS, device, decoder=decoder)
        assert outcome(result) == outcome(alone)
        if isinstance(result, torch.Tensor):
            assert result.device == device and torch.equal(result, decoded(alone))


def corrupted_corpus() -> list[bytes]:
    return corrupted_jpegs(jpeg(project_photos()[1].image, 90))


@pytest.mark.parametrize("decoder", JPEG_DECODERS)
def test_truncated_and_corrupted_jpegs_get_the_cpus_status_and_body_on_the_device(device, decoder):
    corpus = corrupted_corpus()
    on_device = decode_images(corpus, LIMITS, device, decoder=decoder)
    on_cpu = decode_images(corpus, LIMITS, CPU)
    for index, (got, expected) in enumerate(zip(on_device, on_cpu, strict=True)):
        assert outcome(got) == outcome(expected), index


@pytest.mark.parametrize("decoder", JPEG_DECODERS)
@pytest.mark.parametrize("orientation", sorted(STORED_TURNED))
def test_a_rotated_jpeg_comes_out_upright_on_the_device(device, orientation, decoder):
    turned = encode(textured_rgb(90, 140, seed=orientation).transpose(STORED_TURNED[orientation]),
                    "JPEG", quality=95, exif=exif_with_orientation(orientation))
    on_device, on_cpu = (decoded(decode_images([turned], LIMITS, where, decoder=decoder)[0])
                         for where in (device, CPU))
    assert on_device.shape == on_cpu.shape == (3, 90, 140)
    # The device's decoder is not libjpeg: its pixels are close to the CPU's, and far closer than
    # the photo mirrored would be (the gradient runs along its width).
    near = (on_device.cpu().float() - on_cpu.float()).abs().mean()
    assert near < 0.25 * (on_cpu.float() - on_cpu.flip(-1).float()).abs().mean()


@pytest.mark.parametrize("name", ["yolov8n.torchscript", "yolo26n-end2end.torchscript"])
def test_an_ultralytics_export_answers_the_cpus_detections_on_the_gpu(name, ultralytics_exports, gpu_id,
                                                                      tmp_path):
    """The batched GPU path of an Ultralytics export: the same integer letterbox on the device
    (OpenCV's resize, bit for bit), the network in float32 there, Ultralytics' NMS on the device.
    Each photo's detections are the CPU's within the bounds against Ultralytics itself (boxes
    1 px, scores 1e-3, a detection within 1e-3 of the threshold on either side)."""
    description = parse_description({"name": "yolo", "task": "detection", "model": {
        "source": "ultralytics", "weights": str(ultralytics_exports[name])}})
    model_dir = stage_model_dir(description, tmp_path)
    bodies = list(comparison_photos().values())
    rows = [{"body": bytearray(body)} for body in bodies]
    answers = {}
    for device_id in (None, gpu_id):
        handler = load_handler(model_dir, 8, device_id)
        context = archive_context(model_dir, 8, [{} for _ in rows], device_id)
        answers[device_id] = [json.loads(reply) for reply in handler.handle(rows, context)]
        assert all(context.status(index) == 200 for index in range(len(rows)))
    for on_cpu, on_device in zip(answers[None], answers[gpu_id], strict=True):
        assert_detections_within(on_device, rows_from_answer(on_cpu), 0.25)
