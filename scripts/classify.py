"""Send an image to a running TorchServe and print its answer as a table.

    python scripts/classify.py path/to/image.jpg [--model efficientnet_lite0] [--url http://127.0.0.1:8080]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import requests


def predict(url: str, model: str, image: bytes, version: str | None = None,
            timeout_s: float = 60.0) -> requests.Response:
    """POST the raw image bytes to /predictions/{model}[/{version}]."""
    path = f"{url}/predictions/{model}" + (f"/{version}" if version else "")
    return requests.post(path, data=image, timeout=timeout_s,
                         headers={"Content-Type": "application/octet-stream"})


def format_classes(answer: list[dict[str, object]]) -> str:
    rows = [f"  {float(str(c['probability'])):7.4f}  {c['label']} (class {c['index']})" for c in answer]
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("image", type=Path)
    parser.add_argument("--model", default="efficientnet_lite0")
    parser.add_argument("--version", default=None)
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="inference address")
    parser.add_argument("--json", action="store_true", help="print the raw JSON answer")
    args = parser.parse_args(argv)
    answer = predict(args.url, args.model, args.image.read_bytes(), args.version)
    if answer.status_code != 200 or args.json:
        print(f"HTTP {answer.status_code}: {answer.text}" if answer.status_code != 200
              else json.dumps(answer.json(), indent=2))
        return 0 if answer.status_code == 200 else 1
    print(f"{args.model} on {args.image.name}:")
    print(format_classes(answer.json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
