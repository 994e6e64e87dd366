"""The archive builder's ONNX export (torchserve_vision/archives/engine_exports.py): a network
with TensorFlow's "SAME" padding (timm's `Conv2dSame`, as the default detector's backbone has)
is exported with the padding its fixed input size gives, so that ONNX Runtime folds each pad into
its convolution, and the model answers as the network does at every batch size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from timm.layers import create_conv2d
from timm.layers.conv2d_same import Conv2dSame
from torch import nn

from torchserve_vision.archives.engine_exports import example_input, export_onnx, with_fixed_same_padding

# Height and width where a stride-2 "SAME" convolution pads unevenly (an even side) and evenly
# (an odd one), so that a wrong side or amount changes the answer.
INPUT_SHAPE = (3, 32, 31)


def same_padded_network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(create_conv2d(3, 8, 3, stride=2, padding="same"), nn.ReLU6(),
                         create_conv2d(8, 8, 3, stride=2, padding="same", groups=8), nn.ReLU6(),
                         nn.Conv2d(8, 4, 1)).eval()


def test_fixed_padding_answers_as_same_padding_at_the_example_size_in_a_copy() -> None:
    network = same_padded_network()
    assert sum(isinstance(module, Conv2dSame) for module in network.modules()) == 2
    fixed = with_fixed_same_padding(network, example_input(INPUT_SHAPE))
    assert not any(isinstance(module, Conv2dSame) for module in fixed.modules())
    assert sum(isinstance(module, Conv2dSame) for module in network.modules()) == 2   # untouched
    batch = torch.rand(3, *INPUT_SHAPE) * 2 - 1
    with torch.no_grad():
        assert torch.equal(fixed(batch), network(batch))


def test_a_network_without_same_padding_is_exported_as_it_is() -> None:
    network = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1)).eval()
    assert with_fixed_same_padding(network, example_input(INPUT_SHAPE)) is network


@pytest.mark.parametrize("batch_size", [1, 3])
def test_the_onnx_model_folds_its_pads_into_the_convolutions_and_answers_as_the_network(
        batch_size: int, tmp_path: Path) -> None:
    network = same_padded_network()
    export_onnx(network, INPUT_SHAPE, tmp_path / "model.onnx", ("logits",))
    options = onnxruntime.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), options,
                                           providers=["CPUExecutionProvider"])
    operations = {node.op_type for node in onnx.load(str(tmp_path / "optimized.onnx")).graph.node}
    assert "Pad" not in operations and "Conv" in operations, operations
    batch = torch.rand(batch_size, *INPUT_SHAPE) * 2 - 1
    (answer,) = session.run(None, {"image": batch.numpy()})
    with torch.no_grad():
        expected = network(batch).numpy()
    assert answer.shape == expected.shape
    # fp32 kernels differ only in summation order
    np.testing.assert_allclose(answer, expected, rtol=1e-5, atol=1e-5)
