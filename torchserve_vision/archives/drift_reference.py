"""The reference profile of a model version (handlers.drift), recorded at build time.

After torch-model-archiver has written the archive, its own handler is loaded in-process (as a
worker loads it, on the CPU, serving the eager network in fp32: see `serve_eager_fp32`) and
answers REFERENCE_REQUESTS reference requests (`build --drift-reference-requests N` changes it;
0: no profile): the photos of the build's photo set (the project's photos of ImageNet subjects,
or the folder `build --images DIR` names) whole, then seeded variants of them (crops,
mirroring, short sides of 180-720 px, JPEG qualities 50-95) up to that count. The handler's
drift stage counts them into the fixed buckets exactly as it counts served requests, and their
shares are added to the archive as `drift_reference.json`. Single-network archives only
(classification, detection); a pipeline's answers are its stages', which carry their own
profiles.
"""

from __future__ import annotations

import functools
import json
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

import torch
import yaml

from handlers.drift.drift_features import CLASSIFICATION_FEATURES, DETECTION_FEATURES
from handlers.drift.drift_profile import PROFILE_FILE, DriftProfile
from torchserve_vision.local_handler import LocalContext, extract_archive, load_handler
from torchserve_vision.photo_sets import load_photos, variant_jpegs

REFERENCE_REQUESTS = 192
REFERENCE_SEED = 35
FEATURES_OF_TASK = {"classification": CLASSIFICATION_FEATURES, "detection": DETECTION_FEATURES}


@functools.lru_cache(maxsize=4)
def reference_bodies(images_dir: Path | None, count: int = REFERENCE_REQUESTS) -> tuple[bytes, ...]:
    """The reference set's request bodies: every photo whole, then seeded variants (made once per
    process and folder: a build of several archives records them all from the same set)."""
    return tuple(variant_jpegs(load_photos(images_dir), count, REFERENCE_SEED))


def record_profile(archive: Path, task: str, bodies: Sequence[bytes], source: str,
                   batch_size: int = 8) -> DriftProfile:
    """The archive's handler answers `bodies` in batches; its drift counts become the profile.
    The handler may set torch's thread count (as a worker does): it is put back after."""
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="drift-reference-") as tmp:
        model_dir = extract_archive(archive, Path(tmp))
        serve_eager_fp32(model_dir)
        handler = load_handler(model_dir, batch_size)
        for start in range(0, len(bodies), batch_size):
            chunk = bodies[start:start + batch_size]
            context = LocalContext(str(model_dir), {}, {}, request_headers=[{}] * len(chunk))
            handler.handle_batch([{"body": bytearray(body)} for body in chunk], context)
            refused = {index: status for index, (status, _) in context.statuses.items() if status != 200}
            if refused:
                raise ValueError(f"reference requests refused by the model: {refused}")
        assert handler.drift is not None
        counts = handler.drift.counts
    torch.set_num_threads(threads)
    return DriftProfile.from_counts(counts, FEATURES_OF_TASK[task], source)


def serve_eager_fp32(model_dir: Path) -> None:
    """Make the extracted archive's handler serve its eager network in fp32: the profile is then
    the same whichever CPU builds it (a compiled bf16 runner's probabilities differ in the third
    decimal, which moves answers near a bucket's edge), and equal for archives that differ only
    in their compiled models."""
    manifest = json.loads((model_dir / "MAR-INF" / "MANIFEST.json").read_text())
    config = model_dir / manifest["model"]["configFile"]
    model_yaml = yaml.safe_load(config.read_text())
    handler = model_yaml["handler"]
    for compiled in ("compiled_packages", "engine_models", "runner_order", "int8_gate"):
        handler.pop(compiled, None)
    if "precision" in handler:
        handler["precision"] = "fp32"
    config.write_text(yaml.safe_dump(model_yaml))


def add_profile(archive: Path, profile: DriftProfile) -> None:
    """Store the profile in the archive (replacing none: a fresh archive has none)."""
    with zipfile.ZipFile(archive, "a", compression=zipfile.ZIP_DEFLATED) as zipped:
        if PROFILE_FILE in zipped.namelist():
            raise ValueError(f"{archive} already has a {PROFILE_FILE}")
        zipped.writestr(PROFILE_FILE, profile.to_json())


def profile_source(images_dir: Path | None, count: int) -> str:
    photos = "the project's photos" if images_dir is None else f"the photos of {images_dir}"
    return f"{count} requests: {photos} whole, then seeded variants (seed {REFERENCE_SEED})"
