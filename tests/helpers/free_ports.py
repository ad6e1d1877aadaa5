"""Free TCP ports for tests that hand a port to a server in another process. Not a test module.

Binding port 0 and closing the socket is not enough there, and CI met both ways it fails:
* The kernel hands the same ephemeral port out again: `test_cluster` once gave `ray start` one port
  for two of its components, and Ray refused to start ("... is trying to use a port number 47575
  that is used by other components").
* Until the server binds it, the port is free for anyone: one of the run's own processes (Ray's gRPC
  servers, TransferQueue's sockets) took the port `tests/e2e/functional/metrics.sh` had picked, the run
  served on the next one, and Prometheus scraped nothing.

So a port comes from 20000-32000: below the kernel's ephemeral range (32768-60999 by default, where
outgoing connections and other bind-to-0 servers get theirs) and above Ray's worker ports
(10002-19999). It is bindable when drawn, and never handed out twice by one process.

Every test that picks a port uses it (Ray nodes, metrics endpoints, Prometheus, the trainers'
rendezvous); `python tests/helpers/free_ports.py` prints one (the functional shell tests use it).
"""

from __future__ import annotations

import random
import socket

LOW, HIGH = 20000, 32000
_given: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port in [LOW, HIGH] that `host` can bind now, not returned before by this process."""
    for _ in range(1000):
        port = random.randint(LOW, HIGH)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in {LOW}-{HIGH} on {host} after 1000 draws ({len(_given)} given out already)")


if __name__ == "__main__":
    print(free_port())
