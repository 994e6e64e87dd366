"""The response cache: settings, keys, the in-worker and Redis tiers, the perceptual hash,
its stages in `handle`."""
