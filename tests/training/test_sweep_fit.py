"""The MEA paper's loss law `L(D) = (D_c / D)^alpha + L0`, fitted per run: recovered from
synthetic curves with known parameters, refused on runs too short or not falling."""

import math

import numpy as np
import pytest

from megatron_mea.apps.sweeps.fit import LossLawFit, fit_loss_law, fit_run, format_fits

TOKENS_PER_STEP = 65536


def _law(tokens, critical, alpha, floor):
    return (critical / np.asarray(tokens, dtype=float)) ** alpha + floor


@pytest.mark.parametrize("critical,alpha,floor", [(3e5, 0.35, 2.1), (2e7, 0.12, 3.4),
                                                  (1e4, 0.6, 0.8)])
def test_exact_curves_give_back_their_parameters(critical, alpha, floor):
    tokens = np.linspace(2e6, 2e8, 300)
    fit = fit_loss_law(tokens, _law(tokens, critical, alpha, floor))
    assert fit.loss_floor == pytest.approx(floor, rel=1e-6)
    assert fit.alpha == pytest.approx(alpha, rel=1e-6)
    assert fit.critical_tokens == pytest.approx(critical, rel=1e-5)
    assert fit.rmse < 1e-9 and fit.points == 300
    far = 1e11
    assert fit.predict(far) == pytest.approx(_law([far], critical, alpha, floor)[0], rel=1e-9)


def test_noisy_curve_gives_the_floor_and_the_extrapolation_within_the_noise():
    tokens = np.linspace(2e6, 2e8, 400)
    clean = _law(tokens, 3e5, 0.35, 2.1)
    noisy = clean + np.random.default_rng(0).normal(0, 0.005, clean.shape)
    fit = fit_loss_law(tokens, noisy)
    assert fit.loss_floor == pytest.approx(2.1, abs=0.05)
    assert fit.predict(2e9) == pytest.approx(_law([2e9], 3e5, 0.35, 2.1)[0], abs=0.01)
    assert fit.rmse == pytest.approx(0.005, rel=0.2)


def test_rising_or_flat_losses_have_no_fit():
    tokens = np.linspace(1e6, 1e8, 100)
    assert fit_loss_law(tokens, 4.0 - _law(tokens, 3e5, 0.35, 0.0)) is None
    assert fit_loss_law(tokens[:2], _law(tokens[:2], 3e5, 0.35, 2.0)) is None


def test_fit_run_skips_warmup_and_non_finite_losses_and_needs_enough_steps():
    steps = np.arange(1, 301)
    losses = _law(steps * TOKENS_PER_STEP, 3e5, 0.35, 2.1)
    records = [{"iteration": int(i), "lm loss": float(v)} for i, v in zip(steps, losses)]
    records[:20] = [dict(r, **{"lm loss": 9.0}) for r in records[:20]]  # warm-up: off the law
    records[150]["lm loss"] = math.nan
    fit = fit_run(records, TOKENS_PER_STEP, warmup_steps=20)
    assert fit.points == 279
    assert fit.loss_floor == pytest.approx(2.1, rel=1e-6)
    assert fit_run(records[:60], TOKENS_PER_STEP, warmup_steps=20) is None  # 40 < 50 points
    assert fit_run(records[:60], TOKENS_PER_STEP, warmup_steps=20, min_points=40) is not None


def test_the_table_and_json_carry_l0_and_the_prediction():
    fit = LossLawFit(loss_floor=2.1, alpha=0.35, critical_tokens=3e5, points=100, rmse=0.01)
    data = fit.to_json(1e9)
    assert data["loss_floor"] == 2.1 and data["predicted_loss"] == pytest.approx(
        (3e5 / 1e9) ** 0.35 + 2.1)
    table = format_fits([("mea", 3e-3, "stable", fit), ("baseline", 1e-1, "diverged", None)],
                        1e9)
    assert "2.100" in table and f"{fit.predict(1e9):.3f}" in table
    assert "too short or no fit" in table
