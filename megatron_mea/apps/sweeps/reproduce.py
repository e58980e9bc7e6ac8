"""`mea-reproduce`'s studies: the papers' headline claims as `mea-lr-sweep` grids at demo scale
(`STUDIES`), run one seed after another, and the markdown report of what they show
(`megatron_mea.cli.reproduce` holds the flags and the studies' description). Progress lines are
INFO records of this module's logger.
"""

import json
import logging
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from megatron_mea.apps.corpus import prepare_data
from megatron_mea.apps.sweeps import lr_sweep
from megatron_mea.apps.sweeps.runs import load_sweep

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Study:
    """One study: `mea-lr-sweep` grids of `variants` x `lrs`, one per seed."""

    title: str
    source: str
    claim: str
    variants: Tuple[str, ...]
    lrs: Tuple[float, ...]
    seeds: Tuple[int, ...]
    settings: Dict[str, object] = field(default_factory=dict)


STUDIES = {
    "mea-lr": Study(
        title="MEA learning-rate study",
        source="MEA Section 5.1.2, Appendix E (Figs. 4-7)",
        claim="MEA trains stably up to LR 3e-3 while the Transformer, +GroupNorm and the "
              "Differential Transformer become unstable above 1e-3; at 1e-3 MEA has the lowest "
              "validation loss (Fig. 2).",
        variants=("baseline", "mea-norm-only", "mea"),
        lrs=(1e-4, 5e-4, 1e-3, 3e-3),
        seeds=(1234,),
        settings={"lr_decay_style": "constant", "lr_warmup_fraction": 0.4},
    ),
    "kha": Study(
        title="KHA comparison",
        source="KHA Sections 4.3-4.4, Figs. 1-2",
        claim="KHA lowers the loss (by 0.014-0.025 for the MoE models of Table 5 at 100B "
              "tokens, 0.015 at 1T tokens) and has far fewer loss spikes than the baseline.",
        variants=("baseline", "kha-linear", "kha-mlp"),
        lrs=(3e-3, 3e-2),
        seeds=(1234, 1235),
        settings={"qk_layernorm": True, "lr_decay_style": "cosine", "lr_warmup_fraction": 0.05},
    ),
}
PLOTS = ("loss_vs_step.png", "final_loss_vs_lr.png")


def _grid(study: Study, smoke: bool) -> Tuple[tuple, tuple, tuple]:
    if smoke:
        return study.variants[-1:], study.lrs[:1], study.seeds[:1]
    return study.variants, study.lrs, study.seeds


def sweep_dir(out: str, name: str, seed: int) -> str:
    """The `mea-lr-sweep` output directory of one study and seed."""
    return os.path.join(out, name, f"seed{seed}")


def sweep_argv(args, name: str, seed: int, data_path: List[str]) -> List[str]:
    """`mea-lr-sweep`'s arguments for one study and seed."""
    study = STUDIES[name]
    variants, lrs, _ = _grid(study, args.smoke)
    argv = ["--preset", "cpu", "--out", sweep_dir(args.out, name, seed),
            "--data-path", *data_path, "--variants", *variants,
            "--lrs", *[f"{lr:g}" for lr in lrs]]
    settings = {**study.settings, "seed": seed}
    argv += [f"--set={key}={json.dumps(value)}" for key, value in settings.items()]
    argv += [f"--set={item}" for item in args.set]
    if args.train_iters is not None:
        argv += ["--train-iters", str(args.train_iters)]
    return argv


def run_study(args, name: str, data_path: List[str]) -> None:
    """Every seed's grid of study `name` through `mea-lr-sweep`'s sweep (`lr_sweep.run`, which
    raises one of `lr_sweep.FAILURES` when a sweep stops short)."""
    study = STUDIES[name]
    for seed in _grid(study, args.smoke)[2]:
        logger.info("[reproduce] %s, seed %d", study.title, seed)
        lr_sweep.run(lr_sweep.build_parser().parse_args(sweep_argv(args, name, seed, data_path)))


def _summary(out: str, name: str, seed: int) -> dict:
    with open(os.path.join(sweep_dir(out, name, seed), "summary.json"), encoding="utf-8") as f:
        return json.load(f)


def _loss(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def mea_lr_section(runs: Dict[tuple, dict], stable: Dict[str, float], lrs, variants) -> List[str]:
    """Table (final loss and spikes per LR) and the observations of the MEA LR study."""
    head = "| variant | " + " | ".join(f"LR {lr:g}" for lr in lrs) + " | largest stable LR |"
    lines = [head, "|---" * (len(lrs) + 2) + "|"]
    for variant in variants:
        cells = []
        for lr in lrs:
            run = runs.get((variant, lr))
            if run is None:
                cells.append("-")
                continue
            mark = " **diverged**" if run["diverged"] else ""
            cells.append(f"{_loss(run['final_loss'])} ({len(run['spikes'])} spikes){mark}")
        best = stable.get(variant)
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | {best if best else '-'} |")
    finished = [r for r in runs.values() if r["final_loss"] is not None and not r["diverged"]]
    if finished:
        low = min(finished, key=lambda r: r["final_loss"])
        lines += ["", f"Lowest final loss: {low['variant']} at LR {low['lr']:g} "
                      f"({low['final_loss']:.3f})."]
    return lines


def kha_section(runs: Dict[tuple, List[dict]], lrs, variants) -> List[str]:
    """Table (final loss mean over seeds, its change from the baseline, spikes) of the KHA
    comparison."""
    lines = ["| LR | variant | final loss per seed | mean | vs baseline | spikes per seed |",
             "|---|---|---|---|---|---|"]
    for lr in lrs:
        base = [r["final_loss"] for r in runs.get(("baseline", lr), [])
                if r["final_loss"] is not None]
        for variant in variants:
            seeds = runs.get((variant, lr), [])
            losses = [r["final_loss"] for r in seeds if r["final_loss"] is not None]
            mean = statistics.mean(losses) if losses else None
            delta = (f"{mean - statistics.mean(base):+.3f}"
                     if mean is not None and base and variant != "baseline" else "")
            per_seed = ", ".join(_loss(r["final_loss"]) + (" (diverged)" if r["diverged"] else "")
                                 for r in seeds)
            spikes = ", ".join(str(len(r["spikes"])) for r in seeds)
            lines.append(f"| {lr:g} | {variant} | {per_seed} | {_loss(mean)} | {delta} | "
                         f"{spikes} |")
    return lines


def write_report(args, seconds: float) -> str:
    """`report.md` (and the plots beside it) from the studies' sweep summaries; its path."""
    report_dir = args.report_dir or args.out
    os.makedirs(report_dir, exist_ok=True)
    first = args.studies[0]
    settings = load_sweep(sweep_dir(args.out, first, _grid(STUDIES[first], args.smoke)[2][0]))
    config = settings.train_config
    tokens = config["global_batch_size"] * config["seq_length"]
    experts = f", {config['num_experts']} experts" if config.get("num_experts") else ""
    lines = ["# The papers' headline claims at demo scale", "",
             f"`mea-reproduce` ({'smoke run, not a result' if args.smoke else 'full run'}): "
             f"a GPT of {config['num_layers']} layers, hidden {config['hidden_size']}, "
             f"{config['num_attention_heads']} query heads / {config['num_query_groups']} KV "
             f"groups{experts}, {settings.train_iters} steps of {tokens:,} tokens per run; wall "
             f"time of this invocation {seconds / 60:.1f} min. Definitions of spikes and "
             "divergence: `mea-lr-sweep --help`.", ""]
    for name in args.studies:
        study = STUDIES[name]
        variants, lrs, seeds = _grid(study, args.smoke)
        lines += [f"## {study.title}", "", f"The paper ({study.source}): {study.claim}", ""]
        by_run: Dict[tuple, List[dict]] = {}
        for seed in seeds:
            for run in _summary(args.out, name, seed)["runs"]:
                by_run.setdefault((run["variant"], run["lr"]), []).append(run)
        if name == "mea-lr":
            # One seed: the MEA study's verdicts are per LR, as the paper's.
            first = {key: runs[0] for key, runs in by_run.items()}
            stable = _summary(args.out, name, seeds[0])["largest_stable_lr"]
            lines += mea_lr_section(first, stable, lrs, variants)
        else:
            lines += kha_section(by_run, lrs, variants)
        lines.append("")
        for seed in seeds:
            for plot in PLOTS:
                target = f"{name}_seed{seed}_{plot}"
                shutil.copyfile(os.path.join(sweep_dir(args.out, name, seed), plot),
                                os.path.join(report_dir, target))
                lines.append(f"![{study.title}, seed {seed}: {plot[:-4]}]({target})")
        lines.append("")
    path = os.path.join(report_dir, "report.md")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines))
    return path


def run(args) -> str:
    """Run (or continue) the studies `args.studies`, then write the report; its path.

    Raises:
        one of `lr_sweep.FAILURES`: a sweep stopped short (`lr_sweep.failure` words it).
    """
    start = time.perf_counter()
    data_path = args.data_path
    if not data_path:
        data_path = [prepare_data(args.out, lr_sweep.PRESETS["cpu"]["corpus_bytes"])]
    for name in args.studies:
        run_study(args, name, data_path)
    return write_report(args, time.perf_counter() - start)
