"""Send an image to a running TorchServe and print its answer as a table.

    python scripts/predict.py photo.jpg                       # the classifier (efficientnet_lite0)
    python scripts/predict.py photo.jpg --model ssdlite320    # the detector
    python scripts/predict.py photo.jpg --json --url http://127.0.0.1:8080 --version 1.0
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import requests


def predict(url: str, model: str, image: bytes, version: str | None = None,
            headers: dict[str, str] | None = None, timeout_s: float = 60.0) -> requests.Response:
    """POST the raw image bytes to /predictions/{model}[/{version}]."""
    path = f"{url}/predictions/{model}" + (f"/{version}" if version else "")
    return requests.post(path, data=image, timeout=timeout_s,
                         headers={"Content-Type": "application/octet-stream", **(headers or {})})


def format_answer(answer: list[dict[str, Any]]) -> str:
    """Classes (label, index, probability) or detections (label, index, score, box) as a table."""
    if not answer:
        return "  (nothing found)"
    if "box" in answer[0]:
        rows = [(d["score"], d["label"], ", ".join(f"{v:.1f}" for v in d["box"])) for d in answer]
        return "\n".join(f"  {score:7.4f}  {label:<16} box [{box}]" for score, label, box in rows)
    return "\n".join(f"  {c['probability']:7.4f}  {c['label']} (class {c['index']})" for c in answer)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("image", type=Path)
    parser.add_argument("--model", default="efficientnet_lite0")
    parser.add_argument("--version", default=None)
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="inference address")
    parser.add_argument("--json", action="store_true", help="print the raw JSON answer")
    parser.add_argument("--score-threshold", help="detection: X-Score-Threshold for this request")
    parser.add_argument("--max-detections", help="detection: X-Max-Detections for this request")
    parser.add_argument("--classes", help="detection: X-Classes, e.g. person,dog")
    args = parser.parse_args(argv)
    options = {"X-Score-Threshold": args.score_threshold, "X-Max-Detections": args.max_detections,
               "X-Classes": args.classes}
    headers = {name: value for name, value in options.items() if value is not None}
    answer = predict(args.url, args.model, args.image.read_bytes(), args.version, headers)
    if answer.status_code != 200 or args.json:
        print(f"HTTP {answer.status_code}: {answer.text}" if answer.status_code != 200
              else json.dumps(answer.json(), indent=2))
        return 0 if answer.status_code == 200 else 1
    print(f"{args.model} on {args.image.name}:")
    print(format_answer(answer.json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
