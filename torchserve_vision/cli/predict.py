"""`torchserve-vision predict`: send an image to a running TorchServe and print its answer."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from torchserve_vision.cli.common import DEFAULT_MODEL, client_from, connection_flags, json_flag, subcommand

DESCRIPTION = """\
Send an image to a running TorchServe and print its answer as a table.

  torchserve-vision predict photo.jpg                       # the classifier (efficientnet_lite0)
  torchserve-vision predict photo.jpg --model ssdlite320 --score-threshold 0.5
  torchserve-vision predict photo.jpg --json --version 1.0 --key-file .run/key_file.json
"""


def register(commands: argparse._SubParsersAction) -> None:
    parser = subcommand(commands, "predict",
                        "send an image, print the answer", DESCRIPTION, [connection_flags(), json_flag()])
    parser.add_argument("image", type=Path)
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")
    parser.add_argument("--version", default=None, help="default: the default version")
    parser.add_argument("--score-threshold", help="detection: X-Score-Threshold for this request")
    parser.add_argument("--max-detections", help="detection: X-Max-Detections for this request")
    parser.add_argument("--classes", help="detection: X-Classes, e.g. person,dog")
    parser.set_defaults(run=run)


def format_answer(answer: list[dict[str, Any]]) -> str:
    """Classes (label, index, probability) or detections (label, index, score, box) as a table."""
    if not answer:
        return "  (nothing found)"
    if "box" in answer[0]:
        rows = [(d["score"], d["label"], ", ".join(f"{v:.1f}" for v in d["box"])) for d in answer]
        return "\n".join(f"  {score:7.4f}  {label:<16} box [{box}]" for score, label, box in rows)
    return "\n".join(f"  {c['probability']:7.4f}  {c['label']} (class {c['index']})" for c in answer)


def run(args: argparse.Namespace) -> int:
    options = {"X-Score-Threshold": args.score_threshold, "X-Max-Detections": args.max_detections,
               "X-Classes": args.classes}
    headers = {name: value for name, value in options.items() if value is not None}
    answer = client_from(args).predict(args.model, args.version, args.image.read_bytes(), headers)
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        print(f"{args.model} on {args.image.name}:")
        print(format_answer(answer))
    return 0
