"""Drift detection, shown: how many requests each drift reading needs to cross its alert
threshold once the traffic shifts, how often it crosses on traffic like the reference, and what
counting costs a worker.

- **False alarms** (offline, no server): the archive's own handler in-process (the same counting
  as a worker's) answers a long stream of fresh in-distribution requests (variants of the
  reference set's photos, another seed than the reference's), cut into windows of `window`
  requests (200: the fewest an alert reads); reported per feature: the windows whose divergence
  crossed the threshold, and the largest divergence seen.
- **Detection** (a running TorchServe, read through its /metrics): `window` in-distribution
  requests, then each shifted stream in turn (darkened, rotated a quarter turn, downscaled to a
  third, photos of other subjects), each preceded by `window` in-distribution requests again.
  After every `step` requests the counters are read, and the divergence of the last `window`
  requests is computed (handlers.drift, as the Prometheus rules compute it). Reported per shift
  and feature: the shifted requests sent when it first crossed. The lab must be the server's only
  client while it runs: the counters are the server's.
- **Cost**: microseconds of worker CPU per request for counting a batch into the buckets and
  exporting it through TorchServe's own metrics cache (its log lines included), in-process.
"""

from __future__ import annotations

import io
import logging
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from PIL import Image, ImageEnhance

from handlers.drift.drift_features import Observation
from handlers.drift.drift_profile import DriftProfile
from torchserve_vision.local_handler import LocalContext, extract_archive, load_handler
from torchserve_vision.photo_sets import Photo, load_photos, variant_jpegs
from torchserve_vision.photos import CLASSIFIER_PHOTOS, all_photo_paths
from torchserve_vision.prometheus_text import parse_samples, scrape

THRESHOLD = 0.1           # the alert rules' (deploy/prometheus/model-monitoring.rules.yml)
WINDOW = 200              # the fewest observations an alert reads
STEP = 25
IN_DISTRIBUTION_SEED = 2035   # not the reference's (torchserve_vision.archives.drift_reference)
BATCH = 8


def jpeg_of(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def transformed(bodies: Sequence[bytes], change: Callable[[Image.Image], Image.Image]) -> list[bytes]:
    return [jpeg_of(change(Image.open(io.BytesIO(body)).convert("RGB"))) for body in bodies]


def other_subjects(count: int) -> list[bytes]:
    """Variants of scikit-image's images that are not photos of ImageNet subjects (micrographs,
    scans, textures, text, grayscale photos)."""
    others = [Photo(path.name, path.stem, Image.open(path).convert("RGB"))
              for path in all_photo_paths() if path.name not in CLASSIFIER_PHOTOS]
    return variant_jpegs(others, count, IN_DISTRIBUTION_SEED)


def shifted_streams(in_distribution: Sequence[bytes], count: int) -> dict[str, list[bytes]]:
    """Each shift applied to `count` in-distribution requests (other subjects: their own)."""
    base = in_distribution[:count]
    return {
        "darkened": transformed(base, lambda image: ImageEnhance.Brightness(image).enhance(0.35)),
        "rotated": transformed(base, lambda image: image.transpose(Image.Transpose.ROTATE_90)),
        "downscaled": transformed(base, lambda image: image.resize(
            (max(1, image.width // 3), max(1, image.height // 3)), Image.Resampling.BILINEAR)),
        "other subjects": other_subjects(count),
    }


# --- offline: false alarms ----------------------------------------------------------------------
@dataclass(frozen=True)
class FalseAlarms:
    windows: int
    crossed: dict[str, int]          # feature -> windows over the threshold
    largest: dict[str, float]        # feature -> the largest divergence seen


def per_request_counts(handler: Any, model_dir: Path, bodies: Sequence[bytes]) -> list[Counter[Observation]]:
    """What the handler's drift stage counted for each request of `bodies`, sent one by one."""
    per_request: list[Counter[Observation]] = []
    for body in bodies:
        before = Counter(handler.drift.counts)
        handler.handle_batch([{"body": bytearray(body)}],
                             LocalContext(str(model_dir), {}, {}, request_headers=[{}]))
        per_request.append(Counter(handler.drift.counts) - before)
    return per_request


def false_alarms(profile: DriftProfile, per_request: Sequence[Counter[Observation]], window: int,
                 threshold: float) -> FalseAlarms:
    crossed: Counter[str] = Counter()
    largest: dict[str, float] = {}
    windows = len(per_request) // window
    for index in range(windows):
        counts: Counter[Observation] = Counter()
        for request in per_request[index * window:(index + 1) * window]:
            counts.update(request)
        for feature, divergence in profile.drift(counts).items():
            crossed[feature] += divergence > threshold
            largest[feature] = max(largest.get(feature, 0.0), divergence)
    return FalseAlarms(windows, dict(crossed), largest)


# --- online: requests to detection ----------------------------------------------------------------
def observed_counts(metrics_url: str, model: str, version: str) -> Counter[Observation]:
    counts: Counter[Observation] = Counter()
    for sample in parse_samples(scrape(metrics_url)):
        if (sample.name == "HandlerDriftObserved" and sample.labels.get("ModelName") == model
                and sample.labels.get("ModelVersion") == version):
            counts[(sample.labels["Feature"], sample.labels["Bucket"])] += int(sample.value)
    return counts


def send(url: str, headers: dict[str, str], bodies: Sequence[bytes]) -> None:
    def one(body: bytes) -> None:
        answer = requests.post(url, data=body, headers=headers, timeout=60)
        answer.raise_for_status()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, bodies))


def requests_to_detection(profile: DriftProfile, url: str, headers: dict[str, str], metrics_url: str,
                          model: str, version: str, warm_up: Sequence[bytes], shifted: Sequence[bytes],
                          window: int, step: int, threshold: float) -> dict[str, int | None]:
    """`warm_up` (in-distribution, `window` of them), then `shifted` in steps: for each feature,
    the shifted requests sent when the last `window` requests' divergence first crossed
    `threshold` (None: never); also the largest reading during the warm-up ("quiet")."""
    snapshots = [observed_counts(metrics_url, model, version)]
    for start in range(0, len(warm_up), step):
        send(url, headers, warm_up[start:start + step])
        snapshots.append(observed_counts(metrics_url, model, version))
    steps_per_window = window // step
    first: dict[str, int | None] = {feature: None for feature in profile.shares}
    for sent in range(step, len(shifted) + 1, step):
        send(url, headers, shifted[sent - step:sent])
        snapshots.append(observed_counts(metrics_url, model, version))
        recent = snapshots[-1] - snapshots[-1 - steps_per_window]
        for feature, divergence in profile.drift(recent).items():
            if first[feature] is None and divergence > threshold:
                first[feature] = sent
    return first


# --- cost ------------------------------------------------------------------------------------------
def counting_cost_us(handler: Any, model_dir: Path, bodies: Sequence[bytes]) -> dict[str, float]:
    """Worker CPU microseconds per request of the drift stage's `observe`, without exporting and
    with TorchServe's metrics cache (its [METRICS] log lines written to /dev/null)."""
    import ts
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

    cache = MetricsCacheYamlImpl(config_file_path=str(Path(ts.__file__).parent / "configs" / "metrics.yaml"))
    cache.initialize_cache()
    cache.set_request_ids({0: "request"})
    sink = logging.StreamHandler(open(os.devnull, "w"))   # noqa: SIM115 - closed below
    logger = logging.getLogger("ts.metrics.caching_metric")
    logger.addHandler(sink)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    observe = handler.drift.observe
    spent = {"counting": 0.0, "counting and exporting": 0.0}
    current: dict[str, Any] = {}

    def timed(slots: Any, metrics: Any) -> None:
        started = time.thread_time()
        observe(slots, current["metrics"])
        spent[current["label"]] += time.thread_time() - started

    handler.drift.observe = timed
    try:
        for label, metrics in (("counting", None), ("counting and exporting", cache)):
            current.update(label=label, metrics=metrics)
            for start in range(0, len(bodies), BATCH):
                chunk = bodies[start:start + BATCH]
                handler.handle_batch([{"body": bytearray(body)} for body in chunk],
                                     LocalContext(str(model_dir), {}, {}, request_headers=[{}] * len(chunk)))
    finally:
        handler.drift.observe = observe
        logger.removeHandler(sink)
        sink.stream.close()
    return {label: seconds * 1e6 / len(bodies) for label, seconds in spent.items()}


def measure(archive: Path, images_dir: Path | None, url: str | None, headers: dict[str, str],
            metrics_url: str | None, model: str, version: str | None, stream_windows: int,
            window: int = WINDOW, step: int = STEP, threshold: float = THRESHOLD) -> dict[str, Any]:
    """Everything in the module docstring; the online part only with `url` and `metrics_url`."""
    in_distribution = variant_jpegs(load_photos(images_dir), stream_windows * window, IN_DISTRIBUTION_SEED)
    with tempfile.TemporaryDirectory(prefix="drift-lab-") as tmp:
        model_dir = extract_archive(archive, Path(tmp))
        handler = load_handler(model_dir)
        if handler.drift is None or handler.drift.profile is None:
            raise ValueError(f"{archive.name} has no drift reference profile (built before it had one?)")
        profile = handler.drift.profile
        per_request = per_request_counts(handler, model_dir, in_distribution)
        alarms = false_alarms(profile, per_request, window, threshold)
        cost = counting_cost_us(handler, model_dir, in_distribution[:400])
    result: dict[str, Any] = {"archive": archive.name, "threshold": threshold, "window": window,
                              "false_alarms": alarms.__dict__, "cost_us_per_request": cost,
                              "reference": profile.source}
    if url is not None and metrics_url is not None and version is not None:
        streams = shifted_streams(in_distribution, 2 * window)
        result["detection"] = {
            name: requests_to_detection(profile, url, headers, metrics_url, model, version,
                                        in_distribution[:window], stream, window, step, threshold)
            for name, stream in streams.items()}
        result["step"] = step
    return result


def as_text(result: dict[str, Any]) -> str:
    alarms = result["false_alarms"]
    features = sorted(alarms["largest"])
    lines = [f"{result['archive']}: Jensen-Shannon divergence, threshold {result['threshold']}, "
             f"window {result['window']} requests; reference: {result['reference']}",
             f"in-distribution stream: {alarms['windows']} windows",
             "| feature | windows over the threshold | largest divergence |", "|---|---|---|"]
    lines += [f"| {feature} | {alarms['crossed'].get(feature, 0)} of {alarms['windows']} | "
              f"{alarms['largest'][feature]:.3f} |" for feature in features]
    if "detection" in result:
        shifts = list(result["detection"])
        lines += ["", f"shifted requests until the last {result['window']} crossed the threshold "
                      f"(read every {result['step']}; - : never, within {2 * result['window']})",
                  "| feature | " + " | ".join(shifts) + " |", "|---" * (len(shifts) + 1) + "|"]
        for feature in features:
            cells = ["-" if result["detection"][shift].get(feature) is None
                     else str(result["detection"][shift][feature]) for shift in shifts]
            lines.append(f"| {feature} | " + " | ".join(cells) + " |")
    lines += ["", "worker CPU per request: " + ", ".join(
        f"{label} {micros:.0f} us" for label, micros in result["cost_us_per_request"].items())]
    return "\n".join(lines)
