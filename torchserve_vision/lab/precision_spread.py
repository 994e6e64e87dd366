"""How far reduced precision and compiled code move a classifier's answers, on this CPU.

For each archive: every image of scikit-image's data folder in four orientations (26 images x 4:
colour photos of things ImageNet has classes for, and scans, micrographs, textures, drawings),
decoded and preprocessed as the worker does, answered by the eager fp32 model at batch 1 (the
reference) and by each other runner (eager fp32 / bf16, and each compiled package in the archive)
at batch 1 and 8. Prints, per runner and batch size, the largest change of any class probability
on the photos (`photos.CLASSIFIER_PHOTOS`) and on the other images, and how many photo answers the
criterion of handlers/model/answer_agreement.py refuses at the shipped bounds. The photo figures set
the bounds (docs/precision.md).

    torchserve-vision lab precision                      # Lite0/1/2 from model_store/
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 torchserve-vision lab precision
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from handlers.ground.limits import ImageLimits
from handlers.model.answer_agreement import answer_disagreement, probability_bound, top_classes
from handlers.model.compiled_model import load_aoti_package
from handlers.model.model_loading import autocast
from handlers.model.settings import ClassifierSettings
from handlers.request.decode import decode_image_bytes
from handlers.task.transforms import preprocess_classification_batch
from torchserve_vision.local_handler import eager_classifier, extract_archive
from torchserve_vision.photos import CLASSIFIER_PHOTOS, all_photo_paths

Forward = Callable[[torch.Tensor], torch.Tensor]
BATCH_SIZES = (1, 8)
TOP_K = 5


@dataclass(frozen=True)
class Spread:
    """One runner at one batch size against eager fp32 at batch 1."""

    archive: str
    runner: str             # eager-fp32 | eager-bf16 | package-fp32 | package-bf16
    precision: str
    batch_size: int
    photos: int
    max_photo_change: float     # the largest change of any class probability, over the photos
    worst_photo: str
    refused_photos: int         # photo answers the agreement criterion refuses at the shipped bound
    max_other_change: float     # the same over the other images (scans, micrographs, drawings)
    worst_other: str


def photo_batch(settings: ClassifierSettings) -> tuple[list[str], torch.Tensor]:
    """(names, normalized float batch) of every photo in four orientations, decoded as a worker
    decodes a request."""
    names, images = [], []
    for path in all_photo_paths():
        image = decode_image_bytes(path.read_bytes(), ImageLimits())
        variants = {"": image, "-hflip": image.flip(-1), "-vflip": image.flip(-2),
                    "-transposed": image.transpose(-1, -2)}
        for suffix, variant in variants.items():
            names.append(path.name + suffix)
            images.append(variant.contiguous())
    batch = preprocess_classification_batch(images, settings.resize_size, settings.input_size,
                                            settings.mean, settings.std, torch.device("cpu"))
    if settings.channels_last:
        batch = batch.contiguous(memory_format=torch.channels_last)
    return names, batch


def probabilities(forward: Forward, batch: torch.Tensor, batch_size: int) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([forward(chunk).float().softmax(dim=1) for chunk in batch.split(batch_size)])


def is_photo(name: str) -> bool:
    return name.split("-")[0] in CLASSIFIER_PHOTOS


def spread_of(archive: str, runner: str, precision: str, batch_size: int, names: Sequence[str],
              got: torch.Tensor, reference: torch.Tensor) -> Spread:
    change = (got - reference).abs().amax(dim=1)
    bound = probability_bound(precision)
    photos = [index for index, name in enumerate(names) if is_photo(name)]
    others = [index for index in range(len(names)) if index not in photos]
    refused = sum(answer_disagreement(top_classes(got[index], TOP_K),
                                      top_classes(reference[index], TOP_K), bound) is not None
                  for index in photos)
    worst_photo = max(photos, key=lambda index: float(change[index]))
    worst_other = max(others, key=lambda index: float(change[index]))
    return Spread(archive, runner, precision, batch_size, len(photos), float(change[worst_photo]),
                  names[worst_photo], refused, float(change[worst_other]), names[worst_other])


def runners_of(model_dir: Path, settings: ClassifierSettings, network: torch.nn.Module
               ) -> dict[str, tuple[str, Forward]]:
    """name -> (precision, forward): eager in fp32 and bf16, and each package of the archive."""
    device = torch.device("cpu")

    def eager_bf16(batch: torch.Tensor) -> torch.Tensor:
        with autocast(device, "bf16"):
            return network(batch)

    runners: dict[str, tuple[str, Forward]] = {"eager-fp32": ("fp32", network),
                                               "eager-bf16": ("bf16", eager_bf16)}
    for package in settings.compiled_packages:
        name = f"package-{package.target.precision}-{package.target.cpu_capability.lower()}"
        runners[name] = (package.target.precision, load_aoti_package(model_dir / package.file))
    return runners


def measure_archive(archive: Path, threads: int) -> list[Spread]:
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = extract_archive(archive, Path(tmp))
        settings, network = eager_classifier(model_dir)
        names, batch = photo_batch(settings)
        reference = probabilities(network, batch, 1)
        spreads = []
        for runner, (precision, forward) in runners_of(model_dir, settings, network).items():
            for batch_size in BATCH_SIZES:
                if runner == "eager-fp32" and batch_size == 1:
                    continue  # the reference itself
                got = probabilities(forward, batch, batch_size)
                spreads.append(spread_of(archive.name, runner, precision, batch_size, names, got,
                                         reference))
    return spreads


def spreads_table(spreads: Sequence[Spread]) -> str:
    lines = [f"{'archive':<27} {'runner':<18} {'batch':>5} {'photos':>6} {'max |dp|':>8} "
             f"{'bound':>6} {'refused':>7} {'worst photo':<26} {'others':>6}  worst other"]
    for s in spreads:
        lines.append(f"{s.archive:<27} {s.runner:<18} {s.batch_size:>5} {s.photos:>6} "
                     f"{s.max_photo_change:>8.2g} {probability_bound(s.precision):>6g} "
                     f"{s.refused_photos:>7} {s.worst_photo:<26} {s.max_other_change:>6.3f}  "
                     f"{s.worst_other}")
    return "\n".join(lines)
