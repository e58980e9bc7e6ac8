"""`mea-demo`'s run, stage by stage (`megatron_mea.cli.demo` holds its flags):

1. the corpus and its `.bin/.idx` dataset (`megatron_mea.apps.corpus`);
2. one `mea-pretrain` run per variant (a subprocess each, the real CLI): same data, same seed;
   `mea-vh` is MEA with virtual heads: 2 cached K/V component heads for the 4 groups;
3. a greedy sample from each checkpoint with `mea-generate` (the real CLI);
4. the summary table (losses, throughput, KV-cache bytes per token, the sample) and a loss-curve
   PNG.

A rerun in the same `--out` keeps, continues or restarts each variant (`runs`). The tools' own
output is appended to `<out>/demo.log`; the progress lines are INFO records of this module's
logger.
"""

import json
import logging
import os
import shutil
import sys
import time

import yaml

from megatron_mea._optional import import_extra
from megatron_mea.apps.configs import DEMO
from megatron_mea.apps.corpus import prepare_data
from megatron_mea.apps.demo import runs
from megatron_mea.apps.sweeps.runs import write_summary

logger = logging.getLogger(__name__)

VARIANTS = {
    "baseline": ["--attention-variant", "standard"],
    "mea": ["--attention-variant", "mea"],
    "mea-vh": ["--attention-variant", "mea", "--mea-num-kv-components", "2"],
    "kha": ["--attention-variant", "kha"],
}
LOG = "demo.log"
PLOT = "loss_curves.png"


def run_demo(args, command_line: str) -> str:
    """The whole demo in `args.out`: data, one training run per variant of `args.variants`,
    the table (also `summary.txt`) and the plot; returns the table.

    Args:
        args: `mea-demo`'s flags (`out`, `variants`, `train_iters`, `save_interval`,
            `corpus_bytes`).
        command_line: the demo's arguments, for the header of its log.

    Raises:
        runs.DemoError: a tool the demo ran failed (the message names it and the log).
        KeyboardInterrupt: interrupted (a rerun continues).
    """
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, LOG), "a", encoding="utf-8") as log:
        log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} mea-demo {command_line}\n")
        prefix = prepare_data(args.out, args.corpus_bytes)
        config_path = os.path.join(args.out, "demo.yaml")
        with open(config_path, "w", encoding="utf-8") as handle:
            yaml.safe_dump(DEMO, handle, sort_keys=False)
        results = {name: run_variant(name, args, config_path, prefix, log)
                   for name in args.variants}
    table = summarize(results)
    plot(results, os.path.join(args.out, PLOT))
    write_summary(args.out, table)
    return table


def run_variant(name: str, args, config_path: str, prefix: str, log) -> dict:
    """Train (or keep, or continue) one variant and sample it; returns its result for the
    table. Shows the variant's progress bar and logs one line."""
    directory = os.path.join(args.out, "runs", name)
    settings = {"config": DEMO, "flags": VARIANTS[name], "train_iters": args.train_iters,
                "save_interval": args.save_interval, "corpus_bytes": args.corpus_bytes}
    # JSON round trip: compares equal to what a later demo reads back from demo.json.
    settings = json.loads(json.dumps(settings))
    action, start, why = runs.plan_run(directory, settings, args.train_iters)
    if action == "keep":
        logger.info("[demo] %s: complete from an earlier demo, kept (remove %s to train it "
                    "again)", name, directory)
        return runs.completed(directory)
    tensorboard = os.path.join(args.out, "tensorboard", name)
    if action == "afresh":  # the curves of the run it replaces would mix with its own
        shutil.rmtree(tensorboard, ignore_errors=True)
    command = [
        sys.executable, "-m", "megatron_mea.cli.pretrain", "--config", config_path,
        "--data-path", prefix, "--train-iters", str(args.train_iters),
        "--save-interval", str(args.save_interval), "--save", directory,
        "--tensorboard-dir", tensorboard, "--no-progress-bar",
        *VARIANTS[name],
    ]
    seconds = runs.train(name, command, directory, action, start, args.train_iters,
                      settings, log)
    record = runs.read_record(directory)
    record["seconds"] = record.get("seconds", 0.0) + seconds
    runs.write_record(directory, record)
    record["sample"], record["kv_bytes_per_token"] = runs.greedy_sample(directory, log)
    runs.write_record(directory, record)
    how = (f"continued from iteration {start}" if action == "continue"
           else "trained afresh" + (f" ({why})" if why else ""))
    logger.info("[demo] %s: %s to iteration %d in %.0f s, sampled", name, how, args.train_iters,
                seconds)
    return runs.completed(directory)


def summarize(results: dict) -> str:
    """The summary table per variant: final train / validation loss, throughput, KV-cache
    bytes per token and the greedy sample."""
    lines = [f"{'variant':<10}{'train loss':>12}{'valid loss':>12}{'tokens/s':>10}{'wall s':>8}"
             f"{'KV B/token':>12}  greedy sample"]
    for name, result in results.items():
        records = result["records"]
        tail = records[-10:]
        train = sum(r["lm loss"] for r in tail) / len(tail)
        valid = [r["valid loss"] for r in records if "valid loss" in r][-1]
        rates = sorted(r["tokens/s"] for r in records)
        lines.append(
            f"{name:<10}{train:>12.4f}{valid:>12.4f}{rates[len(rates) // 2]:>10.0f}"
            f"{result['seconds']:>8.0f}{result['kv_bytes_per_token']:>12d}  {result['sample']!r}"
        )
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    """Training loss (smoothed) and validation loss per variant, one PNG."""
    import_extra("matplotlib", "the demo's plot").use("Agg")
    plt = import_extra("matplotlib.pyplot", "the demo's plot")

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, result in results.items():
        records = result["records"]
        steps = [r["iteration"] for r in records]
        loss = [r["lm loss"] for r in records]
        window = 10
        tails = [loss[max(0, i - window + 1): i + 1] for i in range(len(loss))]
        smooth = [sum(tail) / len(tail) for tail in tails]
        line, = ax.plot(steps, smooth, label=f"{name} train")
        valid = [(r["iteration"], r["valid loss"]) for r in records if "valid loss" in r]
        ax.plot(*zip(*valid), "o--", color=line.get_color(), label=f"{name} valid")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title("MoE GPT on Python stdlib text, CPU: baseline vs MEA (virtual heads) vs KHA")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
