"""scripts/uv_install.py: uv gets the package sources pip is configured with (pip.conf sections and
PIP_* variables, as pip's install command ranks them), and installs from them for real."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def uv_install_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("uv_install", REPO / "scripts" / "uv_install.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPT = uv_install_script()


def test_the_install_command_sees_the_environment_over_its_section_over_global():
    listed = ["global.find-links='/opt/wheels'",
              "global.extra-index-url='file:///a/simple file:///b/simple'",
              "global.timeout='60'",
              "install.find-links='/srv/install-wheels'",
              "download.index-url='https://elsewhere.example/simple'",   # another command's
              ":env:.find-links='/env/wheels /env/more'",
              "global.cert='/etc/ssl/certs/ca-certificates.crt'",
              "not a setting"]
    assert SCRIPT.pip_settings(listed) == {
        "find-links": "/env/wheels /env/more",
        "extra-index-url": "file:///a/simple file:///b/simple",
        "timeout": "60",
        "cert": "/etc/ssl/certs/ca-certificates.crt"}
    # a section listed after the environment does not override it
    assert SCRIPT.pip_settings([":env:.index-url='https://env.example/simple'",
                                "global.index-url='https://file.example/simple'"]) == {
        "index-url": "https://env.example/simple"}


def test_each_source_becomes_uvs_option_and_the_ca_bundle_its_variable():
    arguments, environment = SCRIPT.uv_sources({
        "index-url": "https://mirror.example/simple",
        "extra-index-url": "file:///a/simple file:///b/simple",
        "find-links": "/opt/wheels", "constraint": "/etc/xdg/pip/constraints.txt",
        "no-index": "true", "cert": "/etc/ssl/certs/ca-certificates.crt", "timeout": "60"})
    assert arguments == ["--index-url", "https://mirror.example/simple",
                         "--extra-index-url", "file:///a/simple", "--extra-index-url", "file:///b/simple",
                         "--find-links", "/opt/wheels", "--constraint", "/etc/xdg/pip/constraints.txt",
                         "--no-index"]
    assert environment == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt"}
    assert SCRIPT.uv_sources({"no-index": "0"}) == ([], {})


def write_wheel(directory: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel of an empty package."""
    dist_info = f"{name}-{version}.dist-info"
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    files = {f"{name}/__init__.py": "",
             f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                   "Tag: py3-none-any\n"}
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
        archive.writestr(f"{dist_info}/RECORD",
                         "".join(f"{path},,\n" for path in [*files, f"{dist_info}/RECORD"]))
    return wheel


def test_uv_installs_from_the_find_links_pip_is_given_and_from_nowhere_else(tmp_path):
    """Run as setup.sh runs it, with pip told to use a local directory and no index (PIP_*
    variables): uv finds the package there (a dry run: this environment is left as it is), and
    a version only an index could have is not found."""
    write_wheel(tmp_path, "tsv_local_probe", "1.0")
    environment = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path)}
    script = [sys.executable, str(REPO / "scripts" / "uv_install.py"), "--dry-run", "--offline"]
    found = subprocess.run([*script, "tsv_local_probe==1.0"], capture_output=True, text=True,
                           env=environment, timeout=120)
    assert found.returncode == 0, found.stderr
    assert "tsv-local-probe==1.0" in found.stderr, found.stderr
    missing = subprocess.run([*script, "tsv_local_probe==2.0"], capture_output=True, text=True,
                             env=environment, timeout=120)
    assert missing.returncode != 0
    assert "tsv-local-probe" in missing.stderr, missing.stderr
