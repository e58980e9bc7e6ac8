"""Run a function on N real processes (gloo on CPU) and collect what each rank returns.

`run_distributed(fn, world_size, *args)` starts fresh rank processes, so every test sees a clean
Megatron parallel state. `fn(rank, world_size, *args)` must be a module-level function; its return
value (tensors, numbers, dicts/lists of them) comes back per rank through `torch.save` files.

On CPU the ranks are forked from a fork server that has already imported torch and
Megatron-Core (`PRELOAD`): a spawned interpreter spends 3-5 s on those imports per rank, which
was most of a small multi-rank test. The server holds no parallel state and no threads, so each
fork starts as clean as a spawned interpreter. Where CUDA exists the ranks are spawned (a CUDA
context does not survive a fork).
"""

import multiprocessing
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_mea.cpu import megatron_on_cpu
from megatron_mea.runtime.process_groups import free_port


# The variables a process group reads at start-up. In-process tests set them (a world of one);
# a subprocess that starts a world of its own must not inherit them (it would reuse a port).
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")

# What the fork server imports once, before it forks any rank.
PRELOAD = ("torch", "megatron.core", "megatron_mea.cpu", "megatron_mea.model.gpt",
           "megatron_mea.specs", "tests._dist")


def standalone_environment(**extra) -> dict:
    """This process's environment without `RENDEZVOUS`, plus `extra`: for a subprocess that
    starts a world of its own."""
    return {**{k: v for k, v in os.environ.items() if k not in RENDEZVOUS}, **extra}


def _start_method() -> str:
    if torch.cuda.is_available():
        return "spawn"
    # Idempotent; takes effect when the server first starts (the first world of the run).
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    return "forkserver"


def _entry(rank, world_size, port, out_dir, fn, args, environment):
    # The fork server's environment is the parent's when the server started; the test's may
    # have changed since (monkeypatch.setenv): the rank takes the parent's of now.
    os.environ.clear()
    os.environ.update(environment)
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
            args=(world_size, free_port(), out_dir, fn, args, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method=_start_method(),
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
