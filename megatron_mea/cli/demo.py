"""`mea-demo` (`make demo`): pretrain a small MoE GPT with MEA, KHA and the baseline on CPU.

1. Build a corpus from the Python standard library's source and documentation on this machine.
2. Preprocess it into Megatron `.bin/.idx` files with the built-in byte-level tokenizer.
3. Run `mea-pretrain` (a subprocess each, the real CLI) for every variant: same data, same seed.
   `mea-vh` is MEA with virtual heads: 2 cached K/V component heads for the 4 groups.
4. Greedy-decode a short sample from each checkpoint with `mea-generate` (the real CLI).
5. Print a summary table (losses, throughput, KV-cache bytes per token, the sample) and save a
   loss-curve PNG.

Run again in the same `--out`, it keeps the variants that are complete, continues the ones an
interruption left halfway and starts the others afresh (`_demo_runs`). The console shows a
progress bar and one line per stage, and the table; the tools' own output is appended to
`<out>/demo.log`, Megatron-Core's log records to `<out>/runs/<variant>/mea-pretrain.log`.

    mea-demo [--out runs/demo] [--train-iters 300] [--variants mea-vh kha]
"""

import json
import os
import shutil
import sys
import time

import yaml

from megatron_mea._optional import import_extra
from megatron_mea.apps.configs import DEMO
from megatron_mea.cli import _demo_runs
from megatron_mea.runtime.argparsing import ArgumentParser
from megatron_mea.runtime.files import atomic_write

DEMO_CONFIG = DEMO

VARIANTS = {
    "baseline": ["--attention-variant", "standard"],
    "mea": ["--attention-variant", "mea"],
    "mea-vh": ["--attention-variant", "mea", "--mea-num-kv-components", "2"],
    "kha": ["--attention-variant", "kha"],
}
LOG = "demo.log"


def prepare_data(out: str, max_bytes: int) -> str:
    """Corpus -> `.bin/.idx`; returns the dataset prefix. Kept from an earlier demo built with
    the same `max_bytes`; otherwise `<out>/data` is built anew (Megatron's index cache there
    included: it is keyed by the path, not by the contents)."""
    from megatron_mea.data import build_stdlib_corpus, build_tokenizer, preprocess_files

    data = os.path.join(out, "data")
    prefix = os.path.join(data, "stdlib_text_document")
    record = os.path.join(data, "corpus.json")
    if os.path.exists(prefix + ".idx") and os.path.exists(record):
        with open(record, encoding="utf-8") as handle:
            built = json.load(handle)
        if built["max_bytes"] == max_bytes:
            print(f"[demo] data: {built['documents']} documents, {built['tokens']} tokens, "
                  f"kept from an earlier demo ({prefix}.bin/.idx)", flush=True)
            return prefix
    shutil.rmtree(data, ignore_errors=True)
    corpus = os.path.join(data, "stdlib_corpus.jsonl")
    os.makedirs(data)
    documents, size = build_stdlib_corpus(corpus, max_bytes=max_bytes)
    summary = preprocess_files(
        [corpus], prefix, build_tokenizer("ByteLevelTokenizer"), append_eod=True
    )
    with atomic_write(record) as handle:  # last: a demo killed before it rebuilds the data
        json.dump({"max_bytes": max_bytes, "documents": summary.documents,
                   "tokens": summary.tokens}, handle)
    print(f"[demo] data: {documents} documents, {size / 2**20:.1f} MiB of stdlib source and "
          f"docs, {summary.tokens} tokens ({prefix}.bin/.idx)", flush=True)
    return prefix


def run_variant(name: str, args, config_path: str, prefix: str, log) -> dict:
    """Train (or keep, or continue) one variant and sample it; returns its result for the
    table. Prints the variant's progress bar and one line."""
    directory = os.path.join(args.out, "runs", name)
    settings = {"config": DEMO_CONFIG, "flags": VARIANTS[name], "train_iters": args.train_iters,
                "save_interval": args.save_interval, "corpus_bytes": args.corpus_bytes}
    # JSON round trip: compares equal to what a later demo reads back from demo.json.
    settings = json.loads(json.dumps(settings))
    action, start, why = _demo_runs.plan_run(directory, settings, args.train_iters)
    if action == "keep":
        print(f"[demo] {name}: complete from an earlier demo, kept (remove {directory} to "
              "train it again)", flush=True)
        return _demo_runs.completed(directory)
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
    seconds = _demo_runs.train(name, command, directory, action, start, args.train_iters,
                               settings, log)
    record = _demo_runs.read_record(directory)
    record["seconds"] = record.get("seconds", 0.0) + seconds
    _demo_runs.write_record(directory, record)
    record["sample"], record["kv_bytes_per_token"] = _demo_runs.greedy_sample(directory, log)
    _demo_runs.write_record(directory, record)
    how = (f"continued from iteration {start}" if action == "continue"
           else "trained afresh" + (f" ({why})" if why else ""))
    print(f"[demo] {name}: {how} to iteration {args.train_iters} in {seconds:.0f} s, "
          f"sampled", flush=True)
    return _demo_runs.completed(directory)


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


def write_summary(out: str, table: str) -> str:
    """Keep a tool's summary `table` as `out/summary.txt` (what `mea-demo` and `mea-lr-sweep`
    print); returns the path."""
    path = os.path.join(out, "summary.txt")
    with atomic_write(path) as handle:
        handle.write(table + "\n")
    return path


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
        The exit status: 0; 1 when a tool it ran failed (one line naming it and the log);
        130 interrupted (a rerun continues).
    """
    parser = ArgumentParser(prog="mea-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/demo")
    parser.add_argument("--train-iters", type=int, default=DEMO_CONFIG["train_iters"])
    parser.add_argument("--save-interval", type=int, default=DEMO_CONFIG["save_interval"],
                        help="checkpoint every N steps: where an interrupted demo continues "
                             "from. Default: %(default)s")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--corpus-bytes", type=int, default=8 * 2**20)
    args = parser.parse_args(argv)

    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    log_path = os.path.join(args.out, LOG)
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} mea-demo "
                  f"{' '.join(sys.argv[1:] if argv is None else argv)}\n")
        prefix = prepare_data(args.out, args.corpus_bytes)
        config_path = os.path.join(args.out, "demo.yaml")
        with open(config_path, "w", encoding="utf-8") as handle:
            yaml.safe_dump(DEMO_CONFIG, handle, sort_keys=False)
        try:
            results = {name: run_variant(name, args, config_path, prefix, log)
                       for name in args.variants}
        except _demo_runs.DemoError as exc:
            print(f"mea-demo: error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("mea-demo: interrupted; run it again to continue where it stopped",
                  file=sys.stderr)
            return 130
    table = summarize(results)
    png = os.path.join(args.out, "loss_curves.png")
    plot(results, png)
    write_summary(args.out, table)
    print("\n" + table + "\n")
    print(f"[demo] loss curves: {png}; TensorBoard: {os.path.join(args.out, 'tensorboard')}")
    print(f"[demo] logs: {log_path} (the tools' output); Megatron-Core's records: "
          f"{os.path.join(args.out, 'runs', '<variant>', 'mea-pretrain.log')}")
    print(f"[demo] total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
