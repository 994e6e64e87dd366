"""The error of every packaged-weights reader (pretrained_weights, tf_ssd_weights): its own module,
so that the readers import it and not each other."""

from __future__ import annotations


class WeightsError(ValueError):
    """Weights that are missing or do not fit the architecture."""
