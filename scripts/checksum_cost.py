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

    from megatron_mea.training import checkpointing, loop
    from megatron_mea.training.arguments import parse_args

    shutil.rmtree(args.out, ignore_errors=True)
    run = parse_args([*flags, "--train-iters", "1", "--no-progress-bar", "--eval-iters", "0"])
    trainer = loop.Trainer(run)
    trainer.train_step()
    trainer.iteration = 1
    write_checksums = checkpointing._write_checksums
    times = {}
    for mode in ("with", "without"):
        checkpointing._write_checksums = write_checksums if mode == "with" else (lambda d: None)
        saves, loads = [], []
        for _ in range(args.repeats):
            root = os.path.join(args.out, mode)
            shutil.rmtree(root, ignore_errors=True)
            started = time.perf_counter()
            trainer.save(root)
            saves.append(time.perf_counter() - started)
            started = time.perf_counter()
            checkpointing.load_checkpoint(root, trainer.modules, trainer.optimizer,
                                          trainer.scheduler)
            loads.append(time.perf_counter() - started)
        times[mode] = (statistics.median(saves), statistics.median(loads))
    checkpointing._write_checksums = write_checksums
    size = _size(checkpointing.checkpoint_dir(os.path.join(args.out, "with"), 1))
    trainer.close()
    print(f"checkpoint: {size / 2**20:.1f} MiB")
    for mode, (save, load) in times.items():
        print(f"{mode} checksums: save {save:.3f} s, load {load:.3f} s")
    (save_with, load_with), (save_without, load_without) = times["with"], times["without"]
    print(f"cost: save +{save_with - save_without:.3f} s "
          f"({100 * (save_with / save_without - 1):+.1f}%), load +{load_with - load_without:.3f} s "
          f"({100 * (load_with / load_without - 1):+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
