#!/usr/bin/env bash
# Build the image of deploy/Dockerfile, both targets, and run it as the manifests do: ready within
# 30 s, answers with and without token authorization, a drain under load that fails no request,
# an arbitrary UID in group 0, `podman kube play` of each overlay (scripts/image_check.py says
# what each step checks). Podman (with runc and catatonit: scripts/podman-packages.sh) is installed
# with apt when any of it is missing and running as root; the project's setup (.venv: kubectl,
# the photos) comes first.
#
#   bash scripts/image-check.sh --base IMAGE@sha256:DIGEST [--target cpu] [--record FILE]
#   bash scripts/image-check.sh --base "$(bash scripts/debian-base-image.sh)"   # no registry
#
# About 30 GB of container storage for both targets; 20-30 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=scripts/podman-packages.sh
source scripts/podman-packages.sh
# Docker alone is used as it is; otherwise Podman with what it needs
if command -v podman >/dev/null 2>&1 || ! command -v docker >/dev/null 2>&1; then
  install_podman_packages image-check || exit 1
fi
bash scripts/setup.sh >/dev/null
exec .venv/bin/python scripts/image_check.py "$@"
