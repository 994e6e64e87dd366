"""Echo archives: a handler that answers every request with a fixed small JSON body and does no
work, in TorchServe's usual worker mode and in its asynchronous one. Served beside a model, they
time what the server alone costs a request (the frontend, the socket to the worker, the worker's
message handling), which is the floor under any handler's latency on that server."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from torchserve_vision.archives import ARCHIVER

ECHO, ECHO_ASYNC, ECHO_QUEUED = "echo", "echo_async", "echo_queued"
# TorchServe 0.12's AsyncWorkerThread sends the load request and only then makes the latch its
# answer counts down: a worker that answers before that (a handler with nothing to load, on a
# busy machine) fails with a NullPointerException, is retried, and can fail so for minutes (seen
# in a CI run: 0 READY workers in 300 s). Loading the asynchronous echo takes this long instead.
ASYNC_LOAD_DELAY_S = 0.5

ECHO_SOURCE = ("class Echo:\n"
               "    def initialize(self, context):\n"
               "        self.initialized = True\n\n"
               "    def handle(self, data, context):\n"
               "        return [b'{\"echo\": true}' for _ in data]\n")

SOURCES = {
    ECHO: (ECHO_SOURCE, "batchSize: 1\n"),
    # The frontend agent's queued batching, as the project's archives have it (the batch size
    # comes with the registration).
    ECHO_QUEUED: (ECHO_SOURCE, "continuousBatching: true\nclientTimeoutInMills: 0\n"),
    ECHO_ASYNC: ("import time\n\n"
                 f"time.sleep({ASYNC_LOAD_DELAY_S})   # TorchServe 0.12: a worker loaded at once fails\n\n\n"
                 "async def handle(data, context):\n"
                 "    return [b'{\"echo\": true}' for _ in data]\n",
                 "batchSize: 1\nasyncCommunication: true\n"),
}


def build_echo_archive(store: Path, name: str) -> str:
    """`<name>.mar` in `store` (built once): ECHO, ECHO_QUEUED or ECHO_ASYNC."""
    archive = f"{name}.mar"
    if (store / archive).is_file():
        return archive
    handler_source, model_yaml = SOURCES[name]
    with tempfile.TemporaryDirectory() as tmp:
        handler, config = Path(tmp) / f"{name}_handler.py", Path(tmp) / "model-config.yaml"
        handler.write_text(handler_source, encoding="utf-8")
        config.write_text(model_yaml, encoding="utf-8")
        subprocess.run([str(ARCHIVER), "--model-name", name, "--version", "1.0",
                        "--handler", str(handler), "--config-file", str(config),
                        "--export-path", str(store), "--force"], check=True, capture_output=True)
    return archive
