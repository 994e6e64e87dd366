"""Ports for servers started beside others (tests, labs, `server run`'s probe port): free now, and
outside the range the kernel takes outgoing connections' local ports from."""

from __future__ import annotations

import socket

from torchserve_vision.torchserve_config import (
    LOWEST_CHOSEN_PORT,
    ephemeral_range_start,
    free_ports,
    port_free,
)


def test_ports_are_distinct_free_and_below_the_ephemeral_range():
    below = ephemeral_range_start()
    for _ in range(20):
        ports = free_ports(5)
        assert len(set(ports)) == 5
        assert all(LOWEST_CHOSEN_PORT <= port < below for port in ports), ports
        assert all(port_free(port) for port in ports)


def test_a_port_in_use_is_never_chosen():
    """Only 1,000 ports to choose from, one of them listened on: it is never among 900 chosen."""
    below = LOWEST_CHOSEN_PORT + 1000
    (busy,) = free_ports(1, below=below)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", busy))
        taken.listen()
        assert not port_free(busy)
        chosen = free_ports(900, below=below)
    assert busy not in chosen and len(set(chosen)) == 900
    assert all(LOWEST_CHOSEN_PORT <= port < below for port in chosen)


def test_the_range_is_read_from_the_kernel_setting_or_defaults(tmp_path):
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t60999\n")
    assert ephemeral_range_start(setting) == 40000
    assert ephemeral_range_start(tmp_path / "missing") == 32768
    setting.write_text("")
    assert ephemeral_range_start(setting) == 32768


def test_with_too_few_ports_below_the_range_the_kernel_chooses():
    ports = free_ports(3, below=LOWEST_CHOSEN_PORT + 10)
    assert len(set(ports)) == 3
    assert all(port >= ephemeral_range_start() for port in ports), ports
