"""libjpeg-turbo's TurboJPEG library (Debian's libturbojpeg0, installed by scripts/setup.sh)
through ctypes: one JPEG decoded with chroma interpolated (libjpeg's default, what the CPU's
decoder gives) or repeated over its blocks (TJFLAG_FASTUPSAMPLE, what nvJPEG gives), so that a
GPU decoder's chroma can be reproduced on a CPU."""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import torch

TJFLAG_FASTUPSAMPLE = 256
TJPF_RGB = 0


def _library() -> ctypes.CDLL:
    name = ctypes.util.find_library("turbojpeg") or "libturbojpeg.so.0"
    try:
        library = ctypes.CDLL(name)
    except OSError as error:
        raise RuntimeError(f"libturbojpeg is missing ({error}): run scripts/setup.sh, or "
                           "'apt-get install libturbojpeg0'") from None
    library.tjInitDecompress.restype = ctypes.c_void_p
    int_pointer = ctypes.POINTER(ctypes.c_int)
    library.tjDecompressHeader3.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_ulong,
                                            int_pointer, int_pointer, int_pointer, int_pointer]
    library.tjDecompress2.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p,
                                      ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    library.tjGetErrorStr.restype = ctypes.c_char_p
    return library


_LIBRARY = _library()
_HANDLE = _LIBRARY.tjInitDecompress()


def decode(data: bytes, repeat_chroma: bool) -> torch.Tensor:
    """`uint8[3, H, W]` stored RGB pixels (no EXIF orientation) of baseline or progressive JPEG
    bytes, chroma interpolated (libjpeg's fancy upsampling) or repeated (`repeat_chroma`)."""
    width, height, subsampling, colourspace = (ctypes.c_int() for _ in range(4))
    if _LIBRARY.tjDecompressHeader3(_HANDLE, data, len(data), ctypes.byref(width), ctypes.byref(height),
                                    ctypes.byref(subsampling), ctypes.byref(colourspace)) != 0:
        raise ValueError(_LIBRARY.tjGetErrorStr().decode())
    pixels = np.empty((height.value, width.value, 3), np.uint8)
    flags = TJFLAG_FASTUPSAMPLE if repeat_chroma else 0
    if _LIBRARY.tjDecompress2(_HANDLE, data, len(data), pixels.ctypes.data, width.value, 0, height.value,
                              TJPF_RGB, flags) != 0:
        raise ValueError(_LIBRARY.tjGetErrorStr().decode())
    return torch.from_numpy(pixels).permute(2, 0, 1).contiguous()
