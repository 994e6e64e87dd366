"""The serving lab's logic: percentiles, Poisson arrivals, the t(B) fit, the tuner's choices,
the sweep's operating point and outputs, the load generator against an instant local server."""

from __future__ import annotations

import base64
import io
import json
import shutil
import socket
import subprocess
import threading
import time
import zipfile
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from handlers.drift.drift_profile import DriftProfile
from torchserve_vision import paths
from torchserve_vision.front_proxy import haproxy_binary
from torchserve_vision.lab import detector_parts
from torchserve_vision.lab.batch_model import (
    MAX_UTILISATION,
    BatchTimeFit,
    fit_batch_time,
    recommend,
)
from torchserve_vision.lab.batching_policies import as_text, goals
from torchserve_vision.lab.cascade_tradeoff import cascade_inputs
from torchserve_vision.lab.drift_detection import false_alarms, shifted_streams
from torchserve_vision.lab.goodput import goodput_row
from torchserve_vision.lab.loadgen import (
    LoadTarget,
    Result,
    instances_bodies,
    instant_server,
    latency_summary,
    poisson_schedule,
    run_closed_loop,
    run_open_loop,
    summarize,
)
from torchserve_vision.lab.pods import Pod, PodError
from torchserve_vision.lab.rolling_update import (
    BalancerLog,
    PodStep,
    balancer_wait_error,
    haproxy_config,
    pods_in_rotation,
    rolled_config,
    step_counts,
)
from torchserve_vision.lab.sweep import SweepPoint, choose_operating_point, write_results
from torchserve_vision.lab.tune import update_models_yaml
from torchserve_vision.photo_sets import PhotoSetError, project_photos, variant_jpegs
from torchserve_vision.photos import photo_path
from torchserve_vision.torchserve_config import free_ports, read_properties, server_config
from torchserve_vision.waiting import wait_until


def test_percentiles_interpolate_between_ranks():
    summary = latency_summary(list(range(1, 101)))  # 1..100 ms
    assert summary["p50"] == pytest.approx(50.5)
    assert summary["p90"] == pytest.approx(90.1)
    assert summary["p99"] == pytest.approx(99.01)
    assert summary["max"] == 100
    assert latency_summary([]) == {"p50": 0.0, "p90": 0.0, "p95": 0.0, "p99": 0.0, "max": 0.0}


def test_summary_counts_errors_by_status_and_uses_only_successes_for_latency():
    results = [Result(0, 10, 200), Result(0, 1000, 503), Result(0, 20, 200), Result(0, 5000, 0)]
    report = summarize("closed loop", results, duration_s=2.0)
    assert (report.sent, report.succeeded, report.throughput_rps) == (4, 2, 1.0)
    assert report.errors == {"503": 1, "connection": 1}
    assert report.latency_ms["max"] == 20


def test_poisson_schedule_has_the_rate_and_exponential_gaps():
    arrivals = np.asarray(poisson_schedule(200.0, 50.0, seed=3))
    assert len(arrivals) == pytest.approx(10_000, rel=0.05)
    assert np.all(np.diff(arrivals) > 0) and arrivals[-1] < 50.0
    gaps = np.diff(arrivals)
    assert gaps.mean() == pytest.approx(1 / 200, rel=0.05)
    assert gaps.std() == pytest.approx(gaps.mean(), rel=0.1)  # exponential: std == mean
    assert poisson_schedule(200.0, 50.0, seed=3) == arrivals.tolist()  # deterministic per seed
    with pytest.raises(ValueError):
        poisson_schedule(0, 1)


def test_fit_recovers_t_fixed_and_t_img_from_noisy_synthetic_data():
    rng = np.random.default_rng(0)
    sizes = [1, 2, 4, 8, 16, 32]
    times = [12.0 + 3.0 * b + rng.normal(0, 0.2) for b in sizes]
    fit = fit_batch_time(sizes, times)
    assert fit.t_fixed_ms == pytest.approx(12.0, abs=0.5)
    assert fit.t_img_ms == pytest.approx(3.0, abs=0.05)
    assert fit.rms_error_ms < 0.4 and fit.r_squared > 0.999
    assert fit.capacity_rps(8) == pytest.approx(8000 / (fit.t_fixed_ms + 8 * fit.t_img_ms))
    with pytest.raises(ValueError):
        fit_batch_time([4, 4], [1.0, 2.0])


def test_a_negative_fixed_cost_is_refitted_through_the_origin():
    fit = fit_batch_time([1, 2, 4, 8], [8.0, 20.0, 44.0, 92.0])  # the free line: -4 + 12 B
    assert fit.t_fixed_ms == 0.0
    assert fit.t_img_ms == pytest.approx((8 + 40 + 176 + 736) / (1 + 4 + 16 + 64))


GPU_LIKE = BatchTimeFit(t_fixed_ms=20.0, t_img_ms=1.0, rms_error_ms=0.1, r_squared=1.0)


def test_tuner_picks_the_smallest_batch_that_covers_the_rate():
    # capacity(B) = 1000 B / (20 + B); 75% of it must cover 200 req/s -> B >= 7.3
    choice = recommend(GPU_LIKE, p99_target_ms=200, rate_rps=200, max_batch=64)
    assert choice.feasible and choice.batch_size == 8
    assert MAX_UTILISATION * choice.capacity_rps >= 200 > MAX_UTILISATION * GPU_LIKE.capacity_rps(7)
    assert choice.max_batch_delay_ms == int(1000 * 7 / 200)  # the time 200 req/s take to fill it
    assert choice.predicted_p99_ms <= 200


def test_tuner_for_maximum_throughput_takes_the_largest_batch_within_the_target():
    choice = recommend(GPU_LIKE, p99_target_ms=200, rate_rps=None, max_batch=256)
    assert choice.batch_size == 80  # 2 * (20 + 80) = 200
    assert choice.predicted_p99_ms <= 200


def test_tuner_says_when_the_target_cannot_be_met():
    too_tight = recommend(GPU_LIKE, p99_target_ms=30, rate_rps=10, max_batch=64)
    assert not too_tight.feasible and "batch size 1" in too_tight.reason
    too_fast = recommend(GPU_LIKE, p99_target_ms=100, rate_rps=5000, max_batch=64)
    assert not too_fast.feasible and too_fast.batch_size == 30  # the best within the target


def point(batch, clients, rps, p99, errors=0) -> SweepPoint:
    return SweepPoint(batch, 20, 1, clients, rps, p99 / 2, p99, errors)


def test_operating_point_is_the_fastest_that_meets_the_sla_without_errors():
    points = [point(1, 1, 30, 50), point(8, 16, 45, 420), point(8, 32, 47, 900), point(4, 16, 46, 300, 2)]
    assert choose_operating_point(points, sla_ms=500) == points[1]
    assert choose_operating_point(points, sla_ms=10) is None


def test_sweep_writes_json_csv_and_a_plot(tmp_path):
    points = [point(1, 1, 30, 50), point(1, 8, 32, 300), point(8, 1, 20, 100), point(8, 8, 45, 280)]
    write_results(points, points[3], 500, tmp_path / "sweep", "test")
    document = json.loads((tmp_path / "sweep.json").read_text())
    assert document["chosen"]["throughput_rps"] == 45 and len(document["points"]) == 4
    assert (tmp_path / "sweep.csv").read_text().count("\n") == 5
    assert (tmp_path / "sweep.png").read_bytes().startswith(b"\x89PNG")


def test_tuner_writes_only_the_chosen_models_serving_settings(tmp_path):
    copy = tmp_path / "models.yaml"
    shutil.copy(paths.MODEL_DESCRIPTIONS, copy)
    update_models_yaml(copy, "efficientnet_lite0", 16, 7)
    text = copy.read_text()
    first, second = text.split("  - name: ssdlite320")
    assert "batch_size: 16" in first and "max_batch_delay_ms: 7" in first
    assert "batch_size: 4" in second and "max_batch_delay_ms: 1" in second   # left as it was
    assert "# Model descriptions" in text  # comments kept


def test_load_generator_measures_an_instant_server_without_errors():
    server, url = instant_server()
    try:
        target = LoadTarget(url, [b"x" * 1000])
        clients = 4
        closed = run_closed_loop(target, clients=clients, duration_s=0.25, max_requests=100_000)
        # the clients go on asking until the quarter second is over: more requests than clients
        # (how many more depends on the CPU)
        assert closed.errors == {} and closed.succeeded == closed.sent > clients
        opened = run_open_loop(target, rate_rps=400, duration_s=0.25, max_requests=100_000, seed=2)
        assert opened.errors == {} and opened.sent == len(poisson_schedule(400, 0.25, seed=2))
        capped = run_closed_loop(target, clients=2, duration_s=5.0, max_requests=50)
        assert capped.sent <= 52  # bounded by count (each client may finish its request in flight)
    finally:
        server.shutdown()


def policy_row(rps: float, p50: float) -> dict[str, object]:
    return {"throughput_rps": rps, "p50_ms": p50, "p99_ms": 2 * p50, "errors": {}}


def test_policy_goals_take_the_one_client_reference_and_the_best_fixed_setting_per_load():
    closed = {"echo": {1: policy_row(1000.0, 0.5)}, "echo_async": {1: policy_row(600.0, 1.5)},
              "batch1": {1: policy_row(90.0, 10.0), 16: policy_row(180.0, 80.0)},
              "frontend_d1": {1: policy_row(85.0, 11.0), 16: policy_row(300.0, 50.0)},
              "continuous": {1: policy_row(88.0, 10.5), 16: policy_row(330.0, 45.0)},
              "single_session": {1: policy_row(100.0, 9.0), 16: policy_row(100.0, 150.0)}}
    found = goals(closed, batch1_ms=9.0)
    assert found["one_client_reference_ms"] == 9.5
    assert found["p50_over_reference_ms"] == {"batch1": 0.5, "frontend_d1": 1.5, "continuous": 1.0,
                                              "single_session": -0.5}
    # only TorchServe's own settings count as fixed settings: continuous may beat them
    assert found["best_fixed"] == {1: "batch1", 16: "frontend_d1"}
    assert found["share_of_best_fixed"]["continuous"][16] == 1.1
    assert found["over_single_session"]["frontend_d1"][16] == 3.0
    text = as_text({"settings": {}, "in_process_batch1_ms": 9.0, "closed_loop": closed,
                    "open_loop": {"frontend_d1": {75.0: policy_row(75.0, 12.0)}}, "goals": found})
    assert "| frontend_d1 | 16 clients | 300.0 | 50.0 | 100.0 |  |" in text
    assert "| frontend_d1 | 75.0 req/s offered | 75.0 | 12.0 | 24.0 |  |" in text
    assert "16 clients: best fixed setting frontend_d1" in text


def test_instances_bodies_carry_that_many_images_each_and_every_image_leads_one():
    bodies = [json.loads(body) for body in instances_bodies([b"a", b"b", b"c"], 4)]
    firsts = [base64.b64decode(body["instances"][0]["data"]) for body in bodies]
    assert firsts == [b"a", b"b", b"c"]
    assert [base64.b64decode(item["data"]) for item in bodies[1]["instances"]] == [b"b", b"c", b"a", b"b"]


def test_a_rolled_pod_keeps_its_ports_and_loads_the_new_version_with_its_settings(tmp_path):
    """lab rolling-update --new-version: the restarted pod's config is its own (same ports),
    loading the new archive, whose models= entry carries the old version's settings."""
    store = tmp_path / "store"
    store.mkdir()
    with zipfile.ZipFile(store / "efficientnet_lite0-2.0.mar", "w") as archive:
        archive.writestr("MAR-INF/MANIFEST.json", json.dumps(
            {"model": {"modelName": "efficientnet_lite0", "modelVersion": "2.0"}}))
    pod = server_config(tmp_path / "pod0", store, paths.DEVELOPMENT_CONFIG,
                        load_models="efficientnet_lite0-1.0.mar")
    rolled = read_properties(rolled_config(pod, tmp_path / "pod0-rolled", store,
                                           "efficientnet_lite0-2.0.mar"))
    before = read_properties(pod)
    assert {key: rolled[key] for key in ("inference_address", "management_address", "model_store")} == {
        key: before[key] for key in ("inference_address", "management_address", "model_store")}
    assert rolled["load_models"] == "efficientnet_lite0-2.0.mar"
    old = json.loads(before["models"])["efficientnet_lite0"]["1.0"]
    assert json.loads(rolled["models"])["efficientnet_lite0"] == {
        "2.0": {**old, "marName": "efficientnet_lite0-2.0.mar"}}


def test_the_cascade_lab_makes_its_inputs_from_a_folder_it_is_given(tmp_path):
    for name in ("chelsea.png", "coffee.png"):
        shutil.copy(photo_path(name), tmp_path / name)
    inputs = cascade_inputs(12, images_dir=tmp_path)
    assert len(set(inputs)) == 12
    # The folder's photos whole first, then their variants.
    whole = [Image.open(io.BytesIO(body)).size for body in inputs[:2]]
    assert whole == [Image.open(photo_path(name)).size for name in ("chelsea.png", "coffee.png")]
    (tmp_path / "empty").mkdir()
    with pytest.raises(PhotoSetError, match="holds no photos"):
        cascade_inputs(12, images_dir=tmp_path / "empty")


def test_detector_parts_times_every_part_of_the_served_detector_and_refuses_a_classifier(model_store):
    figures = detector_parts.measure(model_store / "ssdlite320-1.0.mar", 1, [1], repeats=1, rounds=1)
    assert set(detector_parts.PARTS) <= set(figures[1])
    # the archive's backbone + head on both engines, and the whole as its worker serves it
    assert {"openvino-fp32 backbone+head", "onnxruntime-fp32 backbone+head"} <= set(figures[1])
    assert all(ms > 0 for ms in figures[1].values())
    assert {"postprocess, requests at 0.3", "whole, requests at 0.3"} <= set(figures[1])
    served = [part for part in figures[1] if part.startswith("whole as served (")]
    assert len(served) == 1 and served[0].endswith("-fp32), requests at 0.3")
    assert detector_parts.table(figures).splitlines()[0].split() == ["part", "batch", "1", "ms"]
    with pytest.raises(ValueError, match=r"efficientnet_lite0-1\.0\.mar: not a detector archive"):
        detector_parts.measure(model_store / "efficientnet_lite0-1.0.mar", 1, [1], 1, 1)


def test_goodput_counts_only_answers_within_the_clients_timeout():
    results = [Result(0.0, 200.0, 200), Result(0.1, 900.0, 200), Result(0.2, 1500.0, 200),
               Result(0.3, 5.0, 503), Result(0.4, 300.0, 504), Result(0.5, 1000.0, 0),
               Result(0.6, 10.0, 500)]
    row = goodput_row(results, timeout_ms=1000, duration_s=2.0, setting="deadline", load=2.0,
                      offered_rps=7.0)
    assert row.goodput_rps == 1.0                     # 2 useful answers in 2 s
    assert (row.late, row.shed, row.expired, row.timed_out, row.other_errors) == (1, 1, 1, 1, 1)
    assert row.sent == 7 and 200.0 < row.useful_p99_ms <= 900.0


def test_the_drift_lab_counts_windows_over_the_threshold_and_its_shifts_shift():
    profile = DriftProfile.from_counts(Counter({("brightness", "96"): 10}), ["brightness"], "test")
    quiet, dark = Counter({("brightness", "96"): 1}), Counter({("brightness", "0"): 1})
    stream = [quiet] * 8 + [dark] * 2 + [quiet] * 10 + [dark] * 3     # 2 windows of 10, 3 left over
    alarms = false_alarms(profile, stream, window=10, threshold=0.1)
    assert (alarms.windows, alarms.crossed) == (2, {"brightness": 1})
    assert alarms.largest["brightness"] == pytest.approx(profile.drift(Counter(
        {("brightness", "96"): 8, ("brightness", "0"): 2}))["brightness"])
    originals = variant_jpegs(project_photos(), 3, seed=1)
    streams = shifted_streams(originals, 3)
    assert set(streams) == {"darkened", "rotated", "downscaled", "other subjects"}

    def opened(body: bytes) -> Image.Image:
        return Image.open(io.BytesIO(body))

    for original, darker, turned, smaller in zip(originals, streams["darkened"], streams["rotated"],
                                                 streams["downscaled"], strict=True):
        assert np.asarray(opened(darker)).mean() < 0.5 * np.asarray(opened(original)).mean()
        assert opened(turned).size == opened(original).size[::-1]
        assert opened(smaller).width == opened(original).width // 3
    assert len(set(streams["other subjects"])) == 3


def test_the_rehearsal_reads_the_balancers_changes_of_its_rotation_from_its_warnings():
    """lab rolling-update: HAProxy's own warnings (its stderr in the foreground, as HAProxy 2.6
    writes them) become the report's balancer changes; other lines are left out."""
    stderr = io.BytesIO(
        b"[NOTICE]   (41) : haproxy version is 2.6.12\n"
        b'[WARNING]  (41) : Server pods/pod1 is DOWN, reason: Layer7 wrong status, code: 503, '
        b'info: "Service Unavailable", check duration: 2ms. 1 active and 0 backup servers left. '
        b"2 sessions active, 0 requeued, 0 remaining in queue.\n"
        b"[ALERT]    (41) : backend 'pods' has no server available!\n"
        b"[WARNING]  (41) : Server pods/pod1 is UP, reason: Layer7 check passed, code: 200, check "
        b"duration: 1ms. 2 active and 0 backup servers online. 0 sessions requeued, 0 total in queue.\n")
    started = time.perf_counter()
    log = BalancerLog(stderr)
    log.thread.join(timeout=10)
    changes = [change.split(": ", 1)[1] for change in log.since(started)]
    assert changes == [
        'pod1 DOWN: Layer7 wrong status, code: 503, info: "Service Unavailable", check duration: 2ms',
        "no pod in the rotation",
        "pod1 UP: Layer7 check passed, code: 200, check duration: 1ms"]
    assert log.since(time.perf_counter() + 1) == []
    # a wait for the balancer that times out says what HAProxy said last, whatever it was
    said = str(log.error("timed out waiting for HAProxy to see every pod"))
    assert said.startswith("timed out waiting") and "haproxy version is 2.6.12" in said
    assert "backend 'pods' has no server available!" in said


def test_a_wait_for_a_balancer_that_exited_ends_at_once_with_what_it_said(tmp_path):
    """lab rolling-update: HAProxy that cannot bind its port exits; the wait for its rotation
    ends with its exit status and its alert, not 30 s later with a time-out."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (stats_port,) = free_ports(1)
        (tmp_path / "haproxy.cfg").write_text(haproxy_config(port, [], stats_port))
        balancer = subprocess.Popen([haproxy_binary(), "-db", "-f", str(tmp_path / "haproxy.cfg")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert balancer.stderr is not None
        log = BalancerLog(balancer.stderr, balancer)
        try:
            with pytest.raises(PodError) as raised:
                wait_until(lambda: pods_in_rotation(stats_port, log) == 2, 30, "HAProxy to see every pod",
                           interval_s=0.05, error=log.error)
        finally:
            balancer.kill()
            balancer.wait()
    said = str(raised.value)
    assert said.startswith(f"HAProxy exited with status {balancer.returncode}")
    assert "cannot bind socket" in said and f"127.0.0.1:{port}" in said, said


class NotReadyProbe(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"ready": False, "reason": "efficientnet_lite0: 0 of 1 workers READY"}).encode()
        self.send_response(503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_wait_for_the_balancer_that_times_out_says_what_each_pods_readiness_answers(tmp_path):
    """lab rolling-update: with HAProxy's last lines, the time-out names each pod's own answer
    to GET /ready (its reason, or none), so a pod that is not ready is told from a slow check."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), NotReadyProbe)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    (nothing_there,) = free_ports(1)
    pods = [Pod(name, tmp_path, tmp_path, tmp_path, probe_port=port)
            for name, port in (("pod0", server.server_address[1]), ("pod1", nothing_there))]
    try:
        log = BalancerLog(io.BytesIO(b"[WARNING]  (41) : Server pods/pod0 is DOWN, reason: Layer7 "
                                     b"wrong status, code: 503\n"))
        log.thread.join(timeout=10)
        said = str(balancer_wait_error(pods, log)("timed out after 30 s waiting for HAProxy"))
    finally:
        server.shutdown()
        server.server_close()
    assert said.startswith("timed out after 30 s waiting for HAProxy (pod0 /ready 503 "
                           '{"ready": false, "reason": "efficientnet_lite0: 0 of 1 workers READY"} in ')
    assert "; pod1 /ready no answer {} in " in said
    assert said.endswith("HAProxy's last lines:\n[WARNING]  (41) : Server pods/pod0 is DOWN, reason: "
                         "Layer7 wrong status, code: 503")
    without_log = str(balancer_wait_error(pods[1:], None)("timed out"))
    assert without_log.startswith("timed out (pod1 /ready no answer")


def test_the_ultralytics_lab_prints_both_sides_and_the_two_ratios():
    from torchserve_vision.lab.ultralytics_serving import markdown, timed_rounds

    calls = []
    rates = timed_rounds(lambda: calls.append(1), 4, 0.05)
    assert rates["images_per_s"] > 0 and len(calls) >= 1
    figures = {"yolov8n.torchscript": {
        "served": {1: {"images_per_s": 20.0, "p50_ms": 50.0, "errors": 0},
                   16: {"images_per_s": 30.0, "p50_ms": 500.0, "errors": 0}},
        "ultralytics": {"one_at_a_time": {"images_per_s": 10.0, "ms_per_image": 100.0}},
        "served_at_most_clients_over_best_predict": 3.0, "one_client_p50_over_predict_one_image": 0.5}}
    text = markdown(figures)
    assert "| 16 | 30.0 | 500.0 | 0 |" in text and "| one at a time | 10.0 | 100.0 |" in text
    assert "3.0x" in text and "0.5x" in text


def test_a_rolling_step_counts_failures_by_when_they_ended_and_requests_sent_while_its_pod_was_out():
    step = PodStep("pod0", True, 0, 1.0, 4.0, stopped_at_s=10.0, back_at_s=15.0)
    results = [Result(9.0, 500.0, 200), Result(9.5, 1000.0, 503),    # ended 9.5 and 10.5
               Result(10.0, 10.0, 200), Result(14.9, 10.0, 0), Result(15.0, 10.0, 200),
               Result(30.0, 10.0, 503)]                            # after the window
    counted = step_counts(step, results, 10.0, 20.0)
    assert (counted.failed, counted.errors) == (2, {"503": 1, "connection": 1})
    assert counted.sent_while_out == 2      # scheduled at 10.0 and 14.9; 15.0 is back
