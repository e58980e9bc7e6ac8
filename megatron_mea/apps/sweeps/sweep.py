"""Learning-rate robustness study: the variants, and what "spike", "diverged" and "stable" mean.

Pure functions over loss curves (lists of `metrics.jsonl` records), so the definitions are
testable on constructed curves and a finished sweep can be re-judged with other thresholds
without retraining. Running the sweep is `megatron_mea.apps.sweeps.lr_sweep` (one run:
`megatron_mea.apps.sweeps.runs`); the command line is `megatron_mea.cli.lr_sweep`.

Definitions (every number is a field of `StabilityRule`; steps are optimizer iterations):

- Smoothed loss at step t: the mean of the finite training losses of steps t-w+1 .. t,
  w = `smooth_window`.
- Final loss: the smoothed loss at the last step. Best loss: the lowest smoothed loss of the run.
- Spike: a step after warm-up whose loss exceeds (1 + `spike_threshold`) x the median of the
  previous `spike_window` non-spike losses. Consecutive spike steps form one excursion, counted
  once, so a spike that takes ten steps to come down is one spike. Steps flagged as spikes do not
  enter the median, so a loss that jumps and stays up remains one open excursion.
- Diverged: any of
  1. the trainer stopped on a non-finite loss or grad norm (`nan_policy=stop`), or a recorded
     loss is NaN/Inf;
  2. after warm-up, the smoothed loss exceeds `divergence_factor` x the initial loss (the loss of
     the first step: the model is back to where it started, or worse);
  3. the final loss exceeds (1 + `divergence_rise`) x the best loss: the run broke and did not
     recover by the end.
- Largest stable LR of a variant: the largest learning rate of the grid whose run finished
  without diverging (and, with `max_spikes` set, with at most that many spikes). LRs below it
  need not all be stable; the per-run table shows them.
"""

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from megatron_mea._optional import import_extra

# Flags of `mea-pretrain` per variant; every other setting is shared by all runs of a sweep.
# The MEA paper's LR study compares the baseline, +norm, +HLC and HLC + norm (MEA); KHA follows.
VARIANTS = {
    "baseline": ("--attention-variant", "standard"),
    "mea-norm-only": ("--attention-variant", "mea", "--no-mea-hlc", "--mea-head-norm"),
    "mea-no-norm": ("--attention-variant", "mea", "--no-mea-head-norm"),
    "mea": ("--attention-variant", "mea", "--mea-head-norm"),
    "kha-linear": ("--attention-variant", "kha", "--kha-variant", "linear"),
    "kha-mlp": ("--attention-variant", "kha", "--kha-variant", "mlp"),
}


@dataclass(frozen=True)
class StabilityRule:
    """Thresholds of the spike and divergence definitions (see the module docstring).

    Args:
        spike_threshold: relative excess over the running median that makes a step a spike.
            Default: 0.2 (20 % above).
        spike_window: number of previous non-spike losses whose median is the baseline.
            Default: 20.
        smooth_window: steps averaged into the smoothed loss. Default: 10.
        divergence_factor: smoothed loss above this multiple of the initial loss after warm-up
            is divergence. Default: 1.0.
        divergence_rise: final loss above (1 + this) x the best loss is divergence.
            Default: 0.5.
        max_spikes: for "largest stable LR", also require at most this many spikes.
            Default: None (spikes do not count).
    """

    spike_threshold: float = 0.2
    spike_window: int = 20
    smooth_window: int = 10
    divergence_factor: float = 1.0
    divergence_rise: float = 0.5
    max_spikes: Optional[int] = None


@dataclass
class RunSummary:
    """What one (variant, lr) run showed; NaN where a value does not exist."""

    variant: str
    lr: float
    status: str
    """`completed` (reached train_iters), `stopped` (the trainer stopped on a non-finite value),
    `incomplete` (still to train or interrupted)."""
    steps: int
    final_loss: float
    best_loss: float
    final_valid_loss: float
    max_grad_norm: float
    """Largest finite grad norm after warm-up (before clipping; the first steps' large norms
    would hide everything else)."""
    spikes: List[int]
    """Iteration at which each spike excursion starts."""
    diverged: bool
    diverged_at: Optional[int]
    reason: str


def smoothed(losses: Sequence[float], window: int) -> List[float]:
    """Trailing mean over the last `window` finite values (NaN while none is finite yet)."""
    out = []
    for i in range(len(losses)):
        recent = [v for v in losses[max(0, i - window + 1): i + 1] if math.isfinite(v)]
        out.append(sum(recent) / len(recent) if recent else math.nan)
    return out


def find_spikes(
    iterations: Sequence[int], losses: Sequence[float], rule: StabilityRule, warmup_steps: int
) -> List[int]:
    """Start iterations of the spike excursions after warm-up (definition in the module doc)."""
    history, starts, inside = [], [], False
    for iteration, loss in zip(iterations, losses):
        if not math.isfinite(loss):
            inside = False
            continue
        baseline = statistics.median(history[-rule.spike_window:]) if history else math.nan
        spike = (
            iteration > warmup_steps
            and len(history) >= min(rule.spike_window, 5)
            and loss > (1.0 + rule.spike_threshold) * baseline
        )
        if spike and not inside:
            starts.append(iteration)
        inside = spike
        if not spike:
            history.append(loss)
    return starts


def find_divergence(
    iterations: Sequence[int],
    losses: Sequence[float],
    rule: StabilityRule,
    warmup_steps: int,
    stop_message: str = "",
):
    """(iteration or None, reason) of the first divergence criterion met; ("", None) if none.

    `stop_message` is the trainer's message when it stopped on a non-finite value.
    """
    for iteration, loss in zip(iterations, losses):
        if not math.isfinite(loss):
            return iteration, f"non-finite loss ({loss}) at iteration {iteration}"
    if stop_message:
        at = iterations[-1] + 1 if iterations else 1
        return at, f"trainer stopped: {stop_message}"
    if not losses:
        return None, ""
    smooth = smoothed(losses, rule.smooth_window)
    limit = rule.divergence_factor * losses[0]
    for iteration, value in zip(iterations, smooth):
        if iteration > warmup_steps and value > limit:
            return iteration, (
                f"smoothed loss {value:.3f} > {rule.divergence_factor:g} x initial loss "
                f"{losses[0]:.3f} at iteration {iteration}"
            )
    best = min(smooth)
    if smooth[-1] > (1.0 + rule.divergence_rise) * best:
        return iterations[-1], (
            f"final loss {smooth[-1]:.3f} > (1 + {rule.divergence_rise:g}) x best loss {best:.3f}"
        )
    return None, ""


def summarize_run(
    variant: str,
    lr: float,
    records: Sequence[dict],
    train_iters: int,
    warmup_steps: int,
    rule: StabilityRule,
    stop_message: str = "",
) -> RunSummary:
    """Judge one run from its `metrics.jsonl` records.

    Args:
        records: the per-step records, in order ("iteration", "lm loss", "grad norm" and, at
            evaluation steps, "valid loss").
        train_iters: the run's planned length (fewer records and no stop: `incomplete`).
        warmup_steps: steps of LR warm-up, excluded from the spike and initial-loss criteria.
        stop_message: the trainer's message if it stopped on a non-finite value. Default: "".
    """
    iterations = [r["iteration"] for r in records]
    losses = [float(r["lm loss"]) for r in records]
    finite = [v for v in losses if math.isfinite(v)]
    smooth = [v for v in smoothed(losses, rule.smooth_window) if math.isfinite(v)]
    valid = [r["valid loss"] for r in records if "valid loss" in r]
    grad_norms = [
        r["grad norm"] for r in records
        if r["iteration"] > warmup_steps and math.isfinite(r.get("grad norm", math.nan))
    ]
    if stop_message:
        status = "stopped"
    else:
        status = "completed" if iterations and iterations[-1] >= train_iters else "incomplete"
    diverged_at, reason = find_divergence(iterations, losses, rule, warmup_steps, stop_message)
    last_is_finite = bool(losses) and math.isfinite(losses[-1]) and not stop_message
    return RunSummary(
        variant=variant,
        lr=lr,
        status=status,
        steps=len(records),
        final_loss=smooth[-1] if smooth and last_is_finite else math.nan,
        best_loss=min(smooth) if finite else math.nan,
        final_valid_loss=valid[-1] if valid else math.nan,
        max_grad_norm=max(grad_norms) if grad_norms else math.nan,
        spikes=find_spikes(iterations, losses, rule, warmup_steps),
        diverged=diverged_at is not None,
        diverged_at=diverged_at,
        reason=reason,
    )


def largest_stable_lr(summaries: Sequence[RunSummary], rule: StabilityRule) -> Dict[str, float]:
    """Per variant, the largest LR whose run finished without diverging (and with at most
    `rule.max_spikes` spikes when set); None when no run of the variant qualifies."""
    stable: Dict[str, Optional[float]] = {}
    for s in summaries:
        stable.setdefault(s.variant, None)
        ok = s.status != "incomplete" and not s.diverged
        if ok and rule.max_spikes is not None:
            ok = len(s.spikes) <= rule.max_spikes
        if ok and (stable[s.variant] is None or s.lr > stable[s.variant]):
            stable[s.variant] = s.lr
    return stable


def _number(value: float, width: int) -> str:
    return f"{value:>{width}.3f}" if math.isfinite(value) else f"{'-':>{width}}"


def format_table(summaries: Sequence[RunSummary], rule: StabilityRule) -> str:
    """The summary: one row per run, then the largest stable LR and best final loss per variant."""
    lines = [
        f"{'variant':<12}{'lr':>9}{'status':>11}{'steps':>7}{'final':>8}{'best':>8}"
        f"{'valid':>8}{'spikes':>7}{'max gn':>8}  diverged"
    ]
    for s in summaries:
        lines.append(
            f"{s.variant:<12}{s.lr:>9.2g}{s.status:>11}{s.steps:>7}{_number(s.final_loss, 8)}"
            f"{_number(s.best_loss, 8)}{_number(s.final_valid_loss, 8)}{len(s.spikes):>7}"
            f"{_number(s.max_grad_norm, 8)}  {'yes: ' + s.reason if s.diverged else 'no'}"
        )
    stable = largest_stable_lr(summaries, rule)
    spikes_note = "" if rule.max_spikes is None else f", <= {rule.max_spikes} spikes"
    lines += ["", f"{'variant':<12}{'largest stable LR' + spikes_note:>28}{'lowest final loss':>20}"
              f"{'at lr':>9}{'spikes':>8}"]
    for variant, lr in stable.items():
        runs = [s for s in summaries if s.variant == variant and math.isfinite(s.final_loss)
                and not s.diverged]
        best = min(runs, key=lambda s: s.final_loss) if runs else None
        lines.append(
            f"{variant:<12}{'none' if lr is None else f'{lr:.2g}':>28}"
            + (f"{best.final_loss:>20.3f}{best.lr:>9.2g}" if best else f"{'-':>20}{'-':>9}")
            + f"{sum(len(s.spikes) for s in summaries if s.variant == variant):>8}"
        )
    lines.append(
        f"\nspike: loss > (1 + {rule.spike_threshold:g}) x median of the previous "
        f"{rule.spike_window} losses, after warm-up, one per excursion. diverged: non-finite "
        f"loss, smoothed ({rule.smooth_window}-step) loss > {rule.divergence_factor:g} x initial "
        f"loss after warm-up, or final > (1 + {rule.divergence_rise:g}) x best. 'max gn': largest "
        "grad norm after warm-up. 'spikes' in the second table: all LRs."
    )
    return "\n".join(lines)


def to_json(summaries: Sequence[RunSummary], rule: StabilityRule) -> dict:
    """The summary as JSON-ready data (NaN becomes None)."""

    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return value

    runs = [{k: clean(v) for k, v in dataclasses.asdict(s).items()} for s in summaries]
    return {
        "rule": dataclasses.asdict(rule),
        "runs": runs,
        "largest_stable_lr": largest_stable_lr(summaries, rule),
    }


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend (the sweep's plots)."""
    import_extra("matplotlib", "the sweep's plots").use("Agg")
    return import_extra("matplotlib.pyplot", "the sweep's plots")


def plot_loss_curves(
    curves: Dict[tuple, Sequence[dict]], summaries: Sequence[RunSummary], path: str, window: int
) -> None:
    """One subplot per LR: smoothed training loss vs step for every variant; an `x` marks the
    step at which a run was judged diverged. `curves` maps (variant, lr) to the run's records."""
    plt = _pyplot()

    lrs = sorted({lr for _, lr in curves})
    variants = list(dict.fromkeys(v for v, _ in curves))
    colors = {v: f"C{i}" for i, v in enumerate(variants)}
    by_run = {(s.variant, s.lr): s for s in summaries}
    columns = min(len(lrs), 3)
    rows = -(-len(lrs) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    for ax, lr in zip(axes.flat, lrs):
        for variant in variants:
            records = curves.get((variant, lr))
            if not records:
                continue
            steps = [r["iteration"] for r in records]
            smooth = smoothed([float(r["lm loss"]) for r in records], window)
            ax.plot(steps, smooth, color=colors[variant], label=variant, lw=1.2)
            summary = by_run.get((variant, lr))
            if summary is not None and summary.diverged:
                # At the step the divergence was detected (the last step for a stopped run).
                at = (steps.index(summary.diverged_at) if summary.diverged_at in steps
                      else len(steps) - 1)
                finite = [v for v in smooth[: at + 1] if math.isfinite(v)]
                ax.plot(steps[at], finite[-1] if finite else 0.0, "x", color=colors[variant],
                        ms=10, mew=2)
        ax.set_title(f"peak lr {lr:g}")
        ax.set_xlabel("iteration")
        ax.set_ylabel(f"train loss ({window}-step mean)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(lrs):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("Loss vs step per peak LR (x: diverged)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_final_loss(summaries: Sequence[RunSummary], path: str) -> None:
    """Final loss vs peak LR (log x) per variant; diverged runs as `x` at their last smoothed
    loss, or at the top of the axis when they have none."""
    plt = _pyplot()

    finite = [s.final_loss for s in summaries if math.isfinite(s.final_loss)]
    top = max(finite) * 1.05 if finite else 1.0
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, variant in enumerate(dict.fromkeys(s.variant for s in summaries)):
        runs = sorted((s for s in summaries if s.variant == variant), key=lambda s: s.lr)
        ok = [s for s in runs if not s.diverged and math.isfinite(s.final_loss)]
        ax.plot([s.lr for s in ok], [s.final_loss for s in ok], "o-", color=f"C{i}", label=variant)
        bad = [s for s in runs if s.diverged]
        ax.plot([s.lr for s in bad],
                [s.final_loss if math.isfinite(s.final_loss) else top for s in bad],
                "x", color=f"C{i}", ms=10, mew=2)
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final train loss")
    ax.set_title("Final loss vs peak LR (x: diverged)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
