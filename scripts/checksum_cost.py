"""What the checkpoint checksums cost: save and load times with and without them.

Builds a `mea-pretrain` run from its flags (one process), takes one step, then saves and loads
its checkpoint `--repeats` times each way: with `checksums.json` written and verified (as
always), and without (the list not written: the load then skips the check). Prints the median
times and the checkpoint's size.

    python scripts/checksum_cost.py --out /tmp/cost -- --mock-data --num-layers 4 ...
"""

import argparse
import os
import shutil
import statistics
import sys
import time

from megatron_mea.cpu import megatron_on_cpu


def _no_list(directory: str) -> None:
    """The save without its checksum list."""


def _size(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory))


@megatron_on_cpu()
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="scratch directory (emptied)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("pretrain", nargs=argparse.REMAINDER, help="-- mea-pretrain flags")
    args = parser.parse_args(argv)
    flags = [f for f in args.pretrain if f != "--"]

    from megatron_mea.apps.training import loop
    from megatron_mea.apps.training.arguments import parse_run
    from megatron_mea.checkpoint.torch_dist import integrity, training_state
    from megatron_mea.checkpoint.torch_dist.layout import checkpoint_dir

    shutil.rmtree(args.out, ignore_errors=True)
    run, config = parse_run(
        [*flags, "--train-iters", "1", "--no-progress-bar", "--eval-iters", "0"])
    trainer = loop.Trainer(run, config)
    trainer.train_step()
    trainer.iteration = 1
    write_checksums = training_state._write_checksums
    saves, loads, hashes = {"with": [], "without": []}, {"with": [], "without": []}, []
    for repeat in range(args.repeats):  # interleaved, first one then the other mode first,
        # so that a busy machine or disk weighs on both alike
        for mode in ("with", "without") if repeat % 2 == 0 else ("without", "with"):
            training_state._write_checksums = write_checksums if mode == "with" else _no_list
            root = os.path.join(args.out, mode)
            shutil.rmtree(root, ignore_errors=True)
            started = time.perf_counter()
            trainer.save(root)
            saves[mode].append(time.perf_counter() - started)
            started = time.perf_counter()
            training_state.load_checkpoint(root, trainer.modules, trainer.optimizer,
                                          trainer.scheduler)
            loads[mode].append(time.perf_counter() - started)
        directory = checkpoint_dir(os.path.join(args.out, "with"), 1)
        started = time.perf_counter()
        integrity.checksum_files(directory, integrity.checkpoint_files(directory))
        hashes.append(time.perf_counter() - started)
    training_state._write_checksums = write_checksums
    size = _size(checkpoint_dir(os.path.join(args.out, "with"), 1))
    trainer.close()
    median = statistics.median
    print(f"checkpoint: {size / 2**20:.1f} MiB")
    for mode in ("with", "without"):
        print(f"{mode} checksums: save {median(saves[mode]):.3f} s, "
              f"load {median(loads[mode]):.3f} s")
    hashed = median(hashes)
    print(f"hashing the files once (the work added to a save, and to a load): {hashed:.3f} s "
          f"({size / 2**20 / hashed:.0f} MiB/s): {100 * hashed / median(saves['without']):.1f}% "
          f"of a save, {100 * hashed / median(loads['without']):.1f}% of a load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
