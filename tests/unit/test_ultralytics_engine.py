"""The check an Ultralytics export's engine passes before it serves (handlers/model/ultralytics_engine.py)."""

from __future__ import annotations

import torch

from handlers.model.ultralytics_engine import (
    BOX_BOUND_PX,
    SCORE_BOUND,
    check_outputs,
    output_disagreement,
    probe_outputs,
)


def outputs(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.cat([torch.rand(2, 4, 100, generator=generator) * 640,
                      torch.rand(2, 80, 100, generator=generator)], dim=1)


def test_outputs_within_the_bounds_pass_and_each_bound_is_held():
    expected = outputs()
    assert output_disagreement(expected.clone(), expected) is None
    moved = expected.clone()
    moved[:, :4] += BOX_BOUND_PX * 0.9
    moved[:, 4:] += SCORE_BOUND * 0.9
    assert output_disagreement(moved, expected) is None
    boxes = expected.clone()
    boxes[1, 2, 7] += BOX_BOUND_PX * 1.5
    assert "a box coordinate moved by" in str(output_disagreement(boxes, expected))
    scores = expected.clone()
    scores[0, 40, 3] += SCORE_BOUND * 1.5
    assert "a class score moved by" in str(output_disagreement(scores, expected))
    assert "output shape" in str(output_disagreement(expected[:, :, :50], expected))
    nan = expected.clone()
    nan[0, 5, 0] = float("nan")
    assert output_disagreement(nan, expected) is not None


def test_the_check_runs_both_on_the_probe_divided_by_255():
    probe = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    seen = []

    def export(batch: torch.Tensor) -> tuple[torch.Tensor, list]:
        seen.append(batch)
        return torch.stack([batch.mean(dim=(1, 2, 3))] * 84, dim=1)[..., None], []

    def engine(batch: torch.Tensor) -> torch.Tensor:
        return torch.stack([batch.mean(dim=(1, 2, 3))] * 84, dim=1)[..., None]

    assert check_outputs(engine, probe_outputs(export, probe)) is None
    assert torch.equal(seen[0], probe.float() / 255)
