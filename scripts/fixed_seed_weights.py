"""Fixed-seed weights of a real architecture whose answers still differ from image to image.

Plain random initialisation often gives every photo the same answer (BatchNorm's running
statistics do not match the activations, and small output layers give near-zero logits), which
would hide a mix-up between requests. Calibrating BatchNorm on a few real images and scaling the
output layer to a useful logit spread fixes that, deterministically.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


@torch.no_grad()
def calibrate_batch_norm(model: nn.Module, batches: Sequence[torch.Tensor]) -> None:
    """Set every BatchNorm's running mean/var to the exact average over `batches`."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # cumulative average
    model.train()
    for batch in batches:
        model(batch)
    model.eval()
    for norm in norms:
        norm.momentum = 0.1


@torch.no_grad()
def scale_output_layer(model: nn.Module, batches: Sequence[torch.Tensor], logit_std: float) -> None:
    """Scale the last Linear layer so the logits over `batches` have standard deviation `logit_std`."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError("the model has no Linear output layer to scale")
    logits = torch.cat([model(batch) for batch in batches])
    factor = logit_std / max(float(logits.std()), 1e-12)
    linears[-1].weight.mul_(factor)
    if linears[-1].bias is not None:
        linears[-1].bias.mul_(factor)


def calibrated_classifier(model: nn.Module, batches: Sequence[torch.Tensor],
                          logit_std: float = 3.0) -> nn.Module:
    """Calibrate a freshly initialised classifier in place and return it in eval mode."""
    calibrate_batch_norm(model, batches)
    scale_output_layer(model, batches, logit_std)
    return model.eval()
