"""Tensor code of each model kind: preprocessing, top-k, letterbox, detection decoding, an
SSD's batched postprocess, the cascade's rule, box crops. Pure."""
