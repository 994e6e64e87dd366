"""Start, probe and stop a TorchServe instance in its own run directory.

Every instance gets its own working directory (logs, key_file.json) and its own TMPDIR (TorchServe
keeps its pid file in Python's temp dir, and refuses to start while another instance's exists), so
several instances (the demo, test servers) run side by side and stopping one leaves the others.
`run_in_foreground` is the long-running form: start, serve until SIGTERM or SIGINT, drain, stop.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from handlers.shadow.shadow_policy import TRAFFIC_DIR_ENVIRONMENT
from torchserve_vision import paths
from torchserve_vision.archives.versions import ArchiveError, archive_manifest
from torchserve_vision.client import KeyFile, ManagementError, TorchServeClient
from torchserve_vision.deployment_settings import AS_WRITTEN, DeploymentSettings, local_url
from torchserve_vision.errors import CommandError
from torchserve_vision.front_proxy import FrontProxy, front_config, prepare_traffic_dir
from torchserve_vision.frontend.agent import java_agent_option
from torchserve_vision.json_log_lines import json_line_relay
from torchserve_vision.pod_health import PodHealth, ProbeEndpoint
from torchserve_vision.server_state import (
    Outstanding,
    models_ready,
    not_ready_reason,
    outstanding,
    wait_until_answered,
)
from torchserve_vision.torchserve_config import read_properties, render_properties
from torchserve_vision.v2_model_endpoints import V2ModelEndpoints
from torchserve_vision.waiting import wait_until
from torchserve_vision.worker_forkserver.frontend_setup import (
    prestart_fork_server,
    wait_for_fork_servers,
    with_fork_server,
)
from torchserve_vision.worker_processes import end_leftover_workers


class ServerError(CommandError, RuntimeError):
    """TorchServe did not start, or did not become healthy in time."""


class ServerAlreadyRunning(ServerError):
    """A TorchServe of the same run directory runs already: it was not started here, and it is
    left as it is."""


@dataclass(frozen=True)
class TorchServeInstance:
    run_dir: Path
    config_path: Path
    inference_url: str
    management_url: str
    metrics_url: str
    log_config: Path | None = paths.LOG_CONFIG  # None: TorchServe's built-in log4j2 config
    settings: DeploymentSettings = AS_WRITTEN  # from the environment, for `server run`
    # TorchServe's output (and, with paths.STDOUT_LOG_CONFIG, every log) on this process's
    # standard output instead of run_dir/torchserve.out
    log_to_stdout: bool = False
    # With log_to_stdout: every line of it a JSON object (json_log_lines; paths.JSON_LOG_CONFIG)
    log_json: bool = False

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

    @property
    def output_path(self) -> Path:
        """TorchServe's own output (the launcher's and the JVM's), appended to by every start of
        the run directory; unused when its logs go to standard output."""
        return self.run_dir / "torchserve.out"

    @property
    def traffic_dir(self) -> Path:
        """Where `models shadow` writes a model's shadow policy for its workers to read
        (handlers.shadow.shadow_policy)."""
        return self.run_dir / "traffic"

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["TMPDIR"] = str(self.tmp_dir)
        # The frontend's java.io.tmpdir: worker sockets (.ts.sock.<port>) and unpacked archives
        # go there, so two instances on one host never share a socket path.
        env["TEMP"] = str(self.tmp_dir)
        env["LOG_LOCATION"] = str(self.log_dir)
        env["METRICS_LOCATION"] = str(self.log_dir)
        env[TRAFFIC_DIR_ENVIRONMENT] = str(self.traffic_dir.resolve())
        bin_dir = str(Path(sys.executable).parent)
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
        return with_fork_server(env, self.tmp_dir)

    @property
    def key_file(self) -> Path:
        """Where TorchServe writes its keys when token authorization is on."""
        return self.run_dir / "key_file.json"

    def auth_headers(self, kind: str) -> dict[str, str]:
        """The `kind` ("inference" / "management") key when token authorization is on."""
        return self.client().auth_headers(kind)

    def client(self, timeout_s: float = 5.0, attempts: int = 1) -> TorchServeClient:
        """A client for this instance, with its key file when token authorization is on."""
        return TorchServeClient(self.management_url, self.inference_url,
                                KeyFile(self.key_file) if self.key_file.is_file() else None,
                                metrics_url=self.metrics_url, attempts=attempts,
                                timeout_s=timeout_s)

    def inference_headers(self) -> dict[str, str]:
        return self.auth_headers("inference")  # TorchServe guards /ping with it too

    def management_headers(self) -> dict[str, str]:
        return self.auth_headers("management")

    def model_log_tail(self, lines: int = 40) -> str:
        log = self.log_dir / "model_log.log"
        if not log.is_file():
            return "(no model_log.log yet)"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def instance_for(config_path: Path, run_dir: Path, log_config: Path | None = paths.LOG_CONFIG,
                 settings: DeploymentSettings = AS_WRITTEN,
                 log_to_stdout: bool = False, log_json: bool = False) -> TorchServeInstance:
    properties = settings.apply(read_properties(config_path))
    return TorchServeInstance(
        run_dir=run_dir.resolve(),
        config_path=config_path.resolve(),
        inference_url=local_url(properties.get("inference_address", "http://127.0.0.1:8080")),
        management_url=local_url(properties.get("management_address", "http://127.0.0.1:8081")),
        metrics_url=local_url(properties.get("metrics_address", "http://127.0.0.1:8082")),
        log_config=log_config.resolve() if log_config else None,
        settings=settings,
        log_to_stdout=log_to_stdout,
        log_json=log_to_stdout and log_json,
    )


def configured_model_store(config_path: Path) -> Path:
    """The config's `model_store` (a relative path is taken from the current directory)."""
    return Path(read_properties(config_path).get("model_store", str(paths.MODEL_STORE))).resolve()


# Unix socket paths are limited to 107 bytes; the longest worker socket name is .ts.sock.65535.
MAX_SOCKET_PATH = 107


def java_regex_literal(text: str) -> str:
    """`text` quoted for a Java regular expression, written as a properties-file value."""
    if "\\E" in text:
        raise ServerError(f"cannot quote {text!r} for allowed_urls")
    return "\\\\Q" + text + "\\\\E"


def write_effective_config(instance: TorchServeInstance, model_store: Path) -> Path:
    """The instance's config with its deployment settings applied, `model_store` made absolute,
    `allowed_urls` restricted to archives directly in it (TorchServe copies a file:// URL that
    matches into the store), and the frontend agent (queued batching) among the JVM's options."""
    properties = instance.settings.apply(read_properties(instance.config_path))
    store = str(model_store.resolve())
    properties["model_store"] = store
    properties["allowed_urls"] = f"file://{java_regex_literal(store)}/[^/]+\\\\.mar"
    properties["vmargs"] = " ".join(filter(None, [properties.get("vmargs", ""), java_agent_option()]))
    instance.effective_config.write_text(render_properties(properties), encoding="utf-8")
    return instance.effective_config


def torchserve_command(instance: TorchServeInstance, extra: Sequence[str] = ()) -> list[str]:
    executable = shutil.which("torchserve", path=instance.environment()["PATH"])
    if executable is None:
        raise ServerError("torchserve is not installed; run scripts/setup.sh first")
    return [executable, *extra]


def ping(instance: TorchServeInstance) -> bool:
    return instance.client(timeout_s=2.0).ping()


def archives_loaded_at_start(instance: TorchServeInstance, model_store: Path) -> list[Path]:
    """The archives `load_models=` names (every archive of the store for `all`)."""
    value = read_properties(instance.config_path).get("load_models", "").strip()
    if value.lower() == "all":
        return list(model_store.glob("*.mar"))
    return [model_store / name.strip() for name in value.split(",") if name.strip()]


def expected_model_count(instance: TorchServeInstance, model_store: Path) -> int:
    """Models loaded at start: TorchServe lists two versions of one model (a candidate loaded
    beside the served version) as one model."""
    return len({model_name_of(archive) for archive in archives_loaded_at_start(instance, model_store)})


def check_archives_present(instance: TorchServeInstance, model_store: Path) -> None:
    """ServerError naming the archives `load_models=` asks for that the store lacks: TorchServe
    would start without them and never become healthy."""
    missing = [archive.name for archive in archives_loaded_at_start(instance, model_store)
               if not archive.is_file()]
    if missing:
        raise ServerError(f"{model_store} lacks {', '.join(missing)} (load_models= of "
                          f"{instance.config_path}): build them first, e.g. `torchserve-vision build`")


def model_name_of(archive: Path) -> str:
    """The model an archive holds (its file name when its manifest cannot be read: TorchServe
    will say why when it loads it)."""
    try:
        return str(archive_manifest(archive)["modelName"])
    except ArchiveError:
        return archive.name


def wait_until_healthy(instance: TorchServeInstance, timeout_s: float, expected_models: int = 0,
                       cancelled: threading.Event | None = None, output_start: int = 0) -> None:
    """Wait for /ping and for every model loaded at start to have its workers READY (or until
    `cancelled` is set: the caller is stopping anyway). ServerError at once when the frontend
    has exited unasked: TorchServe 0.12 exits when it cannot bind an address, and /ping alone
    would leave the caller waiting out `timeout_s` for a server that is gone. (A Ctrl-C reaches
    the frontend too; then `cancelled` is set and the caller's stop follows, no error.)
    `output_start`: where this start's output begins in torchserve.out, which keeps earlier
    starts' output."""

    def healthy() -> bool:
        if ping(instance) and models_ready(instance.client(), expected_models):
            return True
        if frontend_pid(instance) is None and not (cancelled is not None and cancelled.is_set()):
            raise ServerError(f"TorchServe at {instance.inference_url} exited while starting"
                              f"{frontend_exit_reason(instance, output_start)}")
        return False

    wait_until(healthy, timeout_s, f"TorchServe at {instance.inference_url} to be healthy", interval_s=0.5,
               cancelled=cancelled,
               error=lambda message: ServerError(
                   f"{message}.\nLast lines of {instance.log_dir / 'model_log.log'}:\n"
                   f"{instance.model_log_tail()}"))


def output_end(instance: TorchServeInstance) -> int:
    """Where the next start's output will begin in torchserve.out (every start of a run
    directory appends to it)."""
    output = instance.output_path
    return output.stat().st_size if output.is_file() else 0


def frontend_exit_reason(instance: TorchServeInstance, output_start: int = 0, lines: int = 20) -> str:
    """Why the frontend exited, from its output after `output_start` (a byte offset): the address
    it could not bind, else its last lines (with log_to_stdout the output went to the caller's
    standard output)."""
    if instance.log_to_stdout:
        return ": see its output above"
    output = instance.output_path
    text = ""
    if output.is_file():
        with output.open("rb") as written:
            written.seek(output_start)
            text = written.read().decode(errors="replace")
    bind = re.search(r"Failed to bind to address: (\S+)", text)
    if bind is not None:
        cause = " (address already in use)" if "Address already in use" in text else ""
        return f": it could not bind {bind[1]}{cause}"
    return f". Last lines of {output}:\n" + "\n".join(text.splitlines()[-lines:])


def refuse_if_running(instance: TorchServeInstance) -> None:
    """ServerAlreadyRunning when a TorchServe runs from the instance's run directory."""
    running = frontend_pid(instance)
    if running is not None:
        raise ServerAlreadyRunning(
            f"TorchServe is already running from {instance.run_dir} (pid {running}, "
            f"{instance.inference_url}); it was left running: use it, or stop it first with "
            f"`torchserve-vision server stop --run-dir {instance.run_dir}`")


def start(instance: TorchServeInstance, model_store: Path | None = None,
          timeout_s: float = 180.0, wait: bool = True, cancelled: threading.Event | None = None) -> None:
    """Start TorchServe with the instance's config (`--ncs`: no snapshot restore) and wait until it
    is healthy; ServerAlreadyRunning (nothing changed) when one runs from the instance's run
    directory already; ServerError before starting when the store lacks an archive `load_models=`
    names, and after stopping it again when it does not become healthy within `timeout_s`."""
    instance.tmp_dir.mkdir(parents=True, exist_ok=True)
    instance.log_dir.mkdir(parents=True, exist_ok=True)
    if len(str(instance.tmp_dir / ".ts.sock.65535").encode()) > MAX_SOCKET_PATH:
        raise ServerError(f"the run directory {instance.run_dir} is too deep for worker sockets "
                          f"(Unix socket paths have at most {MAX_SOCKET_PATH} bytes): use a shorter one")
    refuse_if_running(instance)
    store = model_store or configured_model_store(instance.config_path)
    check_archives_present(instance, store)
    extra = ["--start", "--ncs", "--ts-config", str(write_effective_config(instance, store)),
             "--model-store", str(store.resolve())]
    if instance.log_config is not None:
        extra += ["--log-config", str(instance.log_config)]
    # With log_to_stdout the frontend inherits this process's standard output and keeps it after
    # the command returns: its console logs go where a container's logs are read.
    # As JSON lines, its output goes through a pipe that a thread here copies, wrapping the lines
    # that log4j2 does not write (the launcher's, the JVM's).
    output_path = instance.output_path
    output_start = output_end(instance)
    sys.stdout.flush()
    environment = instance.environment()
    fork_server = prestart_fork_server(environment, instance.tmp_dir / ".model_server.pid")
    relay = json_line_relay() if instance.log_json else None
    with nullcontext(relay) if instance.log_to_stdout else open(output_path, "ab") as output:
        try:
            result = subprocess.run(torchserve_command(instance, extra), cwd=instance.run_dir,
                                    env=environment, stdout=output,
                                    stderr=None if output is None else subprocess.STDOUT, check=False)
        finally:
            if relay is not None:
                os.close(relay)      # the frontend keeps its own copy of the pipe
    if result.returncode != 0:
        if fork_server is not None:
            fork_server.kill()
        where = ("see its output above" if instance.log_to_stdout
                 else "\n" + output_path.read_text(errors="replace")[-2000:])
        raise ServerError(f"torchserve --start failed ({result.returncode}): {where}")
    if wait:
        try:
            wait_until_healthy(instance, timeout_s, expected_model_count(instance, store), cancelled,
                               output_start)
        except ServerError:
            stop(instance)      # a server that never became healthy is not left running
            raise


def drain(instance: TorchServeInstance, timeout_s: float, grace_s: float) -> bool:
    """Wait until no request is queued or in a batch; `grace_s` more only for versions whose
    batches cannot be seen (see `wait_until_answered`). True when drained; False after
    `timeout_s` (continuous load)."""
    client = instance.client()

    def pending() -> Outstanding:
        try:
            return outstanding(client)
        except (ManagementError, KeyError):
            return Outstanding(0)  # not answering: nothing left to drain

    return wait_until_answered(pending, timeout_s, grace_s)


def stop(instance: TorchServeInstance, timeout_s: float = 60.0, drain_timeout_s: float = 0.0,
         drain_grace_s: float = 1.0) -> None:
    """Stop the instance whose pid file lies in its TMPDIR; do nothing if none runs.

    TorchServe's own stop closes every connection at once: requests in flight get no answer.
    With `drain_timeout_s` > 0, queued requests are answered first (see `drain`). Workers still
    running once the frontend has exited (busy loading, or the frontend killed) are killed
    (worker_processes.end_leftover_workers)."""
    pid_file = instance.tmp_dir / ".model_server.pid"
    if not pid_file.exists():
        return
    if drain_timeout_s > 0 and not drain(instance, drain_timeout_s, drain_grace_s):
        print(f"requests still queued after {drain_timeout_s:.0f} s; stopping anyway", file=sys.stderr)
    pid = int(pid_file.read_text().strip() or 0)
    subprocess.run(torchserve_command(instance, ["--stop"]), cwd=instance.run_dir,
                   env=instance.environment(), capture_output=True, timeout=timeout_s, check=False)
    wait_for_exit(pid, timeout_s)
    end_leftover_workers(instance.tmp_dir)
    wait_for_fork_servers(instance.tmp_dir, timeout_s)


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


def frontend_pid(instance: TorchServeInstance) -> int | None:
    """The running frontend's pid, from the pid file in the instance's TMPDIR (None: not running)."""
    pid_file = instance.tmp_dir / ".model_server.pid"
    try:
        pid = int(pid_file.read_text().strip() or 0)
    except (OSError, ValueError):
        return None
    return pid if pid and process_alive(pid) else None


def process_alive(pid: int) -> bool:
    """True while `pid` runs: not gone, and not a zombie (a process that exited and that nobody
    has reaped yet, which `psutil.pid_exists` counts as existing)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def reap_orphans(keep: set[int]) -> None:
    """Reap this process's children that have exited, but those in `keep` (children whose Popen
    objects wait for them). As a container's PID 1 (and TorchServe's frontend leaves
    `torchserve --start` behind, so it becomes a child of PID 1), nobody else would: every dead
    frontend or worker would stay a zombie for the life of the container."""
    for child in psutil.Process().children():
        try:
            if child.pid not in keep and child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            continue


@dataclass(frozen=True)
class ForegroundOptions:
    """How `run_in_foreground` starts and stops. The stop takes at most about
    `drain_delay_s + drain_timeout_s + drain_grace_s + stop_timeout_s` (`stop_bound_s`)."""

    start_timeout_s: float = 180.0
    drain_delay_s: float = 0.0     # serving on, readiness false: time for load balancers to notice
    drain_timeout_s: float = 30.0  # then up to this long for queued requests to be answered
    drain_grace_s: float = 1.0     # then this long for the batches being computed
    stop_timeout_s: float = 30.0
    probe_host: str = "127.0.0.1"
    probe_port: int | None = None  # None: no probe endpoint (see pod_health)
    front_port: int | None = None  # None: no front (see front_proxy); needs probe_port
    grpc_front_port: int | None = None  # None: no gRPC front (see grpc_front); needs front_port

    @property
    def stop_bound_s(self) -> float:
        return self.drain_delay_s + self.drain_timeout_s + self.drain_grace_s + self.stop_timeout_s


DEFAULT_FOREGROUND = ForegroundOptions()
# The front's bound on one request: longer than any response timeout TorchServe applies first.
FRONT_TIMEOUT_S = 600


def grpc_front_for(instance: TorchServeInstance,
                   options: ForegroundOptions) -> AbstractContextManager[object]:
    """The gRPC front of `server run` (imported here: it needs `tritonclient[grpc]`, which only
    a server with a gRPC front uses), forwarding to the front on this host; messages as large
    as the config's max_request_size."""
    try:
        from torchserve_vision.grpc_front import GrpcFront
    except ImportError as missing:
        raise ServerError(f"the gRPC front needs tritonclient[grpc] ({missing}): pip install "
                          "'torchserve-vision[grpc-front]'") from missing

    assert options.grpc_front_port is not None and options.front_port is not None
    connect_host = "127.0.0.1" if options.probe_host in ("0.0.0.0", "::", "") else options.probe_host
    properties = read_properties(instance.config_path)
    largest = max(int(properties.get(name, 6553500)) for name in ("max_request_size", "max_response_size"))
    return GrpcFront(options.probe_host, options.grpc_front_port,
                     f"http://{connect_host}:{options.front_port}", FRONT_TIMEOUT_S, largest)


def stop_handler(stop_requested: threading.Event) -> Callable[[int, Any], None]:
    """A signal handler that sets `stop_requested` once. Python runs a handler in the main thread
    between two bytecodes, also inside another handler: a second signal arriving while the
    first one's `set()` holds the event's lock in that same thread would wait for the lock
    forever (seen: `timeout` and `pkill` each sending SIGTERM hung `server run`). So only the
    first signal sets it; the flag is taken before `set()` is called."""
    taken: list[bool] = []

    def handle(number: int, frame: Any) -> None:
        if not taken:
            taken.append(True)
            stop_requested.set()
    return handle


def run_in_foreground(instance: TorchServeInstance, model_store: Path | None = None,
                      options: ForegroundOptions = DEFAULT_FOREGROUND,
                      on_ready: Callable[[], None] = lambda: None,
                      on_event: Callable[[str], None] = lambda line: None) -> None:
    """Start TorchServe, wait until every model's workers are READY, call `on_ready`, and serve
    until SIGTERM or SIGINT. Then: readiness false (the probe endpoint answers 503 "draining"),
    `drain_delay_s` still serving, queued and in-flight requests answered (up to
    `drain_timeout_s`), TorchServe stopped. A signal while starting stops at once, without
    waiting for the workers. ServerError when it does not start, or when the frontend exits on
    its own."""
    refuse_if_running(instance)
    stop_requested = threading.Event()
    handled = (signal.SIGTERM, signal.SIGINT)
    previous = {number: signal.signal(number, stop_handler(stop_requested)) for number in handled}
    store = model_store or configured_model_store(instance.config_path)
    expected_models = expected_model_count(instance, store)
    health = PodHealth(check=lambda: not_ready_reason(instance.client(timeout_s=2.0), expected_models),
                       frontend_alive=lambda: frontend_pid(instance) is not None)
    probes: ProbeEndpoint | nullcontext[None] = nullcontext()
    front: FrontProxy | nullcontext[None] = nullcontext()
    if options.front_port is not None and options.probe_port is None:
        raise ServerError("a front needs the probe port (its model endpoints live there)")
    if options.grpc_front_port is not None and options.front_port is None:
        raise ServerError("the gRPC front needs the front (it forwards to the front's address)")
    if options.probe_port is not None:
        endpoints = None
        if options.front_port is not None:
            endpoints = V2ModelEndpoints(client=lambda: instance.client(timeout_s=5.0),
                                         required_headers=instance.inference_headers)
        probes = ProbeEndpoint(health, options.probe_host, options.probe_port, endpoints)
    if options.front_port is not None and options.probe_port is not None:
        prepare_traffic_dir(instance.traffic_dir)
        front = FrontProxy(front_config(options.probe_host, options.front_port, instance.inference_url,
                                        options.probe_port, FRONT_TIMEOUT_S,
                                        instance.traffic_dir.resolve()), options.front_port)
    grpc_front = nullcontext() if options.grpc_front_port is None else grpc_front_for(instance, options)

    def own_children() -> set[int]:
        return {front.pid} if isinstance(front, FrontProxy) and front.pid is not None else set()
    try:
        with probes, front, grpc_front:
            output_start = output_end(instance)
            try:
                start(instance, store, options.start_timeout_s, cancelled=stop_requested)
            except ServerAlreadyRunning:
                raise                   # not started here: left running
            except ServerError:
                stop(instance)
                raise
            health.started.set()
            health.refresh()
            if not stop_requested.is_set():
                on_ready()
            while not stop_requested.wait(1.0):
                reap_orphans(keep=own_children())
                if frontend_pid(instance) is None:
                    end_leftover_workers(instance.tmp_dir)
                    where = "" if instance.log_to_stdout else f" (logs in {instance.log_dir})"
                    raise ServerError(f"TorchServe exited on its own{where}"
                                      f"{frontend_exit_reason(instance, output_start)}")
            stop_started = time.monotonic()
            health.draining.set()
            on_event(f"stopping: readiness false, serving for {options.drain_delay_s:g} s more")
            time.sleep(options.drain_delay_s)
            if not drain(instance, options.drain_timeout_s, options.drain_grace_s):
                on_event(f"requests still queued after {options.drain_timeout_s:g} s; stopping anyway")
            stop(instance, timeout_s=options.stop_timeout_s)
            on_event(f"stopped {time.monotonic() - stop_started:.1f} s after the signal "
                     f"(bound {options.stop_bound_s:g} s)")
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        reap_orphans(keep=own_children())
