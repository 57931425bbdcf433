"""A free port for a server that a test starts later by number (the engines listen on a
configured port, not one the OS assigns). Taken below the host's ephemeral range: a port the
OS handed out for `bind(0)` can be handed again to any outgoing connection (of this test, of
the engines, of another process) between the check and the engine's bind, which failed the
vLLM lane once with "Address already in use"; below the range, only a listener can take it."""

from __future__ import annotations

import random
import socket

_given: set = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, below the ephemeral range, not given
    before by this process."""
    top = _ephemeral_low() - 1
    bottom = max(1024, top - 12000)
    for _ in range(500):
        port = random.randint(bottom, top)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in {bottom}..{top}")
