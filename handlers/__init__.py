"""Batched TorchServe handlers for vision models.

Everything in this package except `serving.py`'s use of the TorchServe context is pure code:
it never imports `ts`, so it is testable without a server. The package is copied into every
model archive, so an archive is self-contained.
"""
