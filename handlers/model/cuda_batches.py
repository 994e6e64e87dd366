"""How a CUDA worker's classifier runs its batches (a CPU worker never comes here): batches padded
to a few bucket sizes (the powers of two up to the worker's batch size, and that size), so that
warm-up covers every shape the queue can produce and each shape's kernels are chosen once; and,
behind the archive's `cuda_graphs`, one CUDA graph per bucket, captured at warm-up into one
memory pool and replayed on a static input, so that a batch is one launch from the host instead
of one per layer.

Padding rows are zeros; each image's answer is its own row (a convolution may pick another
algorithm for another batch size: answers move within the bounds of docs/precision.md, not bit
for bit). The CUDA calls go through `GraphBackend`, so the bucketing and graph bookkeeping run
on the CPU in the tests with a stand-in that replays the forward itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor], torch.Tensor]


def bucket_sizes(max_batch: int) -> tuple[int, ...]:
    """The powers of two below `max_batch`, and `max_batch`: 1, 2, 4, ..., max_batch."""
    if max_batch < 1:
        raise ValueError(f"a batch holds at least one image, got max_batch={max_batch}")
    sizes = []
    size = 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return (*sizes, max_batch)


def bucket_of(count: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds `count` images; ValueError past the largest."""
    for size in buckets:
        if count <= size:
            return size
    raise ValueError(f"{count} images in one batch; at most {buckets[-1]}")


class Replay(Protocol):
    def replay(self) -> None: ...


class GraphBackend(Protocol):
    """Captures `forward(static_input)` as a graph into this backend's one memory pool; returns
    the graph and the static output its replays write."""

    def capture(self, forward: Forward, static_input: torch.Tensor) -> tuple[Replay, torch.Tensor]: ...


class CudaGraphs:
    """torch.cuda's graphs, every bucket's in one memory pool (the buckets never run at once)."""

    def __init__(self, device: torch.device, warm_up_runs: int = 3) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.warm_up_runs = warm_up_runs

    def capture(self, forward: Forward, static_input: torch.Tensor) -> tuple[Replay, torch.Tensor]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):      # kernels chosen and memory cached before capture
            for _ in range(self.warm_up_runs):
                forward(static_input)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static_output = forward(static_input)
        return graph, static_output


@dataclass
class _Captured:
    graph: Replay
    static_input: torch.Tensor
    static_output: torch.Tensor


class BucketedRunner:
    """`forward` over `[n, *sample_shape]` batches of `dtype` on `device`: the batch padded with
    zero rows to its bucket, then `forward` (or the bucket's graph, with `graphs`); the first n
    rows of the output, which stay valid after the next call. A batch over `max_batch` runs in
    chunks of `max_batch`."""

    def __init__(self, forward: Forward, max_batch: int, sample_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, graphs: GraphBackend | None = None,
                 memory_format: torch.memory_format = torch.contiguous_format) -> None:
        self.forward = forward
        self.buckets = bucket_sizes(max_batch)
        self.sample_shape = sample_shape
        self.dtype, self.device, self.memory_format = dtype, device, memory_format
        self.graphs = graphs
        self.captured: dict[int, _Captured] = {}

    def zeros(self, count: int) -> torch.Tensor:
        return torch.zeros((count, *self.sample_shape), dtype=self.dtype, device=self.device).contiguous(
            memory_format=self.memory_format)

    def warm_up(self) -> None:
        """Run (or, with graphs, capture) every bucket once, largest first: no request pays a
        first call, and the memory pool is sized by the largest bucket."""
        for size in reversed(self.buckets):
            if self.graphs is None:
                self.forward(self.zeros(size))
            elif size not in self.captured:
                static_input = self.zeros(size)
                graph, static_output = self.graphs.capture(self.forward, static_input)
                self.captured[size] = _Captured(graph, static_input, static_output)

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        count = batch.shape[0]
        if count > self.buckets[-1]:       # more than warm-up covered: in chunks of the largest
            return torch.cat([self(part) for part in batch.split(self.buckets[-1])])
        size = bucket_of(count, self.buckets)
        if self.graphs is not None:
            if size not in self.captured:
                raise RuntimeError(f"no graph for a batch of {size}: call warm_up first")
            captured = self.captured[size]
            captured.static_input[:count].copy_(batch)
            captured.static_input[count:].zero_()
            captured.graph.replay()
            return captured.static_output[:count].clone()
        if count == size:
            return self.forward(batch)
        padded = torch.cat([batch.to(self.dtype), self.zeros(size - count)]).contiguous(
            memory_format=self.memory_format)
        return self.forward(padded)[:count]


def half_weights_dtype(device: torch.device, precision: str, enabled: bool = True) -> torch.dtype | None:
    """The dtype a CUDA worker's weights and input take for `precision` (fp16, bf16), instead of
    autocast over float32 weights, which casts every weight again at every forward; None
    elsewhere (a CPU worker, fp32 / tf32, or the archive's `cuda_half_weights: false`)."""
    if device.type != "cuda" or not enabled:
        return None
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)


def batch_norm_folded(network: nn.Module, device: torch.device, enabled: bool = True) -> nn.Module:
    """On a CUDA worker (and the archive's `cuda_fold_batch_norm`), `network` with each eval-mode
    BatchNorm2d that follows a Conv2d folded into the convolution's weights and bias, by
    torch.fx's conv-bn fusion (a traced copy: ResNet-50's 53 normalisation kernels per batch
    gone); the network itself elsewhere, or where it cannot be traced. The answers move by float
    rounding only (tests/unit/test_cuda_batches.py)."""
    if device.type != "cuda" or not enabled:
        return network
    from torch.fx.experimental.optimization import fuse

    try:
        return fuse(network)
    except Exception as error:   # noqa: BLE001 - an untraceable network serves unfolded
        logger.info("batch norm not folded: %s cannot be traced (%s)", type(network).__name__, error)
        return network


def graph_backend(device: torch.device, enabled: bool) -> Any:
    """`CudaGraphs` for a CUDA worker whose archive asks for graphs, else None."""
    return CudaGraphs(device) if enabled and device.type == "cuda" else None
