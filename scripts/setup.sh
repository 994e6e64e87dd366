#!/usr/bin/env bash
# Set up everything the project needs, idempotently:
#   - a Java 17+ JDK (installed with apt when missing and running as root): TorchServe's runtime,
#     and javac for the frontend agent (torchserve_vision/frontend),
#   - HAProxy, the front of `server run --front-port` and the load balancer of the rolling-update
#     rehearsal (the same way; optional: only those and their tests need it),
#   - redis-server and Prometheus (the same way): real parts for the response cache's shared tier
#     and the autoscaling metrics' tests, and libjpeg-turbo's TurboJPEG library (libturbojpeg0), with
#     which the chroma tests decode as nvJPEG does,
#   - .venv with the pinned packages of requirements.txt / constraints.txt (installed with uv,
#     or pip where uv cannot), Ultralytics for the tests (requirements-ultralytics.txt, without
#     its dependencies), and this project
#     installed into it (editable) with its command, .venv/bin/torchserve-vision,
#   - the frontend agent's jar.
# Re-running does nothing when all of it is already in place.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

java_major() {
  java -version 2>&1 | awk -F'"' '/version/ {split($2, v, "."); print v[1]; exit}'
}

ensure_java() {
  # A JDK, not only a runtime: the frontend agent (torchserve_vision/frontend) is compiled here.
  if command -v java >/dev/null 2>&1 && [ "$(java_major)" -ge 17 ] 2>/dev/null \
      && command -v javac >/dev/null 2>&1; then
    return
  fi
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing openjdk-17-jdk-headless with apt"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openjdk-17-jdk-headless >/dev/null
    return
  fi
  echo "setup: TorchServe needs a Java 17 (or newer) runtime on PATH, and this project's frontend" >&2
  echo "setup: agent a Java compiler (javac); one of them was not found. Install a JDK, e.g." >&2
  echo "setup: 'sudo apt-get install -y openjdk-17-jdk-headless', then run this again." >&2
  exit 1
}

# ensure_debian_package COMMAND PATH PACKAGE WHY: COMMAND on the PATH or PATH present, else PACKAGE
# installed with apt (as root), else a line saying what needs it.
ensure_debian_package() {
  local command=$1 path=$2 package=$3 why=$4
  if command -v "$command" >/dev/null 2>&1 || [ -e "$path" ]; then
    return
  fi
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing $package with apt"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$package" >/dev/null
    return
  fi
  echo "setup: $command not found ($why; e.g. 'sudo apt-get install -y $package')" >&2
}

find_python() {
  for candidate in "${PYTHON:-}" python3.11 python3; do
    if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 \
        && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 10))'; then
      echo "$candidate"; return
    fi
  done
  echo "setup: Python 3.10 or newer is required (3.11 recommended)" >&2
  exit 1
}

ensure_venv() {
  local stamp=.venv/.requirements.sha256 wanted
  wanted=$(cat requirements.txt requirements-ultralytics.txt constraints.txt pyproject.toml | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ] && [ -x .venv/bin/python ]; then
    return
  fi
  if [ ! -x .venv/bin/python ]; then
    "$(find_python)" -m venv .venv
  fi
  echo "setup: installing pinned packages into .venv (first run takes a few minutes)"
  .venv/bin/python -m pip install --quiet --upgrade pip
  # uv (pinned) installs the same pins from the same sources as pip in about a third of the time
  # (scripts/uv_install.py); pip installs them where uv cannot.
  if ! { .venv/bin/python -m pip install --quiet uv==0.13.9 \
         && .venv/bin/python scripts/uv_install.py --quiet -r requirements.txt -c constraints.txt; }; then
    echo "setup: uv could not install the pinned packages; installing them with pip" >&2
    .venv/bin/python -m pip install --quiet -r requirements.txt -c constraints.txt
  fi
  # Ultralytics for the tests only, without its dependencies (requirements-ultralytics.txt says why).
  .venv/bin/python -m pip install --quiet --no-deps -r requirements-ultralytics.txt
  # The project itself: its packages and the torchserve-vision command (dependencies are above).
  .venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
  echo "$wanted" > "$stamp"
}

ensure_java
ensure_debian_package haproxy /usr/sbin/haproxy haproxy \
  "optional: the front and the rolling-update rehearsal need it"
ensure_debian_package redis-server /usr/bin/redis-server redis-server \
  "the response cache's shared tier and its tests need it"
ensure_debian_package prometheus /usr/bin/prometheus prometheus \
  "the autoscaling metrics' tests need it"
ensure_debian_package libturbojpeg /usr/lib/x86_64-linux-gnu/libturbojpeg.so.0 libturbojpeg0 \
  "the chroma tests decode with libjpeg-turbo as nvJPEG does"
ensure_venv
# The frontend agent's jar (queued batching), built against the installed TorchServe; nothing
# happens when it is already there.
.venv/bin/python -m torchserve_vision.frontend.agent >/dev/null
echo "setup: ready (.venv with torchserve-vision, $(java -version 2>&1 | head -n 1))"
