"""Single-session baselines: what a user gets from one shared inference session behind a plain
threaded HTTP server, each request run alone on its own thread as it arrives (no queue, no
batching, no bound on what is accepted). Two engines, behind the same server:

- our own engine: the archive's handler path (JPEG bytes to JSON: our decode, preprocessing,
  compiled package), which isolates what the serving layer adds or costs;
- ONNX Runtime: the archive's eager network exported to ONNX, one `InferenceSession`, and the
  preprocessing a user would write with Pillow (decode, resize of the short side, centre crop,
  normalise), what a hand-written server around `session.run` does.

Each is served at a given number of intra-op threads (the handler loaded at that
`torch_threads`, which its engine takes, for ours; the session's `intra_op_num_threads` for ONNX
Runtime): the lab measures both 1 and the number of cores and keeps the best per load.
"""

from __future__ import annotations

import io
import json
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from handlers.model.model_loading import load_labels
from handlers.model.settings import ClassifierSettings
from torchserve_vision.errors import LabError
from torchserve_vision.lab.loadgen import KeepAliveHandler, LabHTTPServer
from torchserve_vision.local_handler import LocalContext, eager_classifier, load_handler

Answer = Callable[[bytes, dict[str, str]], tuple[int, bytes]]


@contextmanager
def threaded_server(answer: Answer) -> Iterator[str]:
    """`answer(body, headers) -> (status, JSON bytes)` behind a threaded HTTP server, every
    request on its own thread as it arrives. Yields the URL to post images to."""

    class Handler(KeepAliveHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status, reply = answer(body, dict(self.headers))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

    server = LabHTTPServer(("127.0.0.1", 0), Handler)
    server.serve_in_background()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/predictions/single"
    finally:
        server.shutdown()
        server.server_close()


def single_session_handler(model_dir: Path, threads: int | None = None) -> Any:
    """The archive's handler at batch 1 as one session: its engine loaded once, at `threads`
    intra-op threads (None: the archive's `torch_threads`). Loaded per thread count, since an
    engine with threads of its own (OpenVINO, ONNX Runtime) fixes them when it loads; no solo
    threads (handlers.model.host_batches), which need a second load."""
    settings: dict[str, Any] = {"solo_threads": None}
    if threads is not None:
        settings["torch_threads"] = threads
    return load_handler(model_dir, batch_size=1, handler_settings=settings)


def engine_answer(handler: Any, model_dir: str) -> Answer:
    """Our handler path for one request (a batch of one), as `handle_batch` runs it."""
    def answer(body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        context = LocalContext(model_dir, {}, {}, request_headers=[headers])
        (reply,) = handler.handle_batch([{"body": bytearray(body)}], context)
        return context.status(0), reply
    return answer


def export_onnx(model_dir: Path, target: Path) -> tuple[ClassifierSettings, list[str]]:
    """The archive's eager fp32 classifier as an ONNX model at `target` (batch 1, opset of
    torch's exporter); returns the archive's settings and class names."""
    settings, network = eager_classifier(model_dir)
    example = torch.zeros(1, 3, settings.input_size, settings.input_size)
    program = torch.onnx.export(network.to(memory_format=torch.contiguous_format), (example,),
                                dynamo=True, input_names=["image"], output_names=["logits"],
                                verbose=False)
    if program is None:
        raise LabError("torch.onnx.export returned no program")
    program.save(str(target))
    return settings, load_labels(model_dir / settings.labels_file)


def pillow_input(body: bytes, settings: ClassifierSettings) -> np.ndarray:
    """A user's preprocessing: Pillow decode, short side resized to `resize_size` (bilinear),
    centre crop `input_size`, scaled to [0, 1] and normalised: float32 [1, 3, S, S]."""
    image = Image.open(io.BytesIO(body)).convert("RGB")
    scale = settings.resize_size / min(image.size)
    image = image.resize((round(image.width * scale), round(image.height * scale)),
                         Image.Resampling.BILINEAR)
    left = (image.width - settings.input_size) // 2
    top = (image.height - settings.input_size) // 2
    image = image.crop((left, top, left + settings.input_size, top + settings.input_size))
    scaled = np.asarray(image, dtype=np.float32) / np.float32(255.0)
    normalised = (scaled - np.array(settings.mean, np.float32)) / np.array(settings.std, np.float32)
    return np.ascontiguousarray(normalised.transpose(2, 0, 1)[None], dtype=np.float32)


def onnx_answer(session: Any, settings: ClassifierSettings, labels: list[str]) -> Answer:
    """One request through the shared ONNX Runtime session: top-k labels and probabilities."""
    def answer(body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        try:
            pixels = pillow_input(body, settings)
        except OSError as error:
            return 400, json.dumps({"error": str(error)}).encode()
        (logits,) = session.run(None, {"image": pixels})
        exponent = np.exp(logits[0] - logits[0].max())
        probabilities = exponent / exponent.sum()
        best = np.argsort(-probabilities)[:settings.top_k]
        return 200, json.dumps([{"label": labels[i], "index": int(i),
                                 "probability": round(float(probabilities[i]), 4)}
                                for i in best]).encode()
    return answer


@contextmanager
def onnx_session(model_dir: Path) -> Iterator[Callable[[int], Answer]]:
    """The archive's network exported to ONNX; yields `answer_with(threads)`, an answer function
    over one shared `InferenceSession` with that many intra-op threads."""
    import onnxruntime  # the lab's optional dependency

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        settings, labels = export_onnx(model_dir, path)

        def answer_with(threads: int) -> Answer:
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            session = onnxruntime.InferenceSession(str(path), options,
                                                   providers=["CPUExecutionProvider"])
            return onnx_answer(session, settings, labels)

        yield answer_with
