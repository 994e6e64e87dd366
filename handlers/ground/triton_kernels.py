"""Triton where the handlers use it: its kernels run compiled on a CUDA device and through
Triton's interpreter on the CPU (how the tests compare them bit for bit with the CPU's tensor
operations). A kernel written for both calls no other @triton.jit function and no function of
Triton's standard library that is one (`tl.full`, not `tl.zeros`): the interpreter runs only the
kernel it is given. Triton ships with PyTorch's Linux wheels; `available()` says whether it
imports here.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

try:                                      # a Linux torch wheel brings Triton; elsewhere none
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:                       # pragma: no cover - every pinned platform has it
    triton = None
    tl = None

BLOCK = 1024             # elements per program of an elementwise kernel on CUDA
# The interpreter pays per operation, not per element: there a program takes up to this many
# elements (a whole plane of most images), in as few programs as that allows.
INTERPRETED_ELEMENTS = 1 << 20


def available() -> bool:
    """Whether Triton imports here (the kernels then run on CUDA, and interpreted on the CPU)."""
    return triton is not None


def require() -> None:
    if triton is None:
        raise RuntimeError("the preprocessing kernels need Triton, which does not import here")


def launchable(kernel: Any, device: torch.device) -> Any:
    """The kernel as compiled for a CUDA device, or as Triton's interpreter runs it on the CPU."""
    return kernel if device.type == "cuda" else _interpreted(kernel)


@functools.cache
def _interpreted(kernel: Any) -> Any:
    return InterpretedFunction(kernel.fn)


def elementwise_block(device: torch.device, size: int) -> int:
    """Elements per program of an elementwise kernel over `size` elements."""
    if device.type == "cuda":
        return BLOCK
    return min(triton.next_power_of_2(max(size, 1)), INTERPRETED_ELEMENTS)


def no_fp_fusion(device: torch.device) -> dict[str, bool]:
    """Launch options that compile products and sums rounded one by one, as the CPU rounds them
    (no fused multiply-add); the interpreter never fuses them."""
    return {"enable_fp_fusion": False} if device.type == "cuda" else {}
