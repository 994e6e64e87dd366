"""`torchserve-vision server start | stop | status | run`: a TorchServe in its own run directory."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import psutil

from torchserve_vision import paths
from torchserve_vision.cli.common import Subcommand, register_table, subcommand
from torchserve_vision.deployment_settings import DeploymentSettings
from torchserve_vision.json_log_lines import json_log_line
from torchserve_vision.lab.pods import Pod, PodError
from torchserve_vision.server_process import (
    ForegroundOptions,
    ServerError,
    TorchServeInstance,
    configured_model_store,
    frontend_pid,
    instance_for,
    ping,
    run_in_foreground,
    start,
    stop,
)
from torchserve_vision.server_state import models_ready
from torchserve_vision.torchserve_config import free_ports

# The pid of `server run` when `server start --front-port` started it, in the run directory.
BACKGROUND_RUN_PID = "server-run.pid"
# `--log-to`: None keeps TorchServe's logs in files; otherwise the log4j2 config that puts every
# log on standard output (as text, or as JSON lines).
LOG_DESTINATIONS: dict[str, Path | None] = {"files": None, "stdout": paths.STDOUT_LOG_CONFIG,
                                            "json": paths.JSON_LOG_CONFIG}

DESCRIPTION = """\
Start, stop, check or run TorchServe from a config file, in its own run directory (logs, keys,
pid file), so several instances can run side by side.

  torchserve-vision server start                # config/config.properties, waits for READY workers
  torchserve-vision server start --config config/config.production.properties --run-dir .run-prod
  torchserve-vision server status               # exit 0 when every model has READY workers
  torchserve-vision server stop                 # answers queued requests first (--drain-timeout)
  torchserve-vision server run                  # in the foreground until SIGTERM / Ctrl-C
  torchserve-vision server run --probe-port 8090 --drain-delay 5   # a container's command
  torchserve-vision server start --front-port 8000   # `server run` with its front, in the background

`run` serves readiness and liveness probes on --probe-port (GET /ready, GET /live; no key
needed), and on SIGTERM turns readiness false, keeps serving for --drain-delay seconds, answers
what is queued and in flight (up to --drain-timeout), stops TorchServe and exits 0.

`start --front-port F` starts `run` with its front (HAProxy: the Open Inference Protocol's model
endpoints, the canary split) in the background, output in the run directory's server-run.out,
and returns once it is ready; `stop` sends it SIGTERM and waits for it.

Environment (a deployment's settings; unset = the config as written):
  TSV_BIND_ADDRESS=0.0.0.0        inference, management, metrics and probe addresses
  TSV_WORKERS=N                   workers of every model
  TSV_TOKEN_AUTHORIZATION=on|off  TorchServe's token authorization
  TSV_JAVA_PROCESSORS=N           the frontend JVM's -XX:ActiveProcessorCount (a pod's CPU request)
  TSV_MODEL_STORE=/path           default of --model-store
  TSV_PROBE_PORT=8090             default of --probe-port
"""


def location_flags() -> argparse.ArgumentParser:
    location = argparse.ArgumentParser(add_help=False)
    location.add_argument("--config", type=Path, default=paths.DEVELOPMENT_CONFIG,
                          help=f"TorchServe config (default: {paths.DEVELOPMENT_CONFIG})")
    location.add_argument("--run-dir", type=Path, default=paths.RUN_DIR,
                          help=f"logs, keys and the pid file (default: {paths.RUN_DIR})")
    return location


def starting_flags() -> argparse.ArgumentParser:
    starting = argparse.ArgumentParser(add_help=False)
    store = os.environ.get("TSV_MODEL_STORE")
    starting.add_argument("--model-store", type=Path, default=Path(store) if store else None,
                          help="default: $TSV_MODEL_STORE, else the config's model_store")
    starting.add_argument("--timeout", type=float, default=180.0,
                          help="seconds to wait until every model's workers are READY")
    starting.add_argument("--log-config", type=Path, default=paths.LOG_CONFIG,
                          help=f"log4j2 configuration (default: {paths.LOG_CONFIG})")
    starting.add_argument("--builtin-log-config", action="store_true",
                          help="TorchServe's own log4j2 configuration (DEBUG, for comparison)")
    return starting


def draining_flags() -> argparse.ArgumentParser:
    draining = argparse.ArgumentParser(add_help=False)
    draining.add_argument("--drain-timeout", type=float, default=30.0,
                          help="seconds to wait for queued requests before stopping (0: at once)")
    return draining


def probing_flags() -> argparse.ArgumentParser:
    probing = argparse.ArgumentParser(add_help=False)
    probe_port = os.environ.get("TSV_PROBE_PORT")
    probing.add_argument("--probe-port", type=int, default=int(probe_port) if probe_port else None,
                         help="serve GET /ready and /live on this port (default: $TSV_PROBE_PORT; "
                              "none when unset)")
    log_to = os.environ.get("TSV_LOG_TO", "files")
    probing.add_argument("--log-to", choices=sorted(LOG_DESTINATIONS), default=log_to,
                         help="files: TorchServe's logs in the run directory's logs/ (default, or "
                              "$TSV_LOG_TO); stdout: every log on standard output, for a container "
                              f"({paths.STDOUT_LOG_CONFIG} unless --log-config says otherwise); "
                              "json: the same as one JSON object per line, this command's own "
                              f"lines too ({paths.JSON_LOG_CONFIG})")
    probing.add_argument("--drain-delay", type=float, default=0.0,
                         help="seconds to keep serving after SIGTERM with readiness false, before "
                              "draining (time for load balancers to stop sending)")
    return probing


def fronting_flags() -> argparse.ArgumentParser:
    fronting = argparse.ArgumentParser(add_help=False)
    front_port = os.environ.get("TSV_FRONT_PORT")
    fronting.add_argument("--front-port", type=int, default=int(front_port) if front_port else None,
                          help="serve a front (HAProxy) on this port: TorchServe's inference API "
                               "plus the Open Inference Protocol's model metadata and readiness, "
                               "GET /v2/models/{m}[/ready], which TorchServe does not route, and "
                               "the canary split (`models canary`); `run` needs --probe-port, "
                               "`start` runs `run` in the background (default: $TSV_FRONT_PORT; "
                               "none when unset)")
    grpc_front_port = os.environ.get("TSV_GRPC_FRONT_PORT")
    fronting.add_argument("--grpc-front-port", type=int,
                          default=int(grpc_front_port) if grpc_front_port else None,
                          help="serve the Open Inference Protocol's standard gRPC service "
                               "(inference.GRPCInferenceService, what tritonclient.grpc calls) on "
                               "this port, forwarded to the front; needs --front-port (default: "
                               "$TSV_GRPC_FRONT_PORT; none when unset)")
    return fronting


def no_arguments(parser: argparse.ArgumentParser) -> None:
    """Only the flag groups of the table's entry."""


def table() -> tuple[Subcommand, ...]:
    """One entry per subcommand (built when registered: the runners are defined further down)."""
    start_text = "start TorchServe and wait for READY workers"
    run_text = "start, serve until SIGTERM or SIGINT, drain, stop (a container's command)"
    return (
        Subcommand("start", start_text, no_arguments, run_start, start_text,
                   lambda: [location_flags(), starting_flags(), fronting_flags()]),
        Subcommand("stop", "drain, then stop TorchServe", no_arguments, run_stop,
                   "drain, then stop TorchServe", lambda: [location_flags(), draining_flags()]),
        Subcommand("status", "exit 0 when every model has READY workers", no_arguments, run_status,
                   "exit 0 when every model has READY workers", lambda: [location_flags()]),
        Subcommand("run", run_text, no_arguments, run_foreground, run_text,
                   lambda: [location_flags(), starting_flags(), draining_flags(), probing_flags(),
                            fronting_flags()]),
    )


def register(commands: argparse._SubParsersAction) -> None:
    parser = subcommand(commands, "server", "start, stop, check or run TorchServe", DESCRIPTION)
    register_table(parser.add_subparsers(dest="action", required=True, metavar="ACTION"), table())


def instance_from(args: argparse.Namespace) -> TorchServeInstance:
    log_config = None if getattr(args, "builtin_log_config", False) else getattr(args, "log_config",
                                                                                paths.LOG_CONFIG)
    log_to = getattr(args, "log_to", "files")
    destination_config = LOG_DESTINATIONS[log_to]
    if destination_config is not None and log_config == paths.LOG_CONFIG:
        log_config = destination_config
    return instance_for(args.config, args.run_dir, log_config, DeploymentSettings.from_environment(),
                        log_to_stdout=destination_config is not None, log_json=log_to == "json")


def run_start(args: argparse.Namespace) -> int:
    instance = instance_from(args)
    if ping(instance):
        return already_serving(args, instance)
    if args.front_port is not None:
        return start_fronted(args, instance)
    start(instance, args.model_store, timeout_s=args.timeout)
    print(f"TorchServe is ready at {instance.inference_url} (logs in {instance.log_dir})")
    return 0


def already_serving(args: argparse.Namespace, instance: TorchServeInstance) -> int:
    """`server start` where a TorchServe answers already: 0 when it is this run directory's and
    has what was asked (the front on --front-port); else ServerError saying what runs, and that
    it was left as it is."""
    if frontend_pid(instance) is None:
        raise ServerError(f"a TorchServe not started from {args.run_dir} answers at {instance.inference_url} "
                          "(one started by hand, or from another run directory); it was left running: use "
                          "it, or stop it (`torchserve --stop` for one started by hand) and start again")
    if args.front_port is not None and not fronted_on(args.run_dir, args.front_port):
        raise ServerError(f"TorchServe is already serving at {instance.inference_url} from {args.run_dir}, "
                          f"without a front on port {args.front_port}; it was left running: stop it "
                          f"(`torchserve-vision server stop --run-dir {args.run_dir}`) and start it again "
                          "with --front-port")
    front = f", its front on port {args.front_port}" if args.front_port is not None else ""
    print(f"TorchServe is already serving at {instance.inference_url}{front}")
    return 0


def background_run(run_dir: Path) -> psutil.Process | None:
    """The `server run` that `server start --front-port` left in the background, while it runs."""
    try:
        process = psutil.Process(int((run_dir / BACKGROUND_RUN_PID).read_text().strip()))
        return process if "torchserve_vision" in " ".join(process.cmdline()) else None
    except (OSError, ValueError, psutil.Error):
        return None


def fronted_on(run_dir: Path, front_port: int) -> bool:
    """Whether this run directory's background `server run` serves a front on `front_port`."""
    process = background_run(run_dir)
    if process is None:
        return False
    try:
        words = process.cmdline()
    except psutil.Error:
        return False
    flag = words.index("--front-port") if "--front-port" in words else len(words)
    return words[flag + 1:flag + 2] == [str(front_port)]


def start_fronted(args: argparse.Namespace, instance: TorchServeInstance) -> int:
    """`server run` with its front, in a session of its own that outlives this command; ready
    when its readiness probe answers 200."""
    probe_port = os.environ.get("TSV_PROBE_PORT")
    run = Pod("server", args.config, args.run_dir,
              args.model_store or configured_model_store(args.config), drain_delay_s=0.0,
              probe_port=int(probe_port) if probe_port else free_ports(1)[0],
              front_port=args.front_port, grpc_front_port=args.grpc_front_port)
    run.start()
    assert run.process is not None
    (args.run_dir / BACKGROUND_RUN_PID).write_text(str(run.process.pid))
    try:
        run.wait_ready(args.timeout)
    except PodError:
        run.kill()
        (args.run_dir / BACKGROUND_RUN_PID).unlink(missing_ok=True)
        raise
    grpc = f"; gRPC front on port {args.grpc_front_port}" if args.grpc_front_port else ""
    print(f"TorchServe is ready at {instance.inference_url}; the front on port {args.front_port}"
          f"{grpc}; probes on port {run.probe_port} (output in {run.output_path})")
    return 0


def stop_background_run(run_dir: Path, timeout_s: float) -> bool:
    """SIGTERM to the `server run` that `server start --front-port` left in the background (if
    any), and wait for it to drain and exit; whether there was one."""
    process = background_run(run_dir)
    (run_dir / BACKGROUND_RUN_PID).unlink(missing_ok=True)
    if process is None:
        return False
    try:
        process.terminate()
        process.wait(timeout=timeout_s)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        process.kill()
    return True


def run_stop(args: argparse.Namespace) -> int:
    """Stop what this run directory started; say what was stopped, and what still answers at its
    address (a TorchServe started otherwise, left running: exit 1)."""
    instance = instance_from(args)
    ours = frontend_pid(instance) is not None
    # `server run` drains and stops its TorchServe itself (and its front); then nothing is left
    ours = stop_background_run(args.run_dir, args.drain_timeout + 120) or ours
    stop(instance, drain_timeout_s=args.drain_timeout)
    print(f"TorchServe has stopped (run directory {args.run_dir})" if ours
          else f"no TorchServe was running from {args.run_dir}")
    if ping(instance):
        print(f"a TorchServe not started from {args.run_dir} still answers at {instance.inference_url} "
              "and was left running (one started by hand stops with `torchserve --stop`)", file=sys.stderr)
        return 1
    return 0


def run_status(args: argparse.Namespace) -> int:
    instance = instance_from(args)
    if not ping(instance):
        print(f"{instance.inference_url}: not answering /ping")
        return 1
    ready = models_ready(instance.client(), expected_models=0)
    print(f"{instance.inference_url}: healthy, "
          f"{'every model has READY workers' if ready else 'some model has no READY worker'}")
    return 0 if ready else 1


def run_foreground(args: argparse.Namespace) -> int:
    instance = instance_from(args)
    options = ForegroundOptions(start_timeout_s=args.timeout, drain_delay_s=args.drain_delay,
                                drain_timeout_s=args.drain_timeout,
                                probe_host=instance.settings.bind_address or "127.0.0.1",
                                probe_port=args.probe_port, front_port=args.front_port,
                                grpc_front_port=args.grpc_front_port)

    def say(message: str, level: str = "INFO") -> None:
        line = json_log_line(message, "server", level) if instance.log_json else message
        print(line, file=sys.stdout if level == "INFO" else sys.stderr, flush=True)

    if instance.settings.describe():
        say(f"from the environment: {instance.settings.describe()}")

    def ready() -> None:
        probes = f"; probes on port {args.probe_port}" if args.probe_port is not None else ""
        if args.front_port is not None:
            probes += f"; the front (Open Inference Protocol, model endpoints) on port {args.front_port}"
        if args.grpc_front_port is not None:
            probes += f"; its gRPC front (inference.GRPCInferenceService) on port {args.grpc_front_port}"
        say(f"TorchServe is ready at {instance.inference_url}{probes}; stop with SIGTERM or Ctrl-C")

    run_in_foreground(instance, args.model_store, options, on_ready=ready,
                      on_event=lambda line: say(line, "WARN"))
    say("TorchServe has stopped")
    return 0
