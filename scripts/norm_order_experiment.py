"""MEA's k norm before or after the mix, on the same post-hoc compression (docs/inference.md).

Trains the demo's small MoE GPT (`mea-demo`'s config and data) as a baseline with an RMS q/k
norm, compresses it to `nc = 2` of its 4 K/V heads twice with the same SVD (`mea-convert
compress`: mix-then-norm, the default, and `--mea-key-norm-before-mix`), and prints the mean
loss of each on the same tokens right after the SVD and after continuing each (and the baseline)
for the same number of iterations through `mea-pretrain`.

    python scripts/norm_order_experiment.py [--out runs/norm_order] [--baseline-iters 200]
        [--continue-iters 60]
"""

import argparse
import json
import os
import subprocess
import sys

import yaml

from megatron_mea.apps.configs import DEMO
from megatron_mea.apps.corpus import prepare_data


# The demo's training settings (a compressed checkpoint's config.yaml holds the model only).
TRAINING = [f"--{key.replace('_', '-')}={DEMO[key]}" for key in (
    "split", "micro_batch_size", "global_batch_size", "weight_decay", "clip_grad", "eval_iters",
    "log_interval")]


def run(module, *args):
    subprocess.run([sys.executable, "-m", f"megatron_mea.cli.{module}", *args], check=True)


def mean_loss(load_dir, tokens):
    """Mean next-token loss (nats per byte) of the checkpoint at `load_dir` on `tokens`."""
    from megatron_mea.checkpoint.transforms.compress import _mean_loss
    from megatron_mea.checkpoint.torch_dist.model_only import (
        SINGLE_PROCESS_LAYOUT,
        ModelDescription,
        build_model,
        converter_process,
        load_model_weights,
    )

    with converter_process():
        model = build_model(ModelDescription.load(load_dir), **SINGLE_PROCESS_LAYOUT).eval()
        load_model_weights(model, load_dir, None)
        return _mean_loss(model, tokens, micro_batch_size=8)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/norm_order")
    parser.add_argument("--baseline-iters", type=int, default=200)
    parser.add_argument("--continue-iters", type=int, default=60)
    parser.add_argument("--corpus-bytes", type=int, default=4 * 2**20)
    parser.add_argument("--eval-samples", type=int, default=64)
    args = parser.parse_args(argv)
    from megatron_mea.cpu import megatron_on_cpu
    from megatron_mea.data.samples import load_tokens
    from megatron_mea.runtime.console import print_progress

    print_progress("megatron_mea.apps.corpus")  # its "[demo] data: ..." line
    os.makedirs(args.out, exist_ok=True)
    prefix = prepare_data(args.out, args.corpus_bytes)
    config = dict(DEMO, qk_layernorm=True, train_iters=args.baseline_iters,
                  save_interval=args.baseline_iters, eval_interval=args.baseline_iters)
    config_path = os.path.join(args.out, "baseline.yaml")
    with open(config_path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(config, handle, sort_keys=False)
    path = lambda name: os.path.join(args.out, name)  # noqa: E731
    if not os.path.isdir(path("baseline")):
        run("pretrain", "--config", config_path, "--data-path", prefix, "--save",
            path("baseline"), "--attention-variant", "standard", "--no-progress-bar")
    orders = {"mix-then-norm": [], "norm-then-mix": ["--mea-key-norm-before-mix"]}
    for name, flags in orders.items():
        if not os.path.isdir(path(name)):
            run("convert", "--quiet", "compress", "--load", path("baseline"), "--save",
                path(name), "--num-kv-components", "2", *flags)
    # Continued training: the same iterations for the baseline and each compressed model, at
    # a constant learning rate (the demo's final one) with a fresh optimizer. The compressed
    # checkpoints are model-only (they start at iteration 0); the baseline resumes at its own.
    valid = {}
    for name in ("baseline", *orders):
        trained = path(f"{name}-continued")
        if not os.path.isdir(trained):
            start = args.baseline_iters if name == "baseline" else 0
            source_config = config_path if name == "baseline" else os.path.join(path(name),
                                                                                "config.yaml")
            run("pretrain", "--config", source_config, "--load", path(name), "--save", trained,
                "--data-path", prefix, "--train-iters", str(start + args.continue_iters),
                "--save-interval", str(args.continue_iters), "--eval-interval",
                str(args.continue_iters), "--lr", str(DEMO["min_lr"]), "--min-lr",
                str(DEMO["min_lr"]), "--lr-decay-style", "constant",
                "--lr-warmup-iters", "0", "--no-load-optim", "--no-load-rng",
                "--override-opt-param-scheduler", "--no-progress-bar", *TRAINING)
        with open(os.path.join(trained, "metrics.jsonl"), encoding="utf-8") as handle:
            records = [json.loads(line) for line in handle]
        valid[f"{name}-continued"] = [r["valid loss"] for r in records if "valid loss" in r][-1]
    with megatron_on_cpu():
        tokens = load_tokens(prefix, DEMO["seq_length"], args.eval_samples)
        results = {name: mean_loss(path(name), tokens)
                   for name in ("baseline", *orders, "baseline-continued",
                                *(f"{n}-continued" for n in orders))}
    results = {"loss on the first tokens": results, "valid loss of mea-pretrain": valid}
    print(json.dumps(results, indent=1))
    with open(path("results.json"), "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
