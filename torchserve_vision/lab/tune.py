"""Recommend batch size, max batch delay and workers per GPU for a p99 target and a request rate,
from a measured t(B) profile (and a sweep, when given); optionally verify the recommendation with
an open-loop run on a live server, write it into config/models.yaml, and apply it as a rollout.

    torchserve-vision lab tune model_store/efficientnet_lite0-1.0.mar --p99-ms 300 --rate 25
    torchserve-vision lab tune model_store/efficientnet_lite0-1.0.mar --p99-ms 300 --max-throughput \\
        --verify --duration 20          # needs the model served (bash scripts/demo.sh)
    torchserve-vision lab tune ... --sweep .run/sweep.json --write-config --apply
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from torchserve_vision.archives.versions import archive_manifest
from torchserve_vision.client import TorchServeClient
from torchserve_vision.lab.batch_model import MAX_UTILISATION, Recommendation, recommend
from torchserve_vision.lab.benchmark_images import benchmark_jpeg
from torchserve_vision.lab.loadgen import LoadTarget, Report, run_open_loop
from torchserve_vision.lab.profile import Profile, profile_archive
from torchserve_vision.lab.sweep import SweepPoint, apply_settings, choose_operating_point
from torchserve_vision.model_descriptions import (
    QUEUED,
    DescriptionError,
    ServingSettings,
    load_descriptions,
)
from torchserve_vision.server_state import default_version, served_default_version
from torchserve_vision.torchserve_config import write_models_block


def from_sweep(path: Path, p99_target_ms: float, rate_rps: float | None) -> Recommendation | None:
    """The measured point that meets the target (at the rate, when given) with the most headroom."""
    document = json.loads(path.read_text())
    points = [SweepPoint(**p) for p in document["points"]]
    if rate_rps is not None:
        points = [p for p in points if p.throughput_rps >= rate_rps]
    best = choose_operating_point(points, p99_target_ms)
    if best is None:
        return None
    return Recommendation(True, best.batch_size, best.max_batch_delay_ms, best.workers, best.p99_ms,
                          best.throughput_rps, f"measured by the sweep ({best.clients} clients)")


def update_models_yaml(path: Path, model: str, batch_size: int, delay_ms: int) -> None:
    """Set `serving.batch_size` / `max_batch_delay_ms` of one model, keeping the file's comments."""
    text = path.read_text()
    blocks = re.split(r"(?m)^(?=  - name: )", text)
    for index, block in enumerate(blocks):
        if re.match(rf"  - name: {re.escape(model)}\s*$", block.splitlines()[0] if block else ""):
            block = re.sub(r"(?m)^(\s+batch_size:) \d+", rf"\1 {batch_size}", block)
            blocks[index] = re.sub(r"(?m)^(\s+max_batch_delay_ms:) \d+", rf"\1 {delay_ms}", block)
            path.write_text("".join(blocks))
            return
    raise DescriptionError(f"{model} is not described in {path}")


def verify(client: TorchServeClient, model: str, store: Path, recommendation: Recommendation,
           rate_rps: float, duration_s: float) -> Report:
    """Serve the model with the recommended settings and drive it open-loop at `rate_rps`."""
    current = served_default_version(client, model)
    image = benchmark_jpeg("small")
    settings = replace(ServingSettings.of_version(current), batch_size=recommendation.batch_size,
                       max_batch_delay_ms=recommendation.max_batch_delay_ms,
                       min_workers=recommendation.workers, max_workers=recommendation.workers)
    apply_settings(client, model, store, settings, image)
    target = LoadTarget(f"{client.inference_url}/predictions/{model}", [image])
    run_open_loop(target, rate_rps, 2.0, 10**6)  # warm up
    return run_open_loop(target, rate_rps, duration_s, 10**7)



@dataclass
class Tuning:
    model: str
    profile: Profile
    chosen: Recommendation
    from_profile: Recommendation
    verification: Report | None = None
    target_met: bool | None = None

    def to_dict(self) -> dict[str, object]:
        result: dict[str, object] = {"model": self.model, "profile": asdict(self.profile.handler_fit),
                                     "recommendation": asdict(self.chosen),
                                     "from_profile": asdict(self.from_profile)}
        if self.verification is not None:
            result["verification"] = asdict(self.verification)
            result["target_met"] = self.target_met
        return result


def tune(archive: Path, p99_ms: float, rate_rps: float | None, max_batch: int, workers: int,
         device: str, sweep: Path | None) -> Tuning:
    """Profile the archive in-process and recommend settings (a sweep's measured point wins)."""
    model = archive_manifest(archive)["modelName"]
    profile = profile_archive(archive, max_batch, 5, benchmark_jpeg("small"), "small JPEG", device)
    recommendation = recommend(profile.handler_fit, p99_ms, rate_rps, max_batch, workers)
    measured = from_sweep(sweep, p99_ms, rate_rps) if sweep else None
    return Tuning(model, profile, measured or recommendation, recommendation)


def verify_on_server(client: TorchServeClient, tuning: Tuning, store: Path, p99_ms: float,
                     rate_rps: float | None, duration_s: float, keep: bool) -> None:
    """Roll the recommendation out on the live server, drive it open-loop (at the given rate, or
    at MAX_UTILISATION of the predicted capacity), and restore the settings unless `keep`."""
    rate = rate_rps or MAX_UTILISATION * tuning.chosen.capacity_rps
    current = default_version(client, tuning.model)
    report = verify(client, tuning.model, store, tuning.chosen, rate, duration_s)
    tuning.verification = report
    tuning.target_met = report.latency_ms["p99"] <= p99_ms and not report.errors
    if not keep and current is not None:
        apply_settings(client, tuning.model, store, ServingSettings.of_version(current),
                       benchmark_jpeg("small"))


def write_recommendation(tuning: Tuning, descriptions: Path, configs: Sequence[Path]) -> None:
    """Write the chosen batch size and delay into models.yaml (no delay for a model that batches
    queued: it never waits), then the configs' models= from it."""
    serving = {d.name: d.serving for d in load_descriptions(descriptions)}.get(tuning.model)
    delay_ms = 0 if serving is not None and serving.batching == QUEUED else tuning.chosen.max_batch_delay_ms
    update_models_yaml(descriptions, tuning.model, tuning.chosen.batch_size, delay_ms)
    for config in configs:
        write_models_block(config, load_descriptions(descriptions))
