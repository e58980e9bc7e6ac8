"""`mea-demo` (`make demo`): pretrain a small MoE GPT with MEA, KHA and the baseline on CPU.

1. Build a corpus from the Python standard library's source and documentation on this machine.
2. Preprocess it into Megatron `.bin/.idx` files with the built-in byte-level tokenizer.
3. Run `mea-pretrain` (a subprocess each, the real CLI) for every variant: same data, same seed.
   `mea-vh` is MEA with virtual heads: 2 cached K/V component heads for the 4 groups.
4. Greedy-decode a short sample from each checkpoint with `mea-generate` (the real CLI).
5. Print a summary table (losses, throughput, KV-cache bytes per token, the sample) and save a
   loss-curve PNG.

    mea-demo [--out runs/demo] [--train-iters 300] [--variants mea-vh kha]
"""

import json
import os
import re
import subprocess
import sys
import time

import yaml

from megatron_mea.argparsing import ArgumentParser
from megatron_mea._optional import import_extra

# A CPU-sized MoE GPT: 4 layers (2 MoE), 8 query heads / 4 KV groups, 4 experts top-2.
DEMO_CONFIG = {
    "num_layers": 4,
    "hidden_size": 128,
    "ffn_hidden_size": 256,
    "num_attention_heads": 8,
    "num_query_groups": 4,
    "seq_length": 128,
    "num_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 128,
    "moe_layer_freq": 2,
    "moe_aux_loss_coeff": 0.01,
    "micro_batch_size": 8,
    "global_batch_size": 16,
    "train_iters": 300,
    "lr": 2e-3,
    "min_lr": 2e-4,
    "lr_warmup_fraction": 0.05,
    "weight_decay": 0.1,
    "clip_grad": 1.0,
    "seed": 1234,
    "split": "98,2,0",
    "tokenizer_type": "ByteLevelTokenizer",
    "eval_interval": 50,
    "eval_iters": 4,
    "log_interval": 50,
    "save_interval": 150,
}

VARIANTS = {
    "baseline": ["--attention-variant", "standard"],
    "mea": ["--attention-variant", "mea"],
    "mea-vh": ["--attention-variant", "mea", "--mea-num-kv-components", "2"],
    "kha": ["--attention-variant", "kha"],
}
SAMPLE_PROMPT = "def "
SAMPLE_TOKENS = 24


def prepare_data(out: str, max_bytes: int) -> str:
    """Corpus -> `.bin/.idx`; returns the dataset prefix (reused if already built)."""
    from megatron_mea.data import build_stdlib_corpus, build_tokenizer, preprocess_files

    prefix = os.path.join(out, "data", "stdlib_text_document")
    if os.path.exists(prefix + ".idx"):
        print(f"[demo] reusing {prefix}.bin/.idx")
        return prefix
    corpus = os.path.join(out, "data", "stdlib_corpus.jsonl")
    os.makedirs(os.path.dirname(corpus), exist_ok=True)
    documents, size = build_stdlib_corpus(corpus, max_bytes=max_bytes)
    print(f"[demo] corpus: {documents} documents, {size / 2**20:.1f} MiB of stdlib source and docs")
    summary = preprocess_files(
        [corpus], prefix, build_tokenizer("ByteLevelTokenizer"), append_eod=True
    )
    print(f"[demo] preprocessed: {summary.documents} documents, {summary.tokens} tokens")
    return prefix


def run_variant(name: str, flags, config_path: str, prefix: str, out: str, iters: int) -> dict:
    """Train one variant through the real CLI; returns its metrics."""
    run_dir = os.path.join(out, "runs", name)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    command = [
        sys.executable, "-m", "megatron_mea.cli.pretrain", "--config", config_path,
        "--data-path", prefix, "--train-iters", str(iters), "--save", run_dir,
        "--tensorboard-dir", os.path.join(out, "tensorboard", name), *flags,
    ]
    print(f"\n[demo] {name}: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    subprocess.run(command, check=True)
    with open(metrics, encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle]
    return {"records": records, "seconds": time.perf_counter() - start}


def greedy_sample(run_dir: str) -> tuple:
    """(`SAMPLE_TOKENS` greedy bytes after `SAMPLE_PROMPT`, KV-cache bytes per token) of the
    run's checkpoint, through `mea-generate`: the cache it allocated for the prompt and the
    sample, over their tokens."""
    command = [sys.executable, "-m", "megatron_mea.cli.generate", "--load", run_dir,
               "--prompt", SAMPLE_PROMPT, "--max-new-tokens", str(SAMPLE_TOKENS), "--no-stream",
               "--ignore-eod"]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    marker = f"[0] {SAMPLE_PROMPT}"
    start = out.index(marker) + len(marker)
    text = out[start:out.index("\ncheckpoint: ", start)]
    counts = re.search(r"generated (\d+) tokens from (\d+) prompt tokens", out)
    cache = re.search(r"KV cache: (\d+) bytes", out)
    tokens = int(counts.group(1)) + int(counts.group(2))
    return SAMPLE_PROMPT + text, int(cache.group(1)) // tokens


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


def main(argv=None) -> int:
    """Run the whole demo: data, one training run per variant, the table and the plot.

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.

    Returns:
        The exit status: 0, or 1 when a training run failed.
    """
    parser = ArgumentParser(prog="mea-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/demo")
    parser.add_argument("--train-iters", type=int, default=DEMO_CONFIG["train_iters"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--corpus-bytes", type=int, default=8 * 2**20)
    args = parser.parse_args(argv)

    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    prefix = prepare_data(args.out, args.corpus_bytes)
    config_path = os.path.join(args.out, "demo.yaml")
    with open(config_path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(DEMO_CONFIG, handle, sort_keys=False)
    try:
        results = {}
        for name in args.variants:
            result = run_variant(name, VARIANTS[name], config_path, prefix, args.out,
                                 args.train_iters)
            result["sample"], result["kv_bytes_per_token"] = greedy_sample(
                os.path.join(args.out, "runs", name))
            results[name] = result
    except subprocess.CalledProcessError as exc:  # its own output says why
        if exc.stderr:
            print(exc.stderr, file=sys.stderr)
        print(f"mea-demo: error: {' '.join(exc.cmd[1:3])} exited with status {exc.returncode}: "
              f"{' '.join(exc.cmd[1:])}", file=sys.stderr)
        return 1
    table = summarize(results)
    png = os.path.join(args.out, "loss_curves.png")
    plot(results, png)
    with open(os.path.join(args.out, "summary.txt"), "w", encoding="utf-8") as handle:
        handle.write(table + "\n")
    print("\n" + table)
    print(f"\n[demo] loss curves: {png}; TensorBoard: {os.path.join(args.out, 'tensorboard')}")
    print(f"[demo] total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
