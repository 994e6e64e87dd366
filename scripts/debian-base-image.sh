#!/usr/bin/env bash
# A base image for deploy/Dockerfile where no image registry can be reached: Debian 12 (bookworm)
# with its Python 3.11 as `python`, the venv module and ca-certificates, made with debootstrap
# from a Debian mirror and imported into Podman's local storage. Prints the image's reference
# pinned by digest, for `--build-arg PYTHON_IMAGE=` or scripts/image-check.sh --base.
#
#   bash scripts/debian-base-image.sh [NAME]      (default localhost/debian-python:3.11-bookworm)
#
# Needs root (debootstrap), debootstrap and Podman with runc and catatonit (installed with apt
# when missing: scripts/podman-packages.sh) and about
# 300 MB; takes a minute or two. DEBIAN_MIRROR overrides the mirror (default deb.debian.org).
# An image that exists under NAME is reused.
set -euo pipefail
name=${1:-localhost/debian-python:3.11-bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if [ "$(id -u)" -ne 0 ]; then
  echo "debian-base-image: debootstrap needs root" >&2
  exit 1
fi
# shellcheck source=scripts/podman-packages.sh
source "$(dirname "${BASH_SOURCE[0]}")/podman-packages.sh"
if ! command -v debootstrap >/dev/null 2>&1; then
  echo "debian-base-image: installing debootstrap with apt" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi
install_podman_packages debian-base-image

digest_of() {
  podman image inspect --format '{{.Digest}}' "$1"
}

if ! podman image exists "$name"; then
  root=$(mktemp -d)
  trap 'rm -rf "$root"' EXIT
  echo "debian-base-image: debootstrap bookworm from $mirror" >&2
  debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$root" "$mirror" >&2
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | podman import --change 'CMD ["python"]' - "$name" >/dev/null
fi
echo "${name%%:*}@$(digest_of "$name")"
