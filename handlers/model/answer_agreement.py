"""Do two classifier answers for the same image agree, within what a precision's rounding allows?

One criterion, used by a worker's load-time check of a compiled package (handlers.model.compiled_model)
and by the tests: compare the *answers* (class probabilities, best first) with the fp32 eager
model's, not raw logits. A reduced precision (or another kernel, batch size or CPU) moves every
probability a little; a wrong model moves them a lot, and changes the best class of photos whose
answer is clear.

The bounds hold for photos of what the model was trained on (docs/precision.md has the figures;
`torchserve-vision lab precision` measures them on any CPU). bf16 keeps 8 significant bits
(relative rounding 2^-9); through EfficientNet's ~100 layers its logits moved by up to 1.0 and
its probabilities by up to 0.081 against fp32, over 6 photos x 4 orientations x Lite0/1/2 x batch
1 and 8 x eager and compiled; an AMX Xeon showed 0.032. The bound, 0.15, is about twice the worst
seen. fp16 keeps three more bits (8x finer rounding): 0.15 / 8, rounded up. fp32 differs only in
summation order between kernels: measured up to 3.2e-6 on the classifiers, and 4.1e-5 on an
SSDlite detector's anchor scores (its logits reach 24; OpenVINO against eager on an AVX2 EPYC):
1e-3, about 25x the worst seen. int8 (the builder's OpenVINO model,
7-bit weights, gated at build on top-1 agreement) moved probabilities by up to 0.16 on 300
photo variants with its float layers in fp32; in bf16 they add bf16's rounding (0.08): 0.25.
Far from the training photos (micrographs,
drawings, scans) bf16 moved probabilities by up to 0.49: no bound holds there, and such
deployments should serve fp32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# The largest change of any class probability (absolute) that a precision's rounding may cause,
# against the fp32 eager model. tf32 (a GPU's convolutions with float32 inputs rounded to 10
# significant bits, float32 sums) rounds the inputs of its products as fp16 does: fp16's bound.
PROBABILITY_BOUNDS = {"fp32": 1e-3, "tf32": 0.02, "fp16": 0.02, "bf16": 0.15, "int8": 0.25}

# What a GPU's JPEG decoder may add to an answer of the same archive, beyond its precision's
# rounding: nvJPEG is not libjpeg-turbo bit for bit (it repeats 4:2:0 chroma where libjpeg
# interpolates; another IDCT). With the chroma interpolated after decoding as libjpeg does
# (handlers.request.chroma_upsampling), measured on an H200 (torch 2.11, 2026-11-28), Lite0 fp32,
# 106 images: 0.0060 on the worst (no best class changed), against 0.034 before the interpolation
# and 1.5e-6 when the same GPU worker is given the CPU's decoded pixels. Twice the worst measured,
# rounded up: 0.02. Resize, crop and normalisation are the same arithmetic on every device
# (handlers.task.fixed_point_resize) and fp32 on a GPU is IEEE float32, so an answer from the
# CPU's decoded pixels is held to the precision's own bound. docs/precision.md, "CPU and GPU".
DEVICE_BOUND = 0.02

# (class index, probability), best first: the top k of one answer.
RankedClasses = Sequence[tuple[int, float]]


def top_classes(probabilities: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """`float[C]` probabilities of one image -> its k best (class index, probability), best first."""
    values, indices = probabilities.topk(min(k, probabilities.shape[-1]))
    return list(zip(indices.tolist(), values.tolist(), strict=True))


def probability_bound(*precisions: str) -> float:
    """The bound for answers computed in `precisions` (the loosest of them)."""
    return max(PROBABILITY_BOUNDS[precision] for precision in precisions)


def cross_device_bound(precision: str, device_decoder: bool = True) -> float:
    """The bound for an answer computed on a GPU at `precision` against the same archive's fp32
    answer on a CPU. With the GPU's own JPEG decoder: DEVICE_BOUND, plus the precision's bound
    where it rounds more than fp32 (fp32's 1e-3 of summation order is inside DEVICE_BOUND's
    margin). From the CPU's decoded pixels: the precision's bound alone."""
    if not device_decoder:
        return PROBABILITY_BOUNDS[precision]
    return DEVICE_BOUND + (0.0 if precision == "fp32" else PROBABILITY_BOUNDS[precision])


def probability_disagreement(got: RankedClasses, reference: RankedClasses, bound: float) -> str | None:
    """Why `got` cannot be `reference` computed with rounding of at most `bound`, or None.

    Every class both list moves by at most `bound`; a class only one lists is at most `bound`
    above the other's last (else the other would list it). NaN never agrees."""
    got_p, reference_p = dict(got), dict(reference)
    for index, probability in got:
        expected = reference_p.get(index)
        if expected is not None and not abs(probability - expected) <= bound:
            return f"class {index}: probability {probability:.4f}, expected {expected:.4f} (+-{bound:g})"
    for listed, other, other_p in ((got, reference, reference_p), (reference, got, got_p)):
        floor = other[-1][1] + bound
        for index, probability in listed:
            if index not in other_p and not probability <= floor:
                return f"class {index}: probability {probability:.4f} is missing from the other answer"
    return None


def ranking_disagreement(got: RankedClasses, reference: RankedClasses, bound: float) -> str | None:
    """Why `got` ranks classes differently from `reference` where rounding of `bound` cannot
    explain it, or None: wherever the reference's gap between rank r and r + 1 exceeds twice the
    bound, both answers have the same r + 1 best classes (for r = 0: a clear photo keeps its
    best class)."""
    for rank in range(min(len(got), len(reference) - 1)):
        gap = reference[rank][1] - reference[rank + 1][1]
        best = {index for index, _ in reference[:rank + 1]}
        if gap > 2 * bound and {index for index, _ in got[:rank + 1]} != best:
            return (f"the {rank + 1} best classes are {[index for index, _ in got[:rank + 1]]}, "
                    f"expected {sorted(best)} (clear by {gap:.4f})")
    return None


def answer_disagreement(got: RankedClasses, reference: RankedClasses, bound: float) -> str | None:
    """Why `got` is not `reference`'s answer within `bound`, or None. Both hold at least one
    class. The ranking is checked first for its message (a clear photo's best class changed);
    probabilities within the bound imply it."""
    if not got or not reference:
        raise ValueError("answers to compare hold at least one class each")
    return (ranking_disagreement(got, reference, bound)
            or probability_disagreement(got, reference, bound))
