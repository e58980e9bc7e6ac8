"""Run a function on N real processes (gloo on CPU) and collect what each rank returns.

`run_distributed(fn, world_size, *args)` spawns fresh interpreters, so every test sees a clean
Megatron parallel state. `fn(rank, world_size, *args)` must be a module-level function; its return
value (tensors, numbers, dicts/lists of them) comes back per rank through `torch.save` files.
"""

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_mea.cpu import megatron_on_cpu
from megatron_mea.gpt import free_port


# The variables a process group reads at start-up. In-process tests set them (a world of one);
# a subprocess that starts a world of its own must not inherit them (it would reuse a port).
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def standalone_environment(**extra) -> dict:
    """This process's environment without `RENDEZVOUS`, plus `extra`: for a subprocess that
    starts a world of its own."""
    return {**{k: v for k, v in os.environ.items() if k not in RENDEZVOUS}, **extra}


def _entry(rank, world_size, port, out_dir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        with megatron_on_cpu():  # each rank is a fresh interpreter: an entry point
            result = fn(rank, world_size, *args)
        torch.save({"ok": result}, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:  # noqa: B902 -- report any failure of the rank to the parent
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"rank{rank}.pt"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args):
    """Run `fn(rank, world_size, *args)` on `world_size` processes; return the list of results.

    Raises:
        RuntimeError: with the failing rank's traceback.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _entry,
            args=(world_size, free_port(), out_dir, fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        try:
            while not context.join():
                pass
        except Exception as exc:
            errors = []
            for rank in range(world_size):
                path = os.path.join(out_dir, f"rank{rank}.pt")
                if os.path.exists(path):
                    errors.append(torch.load(path, weights_only=True).get("error"))
            details = "\n".join(f"{e}" for e in errors if e)
            raise RuntimeError(f"distributed run failed:\n{details or exc}") from None
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            results.append(torch.load(path, weights_only=True)["ok"])
        return results
