"""Process groups: torch.distributed's default group and Megatron-Core's model-parallel groups,
started in one place (`start_process_groups`) for every tool that runs a model (training,
inference, the converters, the benchmarks), with the rendezvous of a world of one and a free port.

Imports nothing of the package, and torch and Megatron-Core only when a group is started, so that
any part can use it.
"""

import os
import socket
from datetime import timedelta
from typing import Dict, Optional


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


def start_process_groups(
    backend: str,
    *,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    port: Optional[int] = None,
    parallel_sizes: Optional[Dict[str, Optional[int]]] = None,
    timeout_minutes: Optional[float] = None,
) -> None:
    """Start the default process group where none is yet, then Megatron-Core's parallel state.

    Two rendezvous: the launcher's (`rank` and `world_size` None: torchrun's variables, or a
    world of one where a plain `python -m` started the process, `set_up_world_of_one`; with
    NCCL, the process's GPU is its LOCAL_RANK), or one the caller names (`rank` of
    `world_size` on the loopback interface at `port`; None keeps an inherited MASTER_PORT, else
    a free one).

    Args:
        backend: "nccl" or "gloo".
        rank: this process's rank, with `world_size`. Default: the launcher's.
        world_size: the number of processes, with `rank`. Default: the launcher's.
        port: the rendezvous port of a named rank. Default: an inherited MASTER_PORT, else free.
        parallel_sizes: Megatron-Core's `initialize_model_parallel` sizes
            (`tensor_model_parallel_size`, ...). Default: every size 1.
        timeout_minutes: how long a collective waits for the other ranks before it fails.
            Default: torch's and Megatron-Core's.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if (rank is None) != (world_size is None):
        raise ValueError(f"start_process_groups: rank ({rank}) and world_size ({world_size}) "
                         "are given together or not at all")
    if not dist.is_initialized():
        timeout = None if timeout_minutes is None else timedelta(minutes=timeout_minutes)
        if rank is None:
            set_up_world_of_one()
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=timeout)
        else:
            if port is None:
                os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
                os.environ.setdefault("MASTER_PORT", str(free_port()))
            else:
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    groups = {} if timeout_minutes is None else {"distributed_timeout_minutes": timeout_minutes}
    parallel_state.initialize_model_parallel(**(parallel_sizes or {}), **groups)
