"""A rolling update rehearsed on one host with real parts: `server run` pods behind HAProxy,
each pod stopped and started in turn as Kubernetes does it, under continuous open-loop load.

    torchserve-vision lab rolling-update                      # 2 pods, 20 requests/s
    torchserve-vision lab rolling-update --pods 3 --rate 30 --json

Each pod is a `torchserve-vision server run` process (config/config.properties on free
127.0.0.1 ports, the project's model store, probes on a port of its own). HAProxy (Debian's
package) balances requests over the pods and health-checks each pod's GET /ready every 250 ms,
as a Service's endpoints follow readiness (out after two failed checks in a row); it does not
retry a failed request (`retries 0`), so a request sent to a pod that cannot answer counts as a
failure. Per pod: SIGTERM (readiness false, `--drain-delay` of serving while HAProxy takes it
out, drain, stop, exit 0), then a new process on the same ports, until ready and back in
HAProxy's rotation. Reported: every step's time and exit status, requests sent and failed over
the whole run, and each time HAProxy took a pod out of its rotation or back (with its reason), so
a failure can be traced to its cause. `--stock-stop` stops each pod with `torchserve --stop`
instead (no readiness change, no drain), for comparison.

A new model version, rolled out as on Kubernetes (a new image per version): with `--new-version
V`, each pod comes back serving a copy of its archive as version V (what the new image would
carry), and the report counts the answers per version (`X-Model-Version`) before the first pod
is stopped, during the roll, and after the last pod is back.

    torchserve-vision lab rolling-update --new-version 2.0
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO

import requests

from torchserve_vision.archives.versions import archive_manifest
from torchserve_vision.front_proxy import haproxy_binary
from torchserve_vision.lab.loadgen import LoadTarget, Result, error_counts, run_open_loop, summarize
from torchserve_vision.lab.pods import Pod, PodError
from torchserve_vision.photos import photo_path
from torchserve_vision.server_process import stop as stop_torchserve
from torchserve_vision.torchserve_config import free_ports, read_properties, render_properties, server_config
from torchserve_vision.waiting import wait_until

CHECK_INTERVAL_MS = 250
# A pod leaves the rotation after this many failed checks in a row (a readiness probe's
# failureThreshold, 3 by default on Kubernetes): a stop that does not change readiness first
# keeps its pod in the rotation at least (CHECKS_TO_FALL - 1) * CHECK_INTERVAL_MS after it
# starts failing, so the rehearsal always sees what such a stop costs.
CHECKS_TO_FALL = 2
# The longest a pod whose readiness turned false stays in the rotation: the next check starts up
# to one interval later, each failed check may take its whole timeout (HAProxy's check timeout is
# the interval when `timeout check` is unset), and the checks after the first start one interval
# after the previous one ends. A graceful stop's drain delay must be longer than this.
REMOVAL_BOUND_S = (1 + CHECKS_TO_FALL + (CHECKS_TO_FALL - 1)) * CHECK_INTERVAL_MS / 1000


@dataclass(frozen=True)
class PodStep:
    pod: str
    graceful: bool       # SIGTERM to `server run`; False: TorchServe's stock stop
    exit_code: int
    stop_s: float        # SIGTERM (or the stock stop) to exit
    restart_s: float     # start to ready, then back in the load balancer's rotation
    stopped_at_s: float = 0.0   # when the stop was sent, from the start of the load
    back_at_s: float = 0.0      # when it was back in the rotation, from the start of the load
    failed: int = 0      # requests that failed from the previous step's end to this one's
    sent_while_out: int = 0   # requests sent from the stop until the pod was back in rotation
    errors: dict[str, int] = field(default_factory=dict)   # those failures by status


@dataclass(frozen=True)
class RehearsalReport:
    pods: int
    rate_rps: float
    duration_s: float
    sent: int
    failed: int
    errors: dict[str, int]
    latency_ms: dict[str, float]
    steps: list[PodStep]
    # Answers (200) per X-Model-Version: before the first stop, between it and the last pod's
    # return, and after that.
    versions_before: dict[str, int]
    versions_during: dict[str, int]
    versions_after: dict[str, int]
    # HAProxy's changes of its rotation: "<s from the start of the load> <pod> DOWN|UP: <reason>"
    balancer_changes: list[str] = field(default_factory=list)

    def table(self) -> str:
        lines = [f"{step.pod}: {'SIGTERM' if step.graceful else 'stock stop'}, exit "
                 f"{step.exit_code} after {step.stop_s:.1f} s; restarted and in rotation in "
                 f"{step.restart_s:.1f} s; {step.sent_while_out} sent meanwhile, {step.failed} "
                 f"failed {step.errors or ''}".rstrip()
                 for step in self.steps]
        latency = "  ".join(f"{k} {v:.0f}" for k, v in self.latency_ms.items())
        lines.append(f"{self.sent} requests at {self.rate_rps:g}/s over {self.duration_s:.0f} s: "
                     f"{self.failed} failed {self.errors or ''}".rstrip())
        lines.append(f"latency ms: {latency}")
        lines.append(f"answers per version: before the first stop {self.versions_before}, during "
                     f"the roll {self.versions_during}, after {self.versions_after}")
        lines += [f"balancer at {change}" for change in self.balancer_changes]
        return "\n".join(lines)


# HAProxy's warning (on its stderr in the foreground) when a health check changes a server's state:
# "[WARNING]  (123) : Server pods/pod0 is DOWN, reason: Layer7 wrong status, code: 503, ..."
SERVER_STATE_LINE = re.compile(
    r"Server pods/(?P<pod>\S+) is (?P<state>UP|DOWN)(?:, reason: (?P<reason>[^.]*))?")


class BalancerLog:
    """HAProxy's changes of its rotation, read from its stderr as they come, each with the
    time.perf_counter() it was read at; `process`: HAProxy's, when it is to be watched."""

    def __init__(self, stderr: IO[bytes], process: subprocess.Popen[bytes] | None = None) -> None:
        self.process = process
        self.changes: list[tuple[float, str]] = []
        self.last_lines: deque[str] = deque(maxlen=20)    # of its stderr, whatever they say
        self.thread = threading.Thread(target=self.read, args=(stderr,), daemon=True)
        self.thread.start()

    def read(self, stderr: IO[bytes]) -> None:
        for raw in stderr:
            line = raw.decode(errors="replace")
            self.last_lines.append(line.rstrip())
            found = SERVER_STATE_LINE.search(line)
            if found:
                reason = f": {found['reason'].strip()}" if found["reason"] else ""
                self.changes.append((time.perf_counter(), f"{found['pod']} {found['state']}{reason}"))
            elif "has no server available" in line:
                self.changes.append((time.perf_counter(), "no pod in the rotation"))

    def check_running(self) -> None:
        """PodError, with what HAProxy said last, once its process has exited (a port it could
        not bind, a config it refused): a wait for it then ends at once, not at its time-out."""
        if self.process is not None and self.process.poll() is not None:
            self.thread.join(timeout=5)        # its last lines
            raise self.error(f"HAProxy exited with status {self.process.returncode}")

    def error(self, message: str) -> PodError:
        """A PodError for `message` that says what HAProxy said last (why a pod is out)."""
        said = "\n".join(self.last_lines) or "nothing"
        return PodError(f"{message}; HAProxy's last lines:\n{said}")

    def since(self, started: float) -> list[str]:
        """The changes read so far, timed from `started` (time.perf_counter())."""
        return [f"{at - started:.1f} s: {change}" for at, change in list(self.changes) if at >= started]


def haproxy_config(port: int, pods: list[Pod], stats_port: int) -> str:
    servers = "\n".join(
        f"    server {pod.name} {pod.instance.inference_url.removeprefix('http://')} "
        f"check port {pod.probe_port}" for pod in pods)
    return f"""global
    maxconn 2000
defaults
    mode http
    timeout connect 2s
    timeout client 120s
    timeout server 120s
    retries 0
frontend inference
    bind 127.0.0.1:{port}
    default_backend pods
frontend stats
    bind 127.0.0.1:{stats_port}
    http-request return status 200 content-type text/plain lf-string "%[nbsrv(pods)]"
backend pods
    balance roundrobin
    option httpchk GET /ready
    http-check expect status 200
    default-server inter {CHECK_INTERVAL_MS}ms fall {CHECKS_TO_FALL} rise 2
{servers}
"""


def pods_in_rotation(stats_port: int, balancer_log: BalancerLog | None) -> int:
    """How many pods HAProxy has in its rotation (-1: it does not answer); PodError once it has
    exited."""
    if balancer_log is not None:
        balancer_log.check_running()
    return servers_up(stats_port)


def balancer_wait_error(pods: list[Pod], balancer_log: BalancerLog | None) -> Callable[[str], PodError]:
    """The error of a wait for HAProxy that timed out: what each pod's readiness probe answers
    now (and how fast: HAProxy gives a check 250 ms), then what HAProxy said last."""
    def error(message: str) -> PodError:
        message = f"{message} ({pods_readiness(pods)})"
        return balancer_log.error(message) if balancer_log is not None else PodError(message)
    return error


def pods_readiness(pods: list[Pod]) -> str:
    """Each pod's GET /ready now: status, body and milliseconds ("no answer" when none came)."""
    answers = []
    for pod in pods:
        started = time.perf_counter()
        status, body = pod.probe("/ready")
        answers.append(f"{pod.name} /ready {status or 'no answer'} {json.dumps(body)} in "
                       f"{1000 * (time.perf_counter() - started):.0f} ms")
    return "; ".join(answers)


def servers_up(stats_port: int) -> int:
    try:
        return int(requests.get(f"http://127.0.0.1:{stats_port}/", timeout=2).text.strip())
    except (requests.RequestException, ValueError):
        return -1


def rehearse(config: Path, model_store: Path, pod_count: int = 2, rate_rps: float = 20.0,
             drain_delay_s: float = 2.0, settle_s: float = 3.0, load_models: str | None = None,
             graceful: bool = True, roll_count: int | None = None, stock_stop_after: bool = False,
             rolled_load_models: str | None = None, payload: bytes | None = None,
             on_step: Callable[[str], None] = lambda line: None) -> RehearsalReport:
    """Start `pod_count` pods and HAProxy, offer `rate_rps` through it, roll every pod once
    (the first `roll_count` pods, when given). With `rolled_load_models` (archives in
    `model_store`), a rolled pod comes back loading those instead: a new version's image.
    `graceful=False` stops each pod the way TorchServe's stock image ends up doing it
    (`torchserve --stop` at once: in-flight requests are dropped), for comparison;
    `stock_stop_after` adds that comparison as a last step (the first pod, stopped the stock way,
    in the same run and load), with failures counted per step. Each request sends `payload`
    (chelsea.png when not given)."""
    with tempfile.TemporaryDirectory(prefix="rolling-") as tmp:
        root = Path(tmp)
        overrides = {"load_models": load_models} if load_models else {}
        pods = [Pod(f"pod{index}", server_config(root / f"pod{index}", model_store, config, **overrides),
                    root / f"pod{index}" / "run", model_store, drain_delay_s=drain_delay_s)
                for index in range(pod_count)]
        balancer: subprocess.Popen[bytes] | None = None
        try:
            for pod in pods:
                pod.start()
            for pod in pods:
                pod.wait_ready()
            port, stats_port = free_ports(2)     # just before HAProxy binds them
            (root / "haproxy.cfg").write_text(haproxy_config(port, pods, stats_port))
            balancer = subprocess.Popen([haproxy_binary(), "-db", "-f", str(root / "haproxy.cfg")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            assert balancer.stderr is not None
            balancer_log = BalancerLog(balancer.stderr, balancer)
            wait_until(lambda: pods_in_rotation(stats_port, balancer_log) == pod_count, 30,
                       "HAProxy to see every pod", interval_s=0.05,
                       error=balancer_wait_error(pods, balancer_log))
            on_step(f"{pod_count} pods ready behind HAProxy on 127.0.0.1:{port}")
            plan = [(pod, graceful) for pod in pods[:roll_count]]
            plan += [(pods[0], False)] if stock_stop_after else []
            rolled = {} if rolled_load_models is None else {
                pod.name: rolled_config(pod.config, root / f"{pod.name}-rolled", model_store,
                                        rolled_load_models) for pod in pods}
            return roll(pods, plan, port, stats_port, rate_rps, settle_s, on_step, rolled,
                        balancer_log, payload)
        finally:
            if balancer is not None:
                balancer.terminate()
                balancer.wait(timeout=30)
            for pod in pods:
                pod.kill()


def roll(pods: list[Pod], plan: list[tuple[Pod, bool]], port: int, stats_port: int, rate_rps: float,
         settle_s: float, on_step: Callable[[str], None],
         rolled_configs: dict[str, Path] | None = None,
         balancer_log: BalancerLog | None = None, payload: bytes | None = None) -> RehearsalReport:
    """Stop and restart the pods of `plan` in turn (True: gracefully) under open-loop load; a
    restarted pod runs its config of `rolled_configs` when given (the new version's archives);
    the balancer's changes of its rotation from `balancer_log`, when given; each request sends
    `payload` (chelsea.png when not given)."""
    target = LoadTarget(f"http://127.0.0.1:{port}/predictions/efficientnet_lite0",
                        [photo_path().read_bytes() if payload is None else payload], timeout_s=60)
    results: list[Result] = []
    load_done = threading.Event()
    started = time.perf_counter()
    load = threading.Thread(target=run_open_loop, daemon=True, kwargs={
        "target": target, "rate_rps": rate_rps, "duration_s": 3600, "max_requests": 10**7,
        "max_in_flight": 64, "stop": load_done, "results": results, "started": started})
    load.start()
    steps = []
    # Step i counts the requests that failed (ended) in windows[i]..[i + 1]: by when they were
    # sent, a request still in flight when the next step stops its pod (answers take over a
    # second on a loaded 2-core machine) would be counted against the step before.
    windows: list[float] = [0.0]
    try:
        time.sleep(settle_s)
        for pod, graceful in plan:
            stopped_at = time.perf_counter() - started
            if graceful:
                pod.terminate()
            else:
                pod.signalled_at = time.monotonic()
                stop_torchserve(pod.instance)   # no readiness change, no drain
            code, stop_s = pod.wait(timeout_s=120)
            restarted = time.monotonic()
            pod.config = (rolled_configs or {}).get(pod.name, pod.config)
            pod.start()
            pod.wait_ready()
            wait_until(lambda: pods_in_rotation(stats_port, balancer_log) == len(pods), 30,
                       f"HAProxy to take {pod.name} back", interval_s=0.05,
                       error=balancer_wait_error(pods, balancer_log))
            steps.append(PodStep(pod.name, graceful, code, stop_s, time.monotonic() - restarted,
                                 stopped_at, time.perf_counter() - started))
            on_step(f"{pod.name}: exit {code} {stop_s:.1f} s after the stop; back in rotation after "
                    f"{steps[-1].restart_s:.1f} s")
            time.sleep(settle_s)
            windows.append(time.perf_counter() - started)
    finally:
        load_done.set()
        load.join(timeout=120)
    windows[-1] = float("inf")   # the last step also owns what was in flight at the end
    steps = [step_counts(step, results, start, end)
             for step, start, end in zip(steps, windows, windows[1:], strict=False)]
    summary = summarize("open loop", results, time.perf_counter() - started, rate_rps)
    first_stop = steps[0].stopped_at_s if steps else float("inf")
    last_back = max((step.back_at_s for step in steps), default=float("inf"))
    return RehearsalReport(pods=len(pods), rate_rps=rate_rps, duration_s=summary.duration_s,
                           sent=summary.sent, failed=summary.sent - summary.succeeded,
                           errors=summary.errors, latency_ms=summary.latency_ms, steps=steps,
                           versions_before=answers_per_version(results, 0.0, first_stop),
                           versions_during=answers_per_version(results, first_stop, last_back),
                           versions_after=answers_per_version(results, last_back, float("inf")),
                           balancer_changes=balancer_log.since(started) if balancer_log else [])


def step_counts(step: PodStep, results: list[Result], start_s: float, end_s: float) -> PodStep:
    """`step` with the requests that failed in [start_s, end_s), by status, and those sent while
    its pod was out of the rotation."""
    errors = error_counts(result for result in results
                          if start_s <= result.scheduled_s + result.latency_ms / 1000 < end_s)
    sent = sum(step.stopped_at_s <= result.scheduled_s < step.back_at_s for result in results)
    return replace(step, failed=sum(errors.values()), errors=errors, sent_while_out=sent)


def rolled_config(config: Path, directory: Path, model_store: Path, load_models: str) -> Path:
    """`config` (a pod's: its ports stay) loading `load_models` instead, each archive's `models=`
    entry moved to the archive's own version, as the new image's config names it."""
    properties = read_properties(config)
    models = json.loads(properties.get("models") or "{}")
    for archive in load_models.split(","):
        manifest = archive_manifest(model_store / archive)
        versions = models.setdefault(manifest["modelName"], {})
        settings = next(iter(versions.values()), {"defaultVersion": True})
        versions.clear()
        versions[manifest["modelVersion"]] = {**settings, "marName": archive}
    properties.update({"load_models": load_models, "models": json.dumps(models)})
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.properties").write_text(render_properties(properties))
    return directory / "config.properties"


def answers_per_version(results: list[Result], start_s: float, end_s: float) -> dict[str, int]:
    """Successful answers per X-Model-Version among requests scheduled in [start_s, end_s)."""
    return dict(Counter(result.version for result in results
                        if start_s <= result.scheduled_s < end_s and result.status == 200))


def report_document(report: RehearsalReport) -> dict[str, object]:
    return asdict(report)
