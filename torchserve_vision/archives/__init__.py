"""Building and versioning model archives."""

from __future__ import annotations

import sys
from pathlib import Path

# The real torch-model-archiver, installed beside the Python that runs the command.
ARCHIVER = Path(sys.executable).with_name("torch-model-archiver")
