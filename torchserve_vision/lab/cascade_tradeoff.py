"""The confidence cascade's trade-off, in one run on one server: top-1 agreement with the second
model alone against served throughput, for a range of escalation thresholds, with the first model
alone and the second model alone as the two end points.

    bash scripts/demo.sh        # a running server with the model API on; archives built
    torchserve-vision lab cascade --clients 16 --duration 15 --out docs/cascade-cpu
    torchserve-vision lab cascade --images ~/photos --out cascade-mine   # on your own photos

Inputs: at least 300 distinct JPEGs made from real photos in scikit-image's wheel, or from every
image directly in the folder --images names (each photo whole, then seeded random crops, flips,
rescales and JPEG qualities). The first-stage archive,
the second-stage archive and the cascade archive (and a copy of it built with the `margin` rule)
are registered side by side under lab names with the cascade's serving settings; each threshold
is a closed-loop run over all inputs sending `X-Escalation-Threshold`. Agreement is measured on
the served answers: the share of inputs whose top-1 equals the second model's served top-1.
The lab's registrations are removed at the end.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from PIL import Image

from torchserve_vision.archives.build import build_archive
from torchserve_vision.client import TorchServeClient
from torchserve_vision.lab.compare import register, unregister_all
from torchserve_vision.lab.loadgen import LoadTarget, run_closed_loop
from torchserve_vision.model_descriptions import ModelDescription
from torchserve_vision.photo_sets import Photo, folder_photos, variant_jpegs
from torchserve_vision.photos import photo_path

SOURCE_PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png",
                 "motorcycle_right.png", "hubble_deep_field.jpg", "retina.jpg", "ihc.png",
                 "camera.png")
THRESHOLDS = {"probability": (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
              "margin": (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)}
LAB_NAMES = {"first": "lab_cascade_first", "second": "lab_cascade_second",
             "probability": "lab_cascade", "margin": "lab_cascade_margin"}


@dataclass(frozen=True)
class TradeoffPoint:
    name: str                  # "first alone", "second alone", or "<rule> <threshold>"
    rule: str | None
    threshold: float | None
    throughput_rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    escalation_rate: float     # share of inputs the second model answered
    agreement: float           # share of inputs whose top-1 equals the second model's alone


# --- inputs ---------------------------------------------------------------------------------------
def cascade_inputs(count: int = 320, seed: int = 0, images_dir: Path | None = None) -> list[bytes]:
    """`count` distinct JPEGs: each source photo (SOURCE_PHOTOS, or every image directly in
    `images_dir`) whole (quality 90), then seeded variants of the photos in turn until there are
    `count`. photo_sets.PhotoSetError for a folder without photos."""
    photos = (folder_photos(images_dir) if images_dir is not None else
              [Photo(name, name, Image.open(photo_path(name)).convert("RGB")) for name in SOURCE_PHOTOS])
    return variant_jpegs(photos, count, seed)


# --- measuring ------------------------------------------------------------------------------------
def top1_and_model(body: bytes) -> tuple[int, str | None]:
    answer = json.loads(body)
    return int(answer[0]["index"]), answer[0].get("model")


def measure(client: TorchServeClient, model: str, inputs: Sequence[bytes], clients: int,
            duration_s: float, headers: dict[str, str]) -> tuple[Any, list[tuple[int, str | None]]]:
    """A closed-loop run over `inputs`; then every input not answered during it is sent once
    (not counted), so each input has an answer. Returns the report and per-input answers."""
    url = f"{client.inference_url}/predictions/{model}"
    all_headers = {"Content-Type": "application/octet-stream", **headers}
    run_closed_loop(LoadTarget(url, inputs, all_headers), clients, min(3.0, duration_s), 10**6)
    answers: dict[int, bytes] = {}
    report = run_closed_loop(LoadTarget(url, inputs, all_headers, answers=answers), clients,
                             duration_s, 10**7)
    missing = [index for index in range(len(inputs)) if index not in answers]
    if missing:
        rest: dict[int, bytes] = {}
        run_closed_loop(LoadTarget(url, [inputs[i] for i in missing], all_headers, answers=rest),
                        1, 600, len(missing))
        answers.update({missing[index]: body for index, body in rest.items()})
    if len(answers) < len(inputs):
        raise RuntimeError(f"{model}: {len(inputs) - len(answers)} inputs never got a 200")
    print(f"  {model} {headers or ''}: {report.table()}", file=sys.stderr, flush=True)
    return report, [top1_and_model(answers[index]) for index in range(len(inputs))]


def point(name: str, rule: str | None, threshold: float | None, report: Any,
          answers: Sequence[tuple[int, str | None]], reference: Sequence[int],
          second_archive: str | None) -> TradeoffPoint:
    escalated = sum(model == second_archive for _, model in answers) if second_archive else 0
    agree = sum(top1 == wanted for (top1, _), wanted in zip(answers, reference, strict=True))
    return TradeoffPoint(name, rule, threshold, report.throughput_rps, report.latency_ms["p50"],
                         report.latency_ms["p99"], report.sent - report.succeeded,
                         escalated / len(answers), agree / len(answers))


def margin_copy(cascade: ModelDescription) -> ModelDescription:
    options = dict(cascade.handler_options)
    options["escalation"] = {**options.get("escalation", {}), "rule": "margin"}
    return replace(cascade, name=f"{cascade.name}_margin", handler_options=options)


def tradeoff(client: TorchServeClient, store: Path, cascade: ModelDescription,
             inputs: Sequence[bytes], clients: int, duration_s: float) -> list[TradeoffPoint]:
    """Every point of the trade-off; the lab's registrations are removed at the end."""
    margin = margin_copy(cascade)
    build_archive(margin, store)
    archives = {"first": f"{cascade.stages['first']}.mar", "second": f"{cascade.stages['second']}.mar",
                "probability": cascade.archive_name, "margin": margin.archive_name}
    try:
        for role, archive in archives.items():
            register(client, store, archive, LAB_NAMES[role], cascade.serving)
        second_report, second = measure(client, LAB_NAMES["second"], inputs, clients, duration_s, {})
        reference = [top1 for top1, _ in second]
        first_report, first = measure(client, LAB_NAMES["first"], inputs, clients, duration_s, {})
        points = [point("first alone", None, None, first_report, first, reference, None)]
        for rule, thresholds in THRESHOLDS.items():
            for threshold in thresholds:
                report, answers = measure(client, LAB_NAMES[rule], inputs, clients, duration_s,
                                          {"X-Escalation-Threshold": str(threshold)})
                points.append(point(f"{rule} {threshold:g}", rule, threshold, report, answers,
                                    reference, cascade.stages["second"]))
        points.append(point("second alone", None, None, second_report, second, reference, None))
        return points
    finally:
        for name in LAB_NAMES.values():
            unregister_all(client, name)
        (store / margin.archive_name).unlink(missing_ok=True)


# --- reporting ------------------------------------------------------------------------------------
def markdown(points: Sequence[TradeoffPoint], second_alone_rps: float) -> str:
    lines = ["| point | throughput req/s | x second alone | p50 ms | p99 ms | escalated | "
             "top-1 agreement with second alone | errors |", "|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p.name} | {p.throughput_rps:.1f} | {p.throughput_rps / second_alone_rps:.2f} "
                     f"| {p.p50_ms:.1f} | {p.p99_ms:.1f} | {p.escalation_rate:.1%} | "
                     f"{p.agreement:.1%} | {p.errors} |")
    return "\n".join(lines)


def plot(points: Sequence[TradeoffPoint], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for rule, marker in (("probability", "o"), ("margin", "s")):
        curve = [p for p in points if p.rule == rule]
        axes.plot([p.throughput_rps for p in curve], [100 * p.agreement for p in curve],
                  marker=marker, label=f"cascade, rule {rule}")
        for p in curve:
            axes.annotate(f"{p.threshold:g}", (p.throughput_rps, 100 * p.agreement), fontsize=7,
                          textcoords="offset points", xytext=(4, 4))
    for p in points:
        if p.rule is None:
            axes.plot([p.throughput_rps], [100 * p.agreement], marker="*", markersize=14,
                      linestyle="none", label=p.name)
    axes.set_xlabel("served throughput (requests/s)")
    axes.set_ylabel("top-1 agreement with the second model alone (%)")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def save(points: Sequence[TradeoffPoint], out: Path, title: str) -> None:
    """`out`.json (every point) and `out`.png (the plot)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps([asdict(p) for p in points], indent=2))
    plot(points, out.with_suffix(".png"), title)
