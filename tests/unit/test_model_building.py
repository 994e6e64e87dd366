"""How a network is built: in a worker, from the archive's state dict without initialising it
first (meta device); in the builder, with its in-place activations made out-of-place for export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from handlers.model import model_loading
from handlers.model.model_loading import ModelSource, built_from_state_dict, load_state_dict_model
from torchserve_vision.archives.compile_ahead import without_inplace_activations

SOURCES = [ModelSource("timm", "test_efficientnet", 10),
           ModelSource("torchvision", "ssdlite320_mobilenet_v3_large", 3,
                       {"score_thresh": 0.0, "detections_per_img": 20})]


def saved_network(source: ModelSource, path: Path) -> nn.Module:
    torch.manual_seed(0)
    network = model_loading.create_architecture(source).eval()
    torch.save(network.state_dict(), path)
    return network


@pytest.mark.parametrize("source", SOURCES, ids=lambda source: source.architecture)
def test_a_network_built_on_the_meta_device_holds_the_archives_tensors_and_answers_alike(source, tmp_path):
    original = saved_network(source, tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    built = built_from_state_dict(source, state)
    assert built is not None
    assert not any(tensor.is_meta for tensor in [*built.parameters(), *built.buffers()])
    loaded = load_state_dict_model(source, tmp_path / "model.pt").eval()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, original.state_dict()[name]), name
    image = torch.rand(3, 64, 80) if source.architecture.startswith("ssd") else torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        expected = original([image] if image.dim() == 3 else image)
        answered = loaded([image] if image.dim() == 3 else image)
    if isinstance(expected, list):
        assert torch.equal(expected[0]["scores"], answered[0]["scores"])
        assert torch.equal(expected[0]["boxes"], answered[0]["boxes"])
    else:
        assert torch.equal(expected, answered)


class WithUnsavedBuffer(nn.Module):
    """A network whose constructor computes a buffer the state dict does not hold."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.register_buffer("offset", torch.arange(2.0), persistent=False)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.linear(batch) + self.offset


def test_a_network_keeping_a_tensor_its_state_dict_lacks_is_built_and_initialised_as_before(
        tmp_path, monkeypatch):
    monkeypatch.setattr(model_loading, "create_architecture", lambda source: WithUnsavedBuffer())
    torch.manual_seed(0)
    original = WithUnsavedBuffer()
    torch.save(original.state_dict(), tmp_path / "model.pt")
    source = ModelSource("timm", "unsaved-buffer", None)
    assert built_from_state_dict(source, torch.load(tmp_path / "model.pt", weights_only=True)) is None
    loaded = load_state_dict_model(source, tmp_path / "model.pt")
    assert torch.equal(loaded.get_buffer("offset"), torch.arange(2.0))
    batch = torch.rand(3, 4)
    assert torch.equal(loaded(batch), original(batch))


def test_export_sees_no_in_place_activation_and_the_answers_stay_the_same():
    torch.manual_seed(0)
    network = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU6(inplace=True), nn.Conv2d(4, 4, 3),
                            nn.Hardswish(inplace=True), nn.Dropout(0.1)).eval()
    batch = torch.rand(2, 3, 16, 16)
    with torch.no_grad():
        before = network(batch)
        after = without_inplace_activations(network)(batch)
    assert torch.equal(before, after)
    assert [module.inplace for module in network.modules() if hasattr(module, "inplace")] == [False] * 3
