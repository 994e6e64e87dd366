"""OpenVINO's Python package, imported with its usage telemetry off.

Unless the user opted out (a consent file in their home directory), `import openvino` and each
model conversion (`openvino.convert_model`), NNCF's quantization included, post usage events to
Google Analytics through the `openvino_telemetry` package: each event forks the process that sends
it (a worker or a build, gigabytes of mappings to copy) and waits up to 3 s for the post. Over the
test suite that was 352 forks of the test processes alone. A server and its builds send nothing
anywhere, so every import of OpenVINO in this project goes through `openvino_package`: OpenVINO's
and NNCF's tools fall back to their own no-op telemetry when `openvino_telemetry` cannot be
imported, which this arranges (None in `sys.modules` makes an import raise ImportError).

Where `openvino_telemetry` was imported before (by other code in the process), it is left as is.
"""

from __future__ import annotations

import sys
from types import ModuleType

TELEMETRY_MODULE = "openvino_telemetry"


def block_openvino_telemetry() -> None:
    """Make `import openvino_telemetry` fail in this process, unless it was imported already."""
    if TELEMETRY_MODULE not in sys.modules:
        sys.modules[TELEMETRY_MODULE] = None  # type: ignore[assignment]


def openvino_package() -> ModuleType:
    """The `openvino` module, its telemetry blocked first (block_openvino_telemetry)."""
    block_openvino_telemetry()
    import openvino

    return openvino
