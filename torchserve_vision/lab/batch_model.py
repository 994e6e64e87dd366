"""The batching model: t(B) = t_fixed + B * t_img, and what it says about batch size and delay.

Pure functions, no server: a least-squares fit of measured batch times, and a recommendation of
batch size, max batch delay and workers for a p99 latency target and a request rate.

Latency model (conservative, used for the recommendation): under load a request waits at most
the batch delay for its batch to form, then for the batch ahead of it, then for its own batch:
p99 ~ delay + 2 * t(B). A recommendation keeps utilisation at or below `MAX_UTILISATION` of the
capacity workers * B / t(B), so queues stay short; it is then verified by an open-loop run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_UTILISATION = 0.75


@dataclass(frozen=True)
class BatchTimeFit:
    t_fixed_ms: float
    t_img_ms: float
    rms_error_ms: float
    r_squared: float

    def batch_ms(self, batch_size: int) -> float:
        return self.t_fixed_ms + batch_size * self.t_img_ms

    def capacity_rps(self, batch_size: int, workers: int = 1) -> float:
        return workers * batch_size * 1000.0 / self.batch_ms(batch_size)


def fit_batch_time(batch_sizes: Sequence[int], batch_ms: Sequence[float]) -> BatchTimeFit:
    """Least-squares line through (B, t(B)). Needs at least two distinct batch sizes.

    A negative fixed cost has no physical meaning (it comes from noise, or from per-image costs
    that grow faster than linearly) and would make batch size 1 look faster than it is, so the
    line is then refitted through the origin: t_fixed = 0, t_img = sum(B t) / sum(B^2)."""
    sizes = np.asarray(batch_sizes, dtype=float)
    times = np.asarray(batch_ms, dtype=float)
    if len(set(batch_sizes)) < 2 or len(sizes) != len(times):
        raise ValueError("need t(B) for at least two different batch sizes")
    slope, intercept = np.polyfit(sizes, times, 1)
    if intercept < 0:
        slope, intercept = float((sizes * times).sum() / (sizes ** 2).sum()), 0.0
    residuals = times - (intercept + slope * sizes)
    total = float(((times - times.mean()) ** 2).sum())
    r_squared = 1.0 - float((residuals ** 2).sum()) / total if total > 0 else 1.0
    return BatchTimeFit(float(intercept), float(slope), float(np.sqrt((residuals ** 2).mean())),
                        r_squared)


@dataclass(frozen=True)
class Recommendation:
    feasible: bool
    batch_size: int
    max_batch_delay_ms: int
    workers: int
    predicted_p99_ms: float
    capacity_rps: float
    reason: str


def predicted_p99_ms(fit: BatchTimeFit, batch_size: int, delay_ms: float) -> float:
    return delay_ms + 2 * fit.batch_ms(batch_size)


def recommend(fit: BatchTimeFit, p99_target_ms: float, rate_rps: float | None, max_batch: int,
              workers: int = 1) -> Recommendation:
    """Batch size, delay and workers for `rate_rps` (None: maximum throughput) within the target.

    For a rate: the smallest batch whose capacity covers the rate at MAX_UTILISATION and whose
    latency fits, with the delay it takes that rate to fill the batch (capped by what the target
    leaves). For maximum throughput: the largest batch that fits, with the delay the target leaves
    (at most one batch time: beyond that, a saturated server fills batches anyway).
    If nothing fits, `feasible` is False and the fields describe the best that can be done.
    """
    fitting = [b for b in range(1, max_batch + 1) if predicted_p99_ms(fit, b, 0) <= p99_target_ms]
    if not fitting:
        return Recommendation(False, 1, 0, workers, predicted_p99_ms(fit, 1, 0), fit.capacity_rps(1, workers),
                              f"even batch size 1 needs p99 ~{predicted_p99_ms(fit, 1, 0):.0f} ms > "
                              f"{p99_target_ms:.0f} ms on this hardware")
    if rate_rps is None:
        batch = max(fitting)
        delay = min(p99_target_ms - predicted_p99_ms(fit, batch, 0), fit.batch_ms(batch))
        return Recommendation(True, batch, int(delay), workers, predicted_p99_ms(fit, batch, int(delay)),
                              fit.capacity_rps(batch, workers), "largest batch within the target")
    for batch in fitting:
        if rate_rps <= MAX_UTILISATION * fit.capacity_rps(batch, workers):
            room = p99_target_ms - predicted_p99_ms(fit, batch, 0)
            delay = min(room, 1000.0 * (batch - 1) / rate_rps)
            return Recommendation(True, batch, int(delay), workers,
                                  predicted_p99_ms(fit, batch, int(delay)),
                                  fit.capacity_rps(batch, workers),
                                  f"smallest batch covering {rate_rps:.0f} req/s at "
                                  f"{MAX_UTILISATION:.0%} utilisation")
    best = max(fitting)
    return Recommendation(False, best, 0, workers, predicted_p99_ms(fit, best, 0),
                          fit.capacity_rps(best, workers),
                          f"{rate_rps:.0f} req/s needs more than {MAX_UTILISATION:.0%} of the best "
                          f"capacity within the target ({fit.capacity_rps(best, workers):.0f} req/s "
                          f"at batch {best}); add workers or hardware, or relax the target")
