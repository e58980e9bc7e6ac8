"""Fold linear MEA / KHA transforms into plain Q/K/V projection weights.

HLC without the head norm and KHA-Linear are linear maps applied right after the projection
(before any norm or RoPE), so a plain attention whose projection already includes them computes
the same function. Weights use torch's `[out, in]` convention, per head: `[heads, hn, h]`.
"""

from megatron_mea.ops.functional import fold_head_mix, fold_kha_linear  # noqa: F401  (re-exported)
