"""Reading the workers' batch log lines and splitting served / in-process into busy x batch size x
contention (torchserve_vision/lab/batch_log.py)."""

from __future__ import annotations

import json

import pytest

from torchserve_vision.lab.batch_log import logged_batches, served_breakdown, stage_means
from torchserve_vision.lab.batch_model import BatchTimeFit

FIT = BatchTimeFit(t_fixed_ms=8.0, t_img_ms=4.0, rms_error_ms=0.0, r_squared=1.0)  # t(8) = 40 ms


def line(at: str, worker: int, model: str, size: int, inference_ms: float, **timing: float) -> str:
    record = {"model": model, "size": size, "stage_ms": {"decode": 1.0, "inference": inference_ms},
              **timing}
    return (f"2026-11-23T20:01:{at} [INFO ] W-{worker}-{model}_1.0-stdout MODEL_LOG - batch "
            f"{json.dumps(record)}\n")


def test_batch_lines_of_one_model_version_are_read_with_their_worker_and_handler_time():
    lines = [line("17,977", 9000, "efficientnet_lite0", 8, 39.0),
             line("18,001", 9001, "efficientnet_lite0_batch1", 1, 11.0),
             "2026-11-23T20:01:18,100 [INFO ] W-9000-efficientnet_lite0_1.0-stdout MODEL_LOG - "
             "worker ready\n",
             line("18,200", 9001, "efficientnet_lite0", 4, 23.0)]
    batches = logged_batches(lines, "efficientnet_lite0", "1.0")
    assert [(b.worker, b.size, b.handler_ms) for b in batches] == [("9000", 8, 40.0), ("9001", 4, 24.0)]
    assert batches[0].at.microsecond == 977000


def test_full_batches_at_the_in_process_speed_with_workers_always_busy_are_the_in_process_path():
    lines = [line(f"{i:02d},000", 9000 + i % 2, "m", 8, 39.0) for i in range(20)]
    batches = logged_batches(lines, "m", "1.0")
    breakdown = served_breakdown(batches, FIT, 8, window_s=0.4)   # 10 batches x 40 ms per worker
    assert breakdown.busy == pytest.approx(1.0)
    assert breakdown.batch_size_factor == pytest.approx(1.0)
    assert breakdown.contention_factor == pytest.approx(1.0)
    assert breakdown.served_over_in_process == pytest.approx(1.0)


def test_half_full_batches_slower_than_in_process_on_half_busy_workers_multiply_out():
    # Batches of 4: t(4) = 24 ms in-process (6 ms a request vs 5 at 8), served in 48 ms (2x slower).
    batches = logged_batches([line(f"{i:02d},000", 9000, "m", 4, 47.0) for i in range(10)], "m", "1.0")
    breakdown = served_breakdown(batches, FIT, 8, window_s=0.96)   # 480 ms busy of 960
    assert breakdown.busy == pytest.approx(0.5)
    assert breakdown.batch_size_factor == pytest.approx(5 / 6)
    assert breakdown.contention_factor == pytest.approx(0.5)
    served_rps, in_process_rps = 40 / 0.96, 8 / 0.040
    assert breakdown.served_over_in_process == pytest.approx(served_rps / in_process_rps)
    assert breakdown.mean_batch_size == 4 and breakdown.batch_sizes == {4: 10}


def test_no_batches_is_an_error_that_says_why():
    with pytest.raises(ValueError, match="log_batches"):
        served_breakdown([], FIT, 8, 1.0)


def test_stage_means_are_per_batch_and_per_image():
    lines = [line("17,000", 9000, "m", 8, 39.0), line("17,500", 9001, "m", 4, 19.0)]
    means = stage_means(logged_batches(lines, "m", "1.0"))
    assert (means["batches"], means["mean_batch_size"]) == (2, 6.0)
    assert means["ms_per_batch"] == {"decode": 1.0, "inference": 29.0}
    assert means["ms_per_image"] == {"decode": 2.0 / 12, "inference": 58.0 / 12}
    assert stage_means([]) == {"batches": 0}


def test_the_time_outside_the_stages_and_between_batches_is_averaged_where_logged():
    lines = [line("17,000", 9000, "m", 8, 39.0, batch_ms=44.0),                  # a first batch
             line("17,100", 9000, "m", 8, 29.0, batch_ms=32.0, waited_ms=20.0),
             line("17,200", 9001, "m", 8, 29.0, batch_ms=34.0, waited_ms=30.0)]
    means = stage_means(logged_batches(lines, "m", "1.0"))
    assert means["outside_stages_ms_per_batch"] == pytest.approx((4.0 + 2.0 + 4.0) / 3)
    assert means["waited_ms_per_batch"] == pytest.approx(25.0)
    older = stage_means(logged_batches([line("17,000", 9000, "m", 8, 39.0)], "m", "1.0"))
    assert "outside_stages_ms_per_batch" not in older and "waited_ms_per_batch" not in older
