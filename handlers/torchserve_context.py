"""What a handler sees of TorchServe: the context protocol, request headers, TorchServe's own
describe job, the worker's manifest and start-up time. Typed against the small
`TorchServeContext` protocol, not `ts.context.Context`, so tests need no server."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import psutil

from handlers.batch.request_slot import HeaderReader

JSON_CONTENT_TYPE = "application/json"
DESCRIBE_HEADER = "describe"   # TorchServe's `GET /models/{m}?customized=true` sends "True"
# The version that produced an answer (every response carries it: a client, a proxy splitting
# traffic between versions and the shadow comparison can tell which version answered).
MODEL_VERSION_HEADER = "X-Model-Version"
BATCH_SIZE_HEADER = "X-Batch-Size"


def is_describe_request(data: Sequence[Mapping[str, Any]], context: TorchServeContext) -> bool:
    """TorchServe's describe job (`?customized=true`): alone in its batch, no payload, header
    `describe: True`. A client's request that carries the header with an image is predicted as
    usual, and one request's header never decides for a batch of several."""
    return (len(data) == 1 and not any(data[0].values())
            and header_reader(context, 0)(DESCRIBE_HEADER) == "True")


def header_reader(context: TorchServeContext, index: int) -> HeaderReader:
    """Request `index`'s headers by name, in any case: TorchServe hands them over as the client
    spelled them, and HTTP/2 clients and proxies (HAProxy, Envoy) send them in lower case."""
    headers = {name.lower(): value for name, value in context.get_all_request_header(index).items()}
    return lambda name: headers.get(name.lower())


def required_serialized_file(serialized_file: str | None) -> str:
    """The manifest's serialized file name; ValueError for an archive built without one."""
    if serialized_file is None:
        raise ValueError("the archive has no serialized model file (--serialized-file)")
    return serialized_file


def worker_process_age_ms() -> float:
    """Milliseconds since this process started: a worker's start-up time when it is ready
    (Python and torch imports, model load, warm-up; for a worker forked by torchserve-vision's
    fork server, from the fork: the imports were done before)."""
    return (time.time() - psutil.Process().create_time()) * 1000


# A worker forked by torchserve-vision's worker fork server is the fork server's child, not the
# frontend's: the fork server names the frontend's pid here.
FRONTEND_PID_VARIABLE = "TSV_FRONTEND_PID"


def frontend_process() -> psutil.Process | None:
    """The TorchServe frontend that started this worker: the process FRONTEND_PID_VARIABLE names,
    or else this process's parent."""
    named = os.environ.get(FRONTEND_PID_VARIABLE, "")
    return psutil.Process(int(named)) if named.isdigit() else psutil.Process().parent()


def frontend_identity() -> dict[str, Any] | None:
    """The TorchServe frontend this worker belongs to (the process that started it): its pid and
    start time (UTC, ISO 8601), which together name one life of one server; None if unreadable."""
    try:
        frontend = frontend_process()
        if frontend is None:
            return None
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(frontend.create_time()))
    except psutil.Error:
        return None
    return {"pid": frontend.pid, "started": started}


AGENT_JAR_PREFIX = "frontend-agent-"   # torchserve_vision.frontend.agent names its jar so


def frontend_runs_agent() -> bool | None:
    """Whether the TorchServe frontend that started this worker loaded the project's frontend
    agent (a `-javaagent:` option naming its jar on the frontend's command line); None when the
    command line cannot be read."""
    try:
        frontend = frontend_process()
        arguments = frontend.cmdline() if frontend is not None else None
    except psutil.Error:
        return None
    if arguments is None:
        return None
    return any(argument.startswith("-javaagent:") and AGENT_JAR_PREFIX in argument
               for argument in arguments)


def batching_account(model_yaml_config: dict[str, Any] | None) -> dict[str, Any]:
    """How this model's batches are gathered: what the archive asks for (`queued`: the YAML's
    `continuousBatching`, for the frontend agent; else TorchServe's own `delayed`), whether the
    frontend runs the agent, and so what actually gathers them."""
    asked = "queued" if (model_yaml_config or {}).get("continuousBatching") else "delayed"
    agent = frontend_runs_agent()
    if asked == "delayed":
        gathered_by = "TorchServe's batch aggregator (waits up to maxBatchDelay)"
    elif agent:
        gathered_by = "the frontend agent's queued batching"
    elif agent is None:
        gathered_by = "unknown: the frontend's command line could not be read"
    else:
        gathered_by = ("TorchServe's own ContinuousBatching (waits up to maxBatchDelay): the frontend "
                       "agent is not loaded")
    return {"asked": asked, "frontend_agent": agent, "gathered_by": gathered_by}


class TorchServeContext(Protocol):
    """The parts of `ts.context.Context` the handlers use."""

    manifest: dict[str, Any]
    model_yaml_config: dict[str, Any] | None
    metrics: Any     # TorchServe's metrics cache (ts.metrics.metric_cache_abstract); None in tests

    @property
    def system_properties(self) -> dict[str, Any]: ...

    def get_all_request_header(self, idx: int) -> dict[str, str]: ...

    def set_response_status(self, code: int = 200, phrase: str = "", idx: int = 0) -> None: ...

    def set_response_content_type(self, idx: int, value: str) -> None: ...

    def set_response_header(self, idx: int, key: str, value: str) -> None: ...
