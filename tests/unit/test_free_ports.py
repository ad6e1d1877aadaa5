"""tests/helpers/free_ports.py: the ports handed to other processes' servers (Ray's components, a run's
metrics endpoint, Prometheus, a DDP rendezvous) are distinct, bindable, and outside the ranges where
the kernel or Ray give ports to anyone else."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.helpers import free_ports


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except OSError:  # not Linux: the kernel default there
        return 32768, 60999


def test_ports_are_distinct_and_outside_the_ephemeral_and_ray_worker_ranges():
    ports = [free_ports.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports), "a port was handed out twice"
    low, high = _ephemeral_range()
    for p in ports:
        assert free_ports.LOW <= p <= free_ports.HIGH
        assert not low <= p <= high, f"{p} is in the kernel's ephemeral range {low}-{high}"
        assert not 10002 <= p <= 19999, f"{p} is in Ray's default worker port range"


def test_a_port_in_use_or_given_before_is_skipped(monkeypatch):
    given = free_ports.free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        fresh = next(p for p in range(free_ports.LOW, free_ports.HIGH) if p not in free_ports._given and p != busy)
        draws = iter([busy, given, fresh])
        monkeypatch.setattr(free_ports.random, "randint", lambda a, b: next(draws))
        assert free_ports.free_port() == fresh


def test_no_free_port_is_an_error_that_says_so(monkeypatch):
    given = free_ports.free_port()
    monkeypatch.setattr(free_ports.random, "randint", lambda a, b: given)
    try:
        free_ports.free_port()
    except RuntimeError as e:
        assert "no free port in 20000-32000" in str(e)
    else:
        raise AssertionError("free_port returned a port it had given out before")
