#!/usr/bin/env bash
# Build the image of deploy/Dockerfile, both targets, and run it as the manifests do: ready within
# 30 s, answers with and without token authorization, a drain under load that fails no request,
# an arbitrary UID in group 0, `podman kube play` of each overlay (scripts/image_check.py says
# what each step checks). Podman (with runc) is installed with apt when missing and running as
# root; the project's setup (.venv: kubectl, the photos) comes first.
#
#   bash scripts/image-check.sh --base IMAGE@sha256:DIGEST [--target cpu] [--record FILE]
#   bash scripts/image-check.sh --base "$(bash scripts/debian-base-image.sh)"   # no registry
#
# About 30 GB of container storage for both targets; 20-30 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v podman >/dev/null 2>&1 && ! command -v docker >/dev/null 2>&1 \
    || command -v podman >/dev/null 2>&1 && ! command -v runc >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "image-check: installing podman and runc with apt"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman runc >/dev/null
  else
    echo "image-check: needs podman (with runc) or docker: e.g. 'sudo apt-get install -y podman runc'" >&2
    exit 1
  fi
fi
bash scripts/setup.sh >/dev/null
exec .venv/bin/python scripts/image_check.py "$@"
