"""Runner names, CPU kinds and the order table an archive records (pure)."""

from __future__ import annotations

import pytest

from handlers.model.runner_order import (
    DEFAULT_RUNNER_ORDER,
    RunnerName,
    cpu_kind,
    order_for,
    order_to_yaml,
    parse_runner_name,
    parse_runner_order,
    weights_for,
)


def test_runner_names_round_trip_and_unknown_ones_say_what_exists():
    assert parse_runner_name("openvino-bf16") == RunnerName("openvino", "bf16")
    assert str(parse_runner_name("onnxruntime-fp32")) == "onnxruntime-fp32"
    assert parse_runner_name("openvino-int8") == RunnerName("openvino", "int8")
    for bad in ("onnxruntime-bf16", "tensorrt-fp16", "openvino", "aoti-int4", "aoti-int8",
                "onnxruntime-int8"):
        with pytest.raises(ValueError, match=r"runners are .*aoti-fp32"):
            parse_runner_name(bad)


@pytest.mark.parametrize(("table", "message"), [
    ({"avx512_bf16": ["openvino-bf16"]}, "needs an 'avx2' row"),
    ({"avx2": ["aoti-fp32"], "sse4": ["aoti-fp32"]}, "unknown CPU kind 'sse4'"),
    ({"avx2": ["aoti-fp32", "aoti-fp32"]}, "names a runner twice"),
    ({"avx2": "aoti-fp32"}, "must be a list"),
])
def test_a_bad_order_table_is_refused_with_its_reason(table, message):
    with pytest.raises(ValueError, match=message):
        parse_runner_order(table)


def test_the_default_table_parses_and_round_trips():
    parsed = parse_runner_order(DEFAULT_RUNNER_ORDER)
    assert order_to_yaml(parsed) == {kind: list(names) for kind, names in DEFAULT_RUNNER_ORDER.items()}
    # bf16 runners only where bf16 is native: the avx2 row would never run them.
    assert all(name.precision != "bf16" for name in parsed["avx2"])


@pytest.mark.parametrize(("capability", "features", "native_bf16", "kind"), [
    ("AVX512", frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}), True, "amx"),
    ("AVX512", frozenset({"avx512f", "avx512_bf16"}), True, "avx512_bf16"),
    ("AVX512", frozenset({"avx512f"}), False, "avx512"),
    ("AVX2", frozenset({"avx2"}), False, "avx2"),
    # ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 on an AVX-512 CPU: rehearses avx2's order.
    ("AVX2", frozenset({"avx512f", "avx512_bf16"}), False, "avx2"),
    ("AVX512", None, True, "avx512_bf16"),
])
def test_the_cpu_kind_follows_native_bf16_amx_and_the_capability(capability, features, native_bf16, kind):
    assert cpu_kind(capability, features, native_bf16) == kind


def test_a_kind_without_a_row_walks_down_to_the_nearest_lesser_one():
    table = parse_runner_order({"avx512_bf16": ["openvino-bf16"], "avx2": ["onnxruntime-fp32"]})
    assert order_for("amx", table) == (RunnerName("openvino", "bf16"),)
    assert order_for("avx512", table) == (RunnerName("onnxruntime", "fp32"),)
    assert order_for("avx2", table) == (RunnerName("onnxruntime", "fp32"),)


def test_only_an_int8_runner_loads_int8_weights():
    assert weights_for("int8") == "int8"
    assert weights_for("fp32") == weights_for("bf16") == "fp32"
