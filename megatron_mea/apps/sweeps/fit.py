"""The MEA paper's loss law, fitted per run: `L(D) = (D_c / D)^alpha + L0` (its App. D, eq. 35).

`D` is the number of training tokens seen, `L0` the loss the run tends to as `D` grows, `alpha`
and `D_c` the speed of the approach. The paper chooses learning rates by fitting this law to each
run and comparing the extrapolated losses; `mea-lr-sweep` reports the fit beside its stability
verdict. Pure functions over `metrics.jsonl` records (numpy only), testable on synthetic curves.

How the fit works: for a fixed `L0` the law is a straight line in log-log,
`log(L - L0) = alpha * log(D_c) - alpha * log(D)`, solved by least squares. `L0` itself is
searched on `[0, min L)` (a grid, then a golden-section refinement around the grid's best) for
the smallest squared error of the losses themselves.
"""

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np

GRID_POINTS = 256
GOLDEN_STEPS = 80


@dataclass(frozen=True)
class LossLawFit:
    """One run's fitted law.

    Attributes:
        loss_floor: `L0`.
        alpha: the exponent (> 0: the loss falls with `D`).
        critical_tokens: `D_c`.
        points: losses the fit used.
        rmse: root mean squared error of the fitted losses.
    """

    loss_floor: float
    alpha: float
    critical_tokens: float
    points: int
    rmse: float

    def predict(self, tokens: float) -> float:
        """`L(tokens)`."""
        return (self.critical_tokens / tokens) ** self.alpha + self.loss_floor

    def to_json(self, predict_tokens: Optional[float] = None) -> dict:
        """The fit as a dict, plus `predicted_loss` at `predict_tokens` when given."""
        data = asdict(self)
        if predict_tokens is not None:
            data["predict_tokens"] = predict_tokens
            data["predicted_loss"] = self.predict(predict_tokens)
        return data


def _line_fit(log_tokens, losses, floor):
    """(sse, alpha, log D_c) of the log-log line for a fixed `L0 = floor`."""
    y = np.log(losses - floor)
    slope, intercept = np.polyfit(log_tokens, y, 1)
    alpha = -slope
    predicted = np.exp(intercept + slope * log_tokens) + floor
    sse = float(np.sum((predicted - losses) ** 2))
    log_critical = intercept / alpha if alpha != 0 else math.nan
    return sse, alpha, log_critical


def fit_loss_law(tokens: Sequence[float], losses: Sequence[float]) -> Optional[LossLawFit]:
    """Fit `L(D) = (D_c / D)^alpha + L0` to `(tokens, losses)`; None when the losses do not fall
    with the tokens (no `alpha > 0` fits) or fewer than 3 finite points remain.

    Args:
        tokens: training tokens seen at each loss, all > 0.
        losses: the losses (non-finite ones are dropped).
    """
    pairs = [(float(d), float(v)) for d, v in zip(tokens, losses) if math.isfinite(v) and d > 0]
    if len(pairs) < 3:
        return None
    log_tokens = np.log(np.array([d for d, _ in pairs]))
    values = np.array([v for _, v in pairs])
    top = float(values.min())
    if top <= 0:
        return None
    # L0 in [0, min L): L - L0 must stay positive for the logarithm.
    grid = np.linspace(0.0, top, GRID_POINTS + 1)[:-1]
    errors = [_line_fit(log_tokens, values, floor)[0] for floor in grid]
    best = int(np.argmin(errors))
    low = grid[max(best - 1, 0)]
    high = grid[best + 1] if best + 1 < len(grid) else top * (1 - 1e-12)
    ratio = (math.sqrt(5) - 1) / 2
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    fa, fb = _line_fit(log_tokens, values, a)[0], _line_fit(log_tokens, values, b)[0]
    for _ in range(GOLDEN_STEPS):
        if fa <= fb:
            high, b, fb = b, a, fa
            a = high - ratio * (high - low)
            fa = _line_fit(log_tokens, values, a)[0]
        else:
            low, a, fa = a, b, fb
            b = low + ratio * (high - low)
            fb = _line_fit(log_tokens, values, b)[0]
    candidates = [(errors[best], grid[best]), (fa, a), (fb, b)]
    _, floor = min(candidates)
    sse, alpha, log_critical = _line_fit(log_tokens, values, floor)
    if not alpha > 0 or not math.isfinite(log_critical):
        return None
    return LossLawFit(
        loss_floor=float(floor),
        alpha=float(alpha),
        critical_tokens=float(math.exp(log_critical)),
        points=len(pairs),
        rmse=math.sqrt(sse / len(pairs)),
    )


def fit_run(
    records: Sequence[dict],
    tokens_per_step: int,
    warmup_steps: int,
    min_points: int = 50,
) -> Optional[LossLawFit]:
    """The law fitted to one run's training losses after warm-up; None when the run has fewer
    than `min_points` finite losses there (too short to extrapolate) or the law does not fit.

    Args:
        records: `metrics.jsonl` records ("iteration", "lm loss").
        tokens_per_step: global batch x sequence length.
        warmup_steps: steps of LR warm-up, left out (the law describes the loss after it).
        min_points: losses needed after warm-up. Default: 50.
    """
    kept = [r for r in records
            if r["iteration"] > warmup_steps and math.isfinite(float(r["lm loss"]))]
    if len(kept) < max(min_points, 3):
        return None
    return fit_loss_law([r["iteration"] * tokens_per_step for r in kept],
                        [float(r["lm loss"]) for r in kept])


def format_fits(rows: Sequence[tuple], predict_tokens: float) -> str:
    """The fit table: one row per `(variant, lr, verdict, fit or None)`."""
    lines = [f"{'variant':<12}{'lr':>9}{'verdict':>10}{'L0':>8}{'alpha':>8}{'D_c':>10}"
             f"{f'L({predict_tokens:.3g} tok)':>18}"]
    for variant, lr, verdict, fit in rows:
        if fit is None:
            lines.append(f"{variant:<12}{lr:>9.2g}{verdict:>10}{'too short or no fit':>36}")
            continue
        lines.append(
            f"{variant:<12}{lr:>9.2g}{verdict:>10}{fit.loss_floor:>8.3f}{fit.alpha:>8.3f}"
            f"{fit.critical_tokens:>10.3g}{fit.predict(predict_tokens):>18.3f}"
        )
    lines.append(
        "\nfit: L(D) = (D_c / D)^alpha + L0 on the training losses after warm-up (D: tokens "
        "seen); runs with too few steps after warm-up are not fitted."
    )
    return "\n".join(lines)
