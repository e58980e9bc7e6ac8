"""The rendezvous of a world of one process: what torchrun would have set, and a free port.

Below every tool that starts a process group (training, inference, the converters, the CPU
runner, the benchmarks), and importing nothing of the package, so that each can use it.
"""

import os
import socket


def set_up_world_of_one() -> None:
    """The rendezvous variables torchrun sets, for a world of one process, where a plain
    `python -m` started it (no WORLD_SIZE); a launcher's are kept."""
    if "WORLD_SIZE" in os.environ:
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now (for a world of one)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
