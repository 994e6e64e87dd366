"""Building and versioning model archives."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

# The real torch-model-archiver, installed beside the Python that runs the command.
ARCHIVER = Path(sys.executable).with_name("torch-model-archiver")

# The workers an archive is built for: `cpu` archives carry the ahead-of-time compiled CPU
# packages of a classifier's `compile:` (any worker can serve them: GPU workers run the eager
# network); `gpu` archives leave them out, since GPU workers refuse every CPU package (the GPU
# image's build, which then needs no C++ compiler and takes minutes less).
BuildTarget = Literal["cpu", "gpu"]
BUILD_TARGETS: tuple[BuildTarget, ...] = ("cpu", "gpu")
