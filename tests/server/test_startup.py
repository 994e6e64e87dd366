"""Start-up on a real TorchServe: timeouts from config/models.yaml, workers that report their
start-up time and serve the first compiled runner of the archive's order for the CPU at hand
(every archive of the store, each network of the pipelines too), and an archive whose packages
were compiled for another target, refused by the worker and served eagerly instead of crashing it;
a start that cannot become healthy, or whose address is taken, fails and leaves nothing running;
the stop of a frontend that died leaves none of its workers running."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import zipfile
from pathlib import Path

import psutil
import pytest
import requests
import yaml

from handlers.model.runner_selection import EAGER
from tests.images import CAT_LABELS, photo_bytes
from tests.runners import first_runner_here, network_sections
from tests.server.http_client import post_image
from tests.server.logs import wait_for_log
from torchserve_vision import paths
from torchserve_vision.archives import ARCHIVER
from torchserve_vision.model_descriptions import load_descriptions
from torchserve_vision.rollout import wait_for_workers
from torchserve_vision.server_process import (
    ServerError,
    TorchServeInstance,
    frontend_pid,
    instance_for,
    ping,
    process_alive,
    start,
    stop,
)
from torchserve_vision.torchserve_config import read_properties, render_properties, server_config
from torchserve_vision.waiting import wait_until
from torchserve_vision.worker_forkserver import DIRECTORY_VARIABLE, OWNER_VARIABLE
from torchserve_vision.worker_forkserver.frontend_setup import fork_server_pids
from torchserve_vision.worker_processes import workers_of

pytestmark = pytest.mark.server
READY_LINE = re.compile(r"worker ready model=(\S+) version=(\S+) device=\S+ runner=(\S+) .*"
                        r"startup_ms=(\d+)")


def describe(server: TorchServeInstance, model: str, version: str | None = None) -> dict:
    path = f"{model}/{version}" if version else model
    return requests.get(f"{server.management_url}/models/{path}", timeout=30).json()[0]


def started_descriptions():
    return [d for d in load_descriptions(paths.MODEL_DESCRIPTIONS) if d.start]


def test_each_model_has_the_timeouts_of_its_description(server):
    for description in started_descriptions():
        described = describe(server, description.name)
        assert described["startupTimeout"] == description.serving.startup_timeout_s
        assert described["responseTimeout"] == description.serving.response_timeout_s


def test_workers_log_their_start_up_time_and_the_classifier_runs_the_first_runner_of_its_order(
        server, model_store):
    expected_workers = {d.name: d.serving.min_workers for d in started_descriptions()}

    def ready_lines(lines: list[str]) -> list[re.Match[str]]:
        return [match for line in lines if (match := READY_LINE.search(line))]

    lines = wait_for_log(server.log_dir / "model_log.log",
                         lambda lines: len(ready_lines(lines)) >= sum(expected_workers.values()))
    ready = ready_lines(lines)
    for name, workers in expected_workers.items():
        assert sum(match[1] == name for match in ready) >= workers, name
    lite0 = network_sections(model_store / "efficientnet_lite0-1.0.mar")["classifier"]
    expected = first_runner_here(lite0)
    assert {match[3] for match in ready if match[1] == "efficientnet_lite0"} == {expected}
    assert all(int(match[4]) > 0 for match in ready)


def copy_with_foreign_target(source: Path, target: Path, model_name: str) -> None:
    """The archive under another model name, its compiled packages recorded as built with
    another torch and its order naming only them: a worker must refuse them."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as new:
        for item in old.infolist():
            data = old.read(item.filename)
            if item.filename == "model-config.yaml":
                config = yaml.safe_load(data)
                for package in config["handler"]["compiled_packages"]:
                    package["target"]["torch_version"] = "1.0.0"
                config["handler"]["runner_order"] = {"avx512_bf16": ["aoti-bf16", "aoti-fp32"],
                                                     "avx2": ["aoti-fp32"]}
                data = yaml.safe_dump(config).encode()
            elif item.filename == "MAR-INF/MANIFEST.json":
                data = data.replace(b'"efficientnet_lite0"', f'"{model_name}"'.encode())
            new.writestr(item, data)


def test_an_archive_compiled_for_another_target_is_served_eagerly(server, model_store):
    name = "lite0_foreign_target"
    copy_with_foreign_target(model_store / "efficientnet_lite0-1.0.mar", model_store / f"{name}.mar",
                             name)
    registered = requests.post(f"{server.management_url}/models", timeout=120,
                               params={"url": f"{name}.mar", "initial_workers": "1", "synchronous": "true"})
    assert registered.status_code == 200, registered.text
    try:
        assert describe(server, name)["workers"][0]["status"] == "READY"
        reply = post_image(f"{server.inference_url}/predictions/{name}", photo_bytes("chelsea.png"))
        assert reply.status == 200 and reply.body[0]["label"] in CAT_LABELS
        lines = wait_for_log(server.log_dir / "model_log.log",
                             lambda lines: any(f"model={name} " in line for line in lines))
        assert any(f"model={name} " in line and "runner=eager" in line for line in lines)
        assert any("aoti-fp32 refused (target)" in line and "torch 1.0.0" in line for line in lines)
        metrics = requests.get(f"{server.metrics_url}/metrics", timeout=30).text
        refusals = [line for line in metrics.splitlines()
                    if line.startswith("HandlerCompiledModelRefusals{") and f'ModelName="{name}"' in line]
        assert any('Reason="target"' in line and 'Runner="aoti-fp32"' in line for line in refusals)
        assert any(line.startswith("HandlerRunnerSelected{") and f'ModelName="{name}"' in line
                   and 'Runner="eager"' in line for line in metrics.splitlines())
    finally:
        requests.delete(f"{server.management_url}/models/{name}", timeout=60)


def cpu_model_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def described_handler(server: TorchServeInstance, model: str, version: str) -> dict:
    """A worker's own account of what it runs (`models describe --handler`)."""
    return server.client().describe(model, version, customized=True)[0]["customizedMetadata"]


def test_every_archive_serves_the_first_runner_of_its_order_on_this_cpu(server, model_store):
    """Every model of config/models.yaml, registered from the store (one worker each, the ones
    the server did not start), tells through TorchServe's describe API which runner each of its
    networks uses: the first of its order for the CPU at hand, nothing refused."""
    # TorchServe answers a register call once it has read the archive: the cascade's (two
    # classifiers inside) took over the default 5 s on 2 cores busy loading the workers before it.
    client = server.client(timeout_s=120)
    descriptions = load_descriptions(paths.MODEL_DESCRIPTIONS)
    registered = []
    try:
        for description in descriptions:
            if not description.start:
                serving = description.serving
                client.register(f"{description.name}-{description.version}.mar", serving.batch_size,
                                serving.max_batch_delay_ms, 1, serving.response_timeout_s)
                registered.append(description)
        for description in registered:
            wait_for_workers(client, description.name, description.version, 1, 240)
        for description in descriptions:
            handler = described_handler(server, description.name, description.version)
            mar = model_store / f"{description.name}-{description.version}.mar"
            with zipfile.ZipFile(mar) as archive:
                files = archive.namelist()
            runners = handler["runners"]
            sections = network_sections(mar)
            assert runners and set(runners) == set(sections), description.name
            for role, runner in runners.items():
                expected = first_runner_here(sections[role], role)
                assert runner["runner"] == expected, (description.name, role, runner, cpu_model_name())
                assert "refused" not in runner
                assert runner["runner"] == EAGER or any(name.endswith(runner["file"]) for name in files)
    finally:
        for description in registered:
            client.unregister(description.name, description.version)


# A worker that loads for ten minutes: not READY within any wait of the test, however fast the
# machine (a worker forked from a running fork server can be READY within a second). With a
# marker, its `initialize` creates that file first, so a test knows the worker is inside its load.
def slow_loading_handler(marker: Path | None = None) -> str:
    mark = f"        open({str(marker)!r}, 'w').close()\n" if marker else ""
    return ("import time\n\n\n"
            "class SlowLoading:\n"
            "    def initialize(self, context):\n"
            f"{mark}"
            "        time.sleep(600)\n\n"
            "    def handle(self, data, context):\n"
            "        return [b'{}' for _ in data]\n")


def slow_loading_instance(tmp_path: Path, marker: Path | None = None) -> tuple[TorchServeInstance, Path]:
    """An instance whose one model's worker loads for ten minutes (slow_loading_handler), and
    its store."""
    store = tmp_path / "store"
    store.mkdir()
    handler = tmp_path / "slow_loading.py"
    handler.write_text(slow_loading_handler(marker))
    subprocess.run([str(ARCHIVER), "--model-name", "slow_loading", "--version", "1.0", "--handler",
                    str(handler), "--export-path", str(store)], check=True, capture_output=True)
    config = server_config(tmp_path / "config", store, paths.DEVELOPMENT_CONFIG,
                           load_models="slow_loading.mar")
    properties = read_properties(config)
    del properties["models"]            # the archive's own settings
    config.write_text(render_properties(properties))
    return instance_for(config, tmp_path / "run"), store


def test_a_server_that_is_not_healthy_in_time_is_stopped_again(tmp_path):
    """`server start`'s wait runs out (here after 1 s, with a worker that loads for ten
    minutes): the command fails and leaves no TorchServe behind."""
    instance, store = slow_loading_instance(tmp_path)
    with pytest.raises(ServerError, match="to be healthy"):
        start(instance, store, timeout_s=1)
    assert_nothing_left_running(instance)


def test_a_worker_still_loading_when_its_frontend_dies_is_ended_by_the_stop(tmp_path):
    """TorchServe kills its workers from their threads after its stop has begun, and a frontend
    that dies (here SIGKILL) never does: a worker busy loading would go on for its ten minutes,
    and a forked worker's stand-in with it. The stop ends them."""
    loading = tmp_path / "loading"
    instance, store = slow_loading_instance(tmp_path, marker=loading)
    before = fork_server_children()
    start(instance, store, wait=False)
    try:
        # inside its load: a worker killed with its frontend while still starting up may end too
        wait_until(loading.exists, 120, "the worker to begin loading")
        frontend = frontend_pid(instance)
        assert frontend is not None
        forked = wait_for_forked_worker(before)
        os.kill(frontend, signal.SIGKILL)
        wait_until(lambda: frontend_pid(instance) is None, 30, "the frontend to die")
        assert workers_of(instance.tmp_dir), "the worker ended with its frontend: nothing to check"
    finally:
        stop(instance)
    assert_nothing_left_running(instance)
    for process in forked:
        assert not process_alive(process.pid), process


def fork_server_children() -> set[psutil.Process]:
    """The workers forked by this test process's fork server (tests/conftest.py's
    `one_fork_server_per_process`); none where it is not shared."""
    directory = os.environ.get(DIRECTORY_VARIABLE)
    if OWNER_VARIABLE not in os.environ or not directory:
        return set()
    children: set[psutil.Process] = set()
    for pid in fork_server_pids(Path(directory)):
        with contextlib.suppress(psutil.Error):
            children.update(psutil.Process(pid).children())
    return children


def wait_for_forked_worker(before: set[psutil.Process]) -> set[psutil.Process]:
    """The worker the shared fork server forked since `before` (empty where none is shared)."""
    if OWNER_VARIABLE not in os.environ:
        return set()
    wait_until(lambda: bool(fork_server_children() - before), 120, "the forked worker")
    return fork_server_children() - before


def assert_nothing_left_running(instance: TorchServeInstance) -> None:
    assert not ping(instance)
    assert not workers_of(instance.tmp_dir)     # no worker, nor a forked worker's stand-in
    running = subprocess.run(["pgrep", "-f", str(instance.effective_config)], capture_output=True,
                             check=False)
    assert running.returncode == 1, running.stdout    # no process runs with this instance's config


def test_a_server_whose_address_is_taken_fails_at_once_naming_it(tmp_path):
    """TorchServe 0.12 exits when it cannot bind one of its addresses: the start says which at
    once (with a wait of ten minutes, a timeout would read 'to be healthy') and leaves nothing
    running."""
    store = tmp_path / "store"
    store.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"http://127.0.0.1:{taken.getsockname()[1]}"
        config = server_config(tmp_path / "config", store, paths.DEVELOPMENT_CONFIG,
                               load_models="", management_address=address)
        instance = instance_for(config, tmp_path / "run")
        with pytest.raises(ServerError) as failed:
            start(instance, store, timeout_s=600)
    assert str(failed.value).endswith(f"exited while starting: it could not bind {address} "
                                      "(address already in use)")
    assert_nothing_left_running(instance)
