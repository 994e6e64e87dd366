"""`torchserve-vision predict`: send images (files and folders) to a running TorchServe; print
one photo's answer as a table, or many as JSON lines; draw the answers on the photos."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchserve_vision.batch_predict import (
    DEFAULT_CONCURRENCY,
    IN_FLIGHT_PER_BATCH_SLOT,
    AnswerLog,
    PredictError,
    PredictionLine,
    PredictionRun,
    RunCounts,
    answered_paths,
    served_model,
)
from torchserve_vision.cli.common import DEFAULT_MODEL, client_from, connection_flags, json_flag, subcommand
from torchserve_vision.image_inputs import ImageInput, ImageInputs, drawing_paths, found_images

DESCRIPTION = f"""\
Send images to a running TorchServe. One photo: its answer as a table (--json: as JSON). Several,
or a folder (searched recursively; files that are not images are skipped and counted): one JSON
line per image, {{"path", "status", "answer" or "error", "latency_ms"}}, to standard output or
--out, with a progress bar on standard error when it is a terminal, and a summary at the end. A
bad image gets its line with the server's error and the others go on; the exit status is 1 when
any image failed.

  torchserve-vision predict photo.jpg                       # the classifier ({DEFAULT_MODEL})
  torchserve-vision predict photo.jpg --model ssd_mobilenet_v2 --draw photo-boxes.png
  torchserve-vision predict photos/ --model ssd_mobilenet_v2 --out answers.jsonl --draw drawn/
  torchserve-vision predict photos/ --out answers.jsonl --resume   # only what is not answered yet
  torchserve-vision predict photo.jpg --json --version 1.0 --key-file .run/key_file.json

--concurrency: requests in flight; by default {IN_FLIGHT_PER_BATCH_SLOT} x the model's READY workers x its
batch size (when the management API answers), else {DEFAULT_CONCURRENCY}. --resume (with --out) skips
the paths --out already answered with status 200 and sends the others again; an interrupted run
leaves complete lines only. --draw: one photo's drawing to the file given; several photos' under the
folder given, each at its path below the folder it was found in, as PNG.
"""
PROGRESS_EVERY_S = 0.2


def register(commands: argparse._SubParsersAction) -> None:
    parser = subcommand(commands, "predict", "send images, print or record the answers", DESCRIPTION,
                        [connection_flags(), json_flag()])
    parser.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="image files and folders")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")
    parser.add_argument("--version", default=None, help="default: the default version")
    parser.add_argument("--score-threshold", help="detection: X-Score-Threshold for each request")
    parser.add_argument("--max-detections", help="detection: X-Max-Detections for each request")
    parser.add_argument("--classes", help="detection: X-Classes, e.g. person,dog")
    parser.add_argument("--escalation", choices=("auto", "never", "always"),
                        help="cascade: X-Escalation for each request")
    parser.add_argument("--out", type=Path, help="write the JSON lines to this file (appended)")
    parser.add_argument("--resume", action="store_true",
                        help="with --out: skip the paths it answered with status 200")
    parser.add_argument("--concurrency", type=int, help="requests in flight (default: see above)")
    parser.add_argument("--draw", type=Path, metavar="PNG_OR_DIR",
                        help="draw the answers on the photos: a file for one photo, a folder for several")
    parser.set_defaults(run=run)


def format_classes(classes: list[dict[str, Any]], indent: str = "  ") -> str:
    return "\n".join(f"{indent}{c['probability']:7.4f}  {c['label']} (class {c['index']})"
                     for c in classes)


def format_answer(answer: list[dict[str, Any]]) -> str:
    """Classes (label, index, probability; a cascade's answering model) or detections (label,
    index, score, box; a pipeline's classification of the box) as a table."""
    if not answer:
        return "  (nothing found)"
    if "box" in answer[0]:
        lines = []
        for d in answer:
            box = ", ".join(f"{v:.1f}" for v in d["box"])
            lines.append(f"  {d['score']:7.4f}  {d['label']:<16} box [{box}]")
            if d.get("classification"):
                lines.append(format_classes(d["classification"], indent="           "))
        return "\n".join(lines)
    answered_by = f"\n  (answered by {answer[0]['model']})" if "model" in answer[0] else ""
    return format_classes(answer) + answered_by


def request_headers(args: argparse.Namespace) -> dict[str, str]:
    options = {"X-Score-Threshold": args.score_threshold, "X-Max-Detections": args.max_detections,
               "X-Classes": args.classes, "X-Escalation": args.escalation}
    return {name: value for name, value in options.items() if value is not None}


def one_photo(args: argparse.Namespace) -> bool:
    """A single file given, answered on the terminal (no --out)."""
    return len(args.paths) == 1 and args.paths[0].is_file() and args.out is None


def run(args: argparse.Namespace) -> int:
    if args.resume and args.out is None:
        raise PredictError("--resume needs --out: the file whose answers it continues")
    inputs = found_images(args.paths)
    single = one_photo(args)
    drawings = drawing_paths(inputs.images, args.draw, not single) if args.draw else {}
    client = client_from(args)
    model = served_model(client, args.model, args.version)
    concurrency = args.concurrency or model.default_concurrency()
    prediction = PredictionRun(client, client.prediction_url(args.model, args.version),
                               {**client.auth_headers("inference"), **request_headers(args)}, concurrency)
    if single:
        return answer_one(args, prediction, inputs.images[0], drawings)
    return answer_many(args, prediction, inputs, drawings)


def answer_one(args: argparse.Namespace, prediction: PredictionRun, image: ImageInput,
               drawings: dict[str, Path]) -> int:
    lines: list[PredictionLine] = []
    prediction.run([image], lines.append)
    (line,) = lines
    if not line.ok:
        raise PredictError(f"{image.key}: {line.status or 'no answer'} {error_message(line.error)}")
    if args.json:
        print(json.dumps(line.answer, indent=2))
    else:
        print(f"{args.model} on {image.path.name}:")
        print(format_answer(line.answer))
    if drawings:
        draw(image, line, drawings)
        print(f"drawn: {drawings[image.key]}")
    return 0


def answer_many(args: argparse.Namespace, prediction: PredictionRun, inputs: ImageInputs,
                drawings: dict[str, Path]) -> int:
    done = answered_paths(args.out) if args.resume else set()
    images = [image for image in inputs.images if image.key not in done]
    by_key = {image.key: image for image in images}
    stream = open(args.out, "a", encoding="utf-8") if args.out else sys.stdout  # noqa: SIM115
    log = AnswerLog(stream)

    def record(line: PredictionLine) -> None:
        log.write(line)
        if drawings and line.ok:
            draw(by_key[line.path], line, drawings)

    progress = progress_bar(len(images)) if sys.stderr.isatty() else None
    try:
        counts = prediction.run(images, record, progress) if images else RunCounts()
    finally:
        if progress is not None:
            sys.stderr.write("\n")
        if stream is not sys.stdout:
            stream.close()
    print(summary(counts, len(inputs.images) - len(images), inputs.skipped, args.out), file=sys.stderr)
    return 1 if counts.failed else 0


def draw(image: ImageInput, line: PredictionLine, drawings: dict[str, Path]) -> None:
    from torchserve_vision.answer_drawing import save_drawing

    save_drawing(image.path.read_bytes(), line.answer, drawings[image.key])


def error_message(error: Any) -> str:
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return json.dumps(error)


def progress_bar(total: int, width: int = 30) -> Callable[[RunCounts], None]:
    """A one-line progress bar on standard error, redrawn at most every PROGRESS_EVERY_S."""
    shown = [0.0]

    def show(counts: RunCounts) -> None:
        now = time.monotonic()
        if now - shown[0] < PROGRESS_EVERY_S and counts.done < total:
            return
        shown[0] = now
        filled = width * counts.done // max(total, 1)
        failed = f", {counts.failed} failed" if counts.failed else ""
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {counts.done}/{total} images, "
                         f"{counts.images_per_s():.1f} images/s{failed} ")
        sys.stderr.flush()

    return show


def summary(counts: RunCounts, resumed: int, not_images: int, out: Path | None) -> str:
    parts = [f"answered {counts.answered}", f"failed {counts.failed}"]
    if resumed:
        parts.append(f"skipped {resumed} (answered before in {out})")
    if not_images:
        parts.append(f"{not_images} file(s) that are not images left out")
    return ", ".join(parts) + f"; {counts.images_per_s():.1f} images/s"
