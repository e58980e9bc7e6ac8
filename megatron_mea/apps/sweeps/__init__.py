"""Learning-rate sweeps behind `mea-lr-sweep` (`lr_sweep`: the presets, the grid trained and
judged; `sweep`: the verdicts, tables and plots; `runs`: one training run per point; `fit`: the
loss law) and `mea-reproduce` (`reproduce`: the papers' studies as sweeps, and the report)."""
