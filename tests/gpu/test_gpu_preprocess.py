"""On a GPU: the preprocessing kernels compiled for the device give the CPU's values bit for bit
(the interpreter's run of the same kernels is checked in tests/unit/test_preprocess_kernels.py);
a classifier archive with `cuda_preprocess_kernels` answers exactly as without; and a CUDA
worker whose memory cannot hold a full batch answers every request of it (answer_items splits
the batch and retries, handlers/serving.py).

Marked `gpu` (see tests/gpu/test_gpu_answers.py); `--gpu-device cpu` rehearses the first two on
a CPU (the kernels interpreted, the archive's switch unused there).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torchvision.transforms.v2 import functional as F

from handlers.request import chroma_kernels
from handlers.request.chroma_upsampling import H2V1, H2V2, interpolated_chroma
from handlers.task import resize_kernels
from handlers.task.fixed_point_resize import resize_uint8
from handlers.task.transforms import channel_constants, normalize_batch, resized_size_hw
from tests.gpu.test_gpu_batches import answers
from torchserve_vision.lab.benchmark_images import distinct_jpegs
from torchserve_vision.local_handler import load_handler

pytestmark = pytest.mark.gpu

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def random_batch(count: int, height: int, width: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count, 3, height, width), dtype=torch.uint8, generator=generator)


@pytest.mark.parametrize("input_hw", [(720, 720), (427, 640), (1080, 1440)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_the_compiled_resize_kernels_give_the_cpus_values(device, input_hw, dtype):
    images = random_batch(8, input_hw[0], input_hw[1], seed=sum(input_hw))
    resized_hw = resized_size_hw(input_hw, 256)
    cpu_crops = F.center_crop(resize_uint8(images, resized_hw), [224, 224])
    expected = normalize_batch(cpu_crops, MEAN, STD, dtype)
    mean, std = (values.view(-1) for values in channel_constants(MEAN, STD, device))
    got = resize_kernels.resized_crops_normalized(images.to(device), resized_hw, 224, mean, std, dtype)
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("factors", [H2V2, H2V1], ids=["4:2:0", "4:2:2"])
def test_the_compiled_chroma_kernels_give_the_cpus_values(device, factors):
    images = random_batch(8, 720, 720, seed=factors[1])
    got = chroma_kernels.interpolated_chroma(images.to(device), factors)
    assert torch.equal(got.cpu(), interpolated_chroma(images, factors))


def test_the_preprocessing_kernels_answer_exactly_as_the_tensor_operations(lite0_fp16, gpu_id):
    """The same network input, so the same answers, to the last digit."""
    by_ops = load_handler(lite0_fp16, 16, gpu_id, {"cuda_preprocess_kernels": False})
    by_kernels = load_handler(lite0_fp16, 16, gpu_id, {"cuda_preprocess_kernels": True})
    rows = [{"body": bytearray(jpeg)} for jpeg in distinct_jpegs(16, seed=5)]
    assert answers(by_kernels, rows) == answers(by_ops, rows)


# Run in its own process: the memory cap holds for the whole process.
CAPPED_BATCH = textwrap.dedent("""
    import json, logging, sys
    import torch
    from tests.gpu.test_gpu_batches import answers
    from torchserve_vision.lab.benchmark_images import distinct_jpegs
    from torchserve_vision.local_handler import load_handler

    model_dir, gpu_id, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    device = torch.device("cuda", gpu_id)
    handler = load_handler(model_dir, count, gpu_id)
    rows = [{"body": bytearray(jpeg)} for jpeg in distinct_jpegs(count, seed=11)]
    alone = [answers(handler, [row])[0] for row in rows]     # each image alone, uncapped
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    answers(handler, rows[:1])
    per_image = max(torch.cuda.max_memory_reserved(device) - base, 1 << 20)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction((base + 3 * per_image) / total, device)
    together = answers(handler, rows)                        # asserts every status is 200
    print(json.dumps({"same_best": [a[0]["index"] == b[0]["index"] for a, b in zip(alone, together)],
                      "base": base, "per_image": per_image}))
""")


def test_a_batch_that_does_not_fit_in_the_devices_memory_is_answered_whole(lite0_fp16, device, gpu_id):
    """The worker's memory capped (torch.cuda.set_per_process_memory_fraction) at what it holds
    plus three images' worth: a batch of 32 runs out of memory, is split and retried, and every
    request gets its 200 and the best class it gets alone."""
    if device.type != "cuda":
        pytest.skip("a memory cap is a CUDA allocator's; the split itself is tested on the CPU "
                    "in tests/unit (answer_items with a model that raises OutOfMemoryError)")
    done = subprocess.run([sys.executable, "-c", CAPPED_BATCH, str(lite0_fp16), str(gpu_id), "32"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(result["same_best"]), result
    assert "out of memory on" in done.stderr, done.stderr[-4000:]
