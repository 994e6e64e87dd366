"""An ONNX model file served as the whole network (an Ultralytics ONNX export): ONNX Runtime runs
it, called like a torch module on a float32 batch and returning torch tensors.

The session runs on the CPU with the worker's torch threads, or on its GPU through ONNX Runtime's
CUDA provider where the installed ONNX Runtime has one (the `onnxruntime-gpu` package; the
project pins the CPU package, so a CUDA worker runs an ONNX export on its host's CPU and says
so: export TorchScript for GPU workers, docs/requests.md). A model whose batch dimension is fixed
(Ultralytics exports with `dynamic=False`, its default, have batch 1) is run in chunks of that
size, the last one padded with zeros.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

logger = logging.getLogger(__name__)
CUDA_PROVIDER = "CUDAExecutionProvider"


class OnnxProgram(nn.Module):
    """`program(batch)`: the model's first output for `float32[B, ...]` (any B), as a tensor on
    the batch's device. A module without parameters (moving it moves nothing); `device`: where
    the session computes (the CPU unless a CUDA provider is installed and the worker has a GPU)."""

    def __init__(self, path: Path, device: torch.device, threads: int) -> None:
        import onnxruntime

        super().__init__()

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        providers: list[Any] = ["CPUExecutionProvider"]
        self.device = torch.device("cpu")
        if device.type == "cuda":
            if CUDA_PROVIDER in onnxruntime.get_available_providers():
                providers = [(CUDA_PROVIDER, {"device_id": device.index or 0}), "CPUExecutionProvider"]
                self.device = device
            else:
                logger.warning("onnx: ONNX Runtime here has no %s: the ONNX export runs on the CPU of "
                               "this GPU worker (install onnxruntime-gpu, or serve a TorchScript export)",
                               CUDA_PROVIDER)
        self.session = onnxruntime.InferenceSession(str(path), options, providers=providers)
        model_input = self.session.get_inputs()[0]
        self.input_name = model_input.name
        self.input_shape: list[Any] = list(model_input.shape)
        batch = self.input_shape[0] if self.input_shape else None
        self.fixed_batch = batch if isinstance(batch, int) and batch > 0 else None

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        images = batch.detach().to("cpu", torch.float32).contiguous().numpy()
        if self.fixed_batch is None:
            output = self._run(images)
        else:
            output = np.concatenate([self._run(chunk)[: len(chunk)]
                                     for chunk in np.array_split(images, range(self.fixed_batch, len(images),
                                                                              self.fixed_batch))])
        return torch.from_numpy(output).to(batch.device)

    def _run(self, images: np.ndarray) -> np.ndarray:
        size = self.fixed_batch
        if size is not None and len(images) < size:
            padding = np.zeros((size - len(images), *images.shape[1:]), dtype=images.dtype)
            images = np.concatenate([images, padding])
        return np.asarray(self.session.run(None, {self.input_name: images})[0])
