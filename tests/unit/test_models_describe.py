"""`torchserve-vision models describe --handler`: a worker's account of its runners, as printed."""

from __future__ import annotations

from torchserve_vision.cli.models import describe_lines

SERVED = {"modelName": "efficientnet_lite0", "modelVersion": "1.0", "modelUrl": "efficientnet_lite0-1.0.mar",
          "batchSize": 8, "maxBatchDelay": 0, "minWorkers": 2, "maxWorkers": 2, "responseTimeout": 60,
          "jobQueueStatus": {}, "workers": []}


def test_the_runner_that_serves_and_each_refused_one_are_printed():
    description = {**SERVED,
        "customizedMetadata": {"device": "cpu", "precision": "bf16", "runners": {"classifier": {
            "runner": "onnxruntime-fp32", "precision": "fp32", "file": "compiled/model.onnx",
            "cpu_kind": "avx512_bf16",
            "refused": [{"runner": "openvino-bf16", "reason": "load_failed",
                         "message": "loading failed: RuntimeError: truncated weights"}]}}}}
    lines = describe_lines(description)
    assert "    classifier: onnxruntime-fp32 (compiled/model.onnx, avx512_bf16 order)" in lines
    assert ("      refused openvino-bf16 (load_failed): loading failed: RuntimeError: truncated weights"
            in lines)


def test_an_eager_network_says_no_compiled_model_serves():
    description = {**SERVED, "customizedMetadata": {
        "device": "cpu", "precision": "fp32", "runners": {"classifier": {"runner": "eager",
                                                                        "precision": "fp32"}}}}
    assert "    classifier: eager (no compiled model serves)" in describe_lines(description)
