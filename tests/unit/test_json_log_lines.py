"""`server run --log-to json`: the wrapping of lines that log4j2 does not write, the relay, and
the JSON log4j2 config kept in step with the text one."""

from __future__ import annotations

import json
import os
import threading
import xml.etree.ElementTree as ElementTree

import pytest

from torchserve_vision import paths
from torchserve_vision.json_log_lines import as_json_line, json_line_relay, json_log_line
from torchserve_vision.waiting import wait_until


def test_a_json_object_passes_through_and_anything_else_is_wrapped():
    line = '{"time":"2026-11-24T10:00:00.000+00:00","log":"access","message":"x"}'
    assert as_json_line(line) == line
    for text in ("Model server started.", "[1, 2]", '{"not json', "{}}"):
        wrapped = json.loads(as_json_line(text))
        assert wrapped["log"] == "console" and wrapped["message"] == text and wrapped["level"] == "INFO"


def test_own_lines_carry_an_iso_time_with_its_offset():
    line = json.loads(json_log_line("TorchServe has stopped", "server", "WARN"))
    assert line["log"] == "server" and line["level"] == "WARN"
    assert line["time"][10] == "T" and line["time"][-6] in "+-"


def test_the_relay_copies_each_line_to_standard_output_as_json(capfd: pytest.CaptureFixture[str]):
    before = set(threading.enumerate())
    write_end = json_line_relay()
    (relay,) = [thread for thread in set(threading.enumerate()) - before
                if thread.name == "json-log-relay"]
    os.write(write_end, b'plain text\n{"log":"ts","message":"m"}\n\nlast without newline')
    os.close(write_end)
    # The relay ends once every writer has closed the pipe; the output is read once after it
    # (reading capfd while the relay writes can lose a line between pytest's read and truncate).
    wait_until(lambda: not relay.is_alive(), 10, "the relay to copy the lines and end")
    lines = capfd.readouterr().out.splitlines()
    assert [json.loads(line)["message"] for line in lines] == ["plain text", "m", "last without newline"]


def configuration(path: str) -> ElementTree.Element:
    return ElementTree.parse(path).getroot()


def test_the_json_config_has_the_text_configs_loggers_filters_and_appenders():
    text, as_json = configuration(str(paths.STDOUT_LOG_CONFIG)), configuration(str(paths.JSON_LOG_CONFIG))
    text_loggers, json_loggers = text.find("Loggers"), as_json.find("Loggers")
    assert text_loggers is not None and json_loggers is not None
    assert ElementTree.tostring(text_loggers) == ElementTree.tostring(json_loggers)
    for name in ("access_stdout", "ts_stdout", "model_stdout", "ts_metrics_stdout", "model_metrics_stdout"):
        text_console = text.find(f"Appenders/Console[@name='{name}']")
        json_console = as_json.find(f"Appenders/Console[@name='{name}']")
        assert text_console is not None and json_console is not None
        filters = [ElementTree.tostring(element) for element in text_console
                   if element.tag != "PatternLayout"]
        assert filters == [ElementTree.tostring(element) for element in json_console
                           if element.tag != "PatternLayout"]
        pattern = json_console.findtext("PatternLayout/Pattern") or ""
        assert pattern.startswith('{"time":"') and '"message":"%enc{%m}{JSON}"' in pattern
        assert f'"log":"{name.removesuffix("_stdout")}"' in pattern
    assert [a.attrib for a in text.iter("Async")] == [a.attrib for a in as_json.iter("Async")]
