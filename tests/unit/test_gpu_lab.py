"""The pieces of `lab gpu` that run anywhere: the multi-process load generator against the
trivial responder, the distinct benchmark JPEGs, the answer rule applied image by image, and
the in-process reference (tiny, on the CPU). The whole command is rehearsed on a CPU as
docs/benchmarks.md ("GPU") says, and run on a GPU machine."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

from handlers.batch.batch_record import BatchRecord
from handlers.model.answer_agreement import DEVICE_BOUND, PROBABILITY_BOUNDS
from handlers.request.image_header import read_header
from torchserve_vision.lab.benchmark_images import distinct_jpegs
from torchserve_vision.lab.device_answers import STORED_TURNED, agreement, answer_check_images
from torchserve_vision.lab.gpu_lab import as_text, range_times
from torchserve_vision.lab.gpu_reference import classifier_pipeline, model_only, parse_dmon
from torchserve_vision.lab.process_load import run_processes, trivial_responder


@pytest.mark.slow
def test_several_load_processes_measure_the_trivial_responder_without_errors(tmp_path):
    bodies = [b"x" * 1000, b"y" * 2000, b"z" * 3000]
    with trivial_responder(2) as url:
        report = run_processes(url, bodies, clients=4, processes=2, duration_s=1.0, warm_up_s=0.3,
                               work_dir=tmp_path)
    assert report.errors == {} and report.succeeded == report.sent > 0
    assert report.extra == {"clients": 4, "processes": 2}
    assert report.latency_ms["p50"] > 0


@pytest.mark.slow
def test_a_refused_connection_is_counted_as_an_error(tmp_path):
    report = run_processes("http://127.0.0.1:9/predictions/nothing", [b"x"], clients=1, processes=1,
                           duration_s=0.3, warm_up_s=0.0, work_dir=tmp_path)
    assert report.succeeded == 0 and report.errors.get("connection", 0) > 0


def test_benchmark_jpegs_are_distinct_square_and_chroma_subsampled():
    jpegs = distinct_jpegs(12, size=96)
    assert len({hashlib.sha256(body).digest() for body in jpegs}) == 12
    for body in jpegs:
        header = read_header(body)
        assert (header.width, header.height) == (96, 96) and header.jpeg is not None
        assert header.jpeg.device_decodable
    assert jpegs == distinct_jpegs(12, size=96)      # seeded: the same set every run


def test_the_answer_check_images_are_the_photos_their_variants_and_turned_photos():
    images = answer_check_images(variants=10)
    assert len(images) == 10 + 6 * len(STORED_TURNED)
    assert images[0].name == "astronaut.png" and images[6].name.startswith("variant-")
    turned = [image for image in images if "@orientation-" in image.name]
    assert {read_header(image.body).orientation for image in turned} == set(STORED_TURNED)


def test_agreement_applies_the_cross_device_rule_image_by_image():
    reference = [[(1, 0.60), (2, 0.30)], [(5, 0.90), (6, 0.05)]]
    got = [[(1, 0.59), (2, 0.31)], [(6, 0.50), (5, 0.45)]]
    result = agreement("fp32", ["near", "flipped"], got, reference)
    assert result.bound == DEVICE_BOUND and result.top1_changes == 1 and result.decoded_on == "device"
    assert set(result.disagreements) == {"flipped"} and not result.agrees
    assert result.worst_image == "flipped" and abs(result.max_change - 0.45) < 1e-9
    # From the CPU's decoded pixels the GPU is held to fp32's own bound: 0.01 is too far there.
    from_cpu_pixels = agreement("fp32", ["near", "flipped"], got, reference, decoded_on="cpu")
    assert from_cpu_pixels.bound == PROBABILITY_BOUNDS["fp32"]
    assert set(from_cpu_pixels.disagreements) == {"near", "flipped"}


def test_the_reference_pipeline_and_model_alone_run_on_the_cpu():
    network = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))
    cpu = torch.device("cpu")
    assert set(model_only(network, 32, "fp32", False, [2], cpu)) == {2}
    rates = classifier_pipeline(network, distinct_jpegs(3, size=48), 40, 32, (0.5,) * 3, (0.5,) * 3,
                                "fp32", True, [2], cpu)
    assert rates[2] > 0


def test_the_levers_are_variants_of_the_served_models_with_their_settings_changed(monkeypatch):
    import dataclasses

    from handlers.request import nvimgcodec_decoder
    from torchserve_vision.lab import gpu_lab
    from torchserve_vision.model_descriptions import load_descriptions

    descriptions = load_descriptions(gpu_lab.GPU_MODELS)
    by_name = {description.name: description for description in descriptions}
    declared = {f"{model}_{variant}": overrides for model, variant, overrides in gpu_lab.LEVERS}
    variants = {variant.name: (model, variant) for model, variant in gpu_lab.lever_variants(descriptions)}
    assert set(variants) == set(declared) >= {"resnet50_graphs", "resnet50_autocast",
                                              "ssdlite320_per_image_postprocess", "resnet50_nvimgcodec"}
    for name, (model, variant) in variants.items():
        base, overrides = by_name[model], declared[name]
        changed = {key for key in {*base.handler_options, *variant.handler_options}
                   if base.handler_options.get(key) != variant.handler_options.get(key)}
        assert changed == set(overrides) - {"serving"}, name
        assert variant.serving == dataclasses.replace(base.serving, **overrides.get("serving", {})), name
        assert variant.weights == base.weights
    detection = variants["ssdlite320_per_image_postprocess"][1].handler_options["detection"]
    assert detection == {**by_name["ssdlite320"].handler_options["detection"], "postprocess": "per-image"}
    assert variants["resnet50_graphs"][1].handler_options["cuda_graphs"] is True
    assert variants["ssdlite320_batch_64_2_workers"][1].serving.batch_size == 64
    chosen = gpu_lab.lever_variants(descriptions, ["resnet50_graphs", "ssdlite320_nvimgcodec"])
    assert [variant.name for _, variant in chosen] == ["resnet50_graphs", "ssdlite320_nvimgcodec"]
    monkeypatch.setattr(nvimgcodec_decoder, "available", lambda: False)
    assert not any("nvimgcodec" in variant.name for _, variant in gpu_lab.lever_variants(descriptions))


def test_a_runs_plan_adds_up_its_loads_and_overheads():
    from pathlib import Path

    from torchserve_vision.lab import gpu_lab
    from torchserve_vision.model_descriptions import load_descriptions

    descriptions = load_descriptions(gpu_lab.GPU_MODELS)
    only_levers = gpu_lab.GpuLabSettings(Path("."), duration_s=5, warm_up_s=1, steps=("levers",), levers=(
        "resnet50_graphs", "resnet50_autocast", "ssdlite320_per_image_postprocess"))
    assert gpu_lab.planned_s(only_levers, descriptions) == (
        gpu_lab.SERVER_OVERHEAD_S + 3 * (6 + gpu_lab.VARIANT_OVERHEAD_S))
    everything = gpu_lab.GpuLabSettings(Path("."), duration_s=5, warm_up_s=1)
    assert gpu_lab.planned_s(everything, descriptions) > gpu_lab.planned_s(only_levers, descriptions)


def test_a_profiled_batch_is_split_by_the_handlers_ranges():
    """The batch record's stages and the decode's own ranges come out of torch.profiler by name,
    with the host's time inside each (the GPU's is 0 on a CPU)."""
    record = BatchRecord("m", "1")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        for _ in range(2):
            with record.timing("decode"), torch.profiler.record_function("decode:chroma"):
                torch.ones(1000).cumsum(0)
        with record.timing("inference"):
            torch.ones(10).sum()
        with torch.profiler.record_function("elsewhere"):
            torch.ones(10).sum()
    ranges = range_times(profiler.key_averages())
    assert set(ranges) == {"stage:decode", "decode:chroma", "stage:inference"}
    assert ranges["stage:decode"]["calls"] == 2
    assert ranges["stage:decode"]["host_ms"] >= ranges["decode:chroma"]["host_ms"] > 0
    assert ranges["stage:inference"]["device_ms"] == 0


def test_nvidia_smi_dmon_samples_are_read_by_their_header():
    """Two header lines, then one row per second; a column a GPU lacks reads "-"."""
    text = ("# gpu     sm    mem    enc    dec    jpg    ofa \n"
            "# Idx      %      %      %      %      %      % \n"
            "    0     35     10      0      0     42      - \n"
            "    0     61     12      0      0     77      - \n")
    assert parse_dmon(text) == [{"sm": 35, "mem": 10, "enc": 0, "dec": 0, "jpg": 42},
                                {"sm": 61, "mem": 12, "enc": 0, "dec": 0, "jpg": 77}]
    assert parse_dmon("") == []


def test_the_text_summary_lists_rates_and_the_jpeg_engines_apart():
    """In-process rates per batch, then the decode-only runs' engine use, measured or not."""
    engines = {"measured": True, "samples": 4, "busiest_percent": {"sm": 20, "dec": 0, "jpg": 55},
               "images_per_s": 9000.0, "on_jpeg_engines": True}
    record = {"machine": {"device": "cpu", "torch": "2", "torchvision": "0", "cpus": 2},
              "in_process": {"decode_torchvision": {64: 1000.0}, "decode_engines_torchvision": engines,
                             "decode_engines_nvimgcodec": {"measured": False, "why": "needs a CUDA device"}}}
    text = as_text(record)
    assert "decode_torchvision b64 1000" in text and "decode_engines_torchvision b" not in text
    assert "decode_engines_torchvision: busiest sample {'sm': 20, 'dec': 0, 'jpg': 55} over 4 s" in text
    assert "on the JPEG engines: True" in text
    assert "decode_engines_nvimgcodec: not measured (needs a CUDA device)" in text
