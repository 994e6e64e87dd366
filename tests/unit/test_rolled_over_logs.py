"""The test servers' logs are read with the files log4j2 rolled them over into at midnight."""

import gzip
import os

from tests.server.logs import log_lines, rolled_over


def test_a_log_is_read_with_the_files_it_rolled_over_into_oldest_first(tmp_path):
    (tmp_path / "model_log.25-Nov.log.gz").write_bytes(gzip.compress(b"first\n"))
    (tmp_path / "model_log.26-Nov.log.gz").write_bytes(gzip.compress(b"second\n"))
    (tmp_path / "model_log.log").write_text("third\n")
    (tmp_path / "ts_log.26-Nov.log.gz").write_bytes(gzip.compress(b"another log\n"))
    os.utime(tmp_path / "model_log.25-Nov.log.gz", (1_000, 1_000))
    os.utime(tmp_path / "model_log.26-Nov.log.gz", (2_000, 2_000))
    assert log_lines(tmp_path / "model_log.log") == ["first", "second", "third"]
    assert log_lines(tmp_path / "missing" / "model_log.log") == []


def test_a_file_being_compressed_is_read_once_from_its_whole_copy(tmp_path):
    (tmp_path / "model_log.26-Nov.log").write_text("rolled\n")
    (tmp_path / "model_log.26-Nov.log.gz").write_bytes(gzip.compress(b"rol"))
    assert rolled_over(tmp_path / "model_log.log") == [tmp_path / "model_log.26-Nov.log"]
    assert log_lines(tmp_path / "model_log.log") == ["rolled"]
