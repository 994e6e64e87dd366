"""handlers.model.cuda_batches on the CPU: buckets, padding and the graph bookkeeping, with a
stand-in for torch.cuda's graphs that replays the forward on its static input (the real ones run
in tests/gpu). A CPU worker never uses this module; the classifier's own CPU path is unchanged."""

from __future__ import annotations

import pytest
import torch

from handlers.model.cuda_batches import (
    BucketedRunner,
    batch_norm_folded,
    bucket_of,
    bucket_sizes,
    half_weights_dtype,
)


def test_buckets_are_the_powers_of_two_up_to_the_batch_size():
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(8) == (1, 2, 4, 8)
    assert bucket_sizes(12) == (1, 2, 4, 8, 12)
    assert [bucket_of(count, bucket_sizes(12)) for count in (1, 2, 3, 5, 8, 9, 12)] == [1, 2, 4, 8, 8, 12, 12]
    with pytest.raises(ValueError, match="at most 12"):
        bucket_of(13, bucket_sizes(12))
    with pytest.raises(ValueError):
        bucket_sizes(0)


class Recorded:
    """A per-row forward (each output row from its own input row) that records the batch sizes
    it was given."""

    def __init__(self) -> None:
        self.weight = torch.arange(1.0, 13.0).view(3, 4)
        self.sizes: list[int] = []

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        self.sizes.append(batch.shape[0])
        return batch.flatten(2).mean(-1) @ self.weight


class FakeGraph:
    def __init__(self, forward, static_input: torch.Tensor, static_output: torch.Tensor) -> None:
        self.forward, self.static_input, self.static_output = forward, static_input, static_output
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.static_output.copy_(self.forward(self.static_input))


class FakeGraphs:
    """Captures as torch.cuda's graphs do, from the caller's point of view: the forward runs once
    on the static input at capture, and each replay writes the static output again."""

    def __init__(self) -> None:
        self.captured: list[FakeGraph] = []

    def capture(self, forward, static_input):
        graph = FakeGraph(forward, static_input, forward(static_input))
        self.captured.append(graph)
        return graph, graph.static_output


def batch_of(count: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(count, 3, 5, 5, generator=torch.Generator().manual_seed(seed))


def test_a_batch_runs_padded_to_its_bucket_and_each_image_keeps_its_own_row():
    forward = Recorded()
    runner = BucketedRunner(forward, 8, (3, 5, 5), torch.float32, torch.device("cpu"))
    runner.warm_up()
    assert sorted(forward.sizes) == [1, 2, 4, 8]
    for count in (1, 3, 5, 8):
        batch = batch_of(count, seed=count)
        got = runner(batch)
        assert forward.sizes[-1] == bucket_of(count, runner.buckets)
        assert got.shape == (count, 4)
        torch.testing.assert_close(got, forward(batch))      # padding rows change nothing here


def test_with_graphs_each_bucket_is_captured_once_and_replayed_on_its_static_input():
    forward, graphs = Recorded(), FakeGraphs()
    runner = BucketedRunner(forward, 8, (3, 5, 5), torch.float32, torch.device("cpu"), graphs)
    with pytest.raises(RuntimeError, match="warm_up"):
        runner(batch_of(2))
    runner.warm_up()
    runner.warm_up()                                          # captured once
    assert [graph.static_input.shape[0] for graph in graphs.captured] == [8, 4, 2, 1]
    first = runner(batch_of(3, seed=1))
    kept = first.clone()
    second = runner(batch_of(4, seed=2))                     # the same bucket, replayed again
    by_size = {graph.static_input.shape[0]: graph for graph in graphs.captured}
    assert by_size[4].replays == 2
    assert torch.equal(first, kept)                            # an answer outlives the next replay
    torch.testing.assert_close(first, forward(batch_of(3, seed=1)))
    torch.testing.assert_close(second, forward(batch_of(4, seed=2)))
    assert torch.count_nonzero(by_size[4].static_input[4:]) == 0   # padding rows are zeros


def test_a_smaller_batch_after_a_larger_one_leaves_no_rows_of_it_in_the_padding():
    forward, graphs = Recorded(), FakeGraphs()
    runner = BucketedRunner(forward, 8, (3, 5, 5), torch.float32, torch.device("cpu"), graphs)
    runner.warm_up()
    runner(batch_of(8, seed=5))
    runner(batch_of(5, seed=6))
    by_size = {graph.static_input.shape[0]: graph for graph in graphs.captured}
    assert torch.count_nonzero(by_size[8].static_input[5:]) == 0


def test_only_a_cuda_worker_takes_half_weights():
    cuda = torch.device("cuda", 0)
    assert half_weights_dtype(cuda, "fp16") is torch.float16
    assert half_weights_dtype(cuda, "bf16") is torch.bfloat16
    assert half_weights_dtype(cuda, "fp32") is None and half_weights_dtype(cuda, "tf32") is None
    assert half_weights_dtype(torch.device("cpu"), "bf16") is None
    assert half_weights_dtype(cuda, "fp16", enabled=False) is None      # cuda_half_weights: false


def test_a_batch_over_the_largest_bucket_runs_in_chunks_of_it():
    forward, graphs = Recorded(), FakeGraphs()
    runner = BucketedRunner(forward, 4, (3, 5, 5), torch.float32, torch.device("cpu"), graphs)
    runner.warm_up()
    batch = batch_of(11, seed=3)
    torch.testing.assert_close(runner(batch), forward(batch))
    by_size = {graph.static_input.shape[0]: graph for graph in graphs.captured}
    assert (by_size[4].replays, by_size[2].replays, by_size[1].replays) == (3, 0, 0)   # 4 + 4 + 3


def test_a_cuda_workers_batch_norms_are_folded_into_its_convolutions_and_answers_move_by_rounding():
    """Folding runs on the module (torch.fx), so the CPU's tensors show it; a CUDA worker is told
    by its device, which is all the function reads of it."""
    import torchvision

    torch.manual_seed(0)
    network = torchvision.models.resnet18(num_classes=10).eval()
    with torch.no_grad():
        for module in network.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                assert module.running_mean is not None and module.running_var is not None
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.2, 0.2)
    folded = batch_norm_folded(network, torch.device("cuda", 0))
    assert not any(isinstance(module, torch.nn.BatchNorm2d) for module in folded.modules())
    assert sum(isinstance(module, torch.nn.BatchNorm2d) for module in network.modules()) == 20  # untouched
    images = torch.randn(3, 3, 64, 64)
    with torch.inference_mode():
        expected, got = network(images), folded(images)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert batch_norm_folded(network, torch.device("cpu")) is network          # a CPU worker: as loaded
    assert batch_norm_folded(network, torch.device("cuda", 0), enabled=False) is network


def test_a_network_torch_fx_cannot_trace_serves_unfolded():
    class DataDependent(torch.nn.Module):
        def forward(self, images: torch.Tensor) -> torch.Tensor:
            return images * 2 if images.sum() > 0 else images

    network = DataDependent()
    assert batch_norm_folded(network, torch.device("cuda", 0)) is network
