"""The archive's OpenVINO and ONNX Runtime models as runners: `float[B, 3, S, S]` torch batch in,
`float[B, C]` logits out (a classifier; `outputs` gives every output of a model that has more:
an SSD's backbone and head, handlers.model.ssd_engine), on the CPU, with the worker's thread count.

Both engines release the GIL while they compute, like the GIL-free AOTInductor package, so a
worker's other threads (decode, the continuous batcher) go on. Neither pins threads to cores:
workers share the machine's cores. The engines are imported only when an archive's order asks
for them.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from handlers.model.openvino_package import openvino_package

logger = logging.getLogger(__name__)

OPENVINO_PRECISION_HINTS = {"fp32": "f32", "bf16": "bf16"}
OPENVINO_CACHE_LOCK = "compile.lock"   # in the cache directory: one worker compiles at a time


def numpy_input(batch: torch.Tensor) -> np.ndarray:
    """A contiguous float32 NCHW array sharing memory with `batch` where it can. A channels-last
    batch is copied by numpy, not torch: a parallel torch copy leaves torch's OpenMP threads
    spinning on the cores the engine's threads are about to use."""
    return np.ascontiguousarray(batch.detach().cpu().float().numpy())


class OpenVinoRunner:
    """An OpenVINO IR (`model.xml` + `model.bin`, converted by the archive builder) compiled for
    the CPU with its float layers at `precision` (fp32 | bf16; an int8 IR's quantized layers
    compute in int8 whatever it is) with `threads` inference threads, latency mode, one stream, no core
    pinning; compiled blobs kept in `cache_dir` (None: no cache) so the next worker starts faster.
    One inference request, behind a lock: a request object is not safe for concurrent use."""

    def __init__(self, path: Path, precision: str, threads: int, cache_dir: Path | None) -> None:
        config = {"INFERENCE_PRECISION_HINT": OPENVINO_PRECISION_HINTS[precision],
                  "INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1,
                  "PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": False}
        self.compiled = compile_openvino_model(path, config, cache_dir)
        self.request = self.compiled.create_infer_request()
        self.lock = threading.Lock()

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        return self.outputs(batch)[0]

    def outputs(self, batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with self.lock:
            result = self.request.infer({0: numpy_input(batch)})
            # The output buffers belong to the request and are overwritten by its next call.
            return tuple(torch.from_numpy(result[index].copy())
                         for index in range(len(self.compiled.outputs)))


def compile_openvino_model(path: Path, config: dict[str, Any], cache_dir: Path | None) -> Any:
    """The IR at `path` compiled for the CPU with `config`, through the model cache in
    `cache_dir` where there is one. The model's workers share that directory, and OpenVINO does
    not guard it across processes: a worker reading a blob that another is still writing fails
    and deletes it, and the writer then fails too. So workers compile one at a time under a lock
    in the directory (the next one loads the blob the first wrote), and a cache that fails
    anyway costs a compile without it, never the runner."""
    core = openvino_core()
    if cache_dir is not None:
        try:
            with exclusive_lock(cache_dir / OPENVINO_CACHE_LOCK):
                return core.compile_model(str(path), "CPU", {**config, "CACHE_DIR": str(cache_dir)})
        except (OSError, RuntimeError) as error:
            logger.warning("OpenVINO's model cache in %s failed (%s): compiling without it",
                           cache_dir, str(error).strip().splitlines()[-1])
    return core.compile_model(str(path), "CPU", config)


@functools.cache
def openvino_core() -> Any:
    """The process's one OpenVINO Core, never released. Its CPU plugin installs an alternate
    signal stack on the thread that loads it and puts back the previous one when it is released;
    Cores released out of order leave a thread pointing at a freed stack, and the next signal
    with a handler (Ctrl-C) crashes the process."""
    return openvino_package().Core()


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold the kernel's exclusive lock on `path` (created if missing), waiting for other
    processes' and threads' holds; released on exit, or by the kernel when the process dies."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class OnnxRuntimeRunner:
    """An ONNX model in one ONNX Runtime session on the CPU provider with `threads` intra-op
    threads (safe for concurrent calls). Its threads stop spinning when a run ends
    (`session.force_spinning_stop`): by default they spin on for a while, and on 2 cores they
    took 41 ms of CPU in the 50 ms after a run of the default detector (ONNX Runtime 1.32, AMD
    EPYC with AVX-512), cores that another worker's batch, begun just after, computes on; the
    run itself is as fast (12.5 ms against 12.7, 2 threads)."""

    def __init__(self, path: Path, threads: int) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.force_spinning_stop", "1")
        options.log_severity_level = 3   # warnings about unused initializers are not the user's
        self.session = onnxruntime.InferenceSession(str(path), options,
                                                    providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        return self.outputs(batch)[0]

    def outputs(self, batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.from_numpy(output)
                     for output in self.session.run(None, {self.input_name: numpy_input(batch)}))


def openvino_cache_dir(model_dir: Path) -> Path | None:
    """`<model dir>/openvino-cache`, shared by the model's workers, or None where it cannot be
    made (a read-only model directory: the model is then compiled at every start)."""
    directory = model_dir / "openvino-cache"
    try:
        directory.mkdir(exist_ok=True)
    except OSError as error:
        logger.info("no OpenVINO model cache (%s): compiling at every worker start", error)
        return None
    return directory
