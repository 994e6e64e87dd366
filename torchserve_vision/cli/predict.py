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
    parser.add_argument("--escalation", choices=("auto", "never", "always"),
                        help="cascade: X-Escalation for this request")
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


def run(args: argparse.Namespace) -> int:
    options = {"X-Score-Threshold": args.score_threshold, "X-Max-Detections": args.max_detections,
               "X-Classes": args.classes, "X-Escalation": args.escalation}
    headers = {name: value for name, value in options.items() if value is not None}
    answer = client_from(args).predict(args.model, args.version, args.image.read_bytes(), headers)
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        print(f"{args.model} on {args.image.name}:")
        print(format_answer(answer))
    return 0
