"""Build the image of deploy/Dockerfile and run it as the manifests do: the check that the image
the docs tell users to build starts, serves, drains and runs under `podman kube play`.
Run it through scripts/image-check.sh (which installs Podman where it is missing):

    bash scripts/image-check.sh --base IMAGE [--target cpu] [--target gpu] [--record FILE]

For each target (default: cpu and gpu), with Podman (Docker with BuildKit where that is what the
host has):
1. Build from the base image given (any Debian 12 image with Python 3.10+ as `python`, its venv
   module and ca-certificates; scripts/debian-base-image.sh makes one where no registry can be
   reached), pip's settings on this host passed as build secrets (`RUN --mount=type=secret`),
   never as build arguments or files in a layer.
2. Run it with the security settings and scratch volumes of deploy/kubernetes' Deployment
   (read-only root filesystem, every capability dropped, no privilege escalation, a fresh
   volume at each emptyDir's path), as the image's user with token authorization on: /ready
   within 30 s of `run`; a photo refused without a key and answered with the key read from the
   container; then `stop` (SIGTERM) under four request loops that stop sending when /ready turns
   false, as a load balancer does: every request sent is answered, and the container exits 0.
3. Run it again as an arbitrary UID in group 0 (OpenShift's way) with token authorization turned
   off through the environment (TSV_TOKEN_AUTHORIZATION=off): ready, a photo answered with no
   key, the detector answering, exit 0 on stop.
Then, with Podman, `podman kube play` of each overlay as kustomize renders it (deploy/kubernetes,
deploy/kubernetes-gpu, deploy/kubernetes-canary; their Deployments, the image replaced by the one
built here): the pod becomes ready and answers, polled from inside the pod (Podman publishes no
ports for a Deployment), then `podman kube down`. The KServe files are not played: Podman plays
Pods, Deployments, DaemonSets, PersistentVolumeClaims, ConfigMaps and Secrets, not KServe's
custom resources. Other kinds of the overlays (Service, HPA, PodDisruptionBudget, NetworkPolicy,
PodMonitor, PrometheusRule) are left out for the same reason.

Podman settings a restricted host needs go into the check's own containers.conf
(CONTAINERS_CONF), never the system's: open files and processes limited to 20000 where this
process lacks CAP_SYS_RESOURCE (Podman's defaults, 1048576 and the current limit, are refused
there), and runc where cgroups are hybrid (crun 1.8 refuses them).

Cleans up after itself: containers, pods, volumes; the images built stay (tagged as the docs tag
them) unless --remove-images. Disk: about 30 GB of container storage for both targets, build
cache included; it stops before building when less is free.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import yaml

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
sys.path.append(str(SCRIPTS))
from uv_install import pip_settings  # noqa: E402  (scripts/ is not a package)

TARGETS = ("cpu", "gpu")
TAGS = {"cpu": "localhost/torchserve-vision:0.1.0", "gpu": "localhost/torchserve-vision:0.1.0-gpu"}
OVERLAYS = {"kubernetes": "cpu", "kubernetes-gpu": "gpu", "kubernetes-canary": "cpu"}  # -> image
PLAYED_KINDS = ("Deployment",)
READY_WITHIN_S = 30.0
POD_READY_WITHIN_S = 120.0
NEEDED_DISK_GB = 30.0
LOAD_LOOPS = 4
CAT_LABELS = ("tabby", "tiger cat", "Egyptian cat")
PHOTO = "chelsea.png"
DETECTOR_PHOTO = "astronaut.png"
CLASSIFIER, DETECTOR = "efficientnet_lite0", "ssd_mobilenet_v2"
WORKDIR = "/srv/torchserve-vision"   # the image's WORKDIR
# pip options the build may use, and where a value names a file or folder of this host that the
# build cannot see.
PASSED_PIP_OPTIONS = ("index-url", "extra-index-url", "trusted-host", "timeout", "retries", "proxy")
LIMITED = "20000"


class CheckFailed(RuntimeError):
    """What the image did that it must not."""


# --- what the build and the runs are given -------------------------------------------------------
def pip_build_config(settings: dict[str, str]) -> tuple[str, Path | None, list[str]]:
    """A pip.conf for the build (mounted as the secret `pip-conf`), the CA bundle to mount as the
    secret `pip-cert` (None: pip's own), and what was left out and why. Indexes of this host's
    file system (file:// URLs, folders) and local files (constraints, find-links) cannot be seen
    from the build and are left out."""
    lines, left_out = ["[global]"], []
    for option in PASSED_PIP_OPTIONS:
        if option not in settings:
            continue
        values = settings[option].split()
        remote = [value for value in values if not value.startswith(("file:", "/"))]
        left_out += [f"{option} {value} (a path of this host)" for value in values if value not in remote]
        if remote:
            lines.append(f"{option} = {' '.join(remote)}")
    left_out += [f"{option} {settings[option]} (a path of this host)"
                 for option in ("find-links", "constraint") if option in settings]
    certificate = Path(settings["cert"]) if "cert" in settings else None
    if certificate is not None:
        lines.append("cert = /run/secrets/pip-cert")
    return "\n".join(lines) + "\n", certificate, left_out


def containers_conf(has_sys_resource: bool, hybrid_cgroups: bool) -> str:
    """containers.conf for what this host refuses (empty sections where it refuses nothing)."""
    lines = ["[containers]"]
    if not has_sys_resource:
        lines.append(f'default_ulimits = ["nofile={LIMITED}:{LIMITED}", "nproc={LIMITED}:{LIMITED}"]')
    lines.append("[engine]")
    if hybrid_cgroups:
        lines.append('runtime = "runc"')
    return "\n".join(lines) + "\n"


def process_has_sys_resource() -> bool:
    status = Path("/proc/self/status").read_text()
    effective = int(next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")), 16)
    return bool(effective >> 24 & 1)   # CAP_SYS_RESOURCE is capability 24


def cgroups_are_hybrid() -> bool:
    """cgroup v1 controllers beside a cgroup2 hierarchy at /sys/fs/cgroup/unified."""
    return Path("/sys/fs/cgroup/unified").is_dir() and Path("/sys/fs/cgroup/memory").is_dir()


def rendered_overlay(overlay: Path, kubectl: Path) -> list[dict[str, Any]]:
    """The resources `kubectl kustomize` renders for an overlay."""
    text = subprocess.run([str(kubectl), "kustomize", str(overlay)], capture_output=True, text=True,
                          check=True).stdout
    return [document for document in yaml.safe_load_all(text) if document]


def deployment(resources: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = [resource for resource in resources if resource["kind"] == "Deployment"]
    return found


def run_options(resources: list[dict[str, Any]], engine: str) -> list[str]:
    """`run` options for the Deployment's container security settings."""
    pod = deployment(resources)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    security = container.get("securityContext", {})
    options: list[str] = []
    if security.get("readOnlyRootFilesystem"):
        # Podman adds writable tmpfs at /tmp, /var/tmp and /run unless told not to; Kubernetes
        # adds nothing: /tmp is the manifest's emptyDir
        options += ["--read-only"] + (["--read-only-tmpfs=false"] if engine == "podman" else [])
    options += [f"--cap-drop={capability}" for capability in security.get("capabilities", {}).get("drop", [])]
    if security.get("allowPrivilegeEscalation") is False:
        options += ["--security-opt", "no-new-privileges"]
    return options


def scratch_paths(resources: list[dict[str, Any]]) -> list[str]:
    """Where the Deployment's container mounts its emptyDir volumes."""
    pod = deployment(resources)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    empty = {volume["name"] for volume in pod.get("volumes", []) if "emptyDir" in volume}
    return [mount["mountPath"] for mount in container.get("volumeMounts", []) if mount["name"] in empty]


def playable(resources: list[dict[str, Any]], image: str) -> list[dict[str, Any]]:
    """The resources `podman kube play` runs, with every container's image replaced by `image`."""
    played = [json.loads(json.dumps(resource)) for resource in resources if resource["kind"] in PLAYED_KINDS]
    for resource in played:
        for container in resource["spec"]["template"]["spec"]["containers"]:
            container["image"] = image
    return played


# --- the container engine -----------------------------------------------------------------------
@dataclass
class Engine:
    program: str                  # podman or docker
    environment: dict[str, str]
    made: list[tuple[str, str]] = field(default_factory=list)   # (kind, name) to remove at the end

    def __call__(self, *arguments: str, check: bool = True, capture: bool = True,
                 stdin: bytes | None = None,
                 timeout_s: float | None = None) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([self.program, *arguments], env=self.environment, check=False,
                                capture_output=capture, input=stdin, timeout=timeout_s)
        text = subprocess.CompletedProcess(result.args, result.returncode,
                                           decoded(result.stdout), decoded(result.stderr))
        if check and result.returncode != 0:
            raise CheckFailed(f"{self.program} {' '.join(arguments[:3])} ... exited {result.returncode}:\n"
                              f"{text.stdout[-3000:]}{text.stderr[-3000:]}")
        return text

    def volume(self) -> str:
        name = self("volume", "create").stdout.strip()
        self.made.append(("volume", name))
        return name

    def clean_up(self) -> None:
        for kind, name in reversed(self.made):
            if kind == "container":
                self("rm", "--force", "--volumes", name, check=False)
            elif kind == "kube":
                self("kube", "down", name, check=False)
            elif kind == "volume":
                self("volume", "rm", "--force", name, check=False)
        self.made.clear()


def decoded(output: bytes | str | None) -> str:
    if output is None:
        return ""
    return output if isinstance(output, str) else output.decode(errors="replace")


def pick_engine(conf_dir: Path) -> Engine:
    if shutil.which("podman"):
        conf = conf_dir / "containers.conf"
        conf.write_text(containers_conf(process_has_sys_resource(), cgroups_are_hybrid()))
        return Engine("podman", {**os.environ, "CONTAINERS_CONF": str(conf)})
    if shutil.which("docker"):
        return Engine("docker", {**os.environ, "DOCKER_BUILDKIT": "1"})
    raise CheckFailed("neither podman nor docker is installed (scripts/image-check.sh installs podman)")


def storage_free_gb(engine: Engine) -> float:
    template = "{{.Store.GraphRoot}}" if engine.program == "podman" else "{{.DockerRootDir}}"
    root = Path(engine("info", "--format", template).stdout.strip())
    while not root.exists():
        root = root.parent
    return shutil.disk_usage(root).free / 1e9


# --- building ---------------------------------------------------------------------------------
@dataclass
class Built:
    target: str
    image: str
    build_s: float
    size_gb: float


def build(engine: Engine, target: str, base: str, secrets: Path, torch_index_url: str | None) -> Built:
    pip_conf, certificate, left_out = pip_build_config(pip_settings(
        subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                       check=True).stdout.splitlines()))
    for item in left_out:
        say(f"pip setting left out of the build: {item}")
    (secrets / "pip.conf").write_text(pip_conf)
    arguments = ["build", "--file", "deploy/Dockerfile", "--tag", TAGS[target],
                 "--build-arg", f"PYTHON_IMAGE={base}", "--build-arg", f"TARGET={target}",
                 "--secret", f"id=pip-conf,src={secrets / 'pip.conf'}"]
    if certificate is not None:
        arguments += ["--secret", f"id=pip-cert,src={certificate}"]
    if torch_index_url is not None:
        arguments += ["--build-arg", f"TORCH_INDEX_URL={torch_index_url}"]
    say(f"{target}: building {TAGS[target]} from {base}")
    started = time.monotonic()
    log = secrets.parent / f"build-{target}.log"
    with open(log, "w") as output:
        finished = subprocess.run([engine.program, *arguments, "."], cwd=REPO, env=engine.environment,
                                  stdout=output, stderr=subprocess.STDOUT, check=False)
    if finished.returncode != 0:
        raise CheckFailed(f"{target}: the build failed; its log:\n{log.read_text()[-4000:]}")
    build_s = time.monotonic() - started
    size = int(engine("image", "inspect", "--format", "{{.Size}}", TAGS[target]).stdout.strip())
    say(f"{target}: built in {build_s / 60:.1f} min, {size / 1e9:.2f} GB")
    return Built(target, TAGS[target], build_s, size / 1e9)


def existing(engine: Engine, target: str) -> Built:
    size = int(engine("image", "inspect", "--format", "{{.Size}}", TAGS[target]).stdout.strip())
    return Built(target, TAGS[target], 0.0, size / 1e9)


# --- running ------------------------------------------------------------------------------------
def say(line: str) -> None:
    print(f"image-check: {line}", flush=True)


def photo(name: str) -> bytes:
    import skimage

    return (Path(skimage.__file__).parent / "data" / name).read_bytes()


@dataclass
class Running:
    engine: Engine
    name: str
    inference_url: str
    probe_url: str
    started: float

    def ready(self) -> bool:
        try:
            return requests.get(f"{self.probe_url}/ready", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def wait_ready(self, within_s: float) -> float:
        while time.monotonic() - self.started < within_s:
            if self.ready():
                return time.monotonic() - self.started
            state = self.engine("inspect", "--format", "{{.State.Status}}", self.name).stdout.strip()
            if state not in ("running", "created", "configured"):
                raise CheckFailed(f"{self.name} is {state} before ready:\n{self.logs()}")
            time.sleep(0.1)
        raise CheckFailed(f"{self.name}: /ready not 200 within {within_s:.0f} s of run:\n{self.logs()}")

    def logs(self, tail: bool = True) -> str:
        result = self.engine("logs", self.name, check=False)
        return (result.stdout + result.stderr)[-4000 if tail else 0:]

    def predict(self, model: str, body: bytes, key: str | None = None) -> requests.Response:
        headers = {"Content-Type": "image/png"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        return requests.post(f"{self.inference_url}/predictions/{model}", data=body, headers=headers,
                             timeout=120)

    def inference_key(self) -> str:
        text = self.engine("exec", self.name, "cat", f"{WORKDIR}/.run/key_file.json").stdout
        return str(json.loads(text)["inference"]["key"])

    def stop(self, timeout_s: int) -> tuple[int, float]:
        """SIGTERM, then the container's exit code and the seconds it took to exit."""
        started = time.monotonic()
        self.engine("stop", "--time", str(timeout_s), self.name, timeout_s=timeout_s + 30)
        stopped_s = time.monotonic() - started
        exit_code = self.engine("inspect", "--format", "{{.State.ExitCode}}", self.name).stdout.strip()
        return int(exit_code), stopped_s


def start(engine: Engine, image: str, resources: list[dict[str, Any]], name: str,
          extra: list[str]) -> Running:
    options = run_options(resources, engine.program) + [f"--volume={engine.volume()}:{path}"
                                                        for path in scratch_paths(resources)]
    engine.made.append(("container", name))
    engine("rm", "--force", name, check=False)
    started = time.monotonic()
    engine("run", "--detach", "--name", name, "--publish", "127.0.0.1::8080",
           "--publish", "127.0.0.1::8090", *options, *extra, image)
    ports = {}
    for port in (8080, 8090):
        published = engine("port", name, f"{port}/tcp").stdout.strip().splitlines()[0]
        ports[port] = published.rsplit(":", 1)[1]
    return Running(engine, name, f"http://127.0.0.1:{ports[8080]}", f"http://127.0.0.1:{ports[8090]}",
                   started)


@dataclass
class LoadOutcome:
    sent: int = 0
    answered: int = 0
    failures: list[str] = field(default_factory=list)


def load_until_not_ready(running: Running, key: str, stop_sending: threading.Event,
                         outcome: LoadOutcome, lock: threading.Lock) -> None:
    """One request loop: a photo at a time until `stop_sending` (readiness turned false)."""
    body = photo(PHOTO)
    with requests.Session() as session:
        while not stop_sending.is_set():
            with lock:
                outcome.sent += 1
            try:
                answer = session.post(f"{running.inference_url}/predictions/{CLASSIFIER}", data=body,
                                      timeout=120, headers={"Authorization": f"Bearer {key}",
                                                            "Content-Type": "image/png"})
                good = answer.status_code == 200 and answer.json()[0]["label"] in CAT_LABELS
                failure = None if good else f"{answer.status_code} {answer.text[:200]}"
            except requests.RequestException as error:
                failure = repr(error)
            with lock:
                if failure is None:
                    outcome.answered += 1
                else:
                    outcome.failures.append(failure)


def drained_under_load(running: Running, key: str) -> dict[str, Any]:
    """SIGTERM under LOAD_LOOPS request loops that stop sending once /ready is not 200, as a
    load balancer does; every request sent must be answered, and the container exit 0."""
    stop_sending, lock, outcome = threading.Event(), threading.Lock(), LoadOutcome()
    loops = [threading.Thread(target=load_until_not_ready, args=(running, key, stop_sending, outcome, lock))
             for _ in range(LOAD_LOOPS)]
    for loop in loops:
        loop.start()

    def watch_readiness() -> None:
        while running.ready():
            time.sleep(0.05)
        stop_sending.set()

    watcher = threading.Thread(target=watch_readiness)
    try:
        time.sleep(3.0)           # load before the signal
        watcher.start()
        exit_code, stopped_s = running.stop(timeout_s=40)
    finally:
        stop_sending.set()
        for loop in loops:
            loop.join(timeout=150)
        if watcher.is_alive():          # it ends once /ready stops answering 200
            watcher.join(timeout=150)
    if outcome.failures or exit_code != 0 or outcome.answered != outcome.sent:
        raise CheckFailed(f"{running.name}: SIGTERM under load: {outcome.answered} of {outcome.sent} "
                          f"answered, exit {exit_code}; failures: {outcome.failures[:5]}\n{running.logs()}")
    return {"sent": outcome.sent, "answered": outcome.answered, "exit_code": exit_code,
            "stop_s": round(stopped_s, 1)}


def check_as_the_image_user(engine: Engine, built: Built, resources: list[dict[str, Any]]) -> dict[str, Any]:
    running = start(engine, built.image, resources, f"image-check-{built.target}-token", [])
    ready_s = running.wait_ready(READY_WITHIN_S)
    say(f"{built.target}: /ready {ready_s:.1f} s after run (token authorization on)")
    refused = running.predict(CLASSIFIER, photo(PHOTO))
    if refused.status_code not in (400, 401):
        raise CheckFailed(f"{built.target}: a request without a key got {refused.status_code}, not refused")
    answer = running.predict(CLASSIFIER, photo(PHOTO), key=running.inference_key())
    label = top_label(answer)
    say(f"{built.target}: without a key {refused.status_code}; with the container's key: {label}")
    runners = served_runners(running.logs(tail=False))
    say(f"{built.target}: runners {json.dumps(runners, sort_keys=True)}")
    if built.target == "cpu":
        eager = {model: roles for model, roles in runners.items()
                 if not all(role.get("file") for role in roles.values())}
        if eager or set(runners) != {CLASSIFIER, DETECTOR}:
            raise CheckFailed(f"cpu: a worker serves no runner its archive carries: {runners}")
    drain = drained_under_load(running, running.inference_key())
    say(f"{built.target}: SIGTERM under {LOAD_LOOPS} request loops: {drain['answered']} of "
        f"{drain['sent']} answered, exit {drain['exit_code']} after {drain['stop_s']} s")
    return {"ready_s": round(ready_s, 1), "without_key": refused.status_code, "label": label,
            "runners": {model: {role: entry["runner"] for role, entry in roles.items()}
                        for model, roles in runners.items()},
            "drain": drain}


def check_as_any_uid_without_tokens(engine: Engine, built: Built,
                                    resources: list[dict[str, Any]]) -> dict[str, Any]:
    running = start(engine, built.image, resources, f"image-check-{built.target}-any-uid",
                    ["--user", "123456:0", "--env", "TSV_TOKEN_AUTHORIZATION=off"])
    ready_s = running.wait_ready(READY_WITHIN_S)
    label = top_label(running.predict(CLASSIFIER, photo(PHOTO)))
    detections = running.predict(DETECTOR, photo(DETECTOR_PHOTO))
    if detections.status_code != 200 or not isinstance(detections.json(), dict | list):
        raise CheckFailed(f"{built.target}: the detector answered {detections.status_code}: "
                          f"{detections.text[:300]}")
    exit_code, stopped_s = running.stop(timeout_s=40)
    if exit_code != 0:
        raise CheckFailed(f"{built.target}: exit {exit_code} as UID 123456:\n{running.logs()}")
    say(f"{built.target}: as UID 123456 in group 0, tokens off: ready in {ready_s:.1f} s, {label} "
        f"with no key, the detector answered, exit 0 after {stopped_s:.1f} s")
    return {"ready_s": round(ready_s, 1), "label": label, "exit_code": exit_code}


def served_runners(logs: str) -> dict[str, dict[str, Any]]:
    """model -> its workers' `runners=` (role -> runner, file, precision) from their `worker ready`
    lines (the last worker's, where several serve a model)."""
    found = {}
    for line in logs.splitlines():
        if "worker ready model=" in line and " runners=" in line:
            model = line.split("worker ready model=", 1)[1].split()[0]
            found[model] = json.loads(line.split(" runners=", 1)[1])
    return found


def top_label(answer: requests.Response) -> str:
    if answer.status_code != 200:
        raise CheckFailed(f"prediction answered {answer.status_code}: {answer.text[:300]}")
    label = str(answer.json()[0]["label"])
    if label not in CAT_LABELS:
        raise CheckFailed(f"the cat photo was answered {label!r}")
    return label


# --- podman kube play ---------------------------------------------------------------------------
# Run inside the pod's container (its Python, its loopback): wait for /ready, then classify the
# photo read from standard input with no key (the manifests turn token authorization off).
IN_POD = """
import json, sys, time, urllib.request
started, limit = time.monotonic(), float(sys.argv[1])
while True:
    try:
        with urllib.request.urlopen("http://127.0.0.1:8090/ready", timeout=2) as answer:
            if answer.status == 200:
                break
    except OSError:
        pass
    if time.monotonic() - started > limit:
        sys.exit("not ready")
    time.sleep(0.2)
ready_s = time.monotonic() - started
request = urllib.request.Request("http://127.0.0.1:8080/predictions/efficientnet_lite0",
                                 data=sys.stdin.buffer.read(), headers={"Content-Type": "image/png"})
with urllib.request.urlopen(request, timeout=120) as answer:
    print(json.dumps({"ready_s": ready_s, "answer": json.load(answer)}))
"""


def check_kube_play(engine: Engine, overlay: str, image: str, resources: list[dict[str, Any]],
                    workdir: Path) -> dict[str, Any]:
    manifest = workdir / f"{overlay}.yaml"
    manifest.write_text(yaml.safe_dump_all(playable(resources, image), sort_keys=False))
    volumes_before = set(engine("volume", "ls", "--quiet").stdout.split())
    engine.made.append(("kube", str(manifest)))
    started = time.monotonic()
    played = engine("kube", "play", str(manifest)).stdout
    polled = time.monotonic()
    (container,) = played_containers(played)
    try:
        result = engine("exec", "--interactive", container, "python", "-c", IN_POD,
                        str(POD_READY_WITHIN_S), stdin=photo(PHOTO), timeout_s=POD_READY_WITHIN_S + 150)
    except CheckFailed as failure:
        logs = engine("logs", container, check=False)
        raise CheckFailed(f"{overlay}: {failure}\n{(logs.stdout + logs.stderr)[-4000:]}") from None
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    ready_s = polled - started + float(outcome["ready_s"])
    label = str(outcome["answer"][0]["label"])
    if label not in CAT_LABELS:
        raise CheckFailed(f"{overlay}: the cat photo was answered {label!r}")
    engine("kube", "down", str(manifest))
    engine.made.remove(("kube", str(manifest)))
    if engine("container", "exists", container, check=False).returncode == 0:
        raise CheckFailed(f"{overlay}: its container is left after kube down")
    for volume in set(engine("volume", "ls", "--quiet").stdout.split()) - volumes_before:
        engine("volume", "rm", "--force", volume)      # the emptyDirs, where kube down keeps them
    say(f"{overlay}: /ready {ready_s:.1f} s after kube play; answered {label}; kube down")
    return {"ready_s": round(ready_s, 1), "label": label}


def played_containers(output: str) -> list[str]:
    """The IDs of the containers `podman kube play` printed (under `Container:`), infra excluded."""
    lines = [line.strip() for line in output.splitlines()]
    if "Container:" not in lines:
        raise CheckFailed(f"kube play started no container:\n{output}")
    return list(itertools.takewhile(bool, lines[lines.index("Container:") + 1:]))


# --- the whole check ----------------------------------------------------------------------------
def arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/image-check.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True,
                        help="base image (PYTHON_IMAGE), pinned by digest: NAME@sha256:DIGEST")
    parser.add_argument("--target", action="append", choices=TARGETS,
                        help="cpu or gpu; repeat for both (default: both)")
    parser.add_argument("--no-build", action="store_true",
                        help="check the images already built under the check's tags")
    parser.add_argument("--no-kube-play", action="store_true", help="build and run only")
    parser.add_argument("--torch-index-url", help="the build's TORCH_INDEX_URL (default: the Dockerfile's)")
    parser.add_argument("--remove-images", action="store_true",
                        help="remove the images built and the build cache at the end")
    parser.add_argument("--record", type=Path, help="write the figures as JSON to this file")
    return parser.parse_args(argv)


def overlay_resources(kubectl: Path) -> dict[str, list[dict[str, Any]]]:
    return {overlay: rendered_overlay(REPO / "deploy" / overlay, kubectl) for overlay in OVERLAYS}


def main(argv: list[str]) -> int:
    options = arguments(argv)
    targets = options.target or list(TARGETS)
    kubectl = Path(sys.executable).with_name("kubectl")
    record: dict[str, Any] = {"base": options.base, "targets": {}, "kube_play": {}}
    with tempfile.TemporaryDirectory(prefix="image-check-") as tmp:
        workdir = Path(tmp)
        (workdir / "secrets").mkdir(mode=0o700)
        engine = pick_engine(workdir)
        record["engine"] = engine("--version").stdout.strip()
        free = storage_free_gb(engine)
        if free < NEEDED_DISK_GB * len(targets) / len(TARGETS):
            raise CheckFailed(f"{free:.0f} GB free for container storage; the check needs about "
                              f"{NEEDED_DISK_GB:.0f} GB for both targets")
        resources = overlay_resources(kubectl)
        try:
            for target in targets:
                built = (existing(engine, target) if options.no_build else
                         build(engine, target, options.base, workdir / "secrets", options.torch_index_url))
                record["targets"][target] = {
                    "build_min": round(built.build_s / 60, 1), "size_gb": round(built.size_gb, 2),
                    "image_user": check_as_the_image_user(engine, built, resources["kubernetes"]),
                    "any_uid": check_as_any_uid_without_tokens(engine, built, resources["kubernetes"])}
                engine.clean_up()
            if engine.program == "podman" and not options.no_kube_play:
                for overlay, target in OVERLAYS.items():
                    if target in targets:
                        record["kube_play"][overlay] = check_kube_play(
                            engine, overlay, TAGS[target], resources[overlay], workdir)
                        engine.clean_up()
            elif engine.program != "podman":
                say("kube play skipped: Docker has no equivalent")
        finally:
            engine.clean_up()
            if options.remove_images:
                engine("rmi", "--force", *(TAGS[target] for target in targets), check=False)
                engine("image", "prune", "--force", check=False)
    if options.record:
        options.record.write_text(json.dumps(record, indent=2) + "\n")
    say("passed")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except CheckFailed as failure:
        print(f"image-check: FAILED: {failure}", file=sys.stderr)
        sys.exit(1)
