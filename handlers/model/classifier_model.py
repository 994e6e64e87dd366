"""One classification network ready to serve on a device: its settings, class names and runner
(the first of the archive's compiled models that may run here and passes its check, else the
eager network: handlers.model.runner_selection).

Used by the image classifier and by the pipelines (a cascade holds two, detect-then-classify
one), so every classifier is prepared, preprocessed and warmed up the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torchvision.transforms.v2 import functional as F

from handlers.model import model_loading
from handlers.model.compiled_model import EagerModel, MachineTarget, Runner
from handlers.model.cuda_batches import BucketedRunner, batch_norm_folded, graph_backend, half_weights_dtype
from handlers.model.host_batches import loads_of
from handlers.model.model_loading import autocast, load_for_serving
from handlers.model.runner_selection import EAGER, RunnerChoice, choose_runner
from handlers.model.settings import ClassifierSettings
from handlers.task import resize_kernels
from handlers.task.transforms import preprocess_classification_batch


class ClassifierModel:
    """`labels`, `precision` (what the worker runs here), `runner` (the compiled model it loaded,
    or eager, and what was refused), `network` (eager, on `device`), `run` (what serves)."""

    def __init__(self, settings: ClassifierSettings, model_dir: Path, serialized_file: str,
                 device: torch.device) -> None:
        self.settings = settings
        self.device = device
        self.labels, self.precision, self.network = load_for_serving(settings, model_dir,
                                                                     serialized_file, device)
        # On CUDA, batch norms folded into the convolutions, and fp16 / bf16 weights and input
        # instead of autocast over float32 weights (handlers.model.cuda_batches); on a CPU the
        # network as loaded, with autocast.
        self.network = batch_norm_folded(self.network, device, settings.cuda_fold_batch_norm)
        self.weights_dtype = half_weights_dtype(device, self.precision, settings.cuda_half_weights)
        if self.weights_dtype is not None:
            self.network = self.network.to(self.weights_dtype)
        self.input_dtype = self.weights_dtype or torch.float32
        # The resize, crop and normalisation as Triton kernels (CUDA, and the archive's
        # `cuda_preprocess_kernels`); tensor operations elsewhere.
        self.preprocess_kernels = device.type == "cuda" and settings.cuda_preprocess_kernels
        if settings.channels_last:
            self.network = self.network.to(memory_format=torch.channels_last)
        timeout_s = settings.compile.load_timeout_s if settings.compile else 0.0
        self.run: Runner
        self.runner: RunnerChoice
        eager = EagerModel(serve=self.eager_forward, fp32=self.network,
                           model_input=lambda photos: self.crops_input(photos.float()))
        native_bf16 = device.type == "cpu" and model_loading.cpu_has_native_bf16()
        self.channels_last_input = settings.channels_last
        self.run, self.runner = choose_runner(
            settings.archive_runners, model_dir, MachineTarget.here(device, self.precision),
            native_bf16, eager, timeout_s, torch.get_num_threads(), settings.solo_threads)
        # The other engines read plain NCHW: a channels-last batch would be converted back.
        self.channels_last_input = settings.channels_last and self.runner.computes_in_torch

    def eager_forward(self, batch: torch.Tensor) -> torch.Tensor:
        with autocast(self.device, "fp32" if self.weights_dtype is not None else self.precision):
            return self.network(batch)

    def model_input(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        """`uint8[3, H_i, W_i]` images -> the normalized batch: short side to `resize_size`,
        centre crop `input_size`, in the network's memory format."""
        settings = self.settings
        batch = preprocess_classification_batch(images, settings.resize_size, settings.input_size,
                                                settings.mean, settings.std, self.device, self.input_dtype,
                                                kernels=self.preprocess_kernels, resize=settings.resize)
        return self.in_memory_format(batch)

    def crops_input(self, crops: torch.Tensor) -> torch.Tensor:
        """`float[N, 3, S, S]` crops at `input_size` with values 0..255 (e.g. from roi_align over
        uint8 images) -> the normalized batch (no resize or crop)."""
        batch = F.normalize(crops / 255.0, list(self.settings.mean), list(self.settings.std))
        return self.in_memory_format(batch.to(self.input_dtype))

    def in_memory_format(self, batch: torch.Tensor) -> torch.Tensor:
        if self.channels_last_input:
            return batch.contiguous(memory_format=torch.channels_last)
        return batch

    def logits(self, batch: torch.Tensor) -> torch.Tensor:
        """`float[B, C]` for the normalized batch (any B: compiled packages run it in chunks): the
        network's output, logits or (`output: probabilities`) probabilities."""
        return self.run(batch)

    def probabilities(self, output: torch.Tensor) -> torch.Tensor:
        """The network's `float[B, C]` output as float32 probabilities: the softmax of logits, or
        what a network ending in its own softmax returned (`output: probabilities`)."""
        if self.settings.output == "probabilities":
            return output.float()
        return torch.softmax(output.float(), dim=1)

    def warm_up(self, batch_size: int) -> None:
        """Run batch 1 and `batch_size` (the compiled package's dynamic dimension at both ends).
        A CUDA worker's eager network runs its batches in buckets from here on (and, with the
        archive's `cuda_graphs`, replays a graph per bucket): each bucket is run, or captured,
        now (handlers.model.cuda_batches). The preprocessing kernels, where they serve, are
        compiled first (handlers.task.resize_kernels.warm_up)."""
        size = self.settings.input_size
        if self.preprocess_kernels:
            resize_kernels.warm_up(self.device, self.input_dtype)
        with torch.inference_mode():
            if self.device.type == "cuda" and self.runner.runner == EAGER:
                self.run = self.bucketed(batch_size)
                self.run.warm_up()
                return
            for run in loads_of(self.run):
                for count in sorted({1, batch_size}):
                    run(self.in_memory_format(torch.zeros(count, 3, size, size, device=self.device)))

    def bucketed(self, batch_size: int) -> BucketedRunner:
        size = self.settings.input_size
        memory_format = torch.channels_last if self.channels_last_input else torch.contiguous_format
        return BucketedRunner(self.eager_forward, batch_size, (3, size, size), self.input_dtype, self.device,
                              graph_backend(self.device, self.settings.cuda_graphs), memory_format)
