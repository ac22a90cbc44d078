"""Loopback ports for tests: one free port, or the base port of a whole stack whose every port is free.

No test names a fixed port: a second suite on the same host (a CI runner's neighbour, or this suite run twice
at once) would take it first and the test would fail for nothing. A stack's base port is drawn at random from
a window below Linux's ephemeral range (32768-60999, where the kernel hands out the ports clients connect
from), with its engines at base + 21900 below it too, so an outgoing connection never holds a stack's port.
"""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Iterator

from launcher.stack import _port_in_use, stack_ports

# Base ports 9100-10860: the rollout role at the base, preprocess / data / encoder just above it, the
# engines at base + 21900 (31000-32760 and up): all below 32768 for a few engines.
STACK_BASES = range(9100, 10861, 10)


# Single ports (a rendezvous, a one-off server): at random between the stacks' windows, below the ephemeral range.
FREE_PORTS = range(11000, 30000)
# The system's randomness, not the module's: a test that seeds `random` would otherwise make two suites on one host
# draw the same ports in the same order.
_RANDOM = random.SystemRandom()


def free_port() -> int:
    """A loopback port free now, drawn at random below the kernel's ephemeral range. A port the kernel picks (bind to
    0) is one it may hand the very next outgoing connection of any process on the host; between this call and the
    test's use of the port, that connection would take it. Here only a bind of another's at the same random port can."""
    for _ in range(1000):
        port = _RANDOM.choice(FREE_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # held (or in TIME_WAIT): another
                continue
            return port
    raise RuntimeError(f"no free loopback port in {FREE_PORTS}")


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port that refuses every connection while the block runs: bound, never listening. Held, no other
    process nor an outgoing connection of this one can take it (a port only said free could be, mid-test)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def free_stack_base(engines: int = 1) -> int:
    """A base port whose stack (``stack_ports(base, engines)``) is free now, at random in `STACK_BASES`."""
    bases = list(STACK_BASES)
    _RANDOM.shuffle(bases)
    for base in bases:
        if not any(_port_in_use("127.0.0.1", port) for _, _, port in stack_ports(base, engines)):
            return base
    raise RuntimeError(f"no free stack of {engines} engine(s) at base ports {STACK_BASES}")
