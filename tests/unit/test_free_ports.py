"""Ports for servers started beside others (tests, labs, `server run`'s probe port): free now,
outside the range the kernel takes outgoing connections' local ports from, not handed out twice
by one process, and from a share of the range of their own for processes side by side."""

from __future__ import annotations

import socket
from collections import deque

import pytest

from torchserve_vision import torchserve_config
from torchserve_vision.torchserve_config import (
    LOWEST_CHOSEN_PORT,
    PORT_SHARE_VARIABLE,
    ConfigError,
    chosen_range,
    ephemeral_range_start,
    free_ports,
    port_free,
)

SMALL_RANGE = range(LOWEST_CHOSEN_PORT, LOWEST_CHOSEN_PORT + 1000)


@pytest.fixture
def nothing_handed_out(monkeypatch: pytest.MonkeyPatch) -> deque[int]:
    """This process's memory of handed-out ports, empty for the test (the run's servers drew
    ports before it)."""
    handed_out: deque[int] = deque(maxlen=torchserve_config.HANDED_OUT.maxlen)
    monkeypatch.setattr(torchserve_config, "HANDED_OUT", handed_out)
    return handed_out


def test_ports_are_distinct_free_and_below_the_ephemeral_range(monkeypatch):
    monkeypatch.delenv(PORT_SHARE_VARIABLE, raising=False)
    below = ephemeral_range_start()
    for _ in range(20):
        ports = free_ports(5)
        assert len(set(ports)) == 5
        assert all(LOWEST_CHOSEN_PORT <= port < below for port in ports), ports
        assert all(port_free(port) for port in ports)


def test_a_port_in_use_is_never_chosen(nothing_handed_out):
    """Only 1,000 ports to choose from, one of them listened on: it is never among 900 chosen."""
    (busy,) = free_ports(1, SMALL_RANGE)
    nothing_handed_out.clear()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", busy))
        taken.listen()
        assert not port_free(busy)
        chosen = free_ports(900, SMALL_RANGE)
    assert busy not in chosen and len(set(chosen)) == 900
    assert all(port in SMALL_RANGE for port in chosen)


def test_a_port_handed_out_is_not_handed_out_again_before_it_is_bound(nothing_handed_out):
    """Two servers' ports drawn one after the other, neither bound yet: 2 x 450 of 1,000 ports
    never meet (drawn at random without the memory, two draws of 450 would share about 200)."""
    first, second = free_ports(450, SMALL_RANGE), free_ports(450, SMALL_RANGE)
    assert not set(first) & set(second)
    assert set(nothing_handed_out) == set(first) | set(second)


def test_each_share_of_the_range_is_its_own_and_together_they_cover_it(monkeypatch, tmp_path):
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("32768\t60999\n")
    whole = chosen_range("", setting)
    assert whole == range(LOWEST_CHOSEN_PORT, 32768)
    shares = [chosen_range(f"{index}/3", setting) for index in range(3)]
    assert [share.start for share in shares[1:]] == [share.stop for share in shares[:-1]]
    assert shares[0].start == whole.start and whole.stop - shares[-1].stop < 3
    assert {len(share) for share in shares} == {len(whole) // 3}
    monkeypatch.setenv(PORT_SHARE_VARIABLE, "1/2")
    assert chosen_range(range_file=setting) == range(LOWEST_CHOSEN_PORT + len(whole) // 2,
                                                     LOWEST_CHOSEN_PORT + 2 * (len(whole) // 2))
    assert all(port in chosen_range() for port in free_ports(20))
    for wrong in ("1", "2/2", "-1/2", "a/b"):
        with pytest.raises(ConfigError, match=PORT_SHARE_VARIABLE):
            chosen_range(wrong, setting)


def test_the_range_is_read_from_the_kernel_setting_or_defaults(tmp_path):
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t60999\n")
    assert ephemeral_range_start(setting) == 40000
    assert ephemeral_range_start(tmp_path / "missing") == 32768
    setting.write_text("")
    assert ephemeral_range_start(setting) == 32768


def test_with_too_few_ports_below_the_range_the_kernel_chooses():
    ports = free_ports(3, range(LOWEST_CHOSEN_PORT, LOWEST_CHOSEN_PORT + 10))
    assert len(set(ports)) == 3
    assert all(port >= ephemeral_range_start() for port in ports), ports
