"""At TP=2 (two real processes, gloo) incremental decoding equals the full forward and the TP=1
model, for every variant; the KV cache is sharded by heads: half the components for MEA-half,
whose decode steps meet in reduce-scatters of the partial scores."""

import pytest

from tests._dist import run_distributed
from tests.inference import _workers
from tests.inference._common import (
    GROUPS,
    HEAD_DIM,
    LAYERS,
    MAX_SEQ,
    PROMPTS,
    VARIANTS,
    kv_cache_bytes_expected,
)

pytestmark = pytest.mark.slow

# nc = 1 < TP = 2: every rank computes and caches the one component head (duplicated).
DUPLICATED = ("mea-dup", dict(variant="mea", mea_num_kv_components=1, mea_mix_init="normal"))


def test_tp2_incremental_decoding_equals_full_forward_and_tp1(tmp_path):
    results = run_distributed(_workers.tp_decoding, 2, [*VARIANTS, DUPLICATED], 2, str(tmp_path))
    assert results[0] == results[1]  # both ranks decode the same tokens, same cache sizes
    for name, r in results[0].items():
        assert r["same_tokens"], name
        assert r["vs_full_forward"] < 1e-5, (name, r)
        assert r["vs_tp1"] < 1e-5, (name, r)
        if name == DUPLICATED[0]:
            # Per token and layer: the component's K and V on both ranks, and the scalars of
            # each rank's own 2 composite keys (TP=1: all 4).
            tokens = LAYERS * MAX_SEQ * len(PROMPTS)
            assert r["bytes_tp1"] == tokens * (2 * HEAD_DIM + GROUPS) * 4
            assert r["bytes_rank"] == tokens * (2 * HEAD_DIM + GROUPS // 2) * 4
            assert r["bytes_total"] == 2 * r["bytes_rank"]
            continue
        assert r["bytes_tp1"] == kv_cache_bytes_expected(name), name
        assert r["bytes_rank"] * 2 == r["bytes_tp1"] == r["bytes_total"], (name, r)
    baseline = results[0]["baseline"]["bytes_total"]
    assert results[0]["mea-half-no-qk-norm"]["bytes_total"] * 2 == baseline
    assert results[0]["mea"]["bytes_total"] == results[0]["kha"]["bytes_total"] == baseline


def test_tp2_decoding_one_prompt_mixes_single_tokens_across_ranks(tmp_path):
    # One prompt: each decode step has one new token, fewer than the ranks, so the exchange
    # that mixes the new components (for the cache's scalars) leaves one rank without tokens.
    variants = [v for v in [*VARIANTS, DUPLICATED] if v[0].startswith("mea")]
    results = run_distributed(
        _workers.tp_decoding, 2, variants, 2, str(tmp_path), [PROMPTS[1]]
    )
    assert results[0] == results[1]
    for name, r in results[0].items():
        assert r["same_tokens"], name
        assert r["vs_full_forward"] < 1e-5, (name, r)
        assert r["vs_tp1"] < 1e-5, (name, r)
