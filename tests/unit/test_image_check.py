"""scripts/image_check.py's pure parts: what the build is given of pip's settings, the Podman
settings a restricted host needs, the run options taken from the manifests, and what `podman
kube play` is handed. (The check itself builds and runs the images: docs/testing.md.)"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deployment_files import KUBECTL, OVERLAYS, REPO, image_check_script

SCRIPTS = REPO / "scripts"
SCRIPT = image_check_script()


def test_the_build_gets_the_hosts_remote_indexes_and_certificate_not_its_paths():
    settings = {"index-url": "https://mirror.example/simple",
                "extra-index-url": "file:///opt/pypi/simple https://more.example/simple /srv/wheels",
                "find-links": "/opt/wheels", "constraint": "/etc/xdg/pip/constraints.txt",
                "cert": "/etc/ssl/certs/ca-certificates.crt", "timeout": "180", "no-cache-dir": "1"}
    conf, certificate, left_out = SCRIPT.pip_build_config(settings)
    assert conf.splitlines() == ["[global]", "index-url = https://mirror.example/simple",
                                 "extra-index-url = https://more.example/simple", "timeout = 180",
                                 "cert = /run/secrets/pip-cert"]
    assert certificate == Path("/etc/ssl/certs/ca-certificates.crt")
    assert sorted(item.split()[1] for item in left_out) == [
        "/etc/xdg/pip/constraints.txt", "/opt/wheels", "/srv/wheels", "file:///opt/pypi/simple"]


def test_no_pip_settings_give_pips_defaults():
    conf, certificate, left_out = SCRIPT.pip_build_config({})
    assert (conf, certificate, left_out) == ("[global]\n", None, [])


@pytest.mark.parametrize("sys_resource", [True, False])
@pytest.mark.parametrize("hybrid", [True, False])
def test_podman_is_told_only_what_the_host_refuses(sys_resource: bool, hybrid: bool):
    conf = SCRIPT.containers_conf(sys_resource, hybrid)
    assert ("default_ulimits" in conf) == (not sys_resource)
    if not sys_resource:
        assert 'default_ulimits = ["nofile=20000:20000", "nproc=20000:20000"]' in conf
    assert ('runtime = "runc"' in conf) == hybrid
    assert conf.index("[containers]") < conf.index("[engine]")


@pytest.fixture(scope="module")
def cpu_overlay() -> list[dict]:
    return SCRIPT.rendered_overlay(OVERLAYS["cpu"], KUBECTL)


@pytest.mark.parametrize("engine", ["podman", "docker"])
def test_the_container_runs_with_the_deployments_security_settings_and_scratch_volumes(cpu_overlay, engine):
    options = SCRIPT.run_options(cpu_overlay, engine)
    assert "--read-only" in options
    # Podman's --read-only adds writable tmpfs at /tmp, /var/tmp and /run; Kubernetes adds none
    assert ("--read-only-tmpfs=false" in options) == (engine == "podman")
    assert "--cap-drop=ALL" in options
    assert options[options.index("--security-opt") + 1] == "no-new-privileges"
    assert sorted(SCRIPT.scratch_paths(cpu_overlay)) == ["/srv/torchserve-vision/.run", "/tmp"]


def test_kube_play_gets_the_deployments_with_the_image_built_and_the_overlay_is_left_as_it_was(cpu_overlay):
    before = copy.deepcopy(cpu_overlay)
    played = SCRIPT.playable(cpu_overlay, "localhost/torchserve-vision:check")
    assert [resource["kind"] for resource in played] == ["Deployment"]
    (container,) = played[0]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "localhost/torchserve-vision:check"
    assert cpu_overlay == before
    assert {resource["kind"] for resource in cpu_overlay} > {"Deployment", "Service"}


def test_every_overlay_is_played_with_an_image_the_check_builds():
    assert {REPO / "deploy" / overlay for overlay in SCRIPT.OVERLAYS} == set(OVERLAYS.values())
    assert set(SCRIPT.OVERLAYS.values()) <= set(SCRIPT.TAGS) == set(SCRIPT.TARGETS)


def test_the_containers_kube_play_started_are_read_from_its_output():
    output = "Pod:\n61b9c1e1c22d\nContainer:\n3f41c00d378f\n\n"
    assert SCRIPT.played_containers(output) == ["3f41c00d378f"]
    with pytest.raises(SCRIPT.CheckFailed):
        SCRIPT.played_containers("Error: something\n")


def test_the_script_runs_its_help_without_a_container_engine():
    shown = subprocess.run([sys.executable, str(SCRIPTS / "image_check.py"), "--help"],
                           capture_output=True, text=True, check=True).stdout
    assert "--base" in shown and "kube play" in shown


def test_the_runners_workers_serve_are_read_from_their_ready_lines():
    logs = """2026-11-28T14:24:04,204 model [INFO ] W-9001-efficientnet_lite0_1.0-stdout MODEL_LOG - \
worker ready model=efficientnet_lite0 version=1.0 device=cpu runner=openvino-bf16 max_batch_size=8 \
load_ms=1181 warm_up_ms=239 startup_ms=1941 runners={"classifier": {"cpu_kind": "avx512_bf16", \
"file": "compiled/model-openvino.xml", \
"precision": "bf16", "runner": "openvino-bf16", "solo_threads": 2}}
2026-11-28T14:24:04,300 ts [INFO ] W-9002 other line runners=not-json
2026-11-28T14:24:04,617 model [INFO ] W-9002-ssdlite320_1.0-stdout MODEL_LOG - worker ready model=ssdlite320 \
version=1.0 device=cpu runner=eager-fp32 max_batch_size=4 runners={"detector": {"runner": "eager-fp32"}}
"""
    runners = SCRIPT.served_runners(logs)
    assert runners["efficientnet_lite0"]["classifier"]["file"] == "compiled/model-openvino.xml"
    assert runners["ssdlite320"] == {"detector": {"runner": "eager-fp32"}}


def fake_commands(directory: Path, present: set[str], root: bool) -> Path:
    """A PATH folder with stand-ins: `present` programs that exist, `id` as root or not, and an
    `apt-get` that records its arguments in `apt.log`."""
    directory.mkdir()
    for program in present:
        (directory / program).write_text("#!/bin/sh\nexit 0\n")
    (directory / "id").write_text(f"#!/bin/sh\necho {0 if root else 1000}\n")
    (directory / "apt-get").write_text(f'#!/bin/sh\necho "$@" >> {directory}/apt.log\n')
    for script in directory.iterdir():
        script.chmod(0o755)
    return directory


def podman_install(directory: Path) -> subprocess.CompletedProcess[str]:
    command = f'source {SCRIPTS / "podman-packages.sh"} && install_podman_packages test'
    return subprocess.run(["/bin/bash", "-c", command], capture_output=True, text=True, check=False,
                          env={"PATH": str(directory), "PODMAN_HELPERS": str(directory / "helpers")})


@pytest.mark.parametrize("present", [set(), {"podman"}, {"podman", "runc"}])
def test_podman_is_installed_with_runc_and_the_pause_binary_whichever_is_missing(tmp_path, present):
    """catatonit is what `podman kube play` builds its pause image from; apt's
    --no-install-recommends leaves it out unless named."""
    fakes = fake_commands(tmp_path / "bin", present, root=True)
    assert podman_install(fakes).returncode == 0
    install = (fakes / "apt.log").read_text().splitlines()[-1].split()
    assert install[:2] == ["install", "-y"]
    assert {"podman", "runc", "catatonit"} - present <= set(install)


def test_nothing_is_installed_when_all_of_it_is_there_and_a_user_is_told_what_to_install(tmp_path):
    everything = fake_commands(tmp_path / "all", {"podman", "runc", "catatonit"}, root=True)
    assert podman_install(everything).returncode == 0
    assert not (everything / "apt.log").exists()
    user = fake_commands(tmp_path / "user", {"podman"}, root=False)
    refused = podman_install(user)
    assert refused.returncode == 1 and "podman runc catatonit" in refused.stderr


def test_both_scripts_that_install_podman_use_the_one_package_list():
    for script in ("debian-base-image.sh", "image-check.sh"):
        text = (SCRIPTS / script).read_text()
        assert "podman-packages.sh" in text and "install_podman_packages" in text
        installs = [line for line in text.splitlines() if "apt-get install" in line]
        assert all(line.rstrip().endswith("debootstrap >/dev/null") for line in installs), installs
