"""An int8 OpenVINO model for the archive builder: post-training quantization calibrated on real
photos, kept only when its answers pass a gate measured on *other* real photos.

The photos (torchserve_vision/photo_sets.py: the project's, or the folder `--images DIR` names)
are split by source before anything is grown from them: the calibration images are variants of
one part of the sources, the gate images variants of the other, so no variant of a calibration
photo is judged by the gate. Both are decoded, resized and cropped as a worker does.

The quantizer: NNCF 3.4's `nncf.quantize` on the archive's OpenVINO IR, preset `performance`
(symmetric int8 weights and activations), activation ranges from the calibration images' plain
minimum and maximum, weights held to 7 bits in every layer (NNCF's overflow fix: CPUs without
VNNI multiply int8 pairs into saturating 16-bit sums, and the fix is what keeps their answers
those of a VNNI CPU), fast bias correction, and the depthwise convolutions (OpenVINO's
GroupConvolution) and fully connected layers (MatMul) left in float.

Measured on EfficientNet-Lite0 (docs/benchmarks.md, "int8"), calibrated on 300 variants of three
scenes, gate of 300 variants of two others, top-1 agreement with fp32 (OpenVINO bf16 agrees
99.3 % on the same set): NNCF's defaults 38 % (largest probability shift 0.77), whether or not the
first and last layers stay in float; min/max ranges 91 %; accuracy-controlled quantization (6 of
60 layers put back in float to lose at most 3 % on other variants of the calibration scenes) 91 %;
depthwise convolutions in float 93.7 %, with min/max ranges 96.7 %, also the classifier in float
97.7 % on this VNNI CPU but 93.7 % held to AVX2 (the saturation above); with 7-bit weights
95.7 % on both (largest shift 0.16), and 96.0 % with asymmetric activations (preset `mixed`);
full bias correction 80 %. The gate runs the int8 model with its float layers in fp32 and NNCF
collects its statistics in fp32, and 7-bit weights keep a CPU without VNNI to the arithmetic of
one with it; the verdict still moves a little with the CPU, because fp32 kernels sum in another
order on another CPU and the activation ranges, so the scales, follow: the same build measured
95.7 % on the Zen 4 and 97.0 % on an AVX2-only EPYC (4 of 300 images). A worker checks the
model again at its own precision before serving it (handlers/model/runner_selection.py).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from handlers.model.engine_runners import openvino_core
from handlers.model.openvino_package import block_openvino_telemetry, openvino_package
from handlers.model.settings import Int8Settings
from handlers.request.decode import ImageLimits, decode_image_bytes
from handlers.task.transforms import preprocess_classification_batch
from torchserve_vision.photo_sets import load_photos, split_by_source, variant_jpegs

INT8_FILE = "model-openvino-int8.xml"   # and model-openvino-int8.bin beside it
GATE_SHARE = 0.4                         # of the photos' sources, held out for the gate
QUANTIZER = ("NNCF post-training quantization: preset performance, min/max activation ranges, "
             "7-bit weights, fast bias correction, depthwise convolutions and fully connected "
             "layers in float")
FLOAT_LAYER_TYPES = ["GroupConvolution", "MatMul"]
CALIBRATION_SEED, GATE_SEED = 1, 2


class Int8GateFailed(RuntimeError):
    """The int8 model's answers moved too far from the fp32 model's (and the build was not forced)."""


@dataclass(frozen=True)
class Preprocessing:
    """How the classifier's worker turns a photo into its input."""

    resize_size: int
    input_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


@dataclass(frozen=True)
class Int8Request:
    """What `compile.int8` and the build command ask for."""

    settings: Int8Settings
    preprocessing: Preprocessing
    images_dir: Path | None = None    # photos to calibrate and gate on (None: the project's)
    force: bool = False               # keep a model that fails its gate


@dataclass(frozen=True)
class Int8Gate:
    """The gate's verdict and what it was measured on."""

    min_agreement: float
    agreement: float                  # share of gate images whose top-1 is the fp32 model's
    max_probability_shift: float      # the largest change of any class probability, over the images
    median_probability_shift: float   # the median over the images of each one's largest change
    calibration_images: int
    gate_images: int
    calibration_sources: tuple[str, ...]
    gate_sources: tuple[str, ...]
    photos: str                       # "the project's photos" or the folder
    forced: bool = False

    @property
    def passed(self) -> bool:
        return self.agreement >= self.min_agreement

    def summary(self) -> str:
        verdict = "passes" if self.passed else ("FAILS (kept: forced)" if self.forced else "FAILS")
        return (f"int8 gate {verdict}: top-1 agreement with fp32 {self.agreement:.1%} "
                f"(at least {self.min_agreement:.1%}) on {self.gate_images} variants of "
                f"{len(self.gate_sources)} held-out sources {list(self.gate_sources)}; probability "
                f"shift largest {self.max_probability_shift:.3f}, median "
                f"{self.median_probability_shift:.3f}; calibrated on {self.calibration_images} "
                f"variants of {list(self.calibration_sources)} ({self.photos}; {QUANTIZER})")

    def to_dict(self) -> dict[str, Any]:
        described = asdict(self)
        described.update(calibration_sources=list(self.calibration_sources),
                         gate_sources=list(self.gate_sources), quantizer=QUANTIZER)
        return described


def model_input(jpegs: Sequence[bytes], preprocessing: Preprocessing) -> torch.Tensor:
    """`float[N, 3, S, S]`: JPEGs decoded, resized, cropped and normalized as the worker does."""
    images = [decode_image_bytes(body, ImageLimits()) for body in jpegs]
    return preprocess_classification_batch(images, preprocessing.resize_size, preprocessing.input_size,
                                           preprocessing.mean, preprocessing.std, torch.device("cpu"))


def quantized(float_ir: Path, calibration: torch.Tensor) -> Any:
    """The OpenVINO model at `float_ir`, quantized to int8 by NNCF on `calibration` images."""
    block_openvino_telemetry()       # NNCF imports OpenVINO and its telemetry
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, OverflowFix
    from nncf.quantization.range_estimator import RangeEstimatorParametersSet

    nncf.set_log_level(logging.ERROR)
    dataset = nncf.Dataset([image[None].numpy() for image in calibration])
    advanced = AdvancedQuantizationParameters(
        activations_range_estimator_params=RangeEstimatorParametersSet.MINMAX,
        overflow_fix=OverflowFix.ENABLE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nncf.quantize(openvino_core().read_model(str(float_ir)), dataset,
                             preset=nncf.QuantizationPreset.PERFORMANCE, subset_size=len(calibration),
                             ignored_scope=nncf.IgnoredScope(types=FLOAT_LAYER_TYPES, validate=False),
                             advanced_parameters=advanced)


def answer_shift(model: nn.Module, int8_ir: Path, images: torch.Tensor, batch_size: int = 8
                 ) -> tuple[float, float, float]:
    """(top-1 agreement, largest, median per-image largest probability change) of the int8 model
    (float layers in fp32) against `model` in fp32 on `images`."""
    compiled = openvino_core().compile_model(str(int8_ir), "CPU", {
        "INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": torch.get_num_threads()})
    with torch.inference_mode():
        expected = torch.cat([model(chunk).float() for chunk in images.split(batch_size)]).softmax(dim=1)
    got = torch.cat([torch.from_numpy(compiled(chunk.numpy())[0].copy())
                     for chunk in images.split(batch_size)]).float().softmax(dim=1)
    shift = (got - expected).abs().amax(dim=1)
    # A count over the images, not a float32 mean: 288 of 300 is 0.96 exactly, on the gate.
    agreeing = int((got.argmax(dim=1) == expected.argmax(dim=1)).sum())
    return agreeing / len(images), float(shift.max()), float(shift.median())


def build_int8_model(model: nn.Module, float_ir: Path, request: Int8Request) -> Int8Gate:
    """Quantize `float_ir` into INT8_FILE beside it and measure the gate. Int8GateFailed (the file
    removed) when the gate fails and the request does not force it; the gate otherwise. Raises
    photo_sets.PhotoSetError for a folder that gives no photo set."""
    settings, preprocessing, images_dir, force = (request.settings, request.preprocessing,
                                                  request.images_dir, request.force)
    photos = load_photos(images_dir)
    calibration_photos, gate_photos = split_by_source(photos, GATE_SHARE)
    calibration = model_input(variant_jpegs(calibration_photos, settings.calibration_images,
                                            CALIBRATION_SEED), preprocessing)
    gate_images = model_input(variant_jpegs(gate_photos, settings.gate_images, GATE_SEED), preprocessing)
    openvino = openvino_package()
    path = float_ir.parent / INT8_FILE
    openvino.save_model(quantized(float_ir, calibration), str(path), compress_to_fp16=False)
    agreement, largest, median = answer_shift(model.eval(), path, gate_images)
    gate = Int8Gate(settings.min_agreement, agreement, largest, median, len(calibration),
                    len(gate_images), tuple(sorted({p.source for p in calibration_photos})),
                    tuple(sorted({p.source for p in gate_photos})),
                    "the project's photos" if images_dir is None else str(images_dir), force)
    if not gate.passed and not force:
        path.unlink()
        path.with_suffix(".bin").unlink(missing_ok=True)
        raise Int8GateFailed(f"{gate.summary()}. The int8 model is left out of the archive: "
                             "calibrate on photos like the ones served (--images DIR), lower "
                             "compile.int8.min_agreement, drop compile.int8, or keep it anyway "
                             "with --force-int8")
    return gate
