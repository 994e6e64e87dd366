"""Classification postprocessing: logits to the top-k classes of each image."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

import torch


class ClassScore(TypedDict):
    label: str
    index: int
    probability: float


def top_k_classes(logits: torch.Tensor, labels: Sequence[str], k: int) -> list[list[ClassScore]]:
    """`float[B, C]` logits -> for each image, the k most probable classes, best first.

    Probabilities are the softmax over all C classes (computed in float32). k is capped at C.
    Raises ValueError when the model's C differs from the number of labels.
    """
    return top_k_of_probabilities(torch.softmax(logits.float(), dim=1), labels, k)


def top_k_of_probabilities(probabilities: torch.Tensor, labels: Sequence[str],
                           k: int) -> list[list[ClassScore]]:
    """`float[B, C]` probabilities -> for each image, the k most probable classes, best first."""
    if probabilities.ndim != 2:
        raise ValueError(f"expected probabilities of shape [B, C], got {tuple(probabilities.shape)}")
    if probabilities.shape[1] != len(labels):
        raise ValueError(f"the model returns {probabilities.shape[1]} classes "
                         f"but there are {len(labels)} labels")
    top = torch.topk(probabilities, k=min(k, len(labels)), dim=1)
    values, indices = top.values.cpu().tolist(), top.indices.cpu().tolist()
    return [
        [ClassScore(label=labels[i], index=i, probability=p) for p, i in zip(row_p, row_i, strict=True)]
        for row_p, row_i in zip(values, indices, strict=True)
    ]
