"""The reference profile of a model version (handlers.drift), recorded at build time.

After torch-model-archiver has written the archive, its own handler is loaded in-process (as a
worker loads it, on the CPU) and answers REFERENCE_REQUESTS reference requests: the photos of
the build's photo set (the project's photos of ImageNet subjects, or the folder `build --images
DIR` names) whole, then seeded variants of them (crops, mirroring, short sides of 180-720 px,
JPEG qualities 50-95) up to that count. The handler's drift stage counts them into the fixed
buckets exactly as it counts served requests, and the smoothed shares are added to the archive
as `drift_reference.json`. Single-network archives only (classification, detection); a
pipeline's answers are its stages', which carry their own profiles.
"""

from __future__ import annotations

import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

import torch

from handlers.drift.drift_features import CLASSIFICATION_FEATURES, DETECTION_FEATURES
from handlers.drift.drift_profile import PROFILE_FILE, DriftProfile
from torchserve_vision.lab.local_handler import LocalContext, extract_archive, load_handler
from torchserve_vision.photo_sets import load_photos, variant_jpegs

REFERENCE_REQUESTS = 192
REFERENCE_SEED = 35
FEATURES_OF_TASK = {"classification": CLASSIFICATION_FEATURES, "detection": DETECTION_FEATURES}


def reference_requests(images_dir: Path | None, count: int = REFERENCE_REQUESTS) -> list[bytes]:
    """The reference set's request bodies: every photo whole, then seeded variants."""
    return variant_jpegs(load_photos(images_dir), count, REFERENCE_SEED)


def record_profile(archive: Path, task: str, bodies: Sequence[bytes], source: str,
                   batch_size: int = 8) -> DriftProfile:
    """The archive's handler answers `bodies` in batches; its drift counts become the profile.
    The handler may set torch's thread count (as a worker does): it is put back after."""
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="drift-reference-") as tmp:
        model_dir = extract_archive(archive, Path(tmp))
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


def add_profile(archive: Path, profile: DriftProfile) -> None:
    """Store the profile in the archive (replacing none: a fresh archive has none)."""
    with zipfile.ZipFile(archive, "a", compression=zipfile.ZIP_DEFLATED) as zipped:
        if PROFILE_FILE in zipped.namelist():
            raise ValueError(f"{archive} already has a {PROFILE_FILE}")
        zipped.writestr(PROFILE_FILE, profile.to_json())


def profile_source(images_dir: Path | None, count: int) -> str:
    photos = "the project's photos" if images_dir is None else f"the photos of {images_dir}"
    return f"{count} requests: {photos} whole, then seeded variants (seed {REFERENCE_SEED})"
