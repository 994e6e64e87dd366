"""Start, probe and stop a TorchServe instance in its own run directory.

Every instance gets its own working directory (logs, key_file.json) and its own TMPDIR (TorchServe
keeps its pid file in Python's temp dir, and refuses to start while another instance's exists), so
several instances (the demo, test servers) run side by side and stopping one leaves the others.

    python scripts/torchserve_process.py start [--config config/config.properties] [--run-dir .run]
    python scripts/torchserve_process.py stop  [--run-dir .run] [--drain-timeout 30]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import requests

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from scripts.rollout import wait_for_empty_queue  # noqa: E402
from scripts.torchserve_config import read_properties, render_properties  # noqa: E402

DEFAULT_CONFIG = REPO_ROOT / "config" / "config.properties"
DEFAULT_RUN_DIR = REPO_ROOT / ".run"
# Frontend logging at INFO, each line once, written off the request path (see the file).
DEFAULT_LOG_CONFIG = REPO_ROOT / "config" / "log4j2.xml"


class ServerError(RuntimeError):
    """TorchServe did not start, or did not become healthy in time."""


@dataclass(frozen=True)
class TorchServeInstance:
    run_dir: Path
    config_path: Path
    inference_url: str
    management_url: str
    metrics_url: str
    log_config: Path | None = DEFAULT_LOG_CONFIG  # None: TorchServe's built-in log4j2 config

    @property
    def tmp_dir(self) -> Path:
        return self.run_dir / "tmp"

    @property
    def effective_config(self) -> Path:
        """The config TorchServe runs with: `config_path` with this instance's model store."""
        return self.run_dir / "effective.config.properties"

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["TMPDIR"] = str(self.tmp_dir)
        # The frontend's java.io.tmpdir: worker sockets (.ts.sock.<port>) and unpacked archives
        # go there, so two instances on one host never share a socket path.
        env["TEMP"] = str(self.tmp_dir)
        env["LOG_LOCATION"] = str(self.log_dir)
        env["METRICS_LOCATION"] = str(self.log_dir)
        bin_dir = str(Path(sys.executable).parent)
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
        return env

    @property
    def key_file(self) -> Path:
        """Where TorchServe writes its keys when token authorization is on."""
        return self.run_dir / "key_file.json"

    def auth_headers(self, kind: str) -> dict[str, str]:
        """The `kind` ("inference" / "management") key when token authorization is on."""
        if not self.key_file.is_file():
            return {}
        key = json.loads(self.key_file.read_text())[kind]["key"]
        return {"Authorization": f"Bearer {key}"}

    def inference_headers(self) -> dict[str, str]:
        return self.auth_headers("inference")  # TorchServe guards /ping with it too

    def management_headers(self) -> dict[str, str]:
        return self.auth_headers("management")

    def model_log_tail(self, lines: int = 40) -> str:
        log = self.log_dir / "model_log.log"
        if not log.is_file():
            return "(no model_log.log yet)"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def instance_for(config_path: Path, run_dir: Path,
                 log_config: Path | None = DEFAULT_LOG_CONFIG) -> TorchServeInstance:
    properties = read_properties(config_path)
    return TorchServeInstance(
        run_dir=run_dir.resolve(),
        config_path=config_path.resolve(),
        inference_url=properties.get("inference_address", "http://127.0.0.1:8080"),
        management_url=properties.get("management_address", "http://127.0.0.1:8081"),
        metrics_url=properties.get("metrics_address", "http://127.0.0.1:8082"),
        log_config=log_config.resolve() if log_config else None,
    )


def configured_model_store(config_path: Path) -> Path:
    """The config's `model_store`; a relative path is taken from the repository root."""
    store = Path(read_properties(config_path).get("model_store", "model_store"))
    return store if store.is_absolute() else REPO_ROOT / store


# Unix socket paths are limited to 107 bytes; the longest worker socket name is .ts.sock.65535.
MAX_SOCKET_PATH = 107


def java_regex_literal(text: str) -> str:
    """`text` quoted for a Java regular expression, written as a properties-file value."""
    if "\\E" in text:
        raise ServerError(f"cannot quote {text!r} for allowed_urls")
    return "\\\\Q" + text + "\\\\E"


def write_effective_config(instance: TorchServeInstance, model_store: Path) -> Path:
    """The instance's config with `model_store` made absolute and `allowed_urls` restricted to
    archives directly in it (TorchServe copies a file:// URL that matches into the store)."""
    properties = read_properties(instance.config_path)
    store = str(model_store.resolve())
    properties["model_store"] = store
    properties["allowed_urls"] = f"file://{java_regex_literal(store)}/[^/]+\\\\.mar"
    instance.effective_config.write_text(render_properties(properties), encoding="utf-8")
    return instance.effective_config


def torchserve_command(instance: TorchServeInstance, extra: Sequence[str] = ()) -> list[str]:
    executable = shutil.which("torchserve", path=instance.environment()["PATH"])
    if executable is None:
        raise ServerError("torchserve is not installed; run scripts/setup.sh first")
    return [executable, *extra]


def ping(instance: TorchServeInstance) -> bool:
    try:
        answer = requests.get(f"{instance.inference_url}/ping", headers=instance.inference_headers(),
                              timeout=2)
    except (requests.RequestException, ValueError, KeyError):
        return False
    return answer.status_code == 200 and answer.json().get("status") == "Healthy"


def models_ready(instance: TorchServeInstance, expected_models: int) -> bool:
    """At least `expected_models` models registered, each default version with its minimum of
    READY workers. (/ping alone is not enough: it answers Healthy before any model is loaded.)"""
    headers = instance.management_headers()
    try:
        models = requests.get(f"{instance.management_url}/models", headers=headers,
                              timeout=5).json()["models"]
        if len(models) < expected_models:
            return False
        for model in models:
            (default,) = requests.get(f"{instance.management_url}/models/{model['modelName']}",
                                      headers=headers, timeout=5).json()
            ready = sum(worker["status"] == "READY" for worker in default["workers"])
            if ready < max(default["minWorkers"], 1):
                return False
    except (requests.RequestException, ValueError, KeyError, TypeError):
        return False
    return True


def expected_model_count(instance: TorchServeInstance, model_store: Path) -> int:
    value = read_properties(instance.config_path).get("load_models", "").strip()
    if value.lower() == "all":
        return len(list(model_store.glob("*.mar")))
    return len([name for name in value.split(",") if name.strip()])


def wait_until_healthy(instance: TorchServeInstance, timeout_s: float, expected_models: int = 0) -> None:
    """Wait for /ping and for every model loaded at start to have its workers READY."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ping(instance) and models_ready(instance, expected_models):
            return
        time.sleep(0.5)
    raise ServerError(f"TorchServe at {instance.inference_url} was not healthy after {timeout_s:.0f} s."
                      f"\nLast lines of {instance.log_dir / 'model_log.log'}:\n"
                      f"{instance.model_log_tail()}")


def start(instance: TorchServeInstance, model_store: Path | None = None,
          timeout_s: float = 180.0, wait: bool = True) -> None:
    """Start TorchServe with the instance's config (`--ncs`: no snapshot restore) and wait for /ping."""
    instance.tmp_dir.mkdir(parents=True, exist_ok=True)
    instance.log_dir.mkdir(parents=True, exist_ok=True)
    if len(str(instance.tmp_dir / ".ts.sock.65535").encode()) > MAX_SOCKET_PATH:
        raise ServerError(f"the run directory {instance.run_dir} is too deep for worker sockets "
                          f"(Unix socket paths have at most {MAX_SOCKET_PATH} bytes): use a shorter one")
    store = model_store or configured_model_store(instance.config_path)
    extra = ["--start", "--ncs", "--ts-config", str(write_effective_config(instance, store)),
             "--model-store", str(store.resolve())]
    if instance.log_config is not None:
        extra += ["--log-config", str(instance.log_config)]
    with open(instance.run_dir / "torchserve.out", "ab") as output:
        result = subprocess.run(torchserve_command(instance, extra), cwd=instance.run_dir,
                                env=instance.environment(), stdout=output,
                                stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        text = (instance.run_dir / "torchserve.out").read_text(errors="replace")[-2000:]
        raise ServerError(f"torchserve --start failed ({result.returncode}):\n{text}")
    if wait:
        wait_until_healthy(instance, timeout_s, expected_model_count(instance, store))


def pending_requests(instance: TorchServeInstance) -> int:
    """Requests queued (not yet taken by a worker) over every model's default version."""
    headers = instance.management_headers()
    models = requests.get(f"{instance.management_url}/models", headers=headers, timeout=5).json()["models"]
    total = 0
    for model in models:
        for version in requests.get(f"{instance.management_url}/models/{model['modelName']}/all",
                                    headers=headers, timeout=5).json():
            total += int(version.get("jobQueueStatus", {}).get("pendingRequests", 0))
    return total


def drain(instance: TorchServeInstance, timeout_s: float, grace_s: float) -> bool:
    """Wait until no request is queued, then `grace_s` for the batches being computed (see
    `wait_for_empty_queue`). True when drained; False after `timeout_s` (continuous load)."""
    def pending() -> int:
        try:
            return pending_requests(instance)
        except (requests.RequestException, ValueError, KeyError):
            return 0  # not answering: nothing left to drain

    return wait_for_empty_queue(pending, timeout_s, grace_s)


def stop(instance: TorchServeInstance, timeout_s: float = 60.0, drain_timeout_s: float = 0.0,
         drain_grace_s: float = 1.0) -> None:
    """Stop the instance whose pid file lies in its TMPDIR; do nothing if none runs.

    TorchServe's own stop closes every connection at once: requests in flight get no answer.
    With `drain_timeout_s` > 0, queued requests are answered first (see `drain`)."""
    pid_file = instance.tmp_dir / ".model_server.pid"
    if not pid_file.exists():
        return
    if drain_timeout_s > 0 and not drain(instance, drain_timeout_s, drain_grace_s):
        print(f"requests still queued after {drain_timeout_s:.0f} s; stopping anyway", file=sys.stderr)
    frontend_pid = int(pid_file.read_text().strip() or 0)
    subprocess.run(torchserve_command(instance, ["--stop"]), cwd=instance.run_dir,
                   env=instance.environment(), capture_output=True, timeout=timeout_s, check=False)
    wait_for_exit(frontend_pid, timeout_s)


def wait_for_exit(pid: int, timeout_s: float) -> None:
    """`torchserve --stop` can return before the frontend has exited (seen on a busy machine):
    wait for it, and kill it if it outlives `timeout_s`."""
    try:
        process = psutil.Process(pid)
        process.wait(timeout=timeout_s)
    except psutil.NoSuchProcess:
        return
    except psutil.TimeoutExpired:
        process.kill()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("start", "stop", "status"))
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR,
                        help="working directory for logs, keys and the pid file (default: .run)")
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="start: seconds to wait until every model's workers are ready")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="stop: seconds to wait for queued requests first (0: stop at once)")
    parser.add_argument("--log-config", type=Path, default=DEFAULT_LOG_CONFIG,
                        help="start: log4j2 configuration (default: config/log4j2.xml)")
    parser.add_argument("--builtin-log-config", action="store_true",
                        help="start: TorchServe's own log4j2 configuration (DEBUG, for comparison)")
    args = parser.parse_args(argv)
    instance = instance_for(args.config, args.run_dir,
                            None if args.builtin_log_config else args.log_config)
    try:
        if args.action == "start":
            if ping(instance):
                print(f"TorchServe is already serving at {instance.inference_url}")
                return 0
            start(instance, timeout_s=args.timeout)
            print(f"TorchServe is healthy at {instance.inference_url} (logs in {instance.log_dir})")
        elif args.action == "stop":
            stop(instance, drain_timeout_s=args.drain_timeout)
            print("TorchServe has stopped")
        else:
            healthy = ping(instance)
            print(f"{instance.inference_url}: {'healthy' if healthy else 'not answering /ping'}")
            return 0 if healthy else 1
    except ServerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
