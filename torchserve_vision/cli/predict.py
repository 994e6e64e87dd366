"""`torchserve-vision predict`: send images (files and folders) to a running TorchServe; print
one photo's answer as a table, or many as JSON lines; draw the answers on the photos."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from torchserve_vision.batch_predict import (
    DEFAULT_CONCURRENCY,
    IN_FLIGHT_PER_BATCH_SLOT,
    MAX_503_RETRIES,
    AnswerLog,
    PredictError,
    PredictionLine,
    PredictionRun,
    RunCounts,
    answered_paths,
    describe_error,
    served_model,
)
from torchserve_vision.cli.common import DEFAULT_MODEL, client_from, connection_flags, json_flag, subcommand
from torchserve_vision.image_inputs import ImageInput, ImageInputs, drawing_paths, found_images

DESCRIPTION = f"""\
Send images to a running TorchServe. One photo: its answer as a table (--json: as JSON). Several,
or a folder (searched recursively; files that are not images are skipped and counted): one JSON
line per image, {{"path", "status", "answer" or "error", "latency_ms"}}, to standard output or
--out, with a progress bar on standard error when it is a terminal, and a summary at the end. A
bad image gets its line with the server's error and the others go on.

  torchserve-vision predict photo.jpg                       # the classifier ({DEFAULT_MODEL})
  torchserve-vision predict photo.jpg --model ssd_mobilenet_v2 --draw photo-boxes.png
  torchserve-vision predict photos/ --model ssd_mobilenet_v2 --out answers.jsonl --draw drawn/
  torchserve-vision predict photos/ --out answers.jsonl --resume   # only what is not answered yet
  torchserve-vision predict photo.jpg --json --version 1.0 --key-file .run/key_file.json

--concurrency: requests in flight; by default {IN_FLIGHT_PER_BATCH_SLOT} x the model's READY workers x its
batch size, but no more than its queue plus a batch at each worker (when the management API
answers), else {DEFAULT_CONCURRENCY}. A 503 (a full queue) is sent again, up to {MAX_503_RETRIES}
times, after the server's Retry-After or a short growing backoff; the summary counts them.
--resume (with --out) skips the paths whose last line in --out has status 200, and sends the
others again (an image with several lines: its last counts); it refuses a file that is not an
answers file. Paths are recorded resolved (absolute), so `photos/` and `$PWD/photos` are the same
images. --draw: one photo's drawing to the file given; several photos' under the folder given,
each at its path below the folder it was found in, as PNG; each is complete before its line is
written. An error while handling one image is its own failed line; a line that cannot be written
stops the run. The exit status is 0 only when every image found was answered.
"""


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
    done = answered_paths(args.out) if args.resume else set()
    if args.out is not None:
        check_writable(args.out)
    client = client_from(args)
    model = served_model(client, args.model, args.version)
    concurrency = args.concurrency or model.default_concurrency()
    prediction = PredictionRun(client, client.prediction_url(args.model, args.version),
                               {**client.auth_headers("inference"), **request_headers(args)}, concurrency)
    if single:
        return answer_one(args, prediction, inputs.images[0], drawings)
    return answer_many(args, prediction, inputs, drawings, done)


def check_writable(out: Path) -> None:
    """PredictError unless `out` can take answer lines: a file, or none yet (its folder made)."""
    if out.is_dir():
        raise PredictError(f"--out {out} is a folder: give a file to write the answer lines to")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a", encoding="utf-8"):
            pass
    except OSError as error:
        raise PredictError(f"--out {out} cannot be written ({error.strerror})") from None


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
                drawings: dict[str, Path], done: set[str]) -> int:
    """Every image not in `done` sent; its drawing written (when asked) before its line; the
    summary on standard error; 0 when every image found was answered (now or before)."""
    images = [image for image in inputs.images if image.key not in done]
    stream = open(args.out, "a", encoding="utf-8") if args.out else sys.stdout  # noqa: SIM115
    bar = tqdm(total=len(images), unit="image", file=sys.stderr, disable=not sys.stderr.isatty(),
               dynamic_ncols=True)
    shares_terminal = stream is sys.stdout and sys.stdout.isatty() and not bar.disable
    log = AnswerLog(stream, (lambda text: tqdm.write(text, file=sys.stdout)) if shares_terminal else None)

    def progress(counts: RunCounts) -> None:
        bar.set_postfix_str(f"{counts.failed} failed" if counts.failed else "", refresh=False)
        bar.update(1)

    def complete(image: ImageInput, line: PredictionLine) -> None:
        if drawings:
            draw(image, line, drawings)

    try:
        counts = prediction.run(images, log.write, complete, progress)
    except (PredictError, KeyboardInterrupt) as error:
        if isinstance(error.__cause__, BrokenPipeError) and stream is sys.stdout:
            quiet_stdout()
        bar.close()
        print(summary(prediction.counts, len(inputs.images) - len(images), inputs.skipped, args.out),
              file=sys.stderr)
        raise
    finally:
        bar.close()
        if stream is not sys.stdout:
            stream.close()
    print(summary(counts, len(inputs.images) - len(images), inputs.skipped, args.out), file=sys.stderr)
    return 1 if counts.failed or counts.not_done else 0


def quiet_stdout() -> None:
    """Standard output to /dev/null, so that the interpreter's last flush of what a closed pipe
    did not take raises nothing more."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def draw(image: ImageInput, line: PredictionLine, drawings: dict[str, Path]) -> None:
    from torchserve_vision.answer_drawing import save_drawing

    target = drawings[image.key]
    try:
        save_drawing(image.path.read_bytes(), line.answer, target)
    except Exception as error:
        raise PredictError(f"answered, but its drawing could not be written to {target} "
                           f"({describe_error(error)})") from error


def error_message(error: Any) -> str:
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return json.dumps(error)


def summary(counts: RunCounts, resumed: int, not_images: int, out: Path | None) -> str:
    """answered + failed + skipped + not done: every image found."""
    parts = [f"answered {counts.answered}", f"failed {counts.failed}"]
    if resumed:
        parts.append(f"skipped {resumed} (answered before in {out})")
    if counts.not_done:
        parts.append(f"not done {counts.not_done} (the run stopped)")
    total = counts.total + resumed
    text = ", ".join(parts) + f" of {total} image{'s' if total != 1 else ''}"
    if counts.retried:
        text += f"; {counts.retried} answer(s) 503 sent again"
    if not_images:
        text += f"; {not_images} file(s) that are not images left out"
    return text + f"; {counts.images_per_s():.1f} images/s"
