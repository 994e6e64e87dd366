"""The frontend agent's jar: built once with `javac` from the Java sources beside this module,
against the installed TorchServe's `model-server.jar`, under a name that carries a digest of the
sources and TorchServe's version (a change of either builds anew).

The jar belongs to the Python environment whose TorchServe it was compiled against, not to the
copy of this package that built it: it is written to the environment's data directory
(`<sys.prefix>/share/torchserve-vision/` in a virtual environment), or, where that is not
writable (a user install into a system Python), to the user's cache directory. So the command
that builds it finds the same jar wherever it runs from: `python -m` in a source tree imports
this package from the working directory, which a container image's runtime stage never copies.

`scripts/setup.sh` and the container image build it (`python -m torchserve_vision.frontend.agent`);
`torchserve-vision server` builds it on first use where `javac` is at hand, else says how.

The jar holds the agent class and, under `replacement/`, the compiled classes it substitutes
(TorchServe's `ContinuousBatching` and `ServerGroups`, stored under other names, so that only the
agent can hand them to the JVM), and the class they add to TorchServe's package (`RefusingQueue`:
a full queue's 503 that says so).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

from torchserve_vision.errors import CommandError

SOURCES = Path(__file__).parent
AGENT_CLASS = "torchserve_vision.frontend.Agent"
REPLACEMENTS = (  # (TorchServe's class, where the jar stores the agent's substitute)
    ("org/pytorch/serve/wlm/ContinuousBatching.class", "replacement/ContinuousBatching.class.bin"),
    ("org/pytorch/serve/util/ServerGroups.class", "replacement/ServerGroups.class.bin"),
)
# Classes of TorchServe's packages that TorchServe does not have, which the substitutes use: stored
# as they are (the agent's jar is on the frontend's class path, so its class loader finds them).
ADDITIONS = ("org/pytorch/serve/wlm/RefusingQueue.class",)
JAVA_RELEASE = "17"   # TorchServe 0.12's minimum; the runtime may be newer


class AgentError(CommandError, RuntimeError):
    """The agent's jar is missing and cannot be built here."""


def java_sources() -> list[Path]:
    return sorted(SOURCES.glob("*.java"))


def frontend_jar() -> Path:
    """TorchServe's frontend, `ts/frontend/model-server.jar` of the installed package."""
    spec = importlib.util.find_spec("ts")
    if spec is None or spec.origin is None:
        raise AgentError("TorchServe (the ts package) is not installed in this environment")
    return Path(spec.origin).parent / "frontend" / "model-server.jar"


def jar_directories() -> list[Path]:
    """Where the jar is built, in the order tried: the environment's data directory, then the
    user's cache directory. Neither depends on the working directory or on where this module was
    imported from."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return [Path(sysconfig.get_path("data")) / "share" / "torchserve-vision", cache / "torchserve-vision"]


def placed_jar_directory() -> Path:
    """Where a jar built elsewhere may be put beside these sources, for a host without javac
    (../shared/gpu's bundle for a GPU host does): looked at after `jar_directories`, never built
    into. Its name carries the sources' digest, so only a jar of these sources is taken."""
    return SOURCES / "build"


def writable(directory: Path) -> bool:
    """Whether `directory`, or its nearest existing parent, can be written by this process."""
    existing = next(parent for parent in (directory, *directory.parents) if parent.exists())
    return os.access(existing, os.W_OK | os.X_OK)


def agent_jar_name() -> str:
    digest = hashlib.sha256(importlib.metadata.version("torchserve").encode())
    for source in java_sources():
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return f"frontend-agent-{digest.hexdigest()[:16]}.jar"


def agent_jar_path() -> Path:
    """Where the jar of these sources is, or will be written: the first directory that has it
    (`jar_directories`, then `placed_jar_directory`), else the first writable one of
    `jar_directories`."""
    name, directories = agent_jar_name(), jar_directories()
    existing = [directory / name for directory in (*directories, placed_jar_directory())
                if (directory / name).is_file()]
    if existing:
        return existing[0]
    return next((directory / name for directory in directories if writable(directory)),
                directories[0] / name)


def agent_jar() -> Path:
    """The agent's jar, built first if it is not there."""
    path = agent_jar_path()
    return path if path.is_file() else build_agent_jar(path)


def build_agent_jar(path: Path) -> Path:
    """Compile the sources against TorchServe's frontend and write the jar to `path` (whole, then
    renamed: a server starting beside the build never sees half a jar)."""
    javac = shutil.which("javac")
    if javac is None:
        raise AgentError("building the frontend agent needs javac (a JDK 17 or newer; "
                         "scripts/setup.sh installs openjdk-17-jdk-headless with apt as root)")
    with tempfile.TemporaryDirectory() as tmp:
        classes = Path(tmp) / "classes"
        compiled = subprocess.run(
            [javac, "--release", JAVA_RELEASE, "-nowarn", "-cp", str(frontend_jar()),
             "-d", str(classes), *map(str, java_sources())],
            capture_output=True, text=True, check=False)
        if compiled.returncode != 0:
            raise AgentError(f"javac failed:\n{compiled.stdout}{compiled.stderr}")
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        write_jar(classes, partial)
        partial.replace(path)
    return path


def write_jar(classes: Path, jar: Path) -> None:
    manifest = f"Manifest-Version: 1.0\nPremain-Class: {AGENT_CLASS}\n"
    with zipfile.ZipFile(jar, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("META-INF/MANIFEST.MF", manifest)
        for item in sorted((classes / "torchserve_vision").rglob("*.class")):
            archive.write(item, item.relative_to(classes).as_posix())
        for compiled_name, stored_name in REPLACEMENTS:
            archive.write(classes / compiled_name, stored_name)
        for compiled_name in ADDITIONS:
            archive.write(classes / compiled_name, compiled_name)


def java_agent_option() -> str:
    """The JVM option that loads the agent (for config.properties' `vmargs`, which TorchServe
    splits at whitespace)."""
    jar = agent_jar()
    if any(character.isspace() for character in str(jar)):
        raise AgentError(f"the agent's path has whitespace, which TorchServe's vmargs cannot carry: {jar}")
    return f"-javaagent:{jar}"


if __name__ == "__main__":
    try:
        print(agent_jar_path() if sys.argv[1:] == ["--path"] else agent_jar())
    except AgentError as error:
        sys.exit(f"error: {error}")
