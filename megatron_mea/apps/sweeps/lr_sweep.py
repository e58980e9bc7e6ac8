"""`mea-lr-sweep`'s sweep: the presets, the flags (also `mea-reproduce`'s, which runs sweeps of
its own), training every run of the grid, and the table, fits and plots of the runs in a
directory. Progress lines are INFO records of this module's logger (the tool shows them on
stdout); the sweep's own pieces are `sweep` (verdicts, tables, plots), `runs` (one run through
`mea-pretrain`) and `fit` (the loss law).
"""

import argparse
import json
import logging
import os
import time
from functools import partial
from typing import Tuple

import yaml

from megatron_mea._optional import import_extra
from megatron_mea.apps.configs import DEMO
from megatron_mea.apps.corpus import prepare_data
from megatron_mea.apps.sweeps.fit import fit_run, format_fits
from megatron_mea.apps.sweeps.runs import (
    PRETRAIN_MODULE,
    SweepRunError,
    SweepSettings,
    load_sweep,
    prepare_sweep,
    read_metrics,
    read_result,
    run_dir,
    train_command,
    train_run,
    write_summary,
)
from megatron_mea.apps.sweeps.sweep import (
    VARIANTS,
    StabilityRule,
    format_table,
    plot_final_loss,
    plot_loss_curves,
    summarize_run,
    to_json,
)
from megatron_mea.runtime.argparsing import ArgumentParser

logger = logging.getLogger(__name__)

# The first paragraph of `megatron_mea.cli.lr_sweep`'s docstring: `--help`'s description.
DESCRIPTION = (
    "`mea-lr-sweep`: LR robustness sweep: baseline, the head norm alone (+norm), HLC alone (MEA\n"
    "without head norm), MEA (HLC + norm), KHA-Linear and KHA-MLP over a grid of peak learning "
    "rates,\nsame seed and data order, each run through `mea-pretrain`."
)


class NoRunsError(LookupError):
    """The sweep's directory holds no run to judge."""


# What stops a sweep (`run`) short of its table, as its tools report it (`failure`).
FAILURES = (ValueError, SweepRunError, NoRunsError)


def failure(exc: BaseException) -> Tuple[int, str]:
    """(exit status, the one line on stderr) of a sweep stopped by `exc` (one of `FAILURES`):
    2 a refused setting, 1 a failed run or no run to judge."""
    if isinstance(exc, ValueError):
        return 2, f"lr_sweep: error: {exc}"
    if isinstance(exc, SweepRunError):
        return 1, f"lr_sweep: run failed: {exc}"
    return 1, f"lr_sweep: {exc}"


# Shared by both presets: the MEA paper's Llama-3.2-1B recipe has no QK norm, and QK norm is
# itself the usual cure for high-LR attention-logit growth, so with it the baseline would not be
# the one the paper compares against.
_COMMON = {"qk_layernorm": False, "nan_policy": "stop", "seed": 1234, "weight_decay": 0.1,
           "clip_grad": 1.0, "lr_decay_style": "cosine"}

PRESETS = {
    # The demo's MoE GPT (4 layers, 2 MoE; 8 query heads / 4 KV groups) on the stdlib corpus:
    # 6 variants x 4 LRs x 240 steps (~0.5M tokens each); five of them took 39 minutes (2327 s)
    # on 2 CPU cores.
    # 3e-3 is about the best LR of every variant at this size; 1e-1 still trains and 3e-1 blows
    # up right after warm-up, so the grid spans the optimum and the break.
    "cpu": {
        "train_config": {
            **{k: v for k, v in DEMO.items() if k not in ("lr", "min_lr")},
            **_COMMON,
            "train_iters": 240,
            "lr_warmup_fraction": 0.05,
            "eval_interval": 240,
            "eval_iters": 4,
            "log_interval": 20,
            "save_interval": 80,
        },
        "lrs": [3e-3, 3e-2, 1e-1, 3e-1],
        "corpus_bytes": 8 * 2**20,
    },
    # A dense ~190M-parameter GPT (16 layers, hidden 1024, 16 heads / 4 KV groups), BF16,
    # 64 x 1024 tokens per step, 3000 steps (~200M tokens) per run, 6 variants x 5 LRs. The
    # schedule has the shape of the MEA paper's LR study: linear warm-up, then the peak LR held
    # constant. The paper warms up over 1,000 of its 2,500 steps (50B tokens at 20M per step);
    # scaled to 3000 steps, that is 1200.
    "gpu": {
        "train_config": {
            "num_layers": 16, "hidden_size": 1024, "ffn_hidden_size": 2816,
            "num_attention_heads": 16, "num_query_groups": 4, "seq_length": 1024,
            "num_experts": None, "bf16": True, "micro_batch_size": 16, "global_batch_size": 64,
            **_COMMON,
            "lr_decay_style": "constant",
            "train_iters": 3000, "lr_warmup_iters": 1200, "split": "99,1,0",
            "tokenizer_type": "ByteLevelTokenizer",
            "eval_interval": 500, "eval_iters": 10, "log_interval": 50, "save_interval": 500,
        },
        "lrs": [3e-4, 1e-3, 2e-3, 3e-3, 6e-3],
        "corpus_bytes": 256 * 2**20,
    },
}


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags; every preset field can be overridden."""
    rule = StabilityRule()
    parser = ArgumentParser(
        prog="mea-lr-sweep", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "definitions (steps after the LR warm-up; smoothed = mean of the last\n"
            "--smooth-window losses):\n"
            "  spike     loss > (1 + --spike-threshold) x median of the previous --spike-window\n"
            "            non-spike losses; consecutive spike steps count once\n"
            "  diverged  a non-finite loss (the trainer stops), or smoothed loss >\n"
            "            --divergence-factor x the first step's loss, or final smoothed loss >\n"
            "            (1 + --divergence-rise) x the run's lowest smoothed loss\n"
            "  largest stable LR  the largest LR whose run finished without diverging\n"
            "            (and with <= --max-spikes spikes when given)"
        ),
    )
    parser.add_argument("--preset", choices=list(PRESETS), default="cpu", help="Default: cpu")
    parser.add_argument("--out", help="output directory. Default: runs/lr_sweep_<preset>")
    parser.add_argument("--data-path", nargs="+",
                        help="preprocessed dataset (prefix or blend). Default: the `make demo` "
                             "stdlib corpus, built in <out>/data")
    parser.add_argument("--corpus-bytes", type=int, help="size of the default corpus")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="Default: all")
    parser.add_argument("--lrs", nargs="+", type=float, help="peak learning rates")
    parser.add_argument("--train-iters", type=int, help="steps per run")
    parser.add_argument("--save-interval", type=int, help="checkpoint every N steps (resume)")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1,
                        help="cosine decay to lr x this. Default: 0.1")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any mea-pretrain setting for every run (YAML value), e.g. "
                             "--set num_layers=8 --set bf16=true; repeatable")
    parser.add_argument("--spike-threshold", type=float, default=rule.spike_threshold,
                        help=f"relative excess that makes a spike. Default: {rule.spike_threshold}")
    parser.add_argument("--spike-window", type=int, default=rule.spike_window,
                        help=f"losses in the spike baseline. Default: {rule.spike_window}")
    parser.add_argument("--smooth-window", type=int, default=rule.smooth_window,
                        help=f"steps in the smoothed loss. Default: {rule.smooth_window}")
    parser.add_argument("--divergence-factor", type=float, default=rule.divergence_factor,
                        help=f"x initial loss. Default: {rule.divergence_factor}")
    parser.add_argument("--divergence-rise", type=float, default=rule.divergence_rise,
                        help=f"final over best. Default: {rule.divergence_rise}")
    parser.add_argument("--max-spikes", type=int, help="spikes allowed in a 'stable' run")
    parser.add_argument("--fit-min-steps", type=int, default=50,
                        help="steps after warm-up a run needs for the loss-law fit. Default: 50")
    parser.add_argument("--predict-tokens", type=float,
                        help="token count at which the fitted law predicts the loss. Default: "
                             "10 x the tokens of one run")
    parser.add_argument("--summary-only", action="store_true",
                        help="train nothing: judge the runs already in --out (with the settings "
                             "saved there) and redraw")
    return parser


def resolve(args) -> tuple:
    """(SweepSettings without data_path, corpus bytes) from the preset and the flags."""
    preset = PRESETS[args.preset]
    config = dict(preset["train_config"])
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        config[key.strip().replace("-", "_")] = yaml.safe_load(value)
    if args.train_iters is not None:
        config["train_iters"] = args.train_iters
    if args.save_interval is not None:
        config["save_interval"] = args.save_interval
    settings = SweepSettings(
        out=args.out or os.path.join("runs", f"lr_sweep_{args.preset}"),
        data_path=args.data_path or [],
        train_config=config,
        variants=args.variants or list(VARIANTS),
        lrs=args.lrs or preset["lrs"],
        min_lr_ratio=args.min_lr_ratio,
        extra_flags=["--no-progress-bar"],
    )
    return settings, args.corpus_bytes or preset["corpus_bytes"]


def check_commands(settings: SweepSettings, config_path: str) -> None:
    """Validate every variant's command with mea-pretrain's own parser before training.

    Raises:
        ValueError: naming the setting mea-pretrain refuses.
    """
    from megatron_mea.apps.training.arguments import parse_args

    for variant in settings.variants:
        command = train_command(settings, config_path, variant, max(settings.lrs), False)
        parse_args(command[command.index(PRETRAIN_MODULE) + 1:])


def collect(settings: SweepSettings, rule: StabilityRule) -> tuple:
    """(summaries, curves) of every run in the grid that has records."""
    summaries, curves = [], {}
    for variant, lr in settings.grid():
        directory = run_dir(settings.out, variant, lr)
        records = read_metrics(directory)
        result = read_result(directory) or {}
        if not records and not result:
            continue
        curves[(variant, lr)] = records
        summaries.append(summarize_run(
            variant, lr, records, settings.train_iters, settings.warmup_steps, rule,
            stop_message=result.get("stop_message", ""),
        ))
    summaries.sort(key=lambda s: (settings.variants.index(s.variant), s.lr))
    return summaries, curves


def train_all(settings: SweepSettings, config_path: str, rule: StabilityRule) -> None:
    """Train (or skip, or resume) every run of the grid, with a line per run and a step bar."""
    tqdm = import_extra("tqdm", "the sweep's progress bar").tqdm
    grid = settings.grid()
    iters = settings.train_iters
    finished = [read_result(run_dir(settings.out, v, lr)) is not None for v, lr in grid]
    bar = tqdm(total=len(grid) * iters, initial=sum(finished) * iters, unit="step",
               desc="sweep", dynamic_ncols=True, mininterval=5)
    for index, ((variant, lr), done) in enumerate(zip(grid, finished)):
        name = f"[lr-sweep] {index + 1}/{len(grid)} {variant} lr={lr:g}"
        if done:
            tqdm.write(f"{name}: finished earlier, kept")
            continue
        base = bar.n

        def on_step(iteration, base=base):
            bar.update(base + iteration - bar.n)

        tqdm.write(f"{name}: training ({run_dir(settings.out, variant, lr)})")
        result = train_run(settings, config_path, variant, lr, on_step=on_step)
        bar.update(base + iters - bar.n)
        records = read_metrics(run_dir(settings.out, variant, lr))
        s = summarize_run(variant, lr, records, iters, settings.warmup_steps, rule,
                          result["stop_message"])
        verdict = f"DIVERGED ({s.reason})" if s.diverged else "stable"
        resumed = f", resumed at {result['resumed_from']}" if result["resumed_from"] else ""
        tqdm.write(f"{name}: {result['status']} in {result['seconds']:.0f} s{resumed}; final "
                   f"{s.final_loss:.3f}, best {s.best_loss:.3f}, {len(s.spikes)} spikes; {verdict}")
    bar.close()


def fit_all(settings: SweepSettings, summaries, curves, min_steps: int, predict_tokens=None):
    """(fit table, JSON section, {(variant, lr): fit JSON or None}) of every run's loss law."""
    config = settings.train_config
    missing = [k for k in ("global_batch_size", "seq_length") if config.get(k) is None]
    if missing:
        raise ValueError(f"the loss-law fit needs {missing} in the sweep's training settings")
    tokens_per_step = int(config["global_batch_size"]) * int(config["seq_length"])
    if predict_tokens is None:
        predict_tokens = 10.0 * settings.train_iters * tokens_per_step
    rows, fits = [], {}
    for s in summaries:
        fit = fit_run(curves.get((s.variant, s.lr), []), tokens_per_step, settings.warmup_steps,
                      min_steps)
        verdict = "diverged" if s.diverged else ("stable" if s.status != "incomplete" else
                                                 "unfinished")
        rows.append((s.variant, s.lr, verdict, fit))
        fits[(s.variant, s.lr)] = None if fit is None else fit.to_json(predict_tokens)
    section = {"law": "L(D) = (D_c / D)^alpha + L0, D = training tokens seen",
               "tokens_per_step": tokens_per_step, "min_steps": min_steps,
               "predict_tokens": predict_tokens}
    return format_fits(rows, predict_tokens), section, fits


def run(args) -> None:
    """Run (or continue) the sweep `args` describes (`build_parser`), then judge every run in
    its directory, fit the loss law, save the table (summary.txt, summary.json) and the plots,
    and log the table.

    Raises:
        ValueError: a setting or a flag is refused (the message names it).
        SweepRunError: a run failed.
        NoRunsError: the directory holds no run to judge.
    """
    rule = StabilityRule(
        spike_threshold=args.spike_threshold, spike_window=args.spike_window,
        smooth_window=args.smooth_window, divergence_factor=args.divergence_factor,
        divergence_rise=args.divergence_rise, max_spikes=args.max_spikes,
    )
    start = time.perf_counter()
    if args.summary_only:
        settings = load_sweep(args.out or os.path.join("runs", f"lr_sweep_{args.preset}"))
    else:
        settings, corpus_bytes = resolve(args)
        if not settings.data_path:
            settings.data_path = [prepare_data(settings.out, corpus_bytes)]
        config_path = prepare_sweep(settings, partial(check_commands, settings))
        logger.info("[lr-sweep] %d variants x %d LRs x %d steps -> %s", len(settings.variants),
                    len(settings.lrs), settings.train_iters, settings.out)
        train_all(settings, config_path, rule)
        # The table covers every run in the directory, also those of earlier grids.
        settings = load_sweep(settings.out)
    summaries, curves = collect(settings, rule)
    if not summaries:
        raise NoRunsError(f"no runs in {settings.out}")
    fit_table, fit_section, fits = fit_all(settings, summaries, curves, args.fit_min_steps,
                                           args.predict_tokens)
    table = format_table(summaries, rule) + "\n\n" + fit_table
    summary_txt = write_summary(settings.out, table)
    summary = to_json(summaries, rule)
    for entry in summary["runs"]:
        entry["fit"] = fits[(entry["variant"], entry["lr"])]
    summary["fit"] = fit_section
    with open(os.path.join(settings.out, "summary.json"), "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=1)
    curves_png = os.path.join(settings.out, "loss_vs_step.png")
    final_png = os.path.join(settings.out, "final_loss_vs_lr.png")
    plot_loss_curves(curves, summaries, curves_png, rule.smooth_window)
    plot_final_loss(summaries, final_png)
    logger.info("\n%s", table)
    logger.info("\n[lr-sweep] plots: %s, %s; table: %s (+ .json)", curves_png, final_png,
                summary_txt)
    logger.info("[lr-sweep] %.0f s in this invocation", time.perf_counter() - start)
