"""`server run --log-to json`: every line on standard output a JSON object.

TorchServe's own logs are JSON lines by their log4j2 config (config/log4j2-json.xml); what else
TorchServe prints (its launcher's and the JVM's console lines, such as "Model server started.")
and `server run`'s own lines are wrapped here into objects of the same shape: "time" (ISO 8601
with the offset), "log", "level", "message". TorchServe's output then reaches standard output
through a pipe that a thread of `server run` copies line by line (`json_line_relay`).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from datetime import datetime


def json_log_line(message: str, log: str, level: str = "INFO") -> str:
    """One JSON object, shaped like config/log4j2-json.xml's lines."""
    return json.dumps({"time": datetime.now().astimezone().isoformat(timespec="milliseconds"),
                       "log": log, "level": level, "message": message})


def as_json_line(line: str) -> str:
    """`line` itself when it is a JSON object already, else wrapped as one (log "console")."""
    if line.startswith("{"):
        try:
            if isinstance(json.loads(line), dict):
                return line
        except ValueError:
            pass
    return json_log_line(line, "console")


def json_line_relay() -> int:
    """The write end of a pipe (a file descriptor to hand a child as its standard output and
    close here): a daemon thread copies each line written to it to this process's standard
    output as `as_json_line` makes it, until every writer has closed it."""
    read_end, write_end = os.pipe()

    def relay() -> None:
        with open(read_end, "rb") as lines:
            for raw in lines:
                text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if text:
                    sys.stdout.write(as_json_line(text) + "\n")
                    sys.stdout.flush()

    threading.Thread(target=relay, name="json-log-relay", daemon=True).start()
    return write_end
