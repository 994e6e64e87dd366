"""An Ultralytics detection export on another engine: the archive builder converts a TorchScript
export to an OpenVINO IR (fp32 weights, any batch), and a CPU worker serves it when its raw
outputs on the archive's probe photos are the export's own within the Ultralytics path's bounds
(`output_disagreement`); otherwise the export itself serves. Measured on YOLOv8n at 640 on a
2-core AMD EPYC Zen 4 (AVX512-BF16, no AMX): OpenVINO f32 30 ms a batch of one on 2 threads
against TorchScript's 57, and 1.6-1.9x at batch 4 and on one thread (docs/benchmarks.md,
"Ultralytics exports"); fp32 only, since bf16 would move scores past what Ultralytics' own
answers allow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Network = Callable[[torch.Tensor], torch.Tensor]

# The raw outputs an engine may differ from the export by: a box coordinate (input pixels) and a
# class score. Seen on YOLOv8n's probe photos: 0.03 px and 9e-5; the served answers' bounds
# against Ultralytics' own (boxes 1 px, scores 1e-3) keep a margin over them.
BOX_BOUND_PX = 0.25
SCORE_BOUND = 5e-4


def output_disagreement(got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """Why an engine's `[B, 4 + C, N]` outputs are not the export's `expected` ones within
    BOX_BOUND_PX and SCORE_BOUND, or None."""
    if got.shape != expected.shape:
        return f"output shape {tuple(got.shape)}, the export's {tuple(expected.shape)}"
    box_shift = float((got[:, :4].float() - expected[:, :4].float()).abs().amax())
    score_shift = float((got[:, 4:].float() - expected[:, 4:].float()).abs().amax())
    if not box_shift <= BOX_BOUND_PX:
        return f"a box coordinate moved by {box_shift:.3g} px (+-{BOX_BOUND_PX})"
    if not score_shift <= SCORE_BOUND:
        return f"a class score moved by {score_shift:.3g} (+-{SCORE_BOUND})"
    return None


def probe_outputs(export: Callable[[torch.Tensor], Any],
                  probe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the input, the export's outputs) for the `uint8[N, 3, H, W]` letterboxed probe photos:
    divided by 255, as the served input is (an export may answer a tuple, its predictions first).
    A worker computes them once, however many candidates it checks."""
    batch = probe.float().div(255)
    with torch.inference_mode():
        expected = export(batch)
    return batch, expected[0] if isinstance(expected, (tuple, list)) else expected


def check_outputs(engine: Network, reference: tuple[torch.Tensor, torch.Tensor]) -> str | None:
    """`output_disagreement` of the engine's outputs with the export's on the probe photos
    (`reference`: probe_outputs). An engine that fails to run them raises."""
    batch, expected = reference
    with torch.inference_mode():
        return output_disagreement(engine(batch), expected)
