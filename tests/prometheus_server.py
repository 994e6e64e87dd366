"""A real Prometheus (Debian's package) for tests, on a free 127.0.0.1 port, scraping the given
targets with the labels a Kubernetes pod's series carry (namespace, pod), its data in a
temporary directory; stopped after."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import yaml

from torchserve_vision.torchserve_config import free_ports
from torchserve_vision.waiting import wait_until

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


@dataclass(frozen=True)
class Prometheus:
    url: str

    def query(self, expression: str) -> list[dict[str, Any]]:
        answer = requests.get(f"{self.url}/api/v1/query", params={"query": expression}, timeout=10)
        answer.raise_for_status()
        return answer.json()["data"]["result"]

    def series(self, match: str) -> list[dict[str, str]]:
        answer = requests.get(f"{self.url}/api/v1/series", params={"match[]": match}, timeout=10)
        answer.raise_for_status()
        return answer.json()["data"]


@contextmanager
def prometheus(directory: Path, targets: dict[str, dict[str, str]],
               scrape_interval_s: int, rule_files: Sequence[Path] = ()) -> Iterator[Prometheus]:
    """`targets`: host:port -> the labels its series get (e.g. namespace and pod);
    `rule_files`: recording and alerting rules it evaluates (each group at its own interval)."""
    port = free_ports(1)[0]
    config = {"global": {"scrape_interval": f"{scrape_interval_s}s"},
              "rule_files": [str(path) for path in rule_files],
              "scrape_configs": [{"job_name": "pods", "static_configs": [
                  {"targets": [target], "labels": labels} for target, labels in targets.items()]}]}
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={directory / 'prometheus.yml'}",
         f"--storage.tsdb.path={directory / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Prometheus(f"http://127.0.0.1:{port}")

    def ready() -> bool:
        assert process.poll() is None, "prometheus exited"
        try:
            return requests.get(f"{server.url}/-/ready", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    try:
        wait_until(ready, 30, f"prometheus on port {port}", interval_s=0.1)
        yield server
    finally:
        process.terminate()
        process.wait(timeout=30)
