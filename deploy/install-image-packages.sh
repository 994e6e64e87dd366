#!/bin/sh
# The image's Python packages, into the virtual environment VENV, for TARGET (cpu or gpu); run by
# deploy/Dockerfile in the directory that holds pyproject.toml and deploy/requirements-*.lock.
#
#   sh install-image-packages.sh VENV TARGET [TORCH_INDEX_URL]
#
# Every package comes hash-checked from a lock, with --no-deps (nothing is resolved here):
# - gpu: requirements-gpu.lock: PyPI's torch and torchvision (CUDA builds) with the NVIDIA
#   libraries they load.
# - cpu: requirements-cpu.lock (the same without torch, torchvision and CUDA's packages), then
#   torch and torchvision at pyproject.toml's versions, as CPU builds (`+cpu`), from
#   TORCH_INDEX_URL (the PyTorch CPU wheel index; not hash-checked). Where that index cannot be
#   reached (a build that reaches only PyPI or a mirror of it), or TORCH_INDEX_URL is empty,
#   requirements-gpu.lock instead: the CUDA builds run on a CPU, and the image grows from about
#   2.5 to about 7 GB.
# pip's settings (index, certificates) are pip's own: PIP_CONFIG_FILE, PIP_* variables.
set -eu

venv=$1
target=$2
torch_index=${3:-}
pip="$venv/bin/pip"

locked() {
  "$pip" install --no-cache-dir --require-hashes --no-deps -r "$1"
}

# torch==X+cpu torchvision==Y+cpu, at pyproject.toml's versions: a local version that only the CPU
# index has, so that no other index pip is configured with can hand over a CUDA build without its
# libraries.
cpu_builds() {
  "$venv/bin/python" - <<'EOF'
import tomllib
dependencies = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(" ".join(f"{pin}+cpu" for pin in dependencies if pin.split("==")[0] in ("torch", "torchvision")))
EOF
}

case "$target" in
  gpu)
    locked requirements-gpu.lock ;;
  cpu)
    locked requirements-cpu.lock
    # shellcheck disable=SC2046  # one word per pin
    if [ -n "$torch_index" ] \
       && "$pip" install --no-cache-dir --no-deps --retries 1 --timeout 30 \
            --index-url "$torch_index" $(cpu_builds); then
      echo "install-image-packages: torch and torchvision: CPU builds from $torch_index"
    else
      echo "install-image-packages: the PyTorch CPU index (${torch_index:-none given}) cannot be" \
           "reached: torch and torchvision from PyPI with their CUDA libraries, hash-checked" \
           "(requirements-gpu.lock; an image of about 7 GB)"
      locked requirements-gpu.lock
    fi ;;
  *)
    echo "install-image-packages: TARGET must be cpu or gpu, not '$target'" >&2
    exit 2 ;;
esac
