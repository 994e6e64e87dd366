"""A batch's JPEGs decoded by NVIDIA nvImageCodec (`nvidia-nvimgcodec-cu13`), an archive's
`jpeg_decoder: nvimgcodec` on a CUDA worker. Its backends are allowed in this order: the hardware
one (the JPEG engines of an A100, H100 or H200, where the driver exposes them: they would leave
the SMs to the model), the CUDA one, then the hybrid one (Huffman decoding on the host). On the
H200 measured (docs/benchmarks.md, 2026-11-28) it decoded on the host and copied the pixels over,
0.39x torchvision's nvJPEG at batch 64, so it is not the default.

Same contract as torchvision's batched decode in handlers.request.jpeg_batches: stored pixels,
`uint8[3, H, W]` on the device (a view of the decoder's `[H, W, 3]` buffer, which the tensor
keeps alive), one per JPEG in order, None for one the decoder refuses (the caller decodes it on
the CPU, whose answer or error is the CPU's). The decode is queued on the caller's current CUDA
stream, so what the caller does next with the pixels is ordered after it without a host wait;
the outputs are the decoder's own allocations, not blocks of torch's caching allocator.

On the CPU (tests) the decoder is nvImageCodec's libjpeg-turbo backend: the same pixels as
torchvision's CPU decode, bit for bit.

nvImageCodec's nvJPEG backends load `libnvjpeg.so.13` when first used; a CUDA-13 `nvidia-nvjpeg`
wheel installed beside it is loaded here first, so no library path has to name it.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Where pip's `nvidia-nvjpeg` (CUDA 13) puts the library, under a site-packages directory.
NVJPEG_LIBRARY = Path("nvidia") / "cu13" / "lib" / "libnvjpeg.so.13"

def available() -> bool:
    """Whether nvImageCodec's Python package is installed (it is imported only when used)."""
    return importlib.util.find_spec("nvidia.nvimgcodec") is not None


def _load_wheel_nvjpeg() -> None:
    for entry in sys.path:
        library = Path(entry or ".") / NVJPEG_LIBRARY
        if library.is_file():
            ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
            return


@cache
def decoder_for(device: torch.device) -> Any:
    """The process's nvImageCodec decoder for `device`, made on first use."""
    from nvidia import nvimgcodec

    kinds = nvimgcodec.BackendKind
    if device.type != "cuda":
        return nvimgcodec.Decoder(device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY,
                                  backends=[nvimgcodec.Backend(kinds.CPU_ONLY)])
    _load_wheel_nvjpeg()
    index = device.index if device.index is not None else torch.cuda.current_device()
    order = (kinds.HW_GPU_ONLY, kinds.GPU_ONLY, kinds.HYBRID_CPU_GPU)
    backends = [nvimgcodec.Backend(kind) for kind in order]
    return nvimgcodec.Decoder(device_id=index, backends=backends)


@cache
def _params() -> Any:
    from nvidia import nvimgcodec

    return nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB,
                                   sample_format=nvimgcodec.SampleFormat.I_RGB)


def decode_call(encoded: Sequence[bytes], device: torch.device) -> list[torch.Tensor | None]:
    """One decoder call for `encoded`: `uint8[3, H, W]` per JPEG on `device`, None where refused."""
    from nvidia import nvimgcodec

    decoder = decoder_for(device)
    streams = [nvimgcodec.CodeStream(data) for data in encoded]
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device).cuda_stream
        images = decoder.decode(streams, params=_params(), cuda_stream=stream)
        return [None if image is None else torch.from_dlpack(image).permute(2, 0, 1) for image in images]
    images = decoder.decode(streams, params=_params())
    return [None if image is None else torch.from_numpy(np.asarray(image)).permute(2, 0, 1)
            for image in images]
