"""The shadow policy of a model, as `torchserve-vision models shadow` writes it and the stable
version's workers read it: which candidate version gets a copy of what share of the requests,
and where to send it.

One JSON file per model in the server's traffic directory (`TSV_TRAFFIC_DIR`, set by the
`server` commands: `<run dir>/traffic/<model>.json`). A worker looks at the file's modification
time before each batch (one `stat`, microseconds against a batch's milliseconds), so every
request answered after the file is written follows it, on every worker, and none after it is
removed.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TRAFFIC_DIR_ENVIRONMENT = "TSV_TRAFFIC_DIR"


@dataclass(frozen=True)
class ShadowPolicy:
    """Mirror `percent` % of the requests `stable_version` of `model` answers to
    `candidate_version` at `inference_url` (`/predictions/{model}/{candidate_version}`), with the
    inference key from `key_file` when token authorization is on. At most `queue_size` copies
    wait to be sent; more are dropped and counted."""

    model: str
    stable_version: str
    candidate_version: str
    percent: float
    inference_url: str
    key_file: str | None = None
    queue_size: int = 64
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not (isinstance(self.percent, (int, float)) and 0 < self.percent <= 100):
            raise ValueError(f"percent must be in (0, 100], got {self.percent!r}")
        if self.stable_version == self.candidate_version:
            raise ValueError(f"the candidate is the stable version itself ({self.stable_version})")
        if not (isinstance(self.queue_size, int) and self.queue_size >= 1):
            raise ValueError(f"queue_size must be a positive integer, got {self.queue_size!r}")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s)
                and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number, got {self.timeout_s!r}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def candidate_url(self) -> str:
        return f"{self.inference_url.rstrip('/')}/predictions/{self.model}/{self.candidate_version}"


def parse_shadow_policy(data: Mapping[str, Any]) -> ShadowPolicy:
    """The file's JSON object -> ShadowPolicy; ValueError naming what is wrong."""
    fields = set(ShadowPolicy.__dataclass_fields__)
    unknown = set(data) - fields
    if unknown:
        raise ValueError(f"unknown shadow policy fields {sorted(unknown)}")
    try:
        return ShadowPolicy(**data)
    except TypeError as error:
        raise ValueError(f"incomplete shadow policy: {error}") from None


def policy_path(traffic_dir: Path, model: str) -> Path:
    return traffic_dir / f"{model}.json"


def write_policy(path: Path, policy: ShadowPolicy) -> None:
    """Replace the file whole (a worker never reads half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(policy.to_json(), indent=1), encoding="utf-8")
    os.replace(partial, path)


class PolicyFile:
    """The policy in `path` as of the last look (one `stat`; the file is read again only when it
    changed); None when there is no file or it cannot be read (`error` says why)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.modified: int | None = None
        self.policy: ShadowPolicy | None = None
        self.error: str | None = None

    def current(self) -> ShadowPolicy | None:
        try:
            modified = self.path.stat().st_mtime_ns
        except OSError:
            self.modified, self.policy, self.error = None, None, None
            return None
        if modified != self.modified:
            self.modified = modified
            try:
                self.policy = parse_shadow_policy(json.loads(self.path.read_text("utf-8")))
                self.error = None
            except (OSError, ValueError) as error:
                self.policy, self.error = None, f"{self.path}: {error}"
        return self.policy
