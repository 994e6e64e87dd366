"""Tensor code of each model kind: preprocessing, top-k, letterbox, detection decoding,
the cascade's rule, box crops. Pure."""
